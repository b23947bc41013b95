"""``dpgrad.hf.DPTrainer``: a DP step through the Hugging Face Trainer equals dpgrad's own DP step
on the same Poisson batch, in one process and under DDP (2 processes on gloo); the noise's
scale, added once; the accountant; the budget stop; user-level clipping; the refusals."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("opacus")

from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import PRVAccountant, RDPAccountant  # noqa: E402

import dpgrad.opacus  # noqa: E402
from dpgrad.hf import DPTrainer, PoissonSampler, PrivacyArguments  # noqa: E402
from hf_trainer_worker import SEQ, Recording, gpt2, rows, training_args  # noqa: E402

# Its session-scoped fixture runs once: under pytest-xdist the module's tests share a worker.
pytestmark = pytest.mark.xdist_group("test_hf_trainer")

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_lora():
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():  # adapters start at zero: give them a gradient of every kind
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


MODELS = {"gpt2": gpt2, "llama_lora": llama_lora}


def trainer(tmp_path, model, data, privacy=None, **kw):
    privacy = privacy or PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05)
    return DPTrainer(model=model, args=training_args(tmp_path, **kw), train_dataset=data, privacy_args=privacy)


def first_batch(trainer_):
    """The indices of the trainer's first logical batch: its sampler's first draw."""
    sampler = PoissonSampler(trainer_._units, trainer_.sample_rate, torch.Generator().manual_seed(trainer_.args.seed))
    return next(iter(sampler))


def steps(trainer_):
    """The steps the trainer's accountant counted."""
    return sum(n for *_, n in trainer_.accountant.history)


def reference_step(model, data, indices, lr, max_grad_norm, expected, smoothing=0.0):
    """dpgrad.opacus.make_private's DP step (noise 0, single backward) on the given rows (of
    one length)."""
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, criterion, _ = dpgrad.opacus.make_private(
        PrivacyEngine(), module=model, data_loader=loader, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr),
        criterion=nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=smoothing), poisson_sampling=False,
        single_backward=True)
    optimizer.expected_batch_size = expected  # the logical batch's expected size, as the trainer's
    optimizer.zero_grad()
    if indices:
        batch = {k: torch.stack([data[i][k] for i in indices]) for k in ("input_ids", "attention_mask", "labels")}
        length = batch["input_ids"].shape[1]
        positions = torch.arange(length).expand(len(indices), length)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=positions).logits
        loss = criterion(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                         shape=logits[:, :-1].shape[:2])
        loss.backward()
    optimizer.step()
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_one_step_equals_the_clipped_step_of_make_private(tmp_path, name):
    torch.manual_seed(0)
    model = MODELS[name]()
    start = copy.deepcopy(model)
    data = rows()
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=3)
    t = trainer(tmp_path, model, data, privacy=privacy)
    indices = first_batch(t)
    assert len(indices) > 3 and len(indices) % 3  # several physical batches, the last padded
    t.train()
    expected = reference_step(start, data, indices, lr=0.5, max_grad_norm=0.05, expected=8)
    moved = 0
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
        moved += int(not torch.equal(p, dict(start.named_parameters())[n]))
    assert moved > 0
    assert steps(t) == 1


def test_label_smoothing_is_the_clipped_loss(tmp_path):
    """label_smoothing_factor smooths the per-sample loss that is clipped, as the Trainer's
    own loss would be."""
    torch.manual_seed(0)
    model = gpt2()
    start = copy.deepcopy(model)
    data = rows()
    t = trainer(tmp_path, model, data, label_smoothing_factor=0.2)
    indices = first_batch(t)
    t.train()
    plain = reference_step(copy.deepcopy(start), data, indices, lr=0.5, max_grad_norm=0.05, expected=8)
    expected = reference_step(start, data, indices, lr=0.5, max_grad_norm=0.05, expected=8, smoothing=0.2)
    for p, q, r in zip(model.parameters(), expected.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(q, r) for q, r in zip(expected.parameters(), plain.parameters()))


