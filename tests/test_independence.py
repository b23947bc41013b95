"""The guarantee's second half: each sample's contribution is its own (``dpgrad.checks.independence``).

Models and losses that mix samples, or put them out of order, whatever op does it: a batch
statistic, a BatchNorm in training mode, attention across the batch, a batch reordered
between layers and restored, a layer run time-first with T == B; losses reversed or
permuted, a loss that mixes samples, in-batch negatives, outputs normalised by the batch, an
auxiliary loss on an inner layer's output. Each is refused with the error text asserted and
``p.grad`` (``p.grad_sample``) left as it was, by both wrappers in every mode that can see it
(``GradSampleModule`` gets no per-sample losses: its checks are the model's), under per-block
clipping and non-reentrant checkpointing too; ``check_independence=False`` gives the check up.
What is per sample stays exact against float64 (B = 1, zero-weight padding rows, an output
whose batch is on another dimension than the layers'). The probes run once per layout (a
backward pass per probe set, and the forward probe's runs), draw nothing from torch's
generators, and touch no gradient. The holes a single random probe left (first batches of 0
or 1, partial mixing, mixing autograd cannot see, batches of one): test_independence_probes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dpgrad
from dpgrad.checks import independence
from per_sample_reference import assert_tensor_close, per_sample_grads

C = 0.01  # below every per-sample norm: each sample is clipped
B, T = 4, 4  # T == B: a layer run time-first passes the batch-size check
MODES = ["single", "double", "gsm"]
GHOST = ["single", "double"]


class Mixer(nn.Module):
    """x (B, T, 5) -> logits (B, 3): a -> [mix] -> b -> mean over tokens -> head. ``mix`` picks
    what happens between ``a`` and ``b`` (None: every sample alone)."""

    def __init__(self, mix=None, checkpointed=False):
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.bn = nn.BatchNorm1d(6, affine=False, track_running_stats=False)  # no parameters, no buffers
        self.mix, self.checkpointed = mix, checkpointed
        self.hidden = None  # a's output, for an auxiliary loss

    def middle(self, h):
        mix = self.mix
        if mix == "center":  # a statistic over the batch
            h = h - h.mean(0)
        elif mix == "batchnorm":
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        elif mix == "attention":  # samples attend to each other
            flat = h.flatten(1)
            h = (torch.softmax(flat @ flat.T, dim=-1) @ flat).view_as(h)
        if mix == "reorder":  # sorted for b, restored after it (a cyclic shift: no sample stays)
            return torch.tanh(self.b(h.roll(1, 0))).roll(-1, 0)
        if mix == "time_first":
            return torch.tanh(self.b(h.transpose(0, 1))).transpose(0, 1)
        return torch.tanh(self.b(h))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.hidden = h
        h = checkpoint(self.middle, h, use_reentrant=False) if self.checkpointed else self.middle(h)
        return self.head(h.mean(1))


MODEL_MIXES = ["center", "batchnorm", "attention", "reorder", "time_first"]


def ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


# loss(logits, y, model) -> per-sample losses that are not each their own sample's
LOSSES = {
    "reversed": (lambda out, y, m: ce(out, y).flip(0), "in another order than the batch"),
    "permuted": (lambda out, y, m: ce(out, y).roll(1), "in another order than the batch"),
    "mixing": (lambda out, y, m: ce(out, y) + 10 * (out - out.mean(0)).square().sum(1), "the loss mixes samples"),
    "in-batch negatives": (lambda out, y, m: ce(F.normalize(out, dim=1) @ F.normalize(out, dim=1).T / 0.1,
                                                torch.arange(out.shape[0])), "the loss mixes samples"),
    "batch-normalised": (lambda out, y, m: ce((out - out.mean(0)) / out.std(0), y), "the loss mixes samples"),
    "auxiliary": (lambda out, y, m: ce(out, y) + (m.hidden - m.hidden.mean(0)).square().sum((1, 2)),
                  "the loss mixes samples"),
}


def batch(n=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def wrap(model, mode, **kwargs):
    if mode == "gsm":
        return dpgrad.GradSampleModule(model, loss_reduction="sum", **kwargs)
    return dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction="sum",
                                                       single_backward=mode == "single", **kwargs)


def step(wrapped, model, x, y, loss=None):
    """Forward and backward: dpgrad's loss wrapper, or a plain backward for GradSampleModule."""
    loss = loss or (lambda out, y, m: ce(out, y))
    out = wrapped(x)
    if isinstance(wrapped, dpgrad.GradSampleModuleFastGradientClipping):
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, SimpleNamespace(loss_reduction="sum"),
                                                      lambda o, t: loss(o, t, model), "sum")
        criterion(out, y).backward()
    else:
        loss(out, y, model).sum().backward()


