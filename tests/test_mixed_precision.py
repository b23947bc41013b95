"""Mixed precision: fp32 weights under ``torch.autocast``, and bf16 / fp16 weights.

Under autocast a layer can get fp32 inputs and bf16 backprops (a Linear after an fp32 layer)
or bf16 inputs and fp32 backprops (on CUDA autocast runs LayerNorm in fp32 after a bf16
Linear): Opacus issue #740's dtype errors. Models are checked against a float64 run of the
same weights at bf16's tolerance (rel 1e-2), in both modes, with ghost clipping and without;
every sampler is also given both mixes directly (CPU autocast makes only the first). A clipped
sample's share of ``p.grad`` is held to the precision contract's delta of each mode under bf16
and fp16 autocast (docs/guarantees.md, "Precision").
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpgrad
from dpgrad.samplers import registry
from per_sample_reference import assert_norms_close, assert_tensor_close, per_sample_grads, total_norm

RTOL = 1e-2


class MixedNet(nn.Module):
    """Embedding -> Linear -> GELU -> Linear -> LayerNorm -> RMSNorm -> mean -> Linear."""

    def __init__(self, V=13, d=16, h=24, c=5):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.rms = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, c)

    def forward(self, ids):
        x = self.ln(self.down(F.gelu(self.up(self.emb(ids)))))
        return self.head(self.rms(x).mean(1))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 13, (6, 5), generator=g), torch.randint(0, 5, (6,), generator=g)


def loss_fn(logits, y):
    return F.cross_entropy(logits.float(), y, reduction="none")


def run(model, mode, ghost, autocast):
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=0.5, single_backward=mode == "single",
                                                          use_ghost_clipping=ghost)
    ids, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = loss_fn(wrapped(ids), y)
    wrapped.clipped_backward(losses)
    return wrapped.per_sample_gradient_norms


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("mode", ["single", "double"])
def test_fp32_weights_under_autocast(mode, ghost):
    torch.manual_seed(0)
    model = MixedNet()
    ids, y = batch()
    ref = total_norm(per_sample_grads(model, ids, y, loss_fn))
    seen = set()
    hooks = [m.register_forward_hook(lambda m, i, o: seen.add((type(m).__name__, i[0].dtype, o.dtype)))
             for m in (model.up,)]
    norms = run(model, mode, ghost, autocast=True)
    for h in hooks:
        h.remove()
    assert seen == {("Linear", torch.float32, torch.bfloat16)}  # fp32 inputs, bf16 backprops
    assert norms.dtype == torch.float32
    assert_norms_close(norms, ref, "autocast norms", RTOL)
    for p in model.parameters():
        assert p.grad.dtype == torch.float32


def _fp32_linear_inputs_alive(model: nn.Module, forward) -> tuple:
    """(alive, all): the fp32 inputs of the model's Linear layers in ``forward()`` under CPU
    autocast, and how many of them are still alive after it returned (its result kept)."""
    refs = []

    def seen(m, args):
        # The forward pass's own calls (the independence check's forward probe runs the model
        # again, without gradients, on the first step).
        if args[0].dtype == torch.float32 and torch.is_grad_enabled():
            refs.append(weakref.ref(args[0]))

    hooks = [m.register_forward_pre_hook(seen) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept = forward()
    finally:
        for h in hooks:
            h.remove()
    gc.collect()
    assert kept is not None
    return sum(r() is not None for r in refs), len(refs)


WRAPPERS = {
    "gsm": lambda m: dpgrad.GradSampleModule(m),
    "double": lambda m: dpgrad.GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0),
    "single": lambda m: dpgrad.GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0, single_backward=True),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_autocast_keeps_no_fp32_input_that_autograd_lets_go(wrapper):
    """Under autocast a Linear multiplies its fp32 input cast to bf16, and autograd saves the
    cast alone: plain autograd lets the fp32 input of ``up`` (the embeddings) go when the
    forward pass ends (the other Linear layers get bf16 on CPU). The hooks keep autograd's cast in their place, so under every
    wrapper they go too (the steps' exactness: the tests above and below)."""
    torch.manual_seed(0)
    model = MixedNet()
    ids, _ = batch()
    assert _fp32_linear_inputs_alive(model, lambda: model(ids)) == (0, 1)  # plain autograd
    wrapped = WRAPPERS[wrapper](model)
    assert _fp32_linear_inputs_alive(model, lambda: wrapped(ids)) == (0, 1)


def test_a_users_linear_sampler_gets_the_fp32_inputs(monkeypatch):
    """A grad sampler of the user's own for nn.Linear is called with the layer's inputs under
    autocast (fp32 for ``up``, as Opacus calls it), not with the cast dpgrad's own read."""
    torch.manual_seed(0)
    model = MixedNet()
    ours = registry.GRAD_SAMPLERS[nn.Linear]
    given = {}

    def users(layer, activations, backprops):
        given[layer] = activations[0].dtype
        return ours(layer, activations, backprops)

    monkeypatch.setitem(registry.GRAD_SAMPLERS, nn.Linear, users)
    monkeypatch.delitem(registry.GRAD_SAMPLE_GROUPS, nn.Linear)  # so that the sampler itself is called
    wrapped = dpgrad.GradSampleModule(model)
    ids, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = loss_fn(wrapped(ids), y)
    losses.mean().backward()
    assert given == {model.up: torch.float32, model.down: torch.bfloat16, model.head: torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["single", "double"])
def test_half_precision_weights(mode, dtype):
    torch.manual_seed(0)
    model = MixedNet().to(dtype)
    ids, y = batch()
    ref = total_norm(per_sample_grads(copy.deepcopy(model), ids, y, loss_fn))
    norms = run(model, mode, True, autocast=False)
    assert norms.dtype == torch.float32
    assert_norms_close(norms, ref, f"{dtype} norms", RTOL)
    for p in model.parameters():
        assert p.grad.dtype == dtype


LAYERS = {
    "linear": lambda: nn.Linear(6, 7),
    "layer_norm": lambda: nn.LayerNorm(6),
    "rms_norm": lambda: nn.RMSNorm(6, eps=1e-6),
    # (B, 3, 6) inputs as 3 channels of length 6
    "conv1d": lambda: nn.Conv1d(3, 5, 3, padding=1, groups=1),
    "group_norm": lambda: nn.GroupNorm(3, 3),
}


@pytest.mark.parametrize("mix", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_every_sampler_takes_mixed_inputs_and_backprops(kind, mix):
    """Grad, norm, clipped-sum and factor samplers with activations and backprops of different
    dtypes, against float64 on the same (rounded) values."""
    torch.manual_seed(1)
    layer = LAYERS[kind]()
    x = torch.randn(4, 3, 6).to(mix[0])
    g = torch.randn_like(layer(x.float())).to(mix[1])
    layer64 = copy.deepcopy(layer).double()
    expected = registry.GRAD_SAMPLERS[type(layer)](layer64, [x.double()], g.double())
    expected = {name: expected[p] for name, p in layer64.named_parameters()}
    got = registry.GRAD_SAMPLERS[type(layer)](layer, [x], g)
    for name, p in layer.named_parameters():
        assert got[p].dtype == p.dtype
        assert_tensor_close(got[p], expected[name], f"{kind} {name}", rtol=RTOL)
    if type(layer) in registry.NORM_SAMPLERS:
        norms = registry.NORM_SAMPLERS[type(layer)](layer, [x], g)
        coef = torch.rand(4)
        sums = registry.CLIPPED_SUM_SAMPLERS[type(layer)](layer, [x], g, coef)
        for name, p in layer.named_parameters():
            assert norms[p].dtype == torch.float32
            assert_norms_close(norms[p], expected[name].flatten(1).norm(dim=1), f"{kind} {name} norm", RTOL)
            assert sums[p].dtype == p.dtype
            assert_tensor_close(sums[p], torch.einsum("b,b...->...", coef.double(), expected[name]), name, rtol=RTOL)
        for p, (L, R) in registry.FACTOR_SAMPLERS[type(layer)](layer, [x], g).items():
            inner = dpgrad.kernels.reference.outer_sum_inner(L, R, L, R)
            name = next(n for n, q in layer.named_parameters() if q is p)
            assert_norms_close(inner.sqrt(), expected[name].flatten(1).norm(dim=1), f"{kind} {name} factors", RTOL)


@pytest.mark.parametrize("backprops_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rms_norm_default_eps_is_the_inputs(backprops_dtype):
    """RMSNorm(eps=None) uses the input dtype's epsilon; the sampler computes in fp32 but must
    keep bf16's, which dominates for small activations."""
    torch.manual_seed(2)
    layer = nn.RMSNorm(6)
    x = (0.05 * torch.randn(3, 4, 6)).to(torch.bfloat16)
    g = torch.randn(3, 4, 6).to(backprops_dtype)
    got = registry.GRAD_SAMPLERS[nn.RMSNorm](layer, [x], g)[layer.weight]
    expected = []
    for b in range(3):
        w = layer.weight.detach().double().requires_grad_()
        y = F.rms_norm(x[b].double(), (6,), w, eps=torch.finfo(torch.bfloat16).eps)
        (y * g[b].double()).sum().backward()
        expected.append(w.grad)
    assert_tensor_close(got, torch.stack(expected), "RMSNorm weight", rtol=RTOL)


class AutocastMLP(nn.Module):
    """x (B, T, 8) -> Linear -> GELU -> Linear -> mean over tokens -> logits (B, 5). Under
    autocast the first Linear gets fp32 inputs and bf16 backprops, the second bf16 of both."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 5)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))).mean(1)


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("mode", ["single", "double"])
def test_autocast_steps_are_exact_against_float64_of_the_autocast_computation(mode, ghost):
    """The per-sample norms under autocast are those of the gradients autograd's matmuls take:
    ``G_b^T cast(A_b)`` with the fp32 inputs rounded to bf16, as the forward pass multiplied
    them; float64 of those values (the layers' inputs and backprops captured from a plain
    autocast step) agrees to fp32 accuracy, in both modes. Single backward's clipped sums too;
    double backward's come from autograd's own bf16 products (its output rounded to bf16)."""
    torch.manual_seed(3)
    model = AutocastMLP()
    x, y = torch.randn(4, 3, 8), torch.randint(0, 5, (4,))
    captured = {}

    def capture(m, inputs, out):
        captured[m] = [inputs[0].detach()]
        out.register_hook(lambda g: captured[m].append(g))

    hooks = [layer.register_forward_hook(capture) for layer in (model.up, model.down)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(x).float(), y, reduction="sum").backward()
    for h in hooks:
        h.remove()
    assert captured[model.up][0].dtype == torch.float32 and captured[model.up][1].dtype == torch.bfloat16
    per_sample = {}
    for layer, (A, G) in captured.items():
        A64 = (A.to(G.dtype) if A.dtype == torch.float32 else A).double()
        per_sample[layer.weight] = torch.einsum("btp,btd->bpd", G.double(), A64)
        per_sample[layer.bias] = G.double().sum(1)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_sample.values()]).sum(0).sqrt()
    C = 0.05
    coef = (C / (norms + 1e-6)).clamp(max=1.0)

    wrapped_model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    wrapped_model.zero_grad(set_to_none=True)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(wrapped_model, max_grad_norm=C, loss_reduction="sum",
                                                          single_backward=mode == "single", use_ghost_clipping=ghost)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = F.cross_entropy(wrapped(x).float(), y, reduction="none")
    wrapped.clipped_backward(losses)
    assert_norms_close(wrapped.per_sample_gradient_norms, norms, "autocast norms", rtol=1e-5)
    params = dict(zip(model.parameters(), wrapped_model.parameters()))
    for p, g in per_sample.items():
        expected = torch.einsum("b,b...->...", coef, g)
        assert_tensor_close(params[p].grad, expected, "clipped sum", rtol=1e-5 if mode == "single" else RTOL)


class AutocastCNN(nn.Module):
    """x (B, 3, 6, 6) -> Conv2d -> GroupNorm -> tanh -> Conv2d (strided, grouped) -> mean ->
    Linear. Under CPU autocast the convolutions and the Linear run in bf16 (the first on fp32
    inputs), GroupNorm on the bf16 output of the first (on CUDA autocast runs it in fp32: its
    backprops are fp32 there, the mix test_every_sampler_takes_mixed_inputs_and_backprops gives)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, groups=2)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        return self.head(self.conv2(torch.tanh(self.norm(self.conv1(x)))).mean(dim=(2, 3)))


def _float64_per_sample(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict:
    """{parameter: (B, ...)} float64 per-sample gradients of ``<layer(x_b), g_b>`` by torch.func,
    x rounded to g's half dtype where autocast's bf16 layer rounded it (not GroupNorm's fp32)."""
    from torch.func import functional_call, grad, vmap

    if x.dtype == torch.float32 and g.dtype == torch.bfloat16 and not isinstance(layer, nn.GroupNorm):
        x = x.to(g.dtype)
    layer64 = copy.deepcopy(layer).double()
    params = {n: p.detach() for n, p in layer64.named_parameters()}

    def f(p, xb, gb):
        return (functional_call(layer64, p, (xb[None],)) * gb[None]).sum()

    grads = vmap(grad(f), in_dims=(None, 0, 0))(params, x.double(), g.double())
    return {p: grads[n] for n, p in layer.named_parameters()}


@pytest.mark.parametrize("mode", ["single", "double"])
def test_autocast_convolutions_and_group_norm_are_exact_against_float64(mode):
    """Convolutions under autocast (fp32 input beside bf16 backprops, then bf16 of both) and
    GroupNorm on a bf16 input, every layer clipped from its norms: the per-sample
    norms equal float64 of the autocast computation's own inputs and backprops (captured from a
    plain autocast step) to fp32 accuracy; single backward's clipped sums too."""
    from mixed_net import clipped_from_norms

    torch.manual_seed(4)
    model = AutocastCNN()
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    captured = {}

    def capture(m, inputs, out):
        captured[m] = [inputs[0].detach()]
        out.register_hook(lambda g: captured[m].append(g))

    layers = (model.conv1, model.norm, model.conv2, model.head)
    hooks = [layer.register_forward_hook(capture) for layer in layers]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(x).float(), y, reduction="sum").backward()
    for h in hooks:
        h.remove()
    assert [t.dtype for t in captured[model.conv1]] == [torch.float32, torch.bfloat16]
    assert captured[model.norm][0].dtype == torch.bfloat16
    per_sample = {}
    for layer in layers:
        per_sample.update(_float64_per_sample(layer, *captured[layer]))
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_sample.values()]).sum(0).sqrt()
    C = float(norms.median())
    coef = (C / (norms + 1e-6)).clamp(max=1.0)

    wrapped_model = copy.deepcopy(model)
    with clipped_from_norms():
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(wrapped_model, max_grad_norm=C, loss_reduction="sum",
                                                              single_backward=mode == "single")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = F.cross_entropy(wrapped(x).float(), y, reduction="none")
        wrapped.clipped_backward(losses)
    assert_norms_close(wrapped.per_sample_gradient_norms, norms, "autocast norms", rtol=1e-5)
    params = dict(zip(model.parameters(), wrapped_model.parameters()))
    # Single backward: the convolutions' and GroupNorm's clipped sums are fp32; the Linear head's
    # is one GEMM on its bf16 operands, rounded to bf16 as autograd's own weight gradient is.
    exact = {p for layer in (model.conv1, model.norm, model.conv2) for p in layer.parameters()} | {model.head.bias}
    for p, g in per_sample.items():
        expected = torch.einsum("b,b...->...", coef, g)
        rtol = 1e-5 if mode == "single" and p in exact else RTOL
        assert_tensor_close(params[p].grad, expected, "clipped sum", rtol=rtol)


