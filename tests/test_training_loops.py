"""The training loops users write, each exact or refused (``tests/loop_matrix.py``).

Every cell of the matrix (where ``zero_grad()`` sits, accumulation, Poisson or shuffled
batches, Opacus's BatchMemoryManager and ``physical_batch_size``, a GradScaler, the user's own
criterion; ghost clipping in one or two passes and per-sample gradients) runs two logical
steps through ``make_private`` and is measured against float64 per-sample gradients: each
physical batch's multiplicity in each released update (fitted) and the accountant's recorded
sample rate against the one spent. Then the refusals' messages and that they release nothing,
and the GradScaler's overflow.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("opacus")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import dpgrad  # noqa: E402
import dpgrad.opacus  # noqa: E402
import loop_matrix as M  # noqa: E402

pytestmark = pytest.mark.opacus

# The cells refused, and by what: the rest must be exact.
REFUSED = {
    ("plain", "ghost", True, "own"): "UnclippedGradientError",
    ("plain", "ghost", False, "own"): "UnclippedGradientError",
    ("plain", "single", True, "own"): "must come from dpgrad.DPLossFastGradientClipping",
    ("plain", "single", False, "own"): "must come from dpgrad.DPLossFastGradientClipping",
    # Poisson draws summed into one step: refused as Opacus refuses them.
    ("accumulate", "ghost", True, ""): "Poisson sampling is not compatible with gradient accumulation",
    ("accumulate", "single", True, ""): "Poisson sampling is not compatible with gradient accumulation",
    ("accumulate", "hooks", True, ""): "Poisson sampling is not compatible with grad accumulation",
    # Opacus's own optimizer (per-sample gradients): a sum it noised is refused until zero_grad().
    ("memory-manager", "hooks", True, "never"): "zero_grad",
    ("memory-manager", "hooks", False, "never"): "zero_grad",
}


def _key(case: M.Case):
    return (case.loop, case.mode, case.poisson, "own" if case.own_criterion else case.options.get("zero", ""))


@pytest.mark.parametrize("case", M.matrix(), ids=lambda c: c.name.replace(" ", "-"))
def test_every_loop_is_exact_or_refused(case):
    outcome = M.run_case(case)
    row = M.verdict(case, outcome)
    refusal = REFUSED.get(_key(case))
    if refusal is None:
        assert row["verdict"] == "exact", row
    else:
        assert row["verdict"] == "refused", row
        assert refusal in f"{type(outcome.error).__name__}: {outcome.error}", row


def _wrapped(single: bool, poisson: bool = True, batch_size: int = 6, model=None):
    torch.manual_seed(2)
    model = model or M.make_model()
    engine = opacus_engine()
    made = dpgrad.opacus.make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(M.make_data(), batch_size=batch_size), noise_multiplier=0.0, max_grad_norm=M.BOUND,
        poisson_sampling=poisson, loss_reduction="sum", criterion=nn.CrossEntropyLoss(reduction="sum"),
        single_backward=single)
    return (engine, model) + made


def opacus_engine():
    from opacus import PrivacyEngine

    return PrivacyEngine()


@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
def test_the_users_own_criterion_is_refused_before_anything_is_released(single):
    """The Opacus loop kept as it was: its own criterion's plain backward. Refused in the
    backward pass (single) or at the step (double: the plain pass is the first of Opacus's
    protocol), naming the fix; the parameters do not move."""
    net = nn.Linear(4, 2).double()
    engine = opacus_engine()
    wrapped, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
        data_loader=DataLoader(M.make_data(), batch_size=6), noise_multiplier=0.0, max_grad_norm=1e-3,
        criterion=nn.CrossEntropyLoss(), single_backward=single, poisson_sampling=False)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    x[0] *= 1000
    own = nn.CrossEntropyLoss()
    if single:
        with pytest.raises(RuntimeError, match=r"the wrapped model itself \(Linear\).*DPLossFastGradientClipping"):
            own(wrapped(x), y).backward()
    else:
        own(wrapped(x), y).backward()
        with pytest.raises(dpgrad.UnclippedGradientError, match=r"\['weight', 'bias'\].*criterion make_private"):
            optimizer.step()
        with pytest.raises(dpgrad.UnclippedGradientError):  # and again: nothing was taken
            optimizer.step()
    assert not engine.accountant.history
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p.detach(), b)
    # The criterion make_private returned clips the same loop.
    optimizer.zero_grad()
    criterion(wrapped(x), y).backward()
    optimizer.step()
    assert len(engine.accountant.history) == 1


def test_a_refused_accumulation_leaves_p_grad_as_it_was():
    engine, model, wrapped, optimizer, criterion, loader = _wrapped(single=True)
    x, y = M.make_data().tensors
    criterion(wrapped(x[:6]), y[:6]).backward()
    held = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Poisson sampling is not compatible with gradient accumulation.*"
                                         "BatchMemoryManager"):
        criterion(wrapped(x[6:12]), y[6:12]).backward()
    for p, h in zip(model.parameters(), held):
        assert torch.equal(p.grad, h)
    # Parts of one batch (one draw) are no accumulation.
    optimizer.zero_grad()
    with wrapped.one_batch():
        criterion(wrapped(x[:3]), y[:3]).backward()
        criterion(wrapped(x[3:6]), y[3:6]).backward()
    for p, h in zip(model.parameters(), held):
        torch.testing.assert_close(p.grad, h, rtol=1e-12, atol=1e-14)
    optimizer.step()
    assert [rate for _, rate, _ in engine.accountant.history] == [1 / len(loader)]


def test_opacus_own_optimizer_is_refused_an_accumulation_it_would_not_count():
    from opacus.optimizers import DPOptimizerFastGradientClipping as Opacus

    model = M.make_model()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=M.BOUND, loss_reduction="sum")
    optimizer = Opacus(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=M.BOUND,
                       expected_batch_size=6, loss_reduction="sum")
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss(reduction="sum"),
                                                  loss_reduction="sum")
    x, y = M.make_data().tensors
    criterion(wrapped(x[:6]), y[:6]).backward()
    with pytest.raises(ValueError, match=r"\(DPOptimizerFastGradientClipping\) counts one batch per step"):
        criterion(wrapped(x[6:12]), y[6:12]).backward()


def test_the_loss_is_a_tensor_where_loops_use_one():
    engine, model, wrapped, optimizer, criterion, loader = _wrapped(single=True)
    x, y = M.make_data().tensors
    loss = criterion(wrapped(x[:6]), y[:6])
    expected = F.cross_entropy(wrapped(x[:6]), y[:6], reduction="sum").item()
    assert isinstance(loss, torch.Tensor) and bool(torch.isfinite(loss))
    assert f"{loss:.3f}" == f"{expected:.3f}" and abs(float(loss) - expected) < 1e-9
    assert type(loss.detach()) is torch.Tensor and type(loss / 2) is type(loss)
    torch.testing.assert_close((loss / 2).loss_per_sample, loss.loss_per_sample / 2)
    scaled = torch.amp.GradScaler("cpu", init_scale=8.0).scale(loss)
    assert type(scaled) is type(loss) and float(scaled.loss_scale) == 8.0
    assert (loss * torch.tensor(8.0)).loss_scale is None  # a weight is not a loss scale
    saved = copy.deepcopy({"loss": loss})["loss"]
    assert type(saved) is torch.Tensor and saved.item() == loss.item()
    for same in (loss.mean(), torch.sum(loss), loss.clone()):  # a loop written for a loss per device
        assert type(same) is type(loss)
        torch.testing.assert_close(same.loss_per_sample, loss.loss_per_sample, rtol=0, atol=0)
    wrapped.zero_grad()
    loss.backward()
    clipped = [p.grad.clone() for p in model.parameters()]
    wrapped.zero_grad()
    criterion(wrapped(x[:6]), y[:6]).mean().backward()
    for p, g in zip(model.parameters(), clipped):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def _scaled_run(batches, init_scale=2.0 ** 10, physical=None):
    """A GradScaler loop (float32) through make_private: per batch, the parameters' update and
    the scale after it."""
    model = M.make_model(torch.float32)
    engine = opacus_engine()
    wrapped, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(M.make_data(torch.float32), batch_size=6), noise_multiplier=0.0,
        max_grad_norm=M.BOUND, poisson_sampling=False, loss_reduction="sum",
        criterion=nn.CrossEntropyLoss(reduction="sum"), single_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    noised = []
    add_noise = optimizer.add_noise
    optimizer.add_noise = lambda: (noised.append(1), add_noise())[1]
    updates = []
    for x, y in batches:
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(criterion(wrapped(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        updates.append(([b - p.detach() for p, b in zip(model.parameters(), before)], scaler.get_scale()))
    return updates, engine, noised, (wrapped, optimizer, criterion, scaler)


def test_a_scaled_step_clips_the_unscaled_gradients():
    """The update of a GradScaler step is the unscaled step's, each sample clipped at C."""
    x, y = M.make_data(torch.float32).tensors
    (update, scale), = _scaled_run([(x[:6], y[:6])])[0]
    recorder = M.Physical(x[:6], y[:6], torch.ones(6, dtype=torch.float64),
                          dict(M.make_model(torch.float32).named_parameters()), 0)
    want = M.clipped_sum(M.make_model(), recorder)
    torch.testing.assert_close(torch.cat([u.reshape(-1) for u in update]).double(), want, rtol=1e-5, atol=1e-7)
    assert scale == 2.0 ** 10


