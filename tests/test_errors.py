"""Bad input gets a clear error, and leaves the model usable.

Each error must name the layer (its qualified name in the model) and say what to do. After
it, either the wrapper still computes correct per-sample results on good input (checked
against the float64 torch.func reference), or, for errors raised at construction, the
original module carries no trace of dpgrad and trains normally.
"""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpgrad
from dpgrad.grad_sample_module import PARAM_ATTRS
from per_sample_reference import (
    assert_norms_close,
    assert_tensor_close,
    norms_of,
    per_sample_grads,
    total_norm,
)

GSM = dpgrad.GradSampleModule
FGC = dpgrad.GradSampleModuleFastGradientClipping
# (wrapper class, extra kwargs): plain per-sample gradients, ghost clipping, and FGC without it.
WRAPPERS = {
    "gsm": (GSM, {}),
    "fgc_ghost": (FGC, {"use_ghost_clipping": True}),
    "fgc": (FGC, {"use_ghost_clipping": False}),
}


# ---------------------------------------------------------------------------- models
class Encoder(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.proj = nn.Linear(h, h)
        self.fold = False  # fold the batch into the token dimension before proj (as MoE blocks do)
        self.reuse = False  # call proj twice

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.fold:
            B = h.shape[0]
            return self.proj(h.reshape(-1, h.shape[-1])).reshape(B, -1, h.shape[-1])
        if self.reuse:
            h = torch.tanh(self.proj(h))
        return self.proj(h)


class Net(nn.Module):
    """x (B, T, d) -> logits (B, c); layers 'encoder.inp', 'encoder.proj', 'head'."""

    def __init__(self, d: int = 5, h: int = 6, c: int = 3):
        super().__init__()
        self.encoder = Encoder(d, h)
        self.head = nn.Linear(h, c)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


class TiedLM(nn.Module):
    """ids (B, T) -> logits (B, T, V), the input embedding tied to the output layer."""

    def __init__(self, V: int = 7, d: int = 4):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mix(self.emb(ids))))