def test_bf16_mixed_precision_is_the_clipped_step_under_autocast(tmp_path):
    """bf16=True (the Trainer's autocast): the step is make_private's clipped step under the
    same autocast, to bf16's precision (1% of each parameter's update, and the float32
    rounding of the weights; every sample is clipped, so a step without clipping would be
    many times larger)."""
    torch.manual_seed(0)
    model = gpt2()
    start = copy.deepcopy(model)
    data = rows()
    t = trainer(tmp_path, model, data, bf16=True)
    indices = first_batch(t)
    t.train()
    before = [p.detach().clone() for p in start.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference_step(start, data, indices, lr=0.5, max_grad_norm=0.05, expected=8)
    for (n, p), q, b in zip(model.named_parameters(), expected.parameters(), before):
        assert p.dtype == torch.float32
        update = (q - b).abs().max().item()
        ulp = torch.finfo(torch.float32).eps * b.abs().max().item()  # of the stored weights
        assert (p - q).abs().max().item() <= 1e-2 * update + 2 * ulp, n


def test_gradient_checkpointing_is_made_non_reentrant_and_gives_the_same_step(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    plain = copy.deepcopy(model)
    data = rows()
    trainer(tmp_path / "a", plain, data).train()
    t = trainer(tmp_path / "b", model, data, gradient_checkpointing=True)
    assert t.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    t.train()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_noise_has_the_scale_of_the_noise_multiplier_and_bound(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    data = rows()
    quiet, noisy = copy.deepcopy(model), copy.deepcopy(model)
    trainer(tmp_path / "a", quiet, data).train()
    sigma, bound, lr, expected = 2.0, 0.05, 0.5, 8
    trainer(tmp_path / "b", noisy, data, privacy=PrivacyArguments(noise_multiplier=sigma, max_grad_norm=bound)).train()
    # The same batch: the updates differ by lr * noise / expected batch size.
    noise = torch.cat([(q - p).flatten() for p, q in zip(noisy.parameters(), quiet.parameters())]) * expected / lr
    assert noise.numel() > 20000
    assert noise.std().item() == pytest.approx(sigma * bound, rel=0.03)
    assert abs(noise.mean().item()) < 3 * sigma * bound / math.sqrt(noise.numel())


@pytest.mark.parametrize("accountant, cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_equals_opacus_accountant_and_is_logged(tmp_path, accountant, cls):
    torch.manual_seed(0)
    t = trainer(tmp_path, gpt2(), rows(), max_steps=3,
                privacy=PrivacyArguments(noise_multiplier=1.1, max_grad_norm=1.0, accountant=accountant))
    t.train()
    reference = cls()
    for _ in range(3):
        reference.step(noise_multiplier=1.1, sample_rate=8 / 24)
    epsilon, delta = t.privacy_spent()
    assert delta == 24 ** -1.1 and t.sample_rate == 8 / 24  # the default delta, N^-1.1
    assert epsilon == pytest.approx(reference.get_epsilon(delta=24 ** -1.1), rel=1e-6)
    logged = [entry["epsilon"] for entry in t.state.log_history if "epsilon" in entry and "loss" in entry]
    assert len(logged) == 3 and logged[-1] == pytest.approx(epsilon, rel=1e-6)
    assert all("grad_norm" not in entry for entry in t.state.log_history)  # the unnoised norm is not private


def test_target_epsilon_is_spent_by_the_planned_steps_and_never_exceeded(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    t = trainer(tmp_path, model, rows(), max_steps=4,
                privacy=PrivacyArguments(target_epsilon=3.0, max_grad_norm=1.0, accountant="rdp"))
    t.train()
    epsilon, _ = t.privacy_spent()
    assert steps(t) == 4 and 2.9 <= epsilon <= 3.0
    before = [p.detach().clone() for p in model.parameters()]
    t.train()  # the budget is spent: no further step is taken
    assert steps(t) == 4 and t.privacy_spent()[0] == epsilon
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_delta_of_1_over_n_is_warned_of_and_prv_runs_without_rdp_warnings(tmp_path):
    """A given target_delta of 1/N or more is warned of (the default, N^-1.1, is not); the PRV
    accountant's calls (the noise for target_epsilon, epsilon in the logs) give no warning of
    RDP's, which concerns an inner bound of PRV's only; under RDP that warning is kept."""
    import warnings

    with pytest.warns(UserWarning, match=r"target_delta=0.0416667 is at least 1/N for N=24 samples"):
        trainer(tmp_path, gpt2(), rows(), privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1 / 24))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = trainer(tmp_path, gpt2(), rows(), max_steps=2,
                    privacy=PrivacyArguments(target_epsilon=8.0, max_grad_norm=1.0, accountant="prv"))
        t.train()
        epsilon, delta = t.privacy_spent()
    assert steps(t) == 2 and 0 < epsilon <= 8.0 and delta == 24 ** -1.1
    assert not [w for w in seen if "1/N" in str(w.message) or "largest alpha" in str(w.message)]
    from dpgrad.opacus.budget import accountant_quiet

    with pytest.warns(UserWarning, match="largest alpha"), accountant_quiet("rdp"):
        reference = RDPAccountant()
        reference.history = [(20.0, 0.01, 10)]
        reference.get_epsilon(delta=1e-5)


def _clipped_sum(tmp_path, data, user_column):
    """The clipped sum of one step over all of ``data`` (sample rate 1, noise 0, lr 1)."""
    torch.manual_seed(0)
    model = gpt2()
    start = [p.detach().clone() for p in model.parameters()]
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.01, user_column=user_column)
    t = trainer(tmp_path, model, data, privacy=privacy, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                learning_rate=1.0)
    assert t.sample_rate == 1.0
    t.train()
    return torch.cat([(s - p.detach()).flatten() for s, p in zip(start, model.parameters())]) * 32


def test_user_level_clipping_bounds_a_user_with_five_rows_by_the_bound(tmp_path):
    users = ["a"] * 5 + ["b", "c", "d", "e", "f"]
    data, without = rows(10, users), rows(10, users)[5:]
    moved = (_clipped_sum(tmp_path / "u1", data, "user") - _clipped_sum(tmp_path / "u2", without, "user")).norm()
    assert 0 < moved.item() <= 0.01 * (1 + 1e-5)
    # The same rows as five samples move it by up to five bounds (here more than one).
    rows_moved = (_clipped_sum(tmp_path / "r1", data, None) - _clipped_sum(tmp_path / "r2", without, None)).norm()
    assert rows_moved.item() > 0.015


def test_users_are_sampled_with_all_their_rows(tmp_path):
    users = [i // 3 for i in range(24)]
    t = trainer(tmp_path, gpt2(), rows(24, users), privacy=PrivacyArguments(noise_multiplier=1.0, user_column="user"),
                per_device_train_batch_size=2, gradient_accumulation_steps=1)
    assert len(t._units) == 8 and t.sample_rate == 2 / 8 and t.target_delta == 8 ** -1.1
    for batch in t.get_train_dataloader():
        taken = {users[i] for i in batch.indices}
        assert sorted(batch.indices) == [i for i in range(24) if users[i] in taken]
        assert batch.shares == [1 / 3] * len(batch.indices)


class _OwnLoader(DPTrainer):
    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=4)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(rows())


def test_cuda_graph_replays_each_physical_batch_and_trains_as_the_eager_trainer(tmp_path, monkeypatch):
    """PrivacyArguments(cuda_graph=True): each physical batch's forward pass and clipped backward
    replayed (from ``Rerun``, a CPU's stand-in for a CUDA graph; the real capture is tested on a
    GPU), the noise and the step outside: the eager trainer's weights and accounting, bit for
    bit, over steps of several physical batches (the last padded)."""
    import dpgrad.graphs
    from test_graphs import Rerun

    found = {}
    for graph in (False, True):
        graphs = Rerun()
        monkeypatch.setattr(dpgrad.graphs, "GRAPHS", graphs)
        torch.manual_seed(0)
        model = gpt2()
        privacy = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.05, physical_batch_size=3, cuda_graph=graph)
        t = trainer(tmp_path / str(graph), model, rows(), privacy=privacy, max_steps=3)
        t.train()
        found[graph] = ({n: p.detach().clone() for n, p in model.named_parameters()}, t.accountant.history, t)
    (eager, eager_history, _), (replayed, history, t) = found[False], found[True]
    assert history == eager_history and steps(t) == 3
    for name in eager:
        torch.testing.assert_close(replayed[name], eager[name], rtol=0, atol=0, msg=name)
    (graphed,) = t._graphed.graphs.values()  # one shape of physical batch
    assert graphs.captures == 1 and graphed.replays >= 2 and graphed.eager_steps == graphed.warmup


@pytest.mark.parametrize("kw, message", [
    ({"user_column": "user"}, "cuda_graph=True with user_column"),
    ({"recheck_independence": 4}, "cuda_graph=True with recheck_independence"),
])
def test_cuda_graph_refuses_what_a_graph_cannot_replay(kw, message):
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(noise_multiplier=1.0, cuda_graph=True, **kw)


def test_cuda_graph_on_a_cpu_is_refused_at_the_first_pass(tmp_path):
    privacy = PrivacyArguments(noise_multiplier=1.0, physical_batch_size=3, cuda_graph=True)
    t = trainer(tmp_path, gpt2(), rows(), privacy=privacy)
    with pytest.raises(ValueError, match="move the model to a CUDA device"):
        t.train()


@pytest.mark.parametrize("case, message", [
    ("group_by_length", "train_sampling_strategy='group_by_length'"),
    ("own_loader", "_OwnLoader overrides get_train_dataloader"),
    ("deepspeed", "does not support DeepSpeed.*To shard a model over several GPUs, use FSDP2"),
    ("reentrant", "non-reentrant activation checkpointing"),
    ("lomo", "LOMO optimizers update the weights inside the backward pass"),
    ("foreign_optimizer", "not the model's"),
    ("stream", "not an IterableDataset"),
    ("loss_func", "a compute_loss_func would not be the loss it clips"),
    ("empty", "the training dataset is empty"),
    ("one_row", "which is 1.0 for N = 1 rows: a delta of 1 guarantees nothing"),
])
def test_refusals(tmp_path, case, message):
    model, data, kw, cls = gpt2(), rows(), {}, DPTrainer
    if case == "group_by_length":
        kw["train_sampling_strategy"] = "group_by_length"
    elif case == "reentrant":
        kw.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    elif case == "lomo":
        kw["optim"] = "lomo"
    elif case == "stream":
        data = _Stream()
    elif case == "own_loader":
        cls = _OwnLoader
    elif case == "empty":
        data = []
    elif case == "one_row":
        data = rows(1)
    args = training_args(tmp_path, **kw)
    if case == "deepspeed":
        args.deepspeed = {"zero_optimization": {"stage": 2}}
    extra = {}
    if case == "foreign_optimizer":
        extra["optimizers"] = (torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), None)
    elif case == "loss_func":
        extra["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean()
    with pytest.raises(ValueError, match=message):
        cls(model=model, args=args, train_dataset=data, privacy_args=PrivacyArguments(noise_multiplier=1.0), **extra)


def test_the_trainer_s_fsdp_is_taken_in_its_version_2_only(tmp_path):
    """The Trainer's FSDP (which Accelerate enables on GPUs only, so set by hand here): version
    2 (fully_shard) passes the checks, version 1 (flat parameters) is refused."""
    t = trainer(tmp_path, gpt2(), rows(), privacy=PrivacyArguments(noise_multiplier=1.0))
    t.is_fsdp_enabled = True
    t.args.fsdp_config = {"fsdp_version": 2}
    t._refuse_what_breaks_the_guarantee()
    assert t._sharded()
    t.args.fsdp_config = {"fsdp_version": 1}
    with pytest.raises(ValueError, match="takes the Trainer's FSDP in its version 2 only"):
        t._refuse_what_breaks_the_guarantee()


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one of target_epsilon and noise_multiplier"),
    ({"target_epsilon": 8.0, "noise_multiplier": 1.0}, "exactly one of"),
    ({"target_epsilon": -1.0}, "target_epsilon must be a finite positive number"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier must be a finite number"),
    ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max_grad_norm must be a finite positive number"),
    ({"noise_multiplier": 1.0, "accountant": "gdp"}, "accountant='gdp'"),
    ({"noise_multiplier": 1.0, "target_delta": 1.5}, "target_delta must lie strictly between 0 and 1"),
    ({"noise_multiplier": 1.0, "physical_batch_size": 0}, "physical_batch_size must be a positive integer"),
])
def test_privacy_arguments_refuse_what_is_not_a_budget(kw, message):
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(**kw)


def test_privacy_arguments_are_read_by_hf_argument_parser():
    parser = transformers.HfArgumentParser(PrivacyArguments)
    (privacy,) = parser.parse_args_into_dataclasses(["--target_epsilon", "8", "--user_column", "author"])
    assert privacy.target_epsilon == 8.0 and privacy.user_column == "author" and privacy.single_backward


def test_the_trainers_own_clipping_is_turned_off_with_a_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dpgrad.hf"):
        t = trainer(tmp_path, gpt2(), rows(), max_grad_norm=1.0)
    assert t.args.max_grad_norm == 0.0 and "max_grad_norm=1.0 turned off" in caplog.text


def test_per_sample_bounds_above_the_bound_are_refused():
    import dpgrad

    model = dpgrad.GradSampleModuleFastGradientClipping(nn.Linear(3, 2), max_grad_norm=1.0, single_backward=True)
    losses = model(torch.randn(4, 3)).sum(dim=1)
    with pytest.raises(ValueError, match="between 0 and max_grad_norm=1.0"):
        model.clipped_backward(losses, max_grad_norms=[0.5, 0.5, 1.5, 0.5])
    with pytest.raises(ValueError, match="one bound per sample"):
        model.clipped_backward(losses, max_grad_norms=[0.5, 0.5])


def test_an_empty_poisson_batch_is_a_step_of_noise_alone(tmp_path):
    """A logical batch with no row (Poisson sampling allows it) runs one padded physical batch
    whose rows weigh nothing: at noise 0 the weights do not move, and the step is counted."""
    torch.manual_seed(0)
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(tmp_path, model, rows(), per_device_train_batch_size=1, gradient_accumulation_steps=1, seed=6)
    assert first_batch(t) == []
    t.train()
    assert steps(t) == 1 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_callers_training_arguments_are_left_as_they_were(tmp_path):
    args = training_args(tmp_path, max_grad_norm=1.0, gradient_checkpointing=True)
    t = DPTrainer(model=gpt2(), args=args, train_dataset=rows(), privacy_args=PrivacyArguments(noise_multiplier=1.0))
    assert (t.args.gradient_accumulation_steps, t.args.max_grad_norm) == (1, 0.0) and t.expected_batch_size == 8
    assert (args.gradient_accumulation_steps, args.max_grad_norm, args.gradient_checkpointing_kwargs) == (2, 1.0, None)
    again = DPTrainer(model=gpt2(), args=args, train_dataset=rows(), privacy_args=PrivacyArguments(noise_multiplier=1.0))
    assert again.expected_batch_size == 8 and again.sample_rate == 8 / 24


def test_epsilon_is_never_negative(tmp_path):
    """Opacus's accountants can give a little below 0 (here -0.5 at delta 0.5): epsilon is 0."""
    t = trainer(tmp_path, gpt2(), rows(8), max_steps=1,
                privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=0.5, accountant="prv"))
    t.train()
    assert t.privacy_spent() == (0.0, 0.5)
    assert [e["epsilon"] for e in t.state.log_history if "loss" in e] == [0.0]