def test_an_overflow_skips_the_step_and_lowers_the_scale():
    """A batch whose gradients overflow: no noise, no step, not counted; the scaler halves its
    scale; the next batch steps as usual."""
    x, y = M.make_data(torch.float32).tensors
    bad = x[:6].clone()
    bad[2] = float("inf")
    updates, engine, noised, _ = _scaled_run([(bad, y[:6]), (x[6:12], y[6:12])])
    (skipped, scale), (taken, _) = updates
    assert all(torch.equal(u, torch.zeros_like(u)) for u in skipped) and scale == 2.0 ** 9
    assert any(u.abs().max() > 0 for u in taken)
    assert len(noised) == 1 and len(engine.accountant.history) == 1


def test_a_scaled_gradient_stepped_without_the_scaler_is_refused():
    x, y = M.make_data(torch.float32).tensors
    _, engine, _, (wrapped, optimizer, criterion, scaler) = _scaled_run([])
    optimizer.zero_grad()
    scaler.scale(criterion(wrapped(x[:6]), y[:6])).backward()
    with pytest.raises(ValueError, match=r"scaled by a GradScaler.*scaler.step\(optimizer\)"):
        optimizer.step()
    assert not engine.accountant.history


# ---------------------------------------------------------------------- DPTrainer
transformers = pytest.importorskip("transformers")