def ce(logits, y):
    """Per-sample cross entropy (B,), averaged over tokens for (B, T, V) logits."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
    return F.cross_entropy(logits, y, reduction="none")


def batch(B=4, T=3, d=5, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g), torch.randint(0, c, (B,), generator=g)


def lm_batch(B=4, T=5, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, :2] = 0
    return ids, torch.randint(0, V, (B, T), generator=g)


def make(model_cls=Net, seed=0, **kwargs):
    """A model and a pristine copy of it (the reference is computed on the copy)."""
    torch.manual_seed(seed)
    model = model_cls(**kwargs)
    return model, copy.deepcopy(model)


# ---------------------------------------------------------------------------- checks
def assert_step_correct(wrapped, pristine, x, y, loss_reduction="sum"):
    """One forward/backward through ``wrapped`` matches the float64 reference."""
    ref = per_sample_grads(pristine, x, y, ce)
    wrapped.zero_grad()
    losses = ce(wrapped(x), y)
    (losses.mean() if loss_reduction == "mean" else losses.sum()).backward()
    params = dict(wrapped._module.named_parameters())
    if isinstance(wrapped, FGC):
        for n, g in norms_of(ref).items():
            assert_norms_close(params[n]._norm_sample, g, n)
        assert_norms_close(wrapped.get_norm_sample(), total_norm(ref))
    else:
        for n, g in ref.items():
            assert_tensor_close(params[n].grad_sample, g, n)


def assert_untouched(model: nn.Module):
    """No hooks and no per-parameter fields of dpgrad (or Opacus) on the model."""
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, name
        assert not m._backward_hooks and not m._backward_pre_hooks, name
        assert not hasattr(m, "autograd_grad_sample_hooks"), name
        assert not hasattr(m, "ft_compute_sample_grad"), name
    for name, p in model.named_parameters():
        for attr in PARAM_ATTRS:
            assert attr not in p.__dict__, (name, attr)


def assert_trains_normally(model, pristine, x, y):
    """Plain PyTorch training gives the same gradients as on an untouched copy."""
    model.zero_grad()
    pristine.zero_grad()
    ce(model(x), y).sum().backward()
    ce(pristine(x), y).sum().backward()
    for (n, p), q in zip(model.named_parameters(), pristine.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def says(err, *fragments):
    """The error message holds every fragment (case-sensitive, literal)."""
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


# ---------------------------------------------------------------------------- unsupported layers
class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.block(self.fc(x))))


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_batchnorm_under_strict_raises_before_any_change(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make(WithBatchNorm)
    with pytest.raises(NotImplementedError) as err:
        cls(model, **kwargs)
    says(err, "'block.1'", "BatchNorm1d", "GroupNorm", "requires_grad_(False)", "strict=False")
    assert_untouched(model)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    assert_trains_normally(model, pristine, x, y)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_sparse_embedding_is_refused_before_any_change(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model = nn.Sequential(nn.EmbeddingBag(7, 4, sparse=True), nn.Linear(4, 3))
    with pytest.raises(NotImplementedError) as err:
        cls(model, **kwargs)
    says(err, "layer '0' (EmbeddingBag)", "sparse=True", "sparse=False", "requires_grad_(False)", "strict=False")
    assert_untouched(model)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_fused_recurrent_layer_is_refused_naming_opacus_dp_layer(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model = nn.Sequential(nn.GRU(4, 5, batch_first=True))
    with pytest.raises(NotImplementedError) as err:
        cls(model, **kwargs)
    says(err, "layer '0' (GRU)", "opacus.layers.DPGRU", "batch_first=True", "requires_grad_(False)", "strict=False")
    assert_untouched(model)


@pytest.mark.parametrize("function", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_weight_computed_by_a_forward_pre_hook_is_refused_before_any_change(wrapper, function):
    """torch.nn.utils.weight_norm and spectral_norm (not the parametrizations): the layer's
    weight is a tensor their hook computes, whose gradient is not its parameters' (the norm of
    weight_g's and weight_v's per-sample gradients differs from the weight's once g moves off
    the norms of v)."""
    cls, kwargs = WRAPPERS[wrapper]
    model, _ = make(WithBatchNorm)
    model.block[1] = nn.Identity()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of weight_norm
        getattr(torch.nn.utils, function)(model.fc)
    hooks = dict(model.fc._forward_pre_hooks)
    with pytest.raises(NotImplementedError) as err:
        cls(model, **kwargs)
    says(err, "layer 'fc' (Linear)", f"torch.nn.utils.{function}", f"torch.nn.utils.parametrizations.{function}",
         f"remove_{function}", "requires_grad_(False)", "strict=False")
    assert dict(model.fc._forward_pre_hooks) == hooks and not hasattr(model.fc, "ft_compute_sample_grad")
    for p in model.parameters():
        assert not hasattr(p, "grad_sample")


def test_batchnorm_strict_false_warns_and_skips_it():
    model, _ = make(WithBatchNorm)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    # Skipped or not, a BatchNorm in training mode normalises each sample by the batch's
    # statistics: the layers before it see their samples mixed (dpgrad.checks.independence).
    with pytest.warns(UserWarning, match=re.escape("'block.1'")):
        checked = GSM(model, strict=False, loss_reduction="sum")
    with pytest.raises(dpgrad.SampleMixingError) as err:
        checked(x)
    says(err, "samples are mixed inside the model", "layer 'block.0' (Linear)", "layer 'fc' (Linear)",
         "BatchNorm in training mode", "check_independence=False")
    assert all(p.grad is None and p.grad_sample is None for p in model.parameters())
    checked.to_standard_module()
    with pytest.warns(UserWarning, match=re.escape("'block.1'")):
        wrapped = GSM(model, strict=False, loss_reduction="sum", check_independence=False)
    ce(wrapped(x), y).sum().backward()
    bn = model.block[1]
    assert bn.weight.grad_sample is None and bn.bias.grad_sample is None
    assert bn.weight.grad is not None  # ordinary training of that layer goes on
    # The other layers' per-sample gradients add up to their gradients (batch statistics
    # couple the samples, so there is no per-sample reference to compare with).
    for layer in (model.fc, model.block[0], model.head):
        for p in layer.parameters():
            assert p.grad_sample.shape == (6, *p.shape)
            torch.testing.assert_close(p.grad_sample.sum(0), p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_ghost_clipping", [True, False])
def test_fgc_norms_of_a_skipped_trainable_layer_raise(use_ghost_clipping):
    model, _ = make(WithBatchNorm)
    model.block[1].eval()  # its running statistics: no sample mixed with another
    with pytest.warns(UserWarning, match=re.escape("'block.1'")):
        wrapped = FGC(model, strict=False, use_ghost_clipping=use_ghost_clipping)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    ce(wrapped(x), y).mean().backward()
    with pytest.raises(RuntimeError) as err:
        wrapped.get_clipping_coef()
    says(err, "block.1.weight", "block.1.bias", "requires_grad_(False)")


class NormedCustom(nn.BatchNorm1d):
    """A trainable BatchNorm (skipped under strict=False) holding a child Linear it calls."""

    def __init__(self, h):
        super().__init__(h)
        self.lin = nn.Linear(h, h)

    def forward(self, x):
        return super().forward(self.lin(x))


def test_fgc_children_of_a_skipped_layer_are_not_taken_for_zero():
    """A skipped layer's children were not hooked either: their norms are unknown, not 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), NormedCustom(4).eval(), nn.Linear(4, 3))
    with pytest.warns(UserWarning, match=re.escape("'1'")):
        wrapped = FGC(model, strict=False)
    x, y = torch.randn(3, 5), torch.randint(0, 3, (3,))
    ce(wrapped(x), y).mean().backward()
    with pytest.raises(RuntimeError) as err:
        wrapped.get_norm_sample()
    says(err, "'1.weight'", "'1.lin.weight'", "'1.lin.bias'")