def mark(model):
    """Set every p.grad to a known value; return a check that they are unchanged."""
    marks = {}
    for n, p in model.named_parameters():
        p.grad = torch.full_like(p, 7.0)
        marks[n] = p.grad.clone()

    def unchanged():
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, marks[n]), f"{n}.grad was changed"
            assert getattr(p, "grad_sample", None) is None, f"{n}.grad_sample was set"
    return unchanged


def refused(wrapped, model, x, y, fragments, loss=None):
    unchanged = mark(model)
    with pytest.raises(dpgrad.SampleMixingError) as err:
        step(wrapped, model, x, y, loss)
    message = str(err.value)
    for fragment in fragments + ["Nothing has reached p.grad"]:
        assert fragment in message, f"{fragment!r} not in: {message}"
    unchanged()
    return message


def check_exact(model, wrapped, x, y, reference):
    """The step equals the float64 reference: the clipped sum (each sample's contribution at
    most C), or the per-sample gradients."""
    ref = per_sample_grads(reference, x, y, ce)
    params = dict(model.named_parameters())
    if isinstance(wrapped, dpgrad.GradSampleModuleFastGradientClipping):
        norm = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
        coef = (C / (norm + 1e-6)).clamp(max=1.0)
        assert (coef * norm <= C * (1 + 1e-6)).all()
        for n, g in ref.items():
            assert_tensor_close(params[n].grad, torch.einsum("b,b...->...", coef, g), n, scale=C)
    else:
        for n, g in ref.items():
            assert_tensor_close(params[n].grad_sample, g, n)


# ---------------------------------------------------------------------------- the model mixes
MODEL_WORDS = ["samples are mixed inside the model", "check_independence=False"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mix", MODEL_MIXES)
def test_a_model_that_mixes_samples_is_refused(mix, mode):
    torch.manual_seed(0)
    model = Mixer(mix)
    x, y = batch()
    message = refused(wrap(model, mode), model, x, y, MODEL_WORDS)
    # The layers that saw the mix: b for a reordered or time-first b, a (and b) for a mix after a.
    first = "layer 'b' (Linear)" if mix in ("reorder", "time_first") else "layer 'a' (Linear)"
    assert first in message, message
    assert "layer 'head'" not in message, message


@dataclass
class Output:
    logits: torch.Tensor


class Wrapped(nn.Module):
    """A Mixer whose output is an object holding the logits: a dataclass or a SimpleNamespace."""

    def __init__(self, mix, container):
        super().__init__()
        self.inner, self.container = Mixer(mix), container

    def forward(self, x):
        logits = self.inner(x)
        return Output(logits) if self.container == "dataclass" else SimpleNamespace(logits=logits)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("container", ["dataclass", "namespace"])
def test_an_output_in_a_dataclass_or_namespace_is_checked(container, mode):
    """The outputs are found inside a dataclass or a SimpleNamespace: a model that mixes is
    refused, and one that does not stays exact."""
    loss = lambda out, y, m: ce(out.logits, y)  # noqa: E731
    torch.manual_seed(0)
    model = Wrapped("center", container)
    x, y = batch()
    refused(wrap(model, mode), model, x, y, MODEL_WORDS, loss)
    model = Wrapped(None, container)
    reference = Mixer()
    reference.load_state_dict(model.inner.state_dict())
    wrapped = wrap(model, mode)
    step(wrapped, model, x, y, loss)
    check_exact(model.inner, wrapped, x, y, reference)


class Box:
    def __init__(self, logits):
        self.logits = logits


@pytest.mark.parametrize("mode", MODES)
def test_an_output_in_which_no_tensor_is_found_is_refused(mode):
    """An object of another class: dpgrad cannot check the graph from it, and says so."""
    torch.manual_seed(0)
    model = Mixer("center")
    wrapped = wrap(model, mode)
    wrapped._module.forward = lambda x, f=model.forward: Box(f(x))
    unchanged = mark(model)
    with pytest.raises(TypeError, match="the model's output is a Box, in which dpgrad finds no tensor"):
        step(wrapped, model, *batch(), lambda out, y, m: ce(out.logits, y))
    unchanged()


@pytest.mark.parametrize("mode", GHOST)
def test_a_new_layout_that_mixes_is_probed_through_the_loss(mode):
    """After clean steps the probes of a new layout are the loss's, through the whole model
    (one set of probes, not two: a backward pass per probe set)."""
    torch.manual_seed(0)
    model = Mixer()
    wrapped = wrap(model, mode)
    x, y = batch()
    step(wrapped, model, x, y)
    model.zero_grad()
    model.mix = "center"
    probes = []
    original = independence.Probe.__init__

    def counted(self, *args, **kwargs):
        probes.append(kwargs.get("hooks", True))
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(independence.Probe, "__init__", counted)
        message = refused(wrapped, model, x, y, MODEL_WORDS + ["layer 'a' (Linear)"])
    # The loss's probes alone, reading the layers' backprops, one per probe set.
    assert probes == [True] * independence.probe_count(B), probes
    assert "layer 'head'" not in message
    # The model fixed, the same wrapper takes the exact step.
    model.mix = None
    model.zero_grad(set_to_none=True)
    reference = Mixer()
    reference.load_state_dict(model.state_dict())
    step(wrapped, model, x, y)
    check_exact(model, wrapped, x, y, reference)


@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpointing_that_mixes_is_refused(mode):
    torch.manual_seed(0)
    model = Mixer("center", checkpointed=True)
    x, y = batch()
    refused(wrap(model, mode), model, x, y, MODEL_WORDS + ["layer 'a' (Linear)"])


@pytest.mark.parametrize("mode", MODES)
def test_checked_off_gives_the_check_up(mode):
    torch.manual_seed(0)
    model = Mixer("center")
    wrapped = wrap(model, mode, check_independence=False)
    assert wrapped.check_independence is False
    x, y = batch()
    step(wrapped, model, x, y)  # no refusal: the user said the model is per sample
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------------------- the loss mixes
@pytest.mark.parametrize("mode", GHOST)
@pytest.mark.parametrize("case", list(LOSSES))
def test_losses_not_each_their_own_sample_s_are_refused(case, mode):
    torch.manual_seed(0)
    model = Mixer()
    loss, words = LOSSES[case]
    x, y = batch()
    message = refused(wrap(model, mode), model, x, y, [words], loss)
    where = "layer 'a' (Linear)" if case == "auxiliary" else "the model's output of shape (4, 3)"
    assert where in message, message


@pytest.mark.parametrize("mode", GHOST)
def test_losses_out_of_order_after_clean_steps_are_refused(mode):
    """A loss of a new layout is probed even when its model's layout was probed before."""
    torch.manual_seed(0)
    model = Mixer()
    wrapped = wrap(model, mode)
    x, y = batch()
    step(wrapped, model, x, y)
    refused(wrapped, model, x, y, ["in another order than the batch"], LOSSES["permuted"][0])


@pytest.mark.parametrize("mode", GHOST)
def test_per_block_clipping_refuses_a_mix(mode):
    torch.manual_seed(0)
    model = Mixer("center")
    groups = [[model.a.weight, model.a.bias], [model.b.weight, model.b.bias], [model.head.weight, model.head.bias]]
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        model, max_grad_norm=[C] * 3, clipping="groups", clipping_groups=groups, loss_reduction="sum",
        single_backward=mode == "single")
    x, y = batch()
    refused(wrapped, model, x, y, MODEL_WORDS)


