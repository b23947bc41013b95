"""The independence check without holes (``dpgrad.checks.independence``, ``dpgrad.checks.forward_probe``).

Each case is measured first against a float64 emulation that does not use dpgrad (noise 0,
``loss_reduction="sum"``): a sample's contribution is the largest change of the clipped summed
gradient when it is removed, over C; every mixing case below breaks the bound (above C) with
the check given up. With the check on, each is refused with ``p.grad`` (``p.grad_sample``)
untouched, or exact against float64 with every contribution at most C:

- a first batch of 0 or 1 samples (a step, or a forward pass alone) checks nothing: the next
  batch of the layout is probed (the model, and the loss);
- mixing that only some samples see (half the batch, rows a data mask picks, the last row,
  rows reading row 0, pairs summed, an in-place row update) is found whatever the draw: the
  probe sets separate every ordered pair of samples;
- a loss whose largest sample's loss is constant (``CE_b / max_j CE_j``) is found at any seed;
- mixing autograd cannot see (a detached batch statistic, a straight-through
  ``autograd.Function``, a buffer set to the batch mean, label smoothing toward the batch's
  labels, losses scaled by the detached batch maximum) is found by the forward probe;
  mixing switched on after the first step, by ``recheck_independence``;
- rounding is not mixing: a loss on logits shifted by the batch's largest (batches of 4, 1
  and 16) and a softmax of ``h - h.max()`` in the model are exact against float64, while
  ``h + 1e-3 h.mean(0)`` (in the model, or in a loss given to ``clipped_backward``), a few
  times the probes' tolerance, is still refused;
- through ``make_private`` with batches of 0 and 1 first, and through ``DPTrainer``.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpgrad
from dpgrad.checks import independence

C = 0.01
MODES = ["single", "double", "gsm"]
GHOST = ["single", "double"]


class StraightThrough(torch.autograd.Function):
    """Adds the batch mean in its forward pass; its backward pass passes the gradient through."""

    @staticmethod
    def forward(ctx, h):
        return h + h.mean(0)

    @staticmethod
    def backward(ctx, grad):
        return grad


def mixed(model, h, x):
    """``h`` (B, 6) after the model's mix (None: each sample alone)."""
    B, mix = h.shape[0], model.mix
    if mix == "twice the mean":
        return h + 2 * h.mean(0)
    if mix == "first half":
        n = B // 2
        return torch.cat([h[:n] + h.mean(0), h[n:]])
    if mix == "data mask":
        return torch.where((x[:, 0] > 0)[:, None], h + h.mean(0), h)
    if mix == "last row":
        return torch.cat([h[:-1], h[-1:] + h.mean(0, keepdim=True)])
    if mix == "row 0":
        return h + h.index_select(0, torch.zeros(1, dtype=torch.long))
    if mix == "pairs":
        return h.scatter_add(0, (torch.arange(B) // 2 * 2)[:, None].expand_as(h), h)
    if mix == "in place":
        h = h.clone()
        h[0] += 3 * h[1]
        return h
    if mix == "detached statistics":
        return (h - h.mean(0).detach()) / (h.std(0, correction=0).detach() + 1)
    if mix == "straight through":
        return StraightThrough.apply(h)
    if mix == "buffer":
        model.stat.copy_(h.detach().mean(0))
        return h - model.stat
    if mix == "switched":
        return h + model.alpha * h.mean(0)
    if mix == "shifted":
        # Each row's softmax cancels the batch's largest exactly on paper; in fp32 its gradient
        # through the max is rounding.
        return torch.softmax(h - h.max(), -1)
    return h


class Net(nn.Module):
    """x (B, 5) -> logits (B, 3): a -> tanh -> [mix] -> b -> tanh -> head."""

    def __init__(self, mix=None):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.mix, self.alpha = mix, 1.0
        self.register_buffer("stat", torch.zeros(6))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.mix:
            h = mixed(self, h, x)
        return self.head(torch.tanh(self.b(h)))


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def smoothed_toward_the_batch(out, y):
    """Label smoothing toward the batch's label histogram (read from the targets)."""
    histogram = torch.bincount(y, minlength=3).to(out.dtype) / y.shape[0]
    target = 0.7 * F.one_hot(y, 3).to(out.dtype) + 0.3 * histogram
    return -(target * F.log_softmax(out, -1)).sum(-1)


LOSSES = {
    "ce": ce,
    "over the largest": lambda out, y: ce(out, y) / ce(out, y).max(),
    "over the detached largest": lambda out, y: ce(out, y) / ce(out, y).max().detach(),
    "smoothed toward the batch": smoothed_toward_the_batch,
}


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


# ---------------------------------------------------------------------------- float64, no dpgrad
def clipped_sum(model, x, y, loss, C):
    """sum_b c_b grad(loss_b) in float64, each gradient through the whole batch's forward pass
    (the mixing included), flattened over the parameters."""
    m = copy.deepcopy(model).double()
    params = list(m.parameters())
    losses = loss(m(x.double()), y)
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for b in range(len(losses)):
        grads = torch.autograd.grad(losses[b], params, retain_graph=True, allow_unused=True)
        g = torch.cat([(gb if gb is not None else torch.zeros_like(p)).flatten() for gb, p in zip(grads, params)])
        total += min(1.0, C / (g.norm().item() + 1e-6)) * g
    return total


def contribution(model, x, y, loss=ce, C=C) -> float:
    """The largest change of the clipped sum when one sample is removed, over C."""
    full = clipped_sum(model, x, y, loss, C)
    rest = [[i for i in range(len(x)) if i != k] for k in range(len(x))]
    return max((full - clipped_sum(model, x[r], y[r], loss, C)).norm().item() for r in rest) / C


# ---------------------------------------------------------------------------- dpgrad
def wrap(model, mode, **kwargs):
    if mode == "gsm":
        return dpgrad.GradSampleModule(model, loss_reduction="sum", **kwargs)
    return dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction="sum",
                                                       single_backward=mode == "single", **kwargs)


def step(wrapped, x, y, loss=ce):
    """dpgrad's loss wrapper (the clipping wrapper), or a plain backward (GradSampleModule)."""
    out = wrapped(x)
    if isinstance(wrapped, dpgrad.GradSampleModuleFastGradientClipping):
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, loss, "sum")
        criterion.criterion.reduction = "sum"
        criterion(out, y).backward()
    else:
        loss(out, y).sum().backward()