class Buffered(nn.Module):
    """No sampler, its own parameter, a child Linear and a buffer, constant or changed by its
    forward: torch.func takes it whole, reading its buffer live."""

    def __init__(self, h, changes=False):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(h))
        self.lin = nn.Linear(h, h)
        self.register_buffer("offset", torch.randn(h))
        self.changes = changes

    def forward(self, x):
        y = self.lin(x) * self.gain + self.offset
        if self.changes:
            self.offset.mul_(0.5)  # as a running statistic would
        return y


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_taken_whole_reads_its_buffers_live(wrapper):
    """Exact with the buffer as it is at each step (changed between steps by the user), and a
    forward that changes it is refused, naming the layer and the buffer."""
    cls, kwargs = WRAPPERS[wrapper]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), Buffered(4), nn.Linear(4, 3))
    wrapped = cls(copy.deepcopy(model), loss_reduction="sum", **kwargs)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    for step in range(2):
        with torch.no_grad():
            model[1].offset.add_(1.0)
            wrapped._module[1].offset.add_(1.0)
        expected = per_sample_grads(model, x, y, lambda out, t: F.cross_entropy(out, t, reduction="none"))
        wrapped.zero_grad(set_to_none=True)
        ce(wrapped(x), y).sum().backward()
        if wrapper != "gsm":
            assert_norms_close(wrapped.get_norm_sample(), total_norm(expected), f"step {step}")
        else:
            for n, p in wrapped._module.named_parameters():
                assert_tensor_close(p.grad_sample, expected[n], f"step {step}: {n}")
    changing = cls(nn.Sequential(nn.Linear(5, 4), Buffered(4, changes=True), nn.Linear(4, 3)), **kwargs)
    with pytest.raises(ValueError) as err:
        changing(x)
    says(err, "layer '1'", "['offset']", "requires_grad_(False)")


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_frozen_batchnorm_with_running_stats_is_fine(wrapper):
    """A frozen BatchNorm in eval mode treats samples independently: nothing to refuse."""
    cls, kwargs = WRAPPERS[wrapper]
    model, _ = make(WithBatchNorm)
    model.block[1].requires_grad_(False)
    model.block[1].running_mean.normal_()
    model.block[1].eval()
    pristine = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = cls(model, loss_reduction="sum", **kwargs)
    x, y = torch.randn(5, 5), torch.randint(0, 3, (5,))
    assert_step_correct(wrapped, pristine, x, y)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_embedding_scale_grad_by_freq(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("tok", nn.Embedding(9, 4, scale_grad_by_freq=True))
    model.add_module("out", nn.Linear(4, 3))
    pristine = copy.deepcopy(model)
    with pytest.raises(NotImplementedError) as err:
        cls(model, **kwargs)
    says(err, "'tok'", "scale_grad_by_freq=False", "requires_grad_(False)")
    assert_untouched(model)
    ids, y = torch.randint(0, 9, (4, 1)), torch.randint(0, 3, (4,))
    model.zero_grad()
    pristine.zero_grad()
    ce(model(ids).squeeze(1), y).sum().backward()
    ce(pristine(ids).squeeze(1), y).sum().backward()
    for p, q in zip(model.parameters(), pristine.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---------------------------------------------------------------------------- batch dimension
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_batch_folded_into_tokens(wrapper):
    """(B, T, d) reshaped to (B*T, d) before a Linear (as mixture-of-experts blocks do): row i
    is sample i // T's, and the step is the unfolded model's."""
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make()
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    x, y = batch()
    model.encoder.fold = True
    assert_step_correct(wrapped, pristine, x, y)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_rows_that_are_not_a_multiple_of_the_batch(wrapper):
    """A Linear given another number of rows than the batch, and no multiple of it: named."""
    cls, kwargs = WRAPPERS[wrapper]

    class Drops(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.proj = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            return self.proj(h[1:]).sum(0, keepdim=True).expand(x.shape[0], -1)

    wrapped = cls(Drops(), loss_reduction="sum", **kwargs)
    with pytest.raises(ValueError) as err:
        wrapped(torch.randn(5, 4)).sum().backward()
    says(err, "'proj'", "4 samples", "(B*T, d)", "batch_first")


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_input_without_batch_dimension(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)))
    pristine = copy.deepcopy(model)
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError) as err:
        wrapped(x[0]).sum().backward()  # one sample, (d,), square first layer
    says(err, "'body.0'", "shape (4,)", "x.unsqueeze(0)")
    assert_step_correct(wrapped, pristine, x, y)


class _ByKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        return self.l(input=x)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_called_by_keyword_is_refused_naming_the_call(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model = _ByKeyword()
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    with pytest.raises(ValueError) as err:
        wrapped(torch.randn(5, 4))
    says(err, "layer 'l' (Linear)", "no tensor among its positional inputs", "layer(x), not layer(input=x)")
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())