@pytest.mark.parametrize("mode", GHOST)
def test_per_layer_clipping_refuses_a_mixing_loss(mode):
    torch.manual_seed(0)
    model = Mixer()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        model, max_grad_norm=[C] * 6, clipping="per_layer", loss_reduction="sum", single_backward=mode == "single")
    x, y = batch()
    refused(wrapped, model, x, y, ["the loss mixes samples"], LOSSES["mixing"][0])


# ---------------------------------------------------------------------------- no false alarm
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 2, B])
def test_per_sample_models_stay_exact(mode, n):
    torch.manual_seed(0)
    model = Mixer()
    reference = Mixer()
    reference.load_state_dict(model.state_dict())
    wrapped = wrap(model, mode)
    x, y = batch(n)
    for _ in range(2):  # the probing step, then one without
        model.zero_grad(set_to_none=True)
        if mode == "gsm":
            wrapped.zero_grad(set_to_none=True)
        step(wrapped, model, x, y)
        check_exact(model, wrapped, x, y, reference)


@pytest.mark.parametrize("mode", GHOST)
def test_zero_weight_padding_rows_leave_the_loss_to_be_probed(mode):
    """Padded rows weigh zero in the loss: a batch whose losses all weigh zero but one probes
    nothing of the loss (one sample has nobody to mix with), and the step is exact; the next
    batch of the layout probes the loss again."""
    torch.manual_seed(0)
    model = Mixer()
    reference = Mixer()
    reference.load_state_dict(model.state_dict())
    wrapped = wrap(model, mode)
    x, y = batch()
    weights = torch.tensor([1.0, 0.0, 0.0, 0.0])
    step(wrapped, model, x, y, lambda out, t, m: ce(out, t) * weights)
    ref = per_sample_grads(reference, x[:1], y[:1], ce)
    norm = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    coef = (C / (norm + 1e-6)).clamp(max=1.0)
    for n, p in model.named_parameters():
        assert_tensor_close(p.grad, torch.einsum("b,b...->...", coef, ref[n]), n, scale=C)
    model.zero_grad(set_to_none=True)
    probes = []
    original = independence.Probe.__init__

    def counted(self, *args, **kwargs):
        probes.append(1)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(independence.Probe, "__init__", counted)
        step(wrapped, model, x, y)
    assert len(probes) == independence.probe_count(B)  # the loss's, not the model's (checked)