def _recording(tmp_path, privacy, **kw):
    return Recording(model=gpt2(), args=training_args(tmp_path, **kw), train_dataset=rows(12), privacy_args=privacy)


@pytest.mark.parametrize("budget", ["noise", "target"])
def test_resuming_from_a_checkpoint_goes_on_spending_the_same_budget(tmp_path, budget):
    """A run stopped at a checkpoint and resumed has spent what the uninterrupted run spends
    (the accountant's steps are in the checkpoint), and its Poisson batches continue the
    sampler's stream instead of drawing the first ones again. Under target_epsilon, the
    resumed run keeps the budget's noise and stops where the budget ends, whatever max_steps."""
    privacy = (PrivacyArguments(noise_multiplier=1.0, accountant="rdp") if budget == "noise"
               else PrivacyArguments(target_epsilon=1.0, accountant="rdp"))
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)  # q = 1/3, 3 steps an epoch
    first = _recording(tmp_path, privacy, max_steps=6, save_strategy="steps", save_steps=4, **common)
    first.train()  # saves at step 4, goes on to 6: the uninterrupted run
    # Resumed with the same plan, or (under the target, whose budget ends at 6) a longer one.
    resumed = _recording(tmp_path, privacy, max_steps=6 if budget == "noise" else 12, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert steps(first) == steps(resumed) == 6
    assert resumed.privacy_spent() == pytest.approx(first.privacy_spent(), rel=1e-9)
    assert resumed.noise_multiplier == first.noise_multiplier
    if budget == "target":
        assert 0.9 < first.privacy_spent()[0] <= 1.0
    # The checkpoint is one step into the second epoch: the resumed run's draws are exactly the
    # uninterrupted run's fifth and sixth (the Trainer draws and drops the epoch's first again).
    sampler = PoissonSampler(first._units, first.sample_rate, torch.Generator().manual_seed(first.args.seed))
    stream = [list(batch) for _ in range(2) for batch in sampler]  # 2 epochs of 3 draws
    assert first.drawn == stream[:6] and resumed.drawn == stream[4:6], (resumed.drawn, stream)
    for (n, p), q in zip(first.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=n)


def test_a_resume_with_more_max_steps_stops_before_the_step_past_target_epsilon(tmp_path):
    """Under target_epsilon=3, N=24 rows at q = 1/24, the 38 planned steps spend 2.992 and a 39th
    would spend 3.028: within 1% of the target, and still past it. The fresh run takes its 38
    steps; resumed at step 36 with max_steps=48, the run takes the 2 steps left and stops."""
    privacy = PrivacyArguments(target_epsilon=3.0, accountant="rdp")
    common = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, logging_steps=100)
    first = trainer(tmp_path, gpt2(), rows(), privacy=privacy, max_steps=38, save_strategy="steps", save_steps=36,
                    **common)
    first.train()
    spent = first.privacy_spent()
    assert steps(first) == 38 and spent[0] <= 3.0
    resumed = trainer(tmp_path, gpt2(), rows(), privacy=privacy, max_steps=48, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-36"))
    assert steps(resumed) == 38 and resumed.state.global_step == 38 and resumed.privacy_spent() == spent
    reference = RDPAccountant()
    reference.history = [(first.noise_multiplier, 1 / 24, 39)]
    assert 3.0 < reference.get_epsilon(delta=24 ** -1.1) <= 3.0 * 1.01  # the step not taken


def test_a_mid_epoch_resume_takes_the_uninterrupted_run_s_batches(tmp_path):
    """N=20, batch 2, accumulation 2 (5 steps an epoch), resumed from step 2 of 5: steps 3-5
    take the uninterrupted run's draws 3-5, and the final weights are its weights."""
    privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp")
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5)

    def recording(**kw):
        return Recording(model=gpt2(), args=training_args(tmp_path, **common, **kw), train_dataset=rows(20),
                         privacy_args=privacy)

    first = recording(save_strategy="steps", save_steps=2)
    first.train()
    resumed = recording()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(first.drawn) == 5 and resumed.drawn == first.drawn[2:]
    assert steps(resumed) == 5 and resumed.privacy_spent() == pytest.approx(first.privacy_spent(), rel=1e-9)
    for (n, p), q in zip(first.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("problem, message", [
    ("missing", "holds no privacy state"), ("corrupt", "not a readable privacy state"),
    ("ill_typed", "a 'history' that is not a list"), ("other_rate", "the checkpoint's run had sample_rate"),
    ("old_default_delta", r"had target_delta 0.041666.*it was 1 / N before\): pass PrivacyArguments\(target_delta=0.041666"),
])
def test_a_checkpoint_without_a_sound_privacy_state_is_refused(tmp_path, problem, message):
    import json

    privacy = PrivacyArguments(noise_multiplier=1.0)
    t = trainer(tmp_path, gpt2(), rows(), privacy=privacy, max_steps=1, save_strategy="steps", save_steps=1)
    t.train()
    checkpoint = tmp_path / "checkpoint-1"
    state = checkpoint / "dpgrad_privacy.json"
    assert json.loads(state.read_text())["history"] == [[1.0, 8 / 24, 1]]
    kw = {}
    if problem == "missing":
        state.unlink()
    elif problem == "corrupt":
        state.write_text("{")
    elif problem == "ill_typed":
        state.write_text(json.dumps(dict(json.loads(state.read_text()), history=[["1", 0.3, 1]])))
    elif problem == "other_rate":
        kw["per_device_train_batch_size"] = 2
    elif problem == "old_default_delta":  # a run saved when the default delta was 1 / N
        state.write_text(json.dumps(dict(json.loads(state.read_text()), target_delta=1 / 24)))
    resumed = trainer(tmp_path, gpt2(), rows(), privacy=privacy, max_steps=2, **kw)
    with pytest.raises(ValueError, match=message):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert steps(resumed) == 0


@pytest.mark.parametrize("first, then, message", [
    (dict(target_epsilon=3.0), dict(target_epsilon=5.0),
     r"had target_epsilon 3\.0, this one has 5\.0: .* Resume with the same PrivacyArguments \(target_epsilon=3\.0\), "
     "or start a new run"),
    (dict(target_epsilon=3.0), dict(noise_multiplier=1.0),
     r"had target_epsilon 3\.0, this one has none \(noise_multiplier=1\.0\)"),
    (dict(noise_multiplier=1.0), dict(noise_multiplier=1.5),
     r"had noise_multiplier 1\.0, this one has 1\.5: .*\(noise_multiplier=1\.0\), or start a new run"),
    (dict(noise_multiplier=1.0), dict(noise_multiplier=1.0, max_grad_norm=0.5),
     r"had max_grad_norm 1\.0, this one has 0\.5: .*\(max_grad_norm=1\.0\)"),
    (dict(noise_multiplier=1.0, user_column="user"), dict(noise_multiplier=1.0),
     r"had user_column 'user', this one has None"),
], ids=["target_epsilon", "target_epsilon_to_noise", "noise_multiplier", "max_grad_norm", "user_column"])
def test_a_resume_with_other_privacy_settings_is_refused_before_its_first_step(tmp_path, first, then, message):
    """The checkpoint's run spent its budget at its noise, rate, bound and unit of privacy: a
    resumed run that changes them would go on with the checkpoint's noise under a budget it was
    not chosen for (target_epsilon), or count steps as they were not taken."""
    data = rows(users=list(range(24))) if "user_column" in first else rows()
    t = trainer(tmp_path, gpt2(), data, privacy=PrivacyArguments(accountant="rdp", **first), max_steps=1,
                save_strategy="steps", save_steps=1)
    t.train()
    resumed = trainer(tmp_path, gpt2(), data, privacy=PrivacyArguments(accountant="rdp", **then), max_steps=4)
    with pytest.raises(ValueError, match=message):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert steps(resumed) == 0


def test_a_checkpoint_saved_before_its_target_epsilon_was_recorded_resumes_at_its_noise_only(tmp_path):
    """Its budget cannot be checked: under target_epsilon it is refused, naming its noise, with
    which (as noise_multiplier) it resumes."""
    import json

    t = trainer(tmp_path, gpt2(), rows(), privacy=PrivacyArguments(target_epsilon=3.0, accountant="rdp"),
                max_steps=1, save_strategy="steps", save_steps=1)
    t.train()
    state = tmp_path / "checkpoint-1" / "dpgrad_privacy.json"
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({k: v for k, v in saved.items() if k not in ("target_epsilon", "user_column")}))
    noise = saved["noise_multiplier"]
    resumed = trainer(tmp_path, gpt2(), rows(), privacy=PrivacyArguments(target_epsilon=3.0, accountant="rdp"),
                      max_steps=2)
    with pytest.raises(ValueError, match=rf"does not record its run's target_epsilon.*noise_multiplier={noise!r}"):
        resumed.train(resume_from_checkpoint=str(state.parent))
    assert steps(resumed) == 0
    resumed = trainer(tmp_path, gpt2(), rows(), privacy=PrivacyArguments(noise_multiplier=noise, accountant="rdp"),
                      max_steps=2)
    resumed.train(resume_from_checkpoint=str(state.parent))
    assert steps(resumed) == 2