class _OwnParameterModel(nn.Module):
    """A model holding a trainable parameter itself (taken whole by torch.func), returning a
    dict of tensors or, once ``as_dict`` is off, its logits."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4) + 0.1 * torch.randn(4))
        self.body = nn.Linear(4, 3)
        self.as_dict = True

    def forward(self, x):
        h = x * self.scale
        logits = self.body(h)
        return {"logits": logits, "hidden": h} if self.as_dict else logits + (h[:, :3] ** 2 if self.both else 0)


@pytest.mark.parametrize("both", [False, True], ids=["logits", "both"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_taken_whole_returning_a_dict(wrapper, both):
    """The model itself taken whole (a parameter of its own) returning a mapping, as Hugging
    Face's models return a ModelOutput: its tensors that carry gradients are followed, the
    first alone or several, each one's gradient from outside the layer taken."""
    cls, kwargs = WRAPPERS[wrapper]
    torch.manual_seed(0)
    model = _OwnParameterModel()
    model.both = both
    pristine = copy.deepcopy(model)
    pristine.as_dict = False
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    ref = per_sample_grads(pristine, x, y, ce)
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    out = wrapped(x)
    ce(out["logits"] + (out["hidden"][:, :3] ** 2 if both else 0), y).sum().backward()
    if cls is FGC:
        assert_norms_close(wrapped.get_norm_sample(), total_norm(ref))
    else:
        for n, p in model.named_parameters():
            assert_tensor_close(p.grad_sample, ref[n], n)


def test_input_without_batch_dimension_batch_second():
    """batch_first=False: a (B, d) input to a Linear has no batch dimension 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    wrapped = GSM(model, batch_first=False, loss_reduction="sum")
    with pytest.raises(ValueError) as err:
        wrapped(torch.randn(5, 4)).sum().backward()
    says(err, "'0'", "batch_first=False", "x.unsqueeze(1)")
    wrapped.zero_grad()
    x = torch.randn(2, 5, 4)  # (K, B, d)
    wrapped(x).sum().backward()
    expected = torch.einsum("kbp,kbd->bpd", torch.ones(2, 5, 3), x)
    torch.testing.assert_close(model[0].weight.grad_sample, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- wrapping twice
@pytest.mark.parametrize("second", list(WRAPPERS))
@pytest.mark.parametrize("first", list(WRAPPERS))
def test_wrapping_twice(first, second):
    (cls1, kw1), (cls2, kw2) = WRAPPERS[first], WRAPPERS[second]
    model, pristine = make()
    wrapped = cls1(model, loss_reduction="sum", **kw1)
    hooks = {name: dict(m._forward_hooks) for name, m in model.named_modules()}
    for target in (model, wrapped, nn.Sequential(model)):
        with pytest.raises(ValueError) as err:
            cls2(target, **kw2)
        says(err, "already wrapped", "to_standard_module()")
        assert {name: dict(m._forward_hooks) for name, m in model.named_modules()} == hooks
    x, y = batch()
    assert_step_correct(wrapped, pristine, x, y)
    # Unwrapped, it can be wrapped again.
    rewrapped = cls2(wrapped.to_standard_module(), loss_reduction="sum", **kw2)
    assert_step_correct(rewrapped, pristine, x, y)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapping_an_opacus_wrapped_module(wrapper):
    opacus = pytest.importorskip("opacus")
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = opacus.GradSampleModule(model, loss_reduction="sum")
    for target in (model, theirs):
        with pytest.raises(ValueError) as err:
            cls(target, **kwargs)
        says(err, "already wrapped", "to_standard_module()")
    # Opacus's wrapper still works, untouched by the attempt.
    x, y = batch()
    ref = per_sample_grads(pristine, x, y, ce)
    ce(theirs(x), y).sum().backward()
    for n, p in model.named_parameters():
        assert_tensor_close(p.grad_sample, ref[n], n)


# ---------------------------------------------------------------------------- tying and reuse
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_tied_weights_under_ghost_clipping(loss_reduction):
    """The tied weight's norm is that of the summed gradient, cross term included."""
    model, pristine = make(TiedLM)
    wrapped = FGC(model, loss_reduction=loss_reduction, use_ghost_clipping=True)
    ids, y = lm_batch()
    assert_step_correct(wrapped, pristine, ids, y, loss_reduction)


class TiedToFunctorch(nn.Module):
    """A Linear's weight also used by a layer dpgrad has no sampler for (torch.func)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.other = Scale(self.lin.weight)

    def forward(self, x):
        return self.other(self.lin(x))


class Scale(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_weight_tied_between_ghost_and_per_sample_layers(loss_reduction):
    """The Linear, which ghost clipping would clip from its norm, is clipped from its per-sample
    gradients, which are summed with those torch.func gives the other use."""
    model, pristine = make(TiedToFunctorch)
    wrapped = FGC(model, use_ghost_clipping=True, loss_reduction=loss_reduction)
    assert wrapped._path.by_grad_sample == {model.lin}
    assert_step_correct(wrapped, pristine, torch.randn(3, 4), torch.randint(0, 4, (3,)), loss_reduction)


@pytest.mark.parametrize("wrapper", ["gsm", "fgc"])
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_tied_weights_without_ghost_clipping(wrapper, loss_reduction):
    """Per-sample gradients of a tied weight are summed over both uses, as the reference's."""
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make(TiedLM)
    wrapped = cls(model, loss_reduction=loss_reduction, **kwargs)
    ids, y = lm_batch()
    assert_step_correct(wrapped, pristine, ids, y, loss_reduction)
    if wrapper == "gsm":
        # Not just one use's share: the embedding alone would leave unseen tokens' rows zero.
        unseen = model.emb.weight.grad_sample.clone()
        for b in range(ids.shape[0]):
            unseen[b, ids[b].unique()] = 0
        assert (unseen.flatten(1).abs().sum(1) > 0).all()