@pytest.mark.parametrize("mode", MODES)
def test_probes_once_per_layout_touching_nothing(mode):
    """The first step probes (a backward pass per probe set, from the model's outputs, then
    the forward probe's runs; the clipping wrapper's loss the same); later steps of the layout
    do not. A probe draws no number from torch's generators and leaves no gradient, per-sample
    state or module attribute behind."""
    torch.manual_seed(0)
    model = Mixer()
    wrapped = wrap(model, mode)
    x, y = batch()
    probes = []
    original = independence.Probe.__init__

    def counted(self, *args, **kwargs):
        probes.append(1)
        original(self, *args, **kwargs)

    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(torch.is_grad_enabled()))
    n = independence.probe_count(B)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(independence.Probe, "__init__", counted)
        state = torch.get_rng_state()
        out = wrapped(x)  # the model's probes run here
        assert torch.equal(torch.get_rng_state(), state)
        assert len(probes) == n
        assert calls == [True] + [False] * (n + 1)  # the forward probe: a reference run and one per set
        assert model.hidden.requires_grad  # the forward pass's own (the probe's runs had no graph)
        assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())
        if mode == "gsm":
            ce(out, y).sum().backward()
        else:
            wrapped.clipped_backward(ce(out, y))
        first = len(probes)  # the clipping wrapper's loss probes too
        assert first == (n if mode == "gsm" else 2 * n)
        for _ in range(3):
            wrapped.zero_grad()
            model.zero_grad()
            step(wrapped, model, x, y)
        assert len(probes) == first


def test_output_batch_on_another_dimension_than_the_layers():
    """batch_first=False: the layers see [K, B, ...]; the model returns (B, c) with c == B.
    The loss's probe finds the batch on whichever dimension holds it: no false alarm."""

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 4)

        def forward(self, x):  # (T, B, 5) -> (B, 4)
            return self.a(x).mean(0)

    torch.manual_seed(0)
    model = SeqFirst()
    reference = SeqFirst()
    reference.load_state_dict(model.state_dict())
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction="sum",
                                                          batch_first=False, single_backward=True)
    x, y = torch.randn(3, B, 5), torch.randint(0, 4, (B,))
    wrapped.clipped_backward(ce(wrapped(x), y))
    ref = per_sample_grads(reference, x, y, ce, batch_first=False)
    norm = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    coef = (C / (norm + 1e-6)).clamp(max=1.0)
    for n, p in model.named_parameters():
        assert_tensor_close(p.grad, torch.einsum("b,b...->...", coef, ref[n]), n, scale=C)
    # The same model mixing its samples is still found, through the layers.
    model2 = SeqFirst()
    wrapped2 = dpgrad.GradSampleModuleFastGradientClipping(model2, max_grad_norm=C, loss_reduction="sum",
                                                           batch_first=False, single_backward=True)
    with pytest.raises(dpgrad.SampleMixingError, match="the loss mixes samples"):
        out = wrapped2(x)
        wrapped2.clipped_backward(ce(out - out.mean(0), y))


# ---------------------------------------------------------------------------- entry points
def test_make_private_passes_the_setting_on():
    opacus = pytest.importorskip("opacus")
    import dpgrad.opacus as dpo

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(*batch(8))
    for check in (True, False):
        model = Mixer("center")
        module, optimizer, criterion, loader = dpo.make_private(
            opacus.PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=0.0, max_grad_norm=1.0,
            poisson_sampling=False, check_independence=check)
        assert module.check_independence is check
        x, y = next(iter(loader))
        if check:
            with pytest.raises(dpgrad.SampleMixingError, match="samples are mixed inside the model"):
                module(x)
        else:
            criterion(module(x), y).backward()


def test_privacy_arguments_carry_the_setting():
    pytest.importorskip("transformers")
    from dpgrad.hf import PrivacyArguments

    assert PrivacyArguments(noise_multiplier=1.0).check_independence is True
    assert PrivacyArguments(noise_multiplier=1.0, check_independence=False).check_independence is False