def clear(wrapped, model):
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad_sample = None


def refused(wrapped, model, x, y, loss=ce, words=("samples are mixed",)):
    marks = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = marks[n].clone()
    with pytest.raises(dpgrad.SampleMixingError) as err:
        step(wrapped, x, y, loss)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, marks[n]), f"{n}.grad was changed"
        assert getattr(p, "grad_sample", None) is None, f"{n}.grad_sample was set"
    message = str(err.value)
    for w in list(words) + ["Nothing has reached p.grad"]:
        assert w in message, message
    return message


def assert_exact(model, wrapped, reference, x, y, loss=ce):
    """The step equals float64: the clipped sum (the clipping wrapper), or the per-sample
    gradients (GradSampleModule)."""
    params = list(model.parameters())
    if isinstance(wrapped, dpgrad.GradSampleModuleFastGradientClipping):
        got = torch.cat([p.grad.double().flatten() for p in params])
        expected = clipped_sum(reference, x, y, loss, C)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7 * C)
        return
    m = copy.deepcopy(reference).double()
    for b in range(len(x)):
        grads = torch.autograd.grad(loss(m(x[b:b + 1].double()), y[b:b + 1]).sum(), list(m.parameters()))
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad_sample[b].double(), g, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- the probe sets
@pytest.mark.parametrize("size", list(range(2, 72)) + [128, 1024])
def test_the_probe_sets_separate_every_ordered_pair(size):
    """For any two samples i != j some set holds i and not j, with as few sets as Sperner's
    bound allows (n - 1 would hold fewer than B distinct codes)."""
    sets = independence.probe_sets(size)
    holds = [set(s) for s in sets]
    for i, j in itertools.permutations(range(size), 2):
        assert any(i in s and j not in s for s in holds), (i, j)
    n = independence.probe_count(size)
    assert len(sets) <= n and math.comb(n - 1, (n - 1) // 2) < size
    assert independence.probe_count(1) == independence.probe_count(0) == 0 and not independence.probe_sets(1)


# ---------------------------------------------------------------------------- first batches
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first", ["empty step", "step of one", "forward of one"])
def test_a_first_batch_of_zero_or_one_leaves_the_check_on(mode, first):
    """A model adding twice the batch mean to a hidden layer (1.05 C and more with the check
    off): a first batch that cannot be probed checks nothing, and the next batch is refused;
    the batch of one itself is exact."""
    torch.manual_seed(0)
    model = Net("twice the mean")
    reference = copy.deepcopy(model)
    x, y = batch(6)
    assert contribution(model, x, y) > 1.01
    wrapped = wrap(model, mode)
    if first == "forward of one":
        wrapped(x[:1])  # a shape check, with gradients on
    else:
        n = 0 if first == "empty step" else 1
        step(wrapped, x[:n], y[:n])
        if n == 1:
            assert_exact(model, wrapped, reference, x[:1], y[:1])
    clear(wrapped, model)
    refused(wrapped, model, x, y)


@pytest.mark.parametrize("mode", GHOST)
def test_a_mixing_loss_after_a_batch_of_one_is_refused(mode):
    torch.manual_seed(0)
    model = Net()
    x, y = batch(6)
    loss = LOSSES["over the largest"]
    assert contribution(model, x, y, loss) > 1
    wrapped = wrap(model, mode)
    step(wrapped, x[:1], y[:1], loss)
    clear(wrapped, model)
    refused(wrapped, model, x, y, loss, ["the loss mixes samples"])


# ---------------------------------------------------------------------------- every draw
PARTIAL = ["first half", "data mask", "last row", "row 0", "pairs", "in place"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mix", PARTIAL)
def test_mixing_only_some_samples_see_is_found_at_every_seed(mix, mode):
    """One random draw found these only when it drew a sample the mix involves; the probe
    sets find them whatever the seed."""
    for seed in range(8):
        torch.manual_seed(seed)
        model = Net(mix)
        x, y = batch(6, seed)
        if seed == 0:
            assert contribution(model, x, y) > 1.01
        message = refused(wrap(model, mode), model, x, y)
        assert "samples are mixed inside the model:" in message  # autograd's probe, naming the layers
        assert "layer 'a' (Linear)" in message and "layer 'head'" not in message


@pytest.mark.parametrize("mode", GHOST)
def test_a_loss_over_its_largest_is_refused_at_every_seed(mode):
    """loss_b = CE_b / max_j CE_j: the largest sample's loss is constant, its gradient zero on
    every row; one draw of it saw nothing. The other samples' losses read it."""
    for seed in range(8):
        torch.manual_seed(seed)
        model = Net()
        x, y = batch(6, seed)
        if seed == 0:
            assert contribution(model, x, y, LOSSES["over the largest"]) > 2
        refused(wrap(model, mode), model, x, y, LOSSES["over the largest"], ["the loss mixes samples"])


# ---------------------------------------------------------------------------- what autograd cannot see
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mix", ["detached statistics", "straight through", "buffer"])
def test_mixing_autograd_cannot_see_is_found_by_the_forward_probe(mix, mode):
    torch.manual_seed(0)
    model = Net(mix)
    x, y = batch(6)
    assert contribution(model, x, y) > 1.01
    message = refused(wrap(model, mode), model, x, y, words=["where autograd does not see it",
                                                               "the model's output of shape (6, 3)"])
    assert "forward probe" in message


def test_a_buffer_the_forward_pass_writes_is_the_forward_pass_s_own_after_the_probe():
    """The forward probe's runs write to copies of the buffers: the model's buffer holds the
    forward pass's value, and its tensor is the same object (autograd may have saved it)."""
    torch.manual_seed(0)
    model = Net("buffer")
    wrapped = dpgrad.GradSampleModule(model, loss_reduction="sum", check_independence=False)
    x, _ = batch(6)
    stat = model.stat
    wrapped(x)
    expected = model.stat.clone()
    model.stat.zero_()
    wrapped._path.check_independence = True
    with pytest.raises(dpgrad.SampleMixingError):
        wrapped(x)
    assert model.stat is stat and torch.equal(model.stat, expected)


@pytest.mark.parametrize("mode", GHOST)
@pytest.mark.parametrize("loss", ["over the detached largest", "smoothed toward the batch"])
def test_a_loss_mixing_where_autograd_cannot_see_is_found_by_its_forward_probe(loss, mode):
    for seed in range(4):
        torch.manual_seed(seed)
        model = Net()
        x, y = batch(6, seed)
        if loss == "smoothed toward the batch":
            assert contribution(model, x, y, LOSSES[loss]) > 1.1
        refused(wrap(model, mode), model, x, y, LOSSES[loss], ["the loss mixes samples where autograd does not see it"])


@pytest.mark.parametrize("mode", MODES)
def test_mixing_switched_on_later_is_found_by_a_recheck(mode):
    """h + alpha * mean(h), alpha 0 at the first step, 1 after: the graph is the same, so only
    a re-check (``recheck_independence``) probes it again."""
    x, y = batch(6)
    for every, expected in [(None, ["ok"] * 4), (1, ["ok"] + ["refused"] * 3), (3, ["ok", "ok", "refused", "refused"])]:
        torch.manual_seed(0)
        model = Net("switched")
        model.alpha = 0.0
        wrapped = wrap(model, mode, recheck_independence=every)
        assert wrapped.recheck_independence == every
        seen = []
        for k in range(4):
            model.alpha = 0.0 if k == 0 else 1.0
            clear(wrapped, model)
            try:
                step(wrapped, x, y)
                seen.append("ok")
            except dpgrad.SampleMixingError:
                seen.append("refused")
        assert seen == expected, (every, seen)
    torch.manual_seed(0)
    model = Net("switched")
    model.alpha = 1.0
    assert contribution(model, x, y) > 1.01


@pytest.mark.parametrize("every", [0, -1, 2.5, True, "3"])
def test_a_recheck_that_is_not_a_number_of_steps_is_refused(every):
    with pytest.raises(ValueError, match="recheck_independence"):
        dpgrad.GradSampleModule(Net(), recheck_independence=every)


# ---------------------------------------------------------------------------- no false alarm
class Dropped(nn.Module):
    """Per sample, with dropout (the forward probe's runs draw the forward pass's masks) and an
    attribute the forward pass sets (restored after the probe's runs)."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(5, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)
        self.last = None

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x)))
        self.last = h
        return self.head(h)


@pytest.mark.parametrize("mode", MODES)
def test_a_per_sample_model_with_dropout_is_not_refused(mode):
    torch.manual_seed(0)
    model = Dropped()
    plain = copy.deepcopy(model)
    wrapped = wrap(model, mode)
    x, y = batch(6)
    state = torch.get_rng_state()
    out = wrapped(x)
    assert model.last.requires_grad  # the forward pass's own tensor, with its graph
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    torch.testing.assert_close(out, plain(x))  # the same dropout masks as a plain forward pass
    assert torch.equal(torch.get_rng_state(), after)  # the probes drew nothing from torch's generator
    clear(wrapped, model)
    step(wrapped, x, y)
    assert all(torch.isfinite(p.grad if mode != "gsm" else p.grad_sample).all() for p in model.parameters())


def shifted_ce(out, y):
    """Cross-entropy on the logits less the batch's largest: the shift cancels in each row's
    softmax, so loss b is sample b's alone; its gradient through the max, 1 - sum(softmax), is
    rounding."""
    return F.cross_entropy(out - out.max(), y, reduction="none")


class ShiftedCE(nn.Module):
    """``shifted_ce`` as a criterion module, reduced as the wrappers are (the loss wrapper calls
    it with reduction "none")."""

    def __init__(self):
        super().__init__()
        self.reduction = "sum"

    def forward(self, out, y):
        return F.cross_entropy(out - out.max(), y, reduction=self.reduction)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("criterion", ["function", "module"])
def test_logits_shifted_by_the_batch_s_largest_are_not_mixing(criterion, mode):
    """The probes' gradients reach the row of the batch's largest logit by about 1e-7 of the
    probed rows' (fp32 rounding), far under the tolerance: not refused, and each step (a batch
    of 4, of 1, then of 16) is float64's clipped sum (the per-sample gradients under "gsm")."""
    for seed in range(3):
        torch.manual_seed(seed)
        model = Net()
        reference = copy.deepcopy(model)
        wrapped = wrap(model, mode)
        for n in (4, 1, 16):
            x, y = batch(n, seed)
            clear(wrapped, model)
            step(wrapped, x, y, ShiftedCE() if criterion == "module" else shifted_ce)
            assert_exact(model, wrapped, reference, x, y, shifted_ce)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_shifting_by_the_batch_s_largest_is_not_mixing(mode):
    """softmax(h - h.max()) between hooked layers: per sample on paper (float64: no sample moves
    the clipped sum by more than C), rounding for the model's probes."""
    for seed in range(3):
        torch.manual_seed(seed)
        model = Net("shifted")
        reference = copy.deepcopy(model)
        x, y = batch(6, seed)
        if seed == 0:
            assert contribution(model, x, y) <= 1 + 1e-9
        wrapped = wrap(model, mode)
        step(wrapped, x, y)
        assert_exact(model, wrapped, reference, x, y)


@pytest.mark.parametrize("mode", MODES)
def test_mixing_a_few_times_the_tolerance_is_refused(mode):
    """h + 1e-3 h.mean(0) in a batch of 4: each row reads every other at 2.5e-4, which the
    probes see at 2 to 7 times their tolerance (1.0001 C with the check off)."""
    for seed in range(4):
        torch.manual_seed(seed)
        model = Net("switched")
        model.alpha = 1e-3
        x, y = batch(4, seed)
        if seed == 0:
            assert contribution(model, x, y) > 1 + 1e-5
        message = refused(wrap(model, mode), model, x, y)
        assert "samples are mixed inside the model:" in message  # autograd's probe


@pytest.mark.parametrize("mode", GHOST)
def test_a_loss_mixing_a_few_times_the_tolerance_is_refused(mode):
    """loss_b = CE(out_b + 1e-3 mean_j out_j), given to clipped_backward: only the backward
    probes see it."""

    def loss(out, y):
        return ce(out + 1e-3 * out.mean(0), y)

    for seed in range(4):
        torch.manual_seed(seed)
        model = Net()
        x, y = batch(4, seed)
        if seed == 0:
            assert contribution(model, x, y, loss) > 1 + 1e-5
        wrapped = wrap(model, mode)
        with pytest.raises(dpgrad.SampleMixingError, match="the loss mixes samples"):
            wrapped.clipped_backward(loss(wrapped(x), y))
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", GHOST)
def test_per_sample_steps_bound_every_contribution(mode):
    """Batches of 0, 1 and 6 of a per-sample model, through the clipping wrapper: each step's
    clipped sum is float64's, and removing any one sample moves it by at most C (1 + 1e-6),
    measured on dpgrad's own sums."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, mode)
    x, y = batch(6)

    def summed(rows):
        clear(wrapped, model)
        step(wrapped, x[rows], y[rows])
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
                          for p in model.parameters()])

    for n in (0, 1, 6):
        got = summed(list(range(n)))
        if n:
            torch.testing.assert_close(got, clipped_sum(reference, x[:n], y[:n], ce, C), rtol=1e-5, atol=1e-7 * C)
    full = summed(list(range(6)))
    for k in range(6):
        assert (full - summed([i for i in range(6) if i != k])).norm() <= C * (1 + 1e-6)


# ---------------------------------------------------------------------------- entry points
@pytest.mark.parametrize("mode", ["single", "double", "hooks"])
def test_make_private_with_poisson_batches_of_zero_and_one_first(mode):
    """Poisson sampling at a small rate: the first batches hold 0 and 1 samples; a later one
    of 6 is refused (under "hooks", GradSampleModule, at its forward pass)."""
    opacus = pytest.importorskip("opacus")
    import dpgrad.opacus as dpo

    torch.manual_seed(0)
    x, y = batch(6)
    model = Net("twice the mean")
    data = torch.utils.data.TensorDataset(x, y)
    made = dpo.make_private(
        opacus.PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=2), noise_multiplier=0.0, max_grad_norm=1.0,
        poisson_sampling=True, single_backward=mode == "single", grad_sample_mode="hooks" if mode == "hooks" else "ghost")
    module, optimizer = made[0], made[1]
    criterion = made[2] if mode != "hooks" else (lambda out, t: nn.CrossEntropyLoss()(out, t))
    for n in (0, 1):
        optimizer.zero_grad()
        criterion(module(x[:n]), y[:n]).backward()
        optimizer.step()
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(dpgrad.SampleMixingError, match="samples are mixed inside the model"):
        criterion(module(x), y).backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_the_trainer_refuses_mixing_autograd_cannot_see(tmp_path):
    """DPTrainer: a GPT-2 block whose output is centred by its detached batch mean."""
    pytest.importorskip("transformers")
    pytest.importorskip("opacus")
    from dpgrad.hf import DPTrainer, PrivacyArguments
    from hf_trainer_worker import gpt2, rows, training_args

    model = gpt2()
    model.transformer.h[0].register_forward_hook(
        lambda module, args, out: (out[0] - out[0].mean(0, keepdim=True).detach(), *out[1:])
        if isinstance(out, tuple) else out - out.mean(0, keepdim=True).detach())
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05)
    trainer = DPTrainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=rows(),
                        privacy_args=privacy)
    with pytest.raises(dpgrad.SampleMixingError, match="where autograd does not see it"):
        trainer.train()
    assert all(p.grad is None for p in model.parameters())
    assert PrivacyArguments(noise_multiplier=1.0, recheck_independence=5).recheck_independence == 5
    with pytest.raises(ValueError, match="recheck_independence"):
        PrivacyArguments(noise_multiplier=1.0, recheck_independence=0)