from dpgrad.batches import padded_parts  # noqa: E402
from dpgrad.hf import PrivacyArguments  # noqa: E402
from hf_trainer_worker import Recording, gpt2, rows, training_args  # noqa: E402


def _trainer_steps(tmp_path, fp16: bool, resume: bool):
    """DPTrainer's steps (per_device 4 x accumulation 2: an expected batch of 8, physical batches
    of 3, SGD at lr 0.5, no noise), with fp16's GradScaler (on the CPU) or without; with
    ``resume``, the second step taken by a run resumed from the first's checkpoint. For each
    step: its update, the parameters it ran at and its physical batches' rows."""
    data, privacy = rows(), PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=3)
    runs = [(2, None)] if not resume else [(1, None), (2, str(tmp_path / "first" / "checkpoint-1"))]
    found, history = [], []
    for steps, checkpoint in runs:
        torch.manual_seed(0)
        model = gpt2()
        args = training_args(tmp_path / ("first" if checkpoint is None else "resumed"), max_steps=steps, fp16=fp16,
                             save_strategy="steps" if resume and checkpoint is None else "no", save_steps=1)
        t = Recording(model=model, args=args, train_dataset=data, privacy_args=privacy)
        if fp16:  # what accelerate makes for fp16 on a GPU
            t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        seen = []
        original = t.training_step

        def step(model_, inputs, num_items_in_batch=None):
            seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
            return original(model_, inputs, num_items_in_batch)

        t.training_step = step
        t.train(resume_from_checkpoint=checkpoint)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        starts = seen[1:] + [after]
        for indices, before, end in zip(t.drawn, seen, starts):
            parts = [[data[i] for i in part[:real]] for part, real in padded_parts(list(indices), 3, None)]
            update = torch.cat([(before[n] - end[n]).reshape(-1) for n, p in model.named_parameters()
                                if p.requires_grad])
            found.append((update, before, parts, model))
        history = list(t.accountant.history)
    return found, history, t


@pytest.mark.parametrize("fp16, resume", [(False, False), (True, False), (False, True)],
                         ids=["accumulation", "fp16", "resume"])
def test_the_trainer_counts_each_physical_batch_once(tmp_path, fp16, resume):
    """DPTrainer's logical batch in physical batches (accumulation 2, physical size 3; with a
    GradScaler; resumed): each physical batch's multiplicity in each step's update is 1, and the
    accountant records q per step."""
    found, history, t = _trainer_steps(tmp_path, fp16, resume)
    expected, lr = 8, 0.5
    assert len(found) == 2
    for update, params, parts, model in found[-1 if resume else 0:]:
        sums = [M.lm_clipped_sum(model, params, part, 0.05) * (lr / expected) for part in parts if part]
        mult, residual = M.fit(update, sums)
        assert residual < 1e-4 and all(abs(m - 1) < 1e-3 for m in mult), (mult, residual)
    assert [(rate, n) for _, rate, n in history] == [(t.sample_rate, 2)] or \
        [rate for _, rate, _ in history] == [t.sample_rate] * len(history)
    assert sum(n for *_, n in history) == 2
    if fp16:  # the losses went through the scaler, and its step
        assert t.accelerator.scaler._scale is not None and "grad_scale" not in vars(t._dp_optimizer)