def test_each_model_of_model_init_trains_with_a_dp_optimizer_and_one_accountant(tmp_path):
    """``model_init`` (hyperparameter search) builds a new model and optimizer for every
    train(): each is made private, and the one accountant counts every run's steps."""
    from dpgrad.opacus import DPOptimizerFastGradientClipping

    t = DPTrainer(model_init=gpt2, args=training_args(tmp_path, max_steps=2), train_dataset=rows(),
                  privacy_args=PrivacyArguments(noise_multiplier=1.0))
    for run in (1, 2):
        t.train()
        private = t.optimizer.optimizer  # inside accelerate's wrapper
        assert isinstance(private, DPOptimizerFastGradientClipping) and private is t._dp_optimizer
        optimized = {id(p) for group in private.original_optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for p in t.model.parameters()}
        assert steps(t) == 2 * run


# ---------------------------------------------------------------------- TRL's SFTTrainer
def _sft(tmp_path, data, **kw):
    """DPTrainer with TRL's SFTTrainer after it (its dataset preparation, collator, evaluation
    loss), on a word-level tokenizer built here (nothing downloaded)."""
    trl = pytest.importorskip("trl")
    tokenizers = pytest.importorskip("tokenizers")

    class DPSFTTrainer(DPTrainer, trl.SFTTrainer):
        pass

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")
    base = training_args(tmp_path).to_dict()
    base = {k: v for k, v in base.items() if k in {
        "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "learning_rate", "optim",
        "lr_scheduler_type", "weight_decay", "report_to", "save_strategy", "use_cpu", "logging_steps", "seed",
        "disable_tqdm"}}
    config = trl.SFTConfig(output_dir=str(tmp_path), bf16=False, gradient_checkpointing=False,
                           completion_only_loss=True, **{**base, **kw})
    torch.manual_seed(0)
    model = gpt2()
    start = copy.deepcopy(model)
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=3)
    t = DPSFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, privacy_args=privacy)
    return t, model, start