def test_one_layer_registered_twice_is_hooked_once():
    """One module in two containers: each use counts once (two hooks would double it)."""
    torch.manual_seed(0)
    shared = nn.Linear(5, 5)
    model = nn.Sequential()
    model.add_module("a", nn.Sequential(shared, nn.Tanh()))
    model.add_module("b", nn.Sequential(shared))
    model.add_module("head", nn.Linear(5, 3))
    pristine = copy.deepcopy(model)
    wrapped = GSM(model, loss_reduction="sum")
    assert len(shared._forward_hooks) == 1
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    assert_step_correct(wrapped, pristine, x, y)


class Aliased(nn.Module):
    """One Linear registered under two names, called once per forward."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 5)
        self.alias = self.body
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_one_layer_registered_twice_is_not_tying_under_ghost_clipping():
    model, pristine = make(Aliased)
    wrapped = FGC(model, loss_reduction="sum")
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    assert_step_correct(wrapped, pristine, x, y)


def test_layer_called_twice_under_ghost_clipping():
    """Its two uses' norms and their cross term make the norm of the summed gradient."""
    model, pristine = make()
    model.encoder.reuse = pristine.encoder.reuse = True
    wrapped = FGC(model, loss_reduction="sum", use_ghost_clipping=True)
    x, y = batch()
    assert_step_correct(wrapped, pristine, x, y)
    model.encoder.reuse = pristine.encoder.reuse = False
    assert_step_correct(wrapped, pristine, x, y)