class AutocastLinear(nn.Module):
    """x (B, 4, 8) -> Linear -> mean over the 4 tokens (a division by a power of two: exact) ->
    logits (B, 5): a sample's gradient is the loss's gradient rounded once to the autocast dtype,
    times the inputs."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(x).mean(1)


def _contribution_case(name: str):
    """(model, inputs, per-sample losses of the outputs, roundings): one Linear; two with a GELU
    between; Embedding, LayerNorm and RMSNorm (``MixedNet``); a transformer block. Each loss
    reads fp32 logits, so all of a sample's gradient goes through the loss's gradient rounded to
    the autocast dtype; ``roundings`` counts it and those of narrow backprops below it (MixedNet's
    mean over 5 tokens divides its 16-wide backprops by 5), as the error model does."""
    from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig, per_sample_lm_loss

    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)
    ids, y = batch()
    if name == "linear":
        return AutocastLinear(), torch.randn(6, 4, 8, generator=g), lambda out: loss_fn(out, y), 1
    if name == "mlp":
        return AutocastMLP(), torch.randn(6, 4, 8, generator=g), lambda out: loss_fn(out, y), 1
    if name == "embedding_norms":
        return MixedNet(), ids, lambda out: loss_fn(out, y), 2
    cfg = TinyTransformerConfig(vocab_size=31, max_seq_len=8, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    tokens = torch.randint(1, 31, (4, 8), generator=g)
    return TinyTransformer(cfg), tokens, lambda out: per_sample_lm_loss(out.float(), tokens), 1


def _share_error(name: str, mode: str, dtype: torch.dtype, shrink: float = 20, loss_scale=None) -> float:
    """How much of the error model's delta (docs/guarantees.md, "Precision") the clipped samples'
    shares of ``p.grad`` use, on either side of C: the largest ``|share / (C N / (N + 1e-6)) - 1|``
    over the batch's samples, ``N / (N + 1e-6)`` being what exact arithmetic gives (Opacus's
    formula), over delta. Every sample clipped: C is the smallest norm over ``shrink``.

    Sample b's share, in float64, comes from a clipped backward of the batch with every other
    loss weighted 0: rows are independent, so the others add exact zeros and ``p.grad`` holds
    b's clipped gradient alone. ``loss_scale``: the losses multiplied by it, as a GradScaler's
    are (``p.grad`` divided by it).

    Delta: single backward scales the backprops the norm was taken of, so fp32's error alone
    (norms over n elements, the coefficient's division, the product). Double backward's second
    pass rounds the backprops again, at the scale c_b: each rounding that all of the sample's
    gradient goes through, then the result's own (``rescaled_backprops_delta``); those of wider
    backprops have independent errors on many elements, which the norm averages."""
    from precision_bounds import gamma, reduction_depth, rescaled_backprops_delta

    model, inputs, losses_of, roundings = _contribution_case(name)
    # (Whether the rows are independent is checked elsewhere; here it would only cost time.)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, loss_reduction="sum", check_independence=False,
                                                          single_backward=mode == "single")
    scale = None if loss_scale is None else torch.tensor(float(loss_scale))

    def clipped(weights, C=None):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            losses = losses_of(wrapped(inputs)) * weights
        wrapped.clipped_backward(losses if scale is None else losses * scale, loss_scale=scale,
                                 max_grad_norms=None if C is None else torch.full_like(losses, C))
        return wrapped.per_sample_gradient_norms.double()

    B = inputs.shape[0]
    C = clipped(torch.ones(B)).min().item() / shrink
    errors = []
    for b in range(B):
        norm = clipped(F.one_hot(torch.tensor(b), B).float(), C)[b]
        share = total_norm({n: p.grad[None] for n, p in model.named_parameters()})[0] / C / (loss_scale or 1)
        errors.append((share / (norm / (norm + 1e-6)) - 1).abs().item())
    delta = gamma(reduction_depth(sum(p.numel() for p in model.parameters())) + 4)
    if mode == "double":
        delta += rescaled_backprops_delta(dtype, roundings)
    return max(errors) / delta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["single", "double"])
@pytest.mark.parametrize("name", ["linear", "mlp", "embedding_norms", "transformer"])
def test_a_samples_contribution_under_autocast(name, mode, dtype):
    """A clipped sample's share of ``p.grad`` under autocast is C to the error model's delta,
    on both sides, so that a share no longer clipped, or lost, fails too (``_share_error``)."""
    used = _share_error(name, mode, dtype)
    assert used <= 1, f"{name}, {mode} backward, {dtype}: {used:.3g} of delta"


@pytest.mark.parametrize("mode", ["single", "double"])
def test_fp16_contribution_with_a_loss_scale_and_a_small_coefficient(mode):
    """fp16's delta needs the second pass's backprops, c_b times the norm pass's, in fp16's
    normal range: with c_b about 1e-5 they are subnormal unless the losses are scaled (36u off
    measured without a scale); with a GradScaler's 2^16 the bound holds as for any c_b."""
    used = _share_error("mlp", mode, torch.float16, shrink=1e5, loss_scale=2.0 ** 16)
    assert used <= 1, f"{mode} backward: {used:.3g} of delta"