def _prompt_completion_rows(n=24):
    """Tokenized prompt-completion rows (TRL's completion_mask), all of length SEQ."""
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list([
        {"input_ids": torch.randint(2, 64, (SEQ,), generator=g).tolist(),
         "completion_mask": [0] * (2 + i % 4) + [1] * (SEQ - 2 - i % 4)} for i in range(n)])


def test_trl_sft_trainer_subclasses_cleanly_and_takes_the_clipped_step(tmp_path):
    """``class DPSFTTrainer(DPTrainer, SFTTrainer)``: TRL prepares the dataset (labels -100 on
    the prompt: completion-only loss) and collates; the step is make_private's clipped step on
    the same rows and labels."""
    t, model, start = _sft(tmp_path, _prompt_completion_rows())
    prepared = [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"]),
                 "attention_mask": torch.ones(SEQ, dtype=torch.long)} for r in t.train_dataset]
    assert all((r["labels"][:2] == -100).all() and (r["labels"][-1] != -100) for r in prepared)
    indices = first_batch(t)
    assert len(indices) > 3 and len(indices) % 3
    t.train()
    assert steps(t) == 1
    expected = reference_step(start, prepared, indices, lr=0.5, max_grad_norm=0.05, expected=8)
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    assert math.isfinite(t.evaluate(_prompt_completion_rows(6))["eval_loss"])