@pytest.mark.parametrize("wrapper", ["gsm", "fgc"])
def test_layer_called_twice_without_ghost_clipping(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make()
    model.encoder.reuse = pristine.encoder.reuse = True
    wrapped = cls(model, loss_reduction="mean", **kwargs)
    x, y = batch()
    assert_step_correct(wrapped, pristine, x, y, "mean")


def test_two_forwards_before_one_backward_under_ghost_clipping():
    model, pristine = make()
    wrapped = FGC(model, loss_reduction="sum", use_ghost_clipping=True)
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    loss = ce(wrapped(x1), y1).sum() + ce(wrapped(x2), y2).sum()
    with pytest.raises(NotImplementedError) as err:
        loss.backward()
    says(err, "two gradient contributions", "Run backward after every forward pass")
    assert re.search(r"'(encoder\.inp|encoder\.proj|head)'", str(err.value))
    assert_step_correct(wrapped, pristine, x1, y1)


def test_two_forwards_before_one_backward_gsm_sums_per_sample_gradients():
    model, pristine = make()
    wrapped = GSM(model, loss_reduction="sum")
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    (ce(wrapped(x1), y1).sum() + ce(wrapped(x2), y2).sum()).backward()
    ref1, ref2 = per_sample_grads(pristine, x1, y1, ce), per_sample_grads(pristine, x2, y2, ce)
    for n, p in model.named_parameters():
        assert_tensor_close(p.grad_sample, ref1[n] + ref2[n], n)


# ---------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_non_finite_per_sample_values(wrapper, bad):
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make()
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    x, y = batch()
    x_bad = x.clone()
    x_bad[1, 0, 0] = bad
    # inf saturates the tanh after encoder.inp; nan runs through everything.
    named = ("'encoder.inp.weight'", "check_finite=False", *(["'head.bias'"] if bad != bad else []))
    if cls is GSM:
        # Per-sample gradients are withheld (zeros) on the device; the next forward pass raises.
        ce(wrapped(x_bad), y).sum().backward()
        assert all(not p.grad_sample.any() for p in model.parameters())
        with pytest.raises(FloatingPointError) as err:
            wrapped(x)
        says(err, *named, "added nothing")
    else:
        # A plain backward of the ghost wrapper (Opacus's first pass) waits for the check.
        with pytest.raises(FloatingPointError) as err:
            ce(wrapped(x_bad), y).sum().backward()
        says(err, *named)
    assert_step_correct(wrapped, pristine, x, y)

    quiet = cls(cls.to_standard_module(wrapped), loss_reduction="sum", check_finite=False, **kwargs)
    quiet.zero_grad()
    ce(quiet(x_bad), y).sum().backward()
    if cls is GSM:
        gs = model.encoder.inp.weight.grad_sample
        assert not gs[1].isfinite().all() and gs[[0, 2, 3]].isfinite().all()
    else:
        norms = quiet.get_norm_sample()
        assert not norms[1].isfinite() and norms[[0, 2, 3]].isfinite().all()


@pytest.mark.parametrize("single", [True, False])
def test_finite_norms_whose_squares_overflow_say_so(single):
    """Per-sample gradients near 1e20 are finite, their norms' fp32 squares are not: the
    refusal says so, rather than that the loss or the inputs hold inf or NaN alone."""
    model, _ = make()
    wrapped = FGC(model, loss_reduction="sum", single_backward=single)
    x, y = batch()
    wrapped.clipped_backward(ce(wrapped(x), y) * 1e20)
    assert all(not p.grad.any() for p in model.parameters())
    with pytest.raises(FloatingPointError) as err:
        wrapped.raise_if_not_finite()
    says(err, "norm above about 1.8e19, whose square overflows float32", "check_finite=False",
         "added nothing to p.grad")
    wrapped.raise_if_not_finite()  # reported once


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("single", [True, False])
def test_a_non_finite_step_adds_nothing_and_the_next_forward_raises(single, clipping):
    """No host wait in the step: the clipped gradients of a pass with a non-finite norm are
    zeros on the device, so an optimizer step leaves the parameters finite (plain SGD: as they
    were), and the next forward pass raises, naming the parameters, once; the step after it is
    the reference's."""
    model, pristine = make()
    options = dict(max_grad_norm=1.0) if clipping == "flat" else dict(
        clipping="per_layer", max_grad_norm=[0.5] * len(list(model.parameters())))
    wrapped = FGC(model, loss_reduction="mean", single_backward=single, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    wrapped.clipped_backward(ce(wrapped(x), y) * torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with pytest.raises(FloatingPointError) as err:
        wrapped(x)
    says(err, "non-finite per-sample gradient norms", "'head.weight'", "added nothing to p.grad")
    wrapped.zero_grad(set_to_none=True)
    wrapped.clipped_backward(ce(wrapped(x), y))  # reported once: this pass goes through
    wrapped.raise_if_not_finite()
    assert all(p.grad.isfinite().all() and p.grad.any() for p in model.parameters())


def test_reports_in_flight_wait_only_beyond_the_bound(monkeypatch):
    """On a GPU the next forward pass reads a check only once its copy has arrived: checks in
    flight are left for later, up to ``FiniteReports.IN_FLIGHT``, beyond which the host waits
    for the oldest; ``raise_if_not_finite`` waits for all."""
    from dpgrad.backward.finite_checks import FiniteCheck, FiniteReports

    monkeypatch.setattr(FiniteCheck, "ready", lambda self: False)  # every copy still in flight
    model, _ = make()
    wrapped = FGC(model, loss_reduction="sum", single_backward=True)
    x, y = batch()
    nan = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    wrapped.clipped_backward(ce(wrapped(x), y) * nan)  # the bad pass
    for _ in range(FiniteReports.IN_FLIGHT):
        wrapped.clipped_backward(ce(wrapped(x), y))  # forward passes that find it in flight
    with pytest.raises(FloatingPointError):
        wrapped(x)  # IN_FLIGHT + 1 checks in flight: the host waits for the oldest, the bad one
    wrapped.zero_grad()
    wrapped.clipped_backward(ce(wrapped(x), y) * nan)
    wrapped.clipped_backward(ce(wrapped(x), y))
    with pytest.raises(FloatingPointError):
        wrapped.raise_if_not_finite()
    wrapped.raise_if_not_finite()


# ---------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("loss_reduction", ["none", "Mean", None])
def test_invalid_loss_reduction(wrapper, loss_reduction):
    cls, kwargs = WRAPPERS[wrapper]
    model, _ = make()
    with pytest.raises(ValueError) as err:
        cls(model, loss_reduction=loss_reduction, **kwargs)
    says(err, "'sum'", "'mean'")
    assert_untouched(model)


# ---------------------------------------------------------------------------- accumulation
def test_forbid_grad_accumulation():
    model, pristine = make()
    wrapped = GSM(model, loss_reduction="sum")
    wrapped.forbid_grad_accumulation()
    x, y = batch()
    ce(wrapped(x), y).sum().backward()
    with pytest.raises(ValueError) as err:
        ce(wrapped(x), y).sum().backward()
    says(err, "grad accumulation", "optimizer.step()")
    assert re.search(r"'(encoder\.inp|encoder\.proj|head)\.(weight|bias)'", str(err.value))
    # zero_grad (the optimizer's step) clears it: the next step is correct.
    assert_step_correct(wrapped, pristine, x, y)


def test_allow_grad_accumulation_stacks_passes():
    model, pristine = make()
    wrapped = GSM(model, loss_reduction="sum")
    (x1, y1), (x2, y2) = batch(seed=1), batch(B=2, seed=2)
    ce(wrapped(x1), y1).sum().backward()
    ce(wrapped(x2), y2).sum().backward()
    ref1, ref2 = per_sample_grads(pristine, x1, y1, ce), per_sample_grads(pristine, x2, y2, ce)
    for n, p in model.named_parameters():
        assert isinstance(p.grad_sample, list) and len(p.grad_sample) == 2
        assert_tensor_close(p.grad_sample[0], ref1[n], n)
        assert_tensor_close(p.grad_sample[1], ref2[n], n)


# ---------------------------------------------------------------------------- unwrapping
class WithCustom(nn.Module):
    """A layer without a sampler (torch.func fallback) next to registered ones."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head((self.norm(self.emb(ids)) * self.scale).mean(dim=1))


class CustomRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = WithCustom()

    def forward(self, ids):
        return self.body(ids)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_to_standard_module_leaves_no_trace(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make(CustomRoot)
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    ids, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 3, (4,))
    assert_step_correct(wrapped, pristine, ids, y)
    wrapped(ids)  # a forward whose backward never comes
    assert wrapped.to_standard_module() is model
    assert_untouched(model)
    assert_trains_normally(model, pristine, ids, y)
    assert_step_correct(cls(model, loss_reduction="sum", **kwargs), pristine, ids, y)


# ---------------------------------------------------------------------------- forward without backward
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_forward_without_backward_does_not_corrupt_the_next_step(wrapper):
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make(CustomRoot)
    wrapped = cls(model, loss_reduction="mean", **kwargs)
    ids, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 3, (4,))
    assert wrapped.training and torch.is_grad_enabled()
    wrapped(torch.randint(0, 7, (6, 2)))  # other batch size, output discarded
    wrapped(torch.randint(0, 7, (4, 5)))  # same batch size, output discarded
    assert_step_correct(wrapped, pristine, ids, y, "mean")
    # And a discarded forward between two steps.
    wrapped(ids[:3])
    assert_step_correct(wrapped, pristine, ids, y, "mean")


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_forward_whose_backward_never_comes_lets_go_of_its_activations(wrapper, kept):
    """The activations a forward pass saved (here: the head's input) are freed by the next
    forward pass at the latest, whether the caller dropped the output or keeps it (outputs
    kept for metrics); the next step is exact."""
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make()
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    seen = []
    handle = model.head.register_forward_hook(lambda m, inputs, out: seen.append(weakref.ref(inputs[0])))
    x, y = batch()
    out = wrapped(x)
    if kept:
        out = out.detach()  # what a caller keeps for its metrics
    else:
        del out
    handle.remove()
    wrapped(batch(seed=1)[0])  # another forward, whose output is dropped
    gc.collect()
    assert seen and seen[0]() is None, "the first forward's activations are still alive"
    assert_step_correct(wrapped, pristine, x, y)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_failed_backward_does_not_corrupt_the_next_step(wrapper):
    """An error in the middle of a backward pass (a hook raising) leaves no partial state."""
    cls, kwargs = WRAPPERS[wrapper]
    model, pristine = make()
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    x, y = batch()
    losses = ce(wrapped(x), y)

    def boom(grad):
        raise RuntimeError("boom")

    handle = model.encoder.proj.weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        losses.sum().backward()
    handle.remove()
    assert_step_correct(wrapped, pristine, x, y)


class Masked(nn.Module):
    """No sampler: torch.func takes it whole, running it again per sample with what it got."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x, mask=None, twice=False, extra=()):
        y = x * self.scale * (2 if twice else 1)
        for t in extra:
            y = y + t * self.scale
        return y if mask is None else y * mask


class MaskedCalls(nn.Module):
    """``Masked`` called in one of several ways: its tensors by keyword (a mask of a row per
    sample, or one row for all), all by keyword, or in a positional tuple."""

    def __init__(self, how):
        super().__init__()
        self.inner, self.head, self.how = Masked(), nn.Linear(4, 3), how

    def forward(self, x):
        mask, shared = (x > 0).float(), torch.linspace(0.5, 1.5, 4)[None]
        calls = {"keyword": lambda: self.inner(x, mask=mask),
                 "positional": lambda: self.inner(x, mask, twice=True),
                 "shared": lambda: self.inner(x, mask=shared),
                 "all_by_keyword": lambda: self.inner(x=x, mask=mask, twice=True),
                 "tuple": lambda: self.inner(x, None, False, (mask, shared))}
        return self.head(calls[self.how]())


@pytest.mark.parametrize("how", ["keyword", "positional", "shared", "all_by_keyword", "tuple"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_tensors_given_to_a_layer_taken_whole_by_keyword_or_in_tuples(wrapper, how):
    """torch.func recomputes a layer without a sampler one sample at a time: the tensors it
    was given by keyword or inside a tuple are split by sample where they hold a row per sample
    (their size along the batch dimension is the batch size) and given whole otherwise."""
    cls, kwargs = WRAPPERS[wrapper]
    torch.manual_seed(0)
    model = MaskedCalls(how)
    pristine = copy.deepcopy(model)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    assert_step_correct(cls(model, loss_reduction="sum", **kwargs), pristine, x, y)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_keyword_tensor_whose_rows_may_be_the_batch_by_chance(wrapper):
    """At a batch size that is also a size of the layer's input (B == 4 == features), whether a
    keyword tensor holds a row per sample cannot be told: refused at first, naming the layer
    and the way out; after a step at another batch size, remembered and exact."""
    cls, kwargs = WRAPPERS[wrapper]
    torch.manual_seed(0)
    model = MaskedCalls("keyword")
    pristine = copy.deepcopy(model)
    x4, y4 = torch.randn(4, 4), torch.randint(0, 3, (4,))
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    with pytest.raises(ValueError) as err:
        wrapped(x4)
    says(err, "layer 'inner' (Masked)", "keyword argument 'mask'", "batch size 4", "a first step at a batch size")
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    assert_step_correct(wrapped, pristine, x, y)
    assert_step_correct(wrapped, pristine, x4, y4)


class FromTheBatch(nn.Module):
    """``Masked`` given a keyword tensor computed from the batch's rows (as Funnel's attention
    gets its unpooled states beside the pooled ones), or a table computed from parameters alone
    (``table``: a learned (4, 4) gate, shared by all samples)."""

    def __init__(self, table: bool):
        super().__init__()
        self.pre, self.inner, self.head = nn.Linear(4, 4), Masked(), nn.Linear(4, 3)
        self.gate = nn.Linear(4, 4) if table else None

    def forward(self, x):
        h = self.pre(x)
        mask = torch.sigmoid(h.flip(-1)) if self.gate is None else torch.sigmoid(self.gate(torch.eye(4)))
        return self.head(self.inner(h, mask=mask))


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_keyword_tensor_computed_from_the_batch_is_split_at_any_batch_size(wrapper):
    """B == 4 == features: a keyword tensor autograd computed from the batch's rows holds a row
    per sample (it meets the layer's input behind both); one computed from parameters alone
    cannot be told from a table, and is refused at first."""
    cls, kwargs = WRAPPERS[wrapper]
    x4, y4 = torch.randn(4, 4), torch.randint(0, 3, (4,))
    torch.manual_seed(0)
    model = FromTheBatch(table=False)
    pristine = copy.deepcopy(model)
    assert_step_correct(cls(model, loss_reduction="sum", **kwargs), pristine, x4, y4)
    wrapped = cls(FromTheBatch(table=True), loss_reduction="sum", **kwargs)
    with pytest.raises(ValueError) as err:
        wrapped(x4)
    says(err, "layer 'inner' (Masked)", "keyword argument 'mask'", "batch size 4")


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_linear_output_changed_in_place(wrapper):
    """A Linear's (B, T, p) output is a view of its (B*T, p) product; changed in place (``h +=
    x``, ``h.mul_(s)``, as RoCBert's embeddings do), autograd would drop the view's node and a
    hook on it. The first forward pass gives every such output as a tensor of its own and learns
    which layers' outputs are changed; exact at every step, in place or out of place. A layer
    whose output is changed in place only later is refused, naming it."""
    cls, kwargs = WRAPPERS[wrapper]

    class Adds(nn.Module):
        def __init__(self, in_place):
            super().__init__()
            self.tok, self.map, self.typ, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Embedding(2, 6), \
                nn.Linear(6, 3)
            self.in_place = in_place

        def forward(self, ids):
            h = self.map(self.tok(ids))
            if self.in_place:
                h += self.typ(torch.zeros_like(ids))
                h.mul_(torch.linspace(0.5, 2.0, h.shape[-1]))
            else:
                h = (h + self.typ(torch.zeros_like(ids))) * torch.linspace(0.5, 2.0, h.shape[-1])
            return self.head(h.mean(1))

    ids, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 3, (4,))
    for in_place in (True, False):
        torch.manual_seed(0)
        model = Adds(in_place)
        pristine = copy.deepcopy(model)
        wrapped = cls(model, loss_reduction="sum", **kwargs)
        for step in range(2):  # the first forward pass, then one of the layout it learned
            assert_step_correct(wrapped, pristine, ids, y)
            wrapped.zero_grad(set_to_none=True)
    model = Adds(in_place=False)
    wrapped = cls(model, loss_reduction="sum", **kwargs)
    ce(wrapped(ids), y).sum().backward()
    model.in_place = True
    with pytest.raises(ValueError) as err:
        ce(wrapped(ids), y).sum().backward()
    says(err, "layer 'map' (Linear) was changed in place", "h = h + x")


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_on_rows_picked_from_the_batch(wrapper):
    """A module per expert, called on the tokens routed to it (x[mask]): each row is its
    token's sample's (tests/test_picked_rows.py). Rows picked from a tensor that is not the
    batch's tokens (rows appended) cannot be told: refused, naming the layer and what to do
    instead."""
    cls, kwargs = WRAPPERS[wrapper]

    class PerExpert(nn.Module):
        def __init__(self, extra=False):
            super().__init__()
            self.tok, self.expert, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 3)
            self.extra = extra

        def forward(self, ids):
            x = self.tok(ids)
            routed = ids % 2 == 0
            if self.extra:  # B*T + 2 rows to pick from (13 picked)
                flat = torch.cat([x.view(-1, 6), x[0, :2]])
                token = torch.cat([routed.view(-1), routed.new_ones(2)]).nonzero()[:, 0]
                out = torch.zeros_like(flat).index_add(0, token, self.expert(flat[token]))
                x = x + out[:-2].view(x.shape)
            else:
                x = x.masked_scatter(routed[..., None], self.expert(x[routed]))
            return self.head(x.mean(1))

    ids, y = torch.arange(20).view(4, 5) % 11, torch.randint(0, 3, (4,))
    torch.manual_seed(0)
    model = PerExpert()
    pristine = copy.deepcopy(model)
    assert_step_correct(cls(model, loss_reduction="sum", **kwargs), pristine, ids, y)
    with pytest.raises(ValueError) as err:
        cls(PerExpert(extra=True), **kwargs)(ids)
    says(err, "layer 'expert'", "rows picked by indexing", "grouped experts")