@pytest.mark.parametrize("kw, message", [
    ({"packing": True}, "packing \\(or padding_free\\) puts several examples into one row"),
    ({"padding_free": True}, "packing \\(or padding_free\\)"),
    ({"loss_type": "dft"}, "loss_type='dft' would not be the loss it clips"),
    ({"activation_offloading": True}, "activation_offloading"),
])
def test_trl_settings_that_break_per_sample_clipping_are_refused(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _sft(tmp_path, _prompt_completion_rows(), **kw)


# ---------------------------------------------------------------------- DDP (2 processes, gloo)
WORLD = 2


def _start():
    """The workers' model before the step."""
    torch.manual_seed(0)
    return gpt2()


@pytest.fixture(scope="session")  # once per worker, however its tests interleave
def ddp(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch without distributed")
    from dpgrad.tools.ranks import spawn

    out = str(tmp_path_factory.mktemp("ddp"))
    jobs = [("ddp_step", dict(noise=noise, out=out)) for noise in (0.0, 2.0)] + [("ddp_resume", dict(out=out))]
    jobs += [("ddp_step", dict(noise=noise, out=out, sharded=True)) for noise in (0.0, 2.0)]
    jobs += [("ddp_resume", dict(out=out, sharded=True))]
    got = dict(zip((0.0, 2.0, "resume", "fsdp", "fsdp noisy", "fsdp resume"),
                   zip(*spawn(WORLD, jobs, "hf_trainer_worker"))))
    got["out"] = out
    return got


def test_ddp_step_is_the_one_process_clipped_step_of_the_ranks_batches(ddp):
    """Under the Trainer's DDP each rank Poisson-samples its share of the rows at the global
    rate (expected batch: per device x world), runs its own number of physical batches, and
    the step is make_private's clipped step over the union of the ranks' batches."""
    ranks = ddp[0.0]
    taken = []
    for rank, got in enumerate(ranks):
        assert got["model"] == "DistributedDataParallel"  # the Trainer wrapped it, as under torchrun
        assert got["world_size"] == WORLD and got["expected_batch_size"] == 8
        assert got["sample_rate"] == pytest.approx(8 / 24)
        assert got["optimizer"] == "DistributedDPOptimizerFastGradientClipping"
        assert got["indices"] and all(i % WORLD == rank for i in got["indices"]), got["indices"]
        taken += got["indices"]
    physical = [math.ceil(len(got["indices"]) / 2) for got in ranks]
    assert physical[0] != physical[1], "the ranks should run different numbers of physical batches"
    expected = reference_step(_start(), rows(), taken, lr=0.5, max_grad_norm=0.05, expected=8)
    start = list(_start().named_parameters())
    for rank, got in enumerate(ranks):
        moved = 0
        for (n, before), q in zip(start, expected.parameters()):
            p = torch.from_numpy(got["params"][n])
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} {n}")
            moved += int(not torch.equal(p, before.detach()))
        assert moved > 0


def test_a_model_sharded_by_fsdp2_takes_the_one_process_clipped_step(ddp):
    """A GPT-2 sharded by fully_shard before the Trainer (Accelerate enables its own FSDP on
    GPUs only: on CPU ranks this is the FSDP2 path that runs): the same Poisson batches as under
    DDP, every rank running as many physical batches as the one with the most, the step
    make_private's clipped step over the ranks' batches; with noise, each coordinate noised
    once (each rank its shards) and accounted at the global rate."""
    ranks, noisy = ddp["fsdp"], ddp["fsdp noisy"]
    taken = []
    for rank, got in enumerate(ranks):
        assert got["model"] == "GradSampleModuleFastGradientClipping"  # not Accelerate's DDP around FSDP2
        assert got["optimizer"] == "FSDPOptimizerFastGradientClipping"
        assert got["indices"] == ddp[0.0][rank]["indices"]
        taken += got["indices"]
    expected = reference_step(_start(), rows(), taken, lr=0.5, max_grad_norm=0.05, expected=8)
    for rank, got in enumerate(ranks):
        for (n, _), q in zip(_start().named_parameters(), expected.parameters()):
            torch.testing.assert_close(torch.from_numpy(got["params"][n]), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {n}")
    for n, p in noisy[0]["params"].items():
        assert (p == noisy[1]["params"][n]).all(), n
    noise = torch.cat([torch.from_numpy(noisy[0]["params"][n] - ranks[0]["params"][n]).flatten()
                       for n in ranks[0]["params"]]) * 8 / 0.5
    assert noise.std().item() == pytest.approx(2.0 * 0.05, rel=0.03)
    assert noisy[0]["epsilon"] == pytest.approx(ddp[2.0][0]["epsilon"], rel=1e-9)


def test_a_model_sharded_by_fsdp2_resumes_as_under_ddp(ddp):
    """Under FSDP2 (sharded by the caller) the checkpoint holds the gathered weights, each rank's
    optimizer state and privacy state; the resumed run counts the steps before it, draws on
    from each rank's stream, and ends on the uninterrupted run's weights."""
    for rank, got in enumerate(ddp["fsdp resume"]):
        first, resumed = got["first"], got["resumed"]
        assert len(first["drawn"]) == 4 and resumed["drawn"] == first["drawn"][3:]
        assert resumed["history"] == first["history"] and sum(n for *_, n in resumed["history"]) == 4
        assert first["drawn"] == ddp["resume"][rank]["first"]["drawn"]  # the batches DDP draws
        for n, p in first["params"].items():
            torch.testing.assert_close(torch.from_numpy(resumed["params"][n]), torch.from_numpy(p), msg=n)


def test_ddp_noise_is_added_once_and_accounted_at_the_global_rate(ddp):
    quiet, noisy = ddp[0.0], ddp[2.0]
    for a, b in zip(quiet, noisy):
        assert a["indices"] == b["indices"]  # the same seed: the same batches
    for n, p in noisy[0]["params"].items():
        assert (p == noisy[1]["params"][n]).all(), n  # every rank took the same step
    sigma, bound, lr, expected = 2.0, 0.05, 0.5, 8
    noise = torch.cat([torch.from_numpy(noisy[0]["params"][n] - quiet[0]["params"][n]).flatten()
                       for n in quiet[0]["params"]]) * expected / lr
    # Noise from every rank would be larger: sqrt(world) times if drawn independently.
    assert noise.std().item() == pytest.approx(sigma * bound, rel=0.03)
    accountant = PRVAccountant()
    accountant.history = [(sigma, 8 / 24, 1)]
    for got in noisy:
        assert got["epsilon"] == pytest.approx(accountant.get_epsilon(delta=24 ** -1.1), rel=1e-6)


def test_ddp_resume_goes_on_with_each_ranks_stream_and_the_privacy_spent(ddp):
    """Under DDP each rank's checkpoint holds its own privacy state (its sampler's generator);
    a run resumed from it counts the steps before it, each rank draws on from its own stream,
    and the step it takes is the clipped step of the ranks' batches from the checkpoint's
    weights."""
    from dpgrad.batches import rank_generator

    ranks = ddp["resume"]
    assert {"dpgrad_privacy-rank0.json", "dpgrad_privacy-rank1.json"} <= set(ranks[0]["files"])
    taken = []
    for rank, got in enumerate(ranks):
        first, resumed = got["first"], got["resumed"]
        assert len(first["drawn"]) == 4 and len(resumed["drawn"]) == 1
        assert resumed["history"] == first["history"] and sum(n for *_, n in resumed["history"]) == 4
        units = [[i] for i in range(24)][rank::WORLD]
        sampler = PoissonSampler(units, 8 / 24, rank_generator(5, rank))
        assert len(sampler) == 3  # the checkpoint ends the first epoch
        stream = [list(batch) for _ in range(3) for batch in sampler]
        assert first["drawn"] == stream[:4]
        # The second epoch goes on with the stream (a fresh generator would draw the first
        # epoch's batches again).
        assert resumed["drawn"] == first["drawn"][3:]
        taken += resumed["drawn"][0]
    for n, p in ranks[0]["resumed"]["params"].items():
        assert (p == ranks[1]["resumed"]["params"][n]).all(), n
        # The uninterrupted run's last step, from the same weights on the same batches.
        torch.testing.assert_close(p, ranks[0]["first"]["params"][n], rtol=1e-6, atol=1e-7, msg=n)
    at_checkpoint = transformers.GPT2LMHeadModel.from_pretrained(f"{ddp['out']}/first/checkpoint-3").train()
    names = [n for n, _ in at_checkpoint.named_parameters()]
    expected = reference_step(at_checkpoint, rows(), taken, lr=0.5, max_grad_norm=0.05, expected=8)
    for n, q in zip(names, expected.parameters()):
        torch.testing.assert_close(torch.from_numpy(ranks[0]["resumed"]["params"][n]), q.detach(), rtol=1e-5,
                                   atol=1e-6, msg=n)


@pytest.mark.parametrize("check", [True, False])
def test_a_model_that_mixes_samples_is_refused_unless_the_check_is_given_up(tmp_path, check):
    """dpgrad.checks.independence through the Trainer: a block whose output is centred over the
    batch mixes samples; the first step refuses it (PrivacyArguments.check_independence),
    before any gradient or the accountant moves."""
    model = gpt2()
    model.transformer.h[0].register_forward_hook(
        lambda module, args, out: (out[0] - out[0].mean(0, keepdim=True), *out[1:]) if isinstance(out, tuple)
        else out - out.mean(0, keepdim=True))
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, check_independence=check)
    trainer_ = trainer(tmp_path, model, rows(), privacy, max_steps=1)
    if check:
        with pytest.raises(dpgrad.SampleMixingError, match="samples are mixed inside the model"):
            trainer_.train()
        assert steps(trainer_) == 0
        assert all(p.grad is None for p in model.parameters())
    else:
        trainer_.train()
        assert steps(trainer_) == 1
