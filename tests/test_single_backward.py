"""Clipped backward (``clipped_backward``, ``dpgrad.DPLossFastGradientClipping``) in both modes.

``p.grad`` after single backward must equal the double backward's and the float64 reference
``sum_k sum_b c_kb * g_kb`` (fp32 rel 1e-5) on random models mixing every supported layer
(``tests/mixed_net.py``), for both loss reductions, over one or several micro-batches (each
clipped on its own). The clipping factors are dpgrad's own, checked against the reference
norms separately, so the sums are compared on the same factors.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import dpgrad
from mixed_net import (FREEZES, NetConfig, build, clipped_from_norms, fp32_budget_used_by_autograd, make_batch,
                       model_cases, per_sample_loss)
from per_sample_reference import (RTOL, assert_norms_close, assert_tensor_close, examples, per_sample_grads,
                                  total_norm)

MODES = ["single", "double"]
# The same, with every layer clipped from its norms however small its per-sample gradients.
NORMS_MODES = ["single-norms", "double-norms"]


def wrap(model, mode, *, loss_reduction="mean", batch_first=True, max_grad_norm=1.0, ghost=True):
    return dpgrad.GradSampleModuleFastGradientClipping(
        model,
        batch_first=batch_first,
        loss_reduction=loss_reduction,
        max_grad_norm=max_grad_norm,
        use_ghost_clipping=ghost,
        single_backward=mode == "single",
    )


def dp_criterion(wrapped, loss_reduction):
    # The loss wrapper only reads the optimizer's loss_reduction (Opacus's optimizer has one).
    optimizer = SimpleNamespace(loss_reduction=loss_reduction)
    return dpgrad.DPLossFastGradientClipping(
        wrapped, optimizer, nn.CrossEntropyLoss(reduction=loss_reduction), loss_reduction
    )


def clipping_bound(model, batches, batch_first):
    """C between the middle reference norms of the first micro-batch: about half are clipped."""
    x, y = batches[0]
    ranked = total_norm(per_sample_grads(model, x.detach(), y, per_sample_loss, batch_first)).sort().values
    B = ranked.numel()
    if B < 2 or ranked[B // 2] == 0:
        return 1.0
    return float(ranked[B // 2 - 1] + ranked[B // 2]) / 2


def check_clipped_sums(model, batches, mode, loss_reduction, batch_first, rtol=RTOL, ghost=True, wrapped=None):
    """Accumulate the micro-batches through DPLossFastGradientClipping; check every p.grad
    against the float64 reference clipped sum. Returns {name: p.grad}. A mode "...-norms"
    clips every layer that has a norm sampler from its norms. ``wrapped``: a wrapper made
    earlier (by ``wrap``) around a copy of ``model`` to go on with (its max_grad_norm is set
    here); ``model`` then gives the reference only."""
    if mode.endswith("-norms"):
        with clipped_from_norms():
            return _check_clipped_sums(model, batches, mode.removesuffix("-norms"), loss_reduction, batch_first,
                                       rtol, ghost, wrapped)
    return _check_clipped_sums(model, batches, mode, loss_reduction, batch_first, rtol, ghost, wrapped)


def _check_clipped_sums(model, batches, mode, loss_reduction, batch_first, rtol, ghost, wrapped=None):
    refs = [per_sample_grads(model, x.detach(), y, per_sample_loss, batch_first) for x, y in batches]
    C = clipping_bound(model, batches, batch_first)
    params = dict(model.named_parameters() if wrapped is None else wrapped._module.named_parameters())
    if wrapped is None:
        wrapped = wrap(model, mode, loss_reduction=loss_reduction, batch_first=batch_first, max_grad_norm=C,
                       ghost=ghost)
    wrapped.max_grad_norm = C
    criterion = dp_criterion(wrapped, loss_reduction)
    expected = {n: 0 for n in refs[0]}
    scale = {n: 0.0 for n in refs[0]}
    for (x, y), ref in zip(batches, refs):
        loss = criterion(wrapped(x), y)
        loss.backward()
        norms = wrapped.per_sample_gradient_norms
        assert_norms_close(norms, total_norm(ref), "per-sample norms", rtol)
        coef = (C / (norms + 1e-6)).clamp(max=1.0).double()
        for n, g in ref.items():
            expected[n] = expected[n] + torch.einsum("b,b...->...", coef, g)
            if g.shape[0]:
                scale[n] += (coef[:, None] * g.flatten(1).abs()).sum(0).max().item()
    grads = {}
    for n, p in params.items():
        if n not in expected:
            assert p.grad is None, f"frozen {n} got a gradient"
            continue
        want = torch.zeros_like(p, dtype=torch.float64) + expected[n]
        # A trainable parameter no backward reached keeps None, as after Opacus's protocol.
        got = torch.zeros_like(p) if p.grad is None else p.grad
        assert got.dtype == p.dtype
        assert_tensor_close(got, want, f"clipped {n}.grad ({mode})", scale[n], rtol)
        grads[n] = got
    return grads


# ---------------------------------------------------------------------------- fixed shapes
@pytest.mark.parametrize("policy", ["", "-norms"])
@pytest.mark.parametrize("freeze", ["none", "weight", "bias", "layer", "embedding"])
@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_single_equals_double_and_reference(loss_reduction, micro_batches, freeze, policy):
    cfg = NetConfig()
    model = build(cfg, seed=0, freeze=FREEZES[freeze])
    # Micro-batches of different sizes, as Poisson sampling gives.
    batches = [make_batch(cfg, B=4 + k, T=3, seed=10 + k) for k in range(micro_batches)]
    single = check_clipped_sums(copy.deepcopy(model), batches, "single" + policy, loss_reduction, True)
    double = check_clipped_sums(copy.deepcopy(model), batches, "double" + policy, loss_reduction, True)
    for n in single:
        assert_tensor_close(single[n], double[n].double(), f"single vs double {n}")


@pytest.mark.parametrize("mode", MODES)
def test_finish_plans_follow_the_pass(mode):
    """The finish step groups a pass's records by a plan made once for the pass's layout
    (layers, shapes, trainable parameters) and reused: the same layout again reuses it; a new
    batch size or sequence length makes another; a frozen parameter hooks the model anew,
    which plans again from scratch; every step stays exact."""
    cfg = NetConfig()
    model = build(cfg, seed=3)
    wrapped = wrap(copy.deepcopy(model), mode, loss_reduction="sum")
    batches = [make_batch(cfg, B=4, T=3, seed=30), make_batch(cfg, B=4, T=3, seed=31),
               make_batch(cfg, B=5, T=3, seed=32), make_batch(cfg, B=4, T=6, seed=33)]
    check_clipped_sums(model, batches, mode, "sum", True, wrapped=wrapped)
    assert len(wrapped._path.planner._plans) == 3
    first = next(iter(wrapped._path.planner._plans.values()))
    wrapped.zero_grad(set_to_none=True)
    check_clipped_sums(model, batches[:1], mode, "sum", True, wrapped=wrapped)
    assert len(wrapped._path.planner._plans) == 3 and next(iter(wrapped._path.planner._plans.values())) is first
    for frozen in ("lin1.bias", "emb.weight"):
        for m in (model, wrapped._module):
            dict(m.named_parameters())[frozen].requires_grad_(False)
        wrapped.zero_grad(set_to_none=True)
        check_clipped_sums(model, batches[:1], mode, "sum", True, wrapped=wrapped)
        assert len(wrapped._path.planner._plans) == 1 and next(iter(wrapped._path.planner._plans.values())) is not first


@pytest.mark.parametrize("mode", MODES)
def test_batch_second_and_without_ghost_clipping(mode):
    """batch_first=False, and use_ghost_clipping=False (every layer from per-sample gradients)."""
    cfg = NetConfig(batch_first=False)
    batches = [make_batch(cfg, B=5, T=4, seed=20), make_batch(cfg, B=3, T=4, seed=21)]
    check_clipped_sums(build(cfg, seed=1), batches, mode, "mean", False)
    check_clipped_sums(build(cfg, seed=1), batches, mode, "sum", False, ghost=False)


@settings(max_examples=examples(60), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=model_cases(MODES + NORMS_MODES))
def test_random_models_match_float64_reference(case):
    """Random mixed models, with one or two micro-batches; ill-conditioned draws (see
    test_reference_models) run in float64 against rtol 1e-10."""
    cfg = case["cfg"]
    model = build(cfg, seed=case["seed"], freeze=case["freeze"])
    if not any(p.requires_grad for p in model.parameters()):
        model.head.bias.requires_grad_(True)
    batches = [make_batch(cfg, B=case["B"], T=case["T"], seed=case["seed"] + 1)]
    if case["seed"] % 2:
        batches.append(make_batch(cfg, B=max(1, case["B"] - 1), T=case["T"], seed=case["seed"] + 2))
    rtol = RTOL
    for x, y in batches:
        ref = per_sample_grads(model, x, y, per_sample_loss, batch_first=cfg.batch_first)
        if fp32_budget_used_by_autograd(model, x, y, ref, cfg.batch_first) > 0.25:
            event("ill-conditioned in fp32: checked in float64")
            model, rtol = model.double(), 1e-10
            break
    check_clipped_sums(model, batches, case["wrapper"], case["loss_reduction"], cfg.batch_first, rtol)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", MODES)
def test_one_sample_is_clipped_from_its_plain_gradient(mode, loss_reduction):
    """A batch of one: the plain gradient is the per-sample one, so no norm or clipped-sum
    group runs; micro-batches of one accumulate, each clipped on its own, as any other."""
    cfg = NetConfig()
    model = build(cfg, seed=4, freeze="bias")
    batches = [make_batch(cfg, B=1, T=3, seed=40 + k) for k in range(3)]
    wrapped = wrap(copy.deepcopy(model), mode, loss_reduction=loss_reduction)

    def no_groups(records):
        raise AssertionError("a batch of one made norm groups")

    wrapped._path._norm_rows = no_groups
    check_clipped_sums(model, batches, mode, loss_reduction, True, wrapped=wrapped)
    assert all(p._norm_sample.shape == (1,) for p in wrapped.trainable_parameters if p._norm_sample is not None)


@pytest.mark.parametrize("mode", MODES)
def test_one_sample_with_a_non_finite_loss_adds_nothing_and_raises_at_the_next_forward(mode):
    cfg = NetConfig()
    model = build(cfg, seed=4)
    wrapped = wrap(model, mode)
    x, y = make_batch(cfg, B=1, T=3, seed=41)
    losses = per_sample_loss(wrapped(x), y) * float("nan")
    wrapped.clipped_backward(losses)
    assert all(not p.grad.any() for p in model.parameters() if p.requires_grad)
    with pytest.raises(FloatingPointError, match="non-finite per-sample gradient norms"):
        wrapped(x)
    wrapped(x)  # reported once


class Embeddings(nn.Module):
    """A class token and position embeddings around a patch projection (ViT's pattern): at
    B = 1 autograd returns the class token's gradient as a view into the position
    embeddings'."""

    def __init__(self, d=4, T=3):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, T + 1, d))
        self.proj = nn.Linear(5, d)

    def forward(self, x):
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], 1) + self.pos


class ClassToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = Embeddings(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x))[:, 0])


def clipped_reference(model, x, y, bound, gamma=None):
    """float64: sum_b c_b g_b, c_b Opacus's min(1, C / (n + 1e-6)), or automatic clipping's
    C / (n + gamma) (above 1 for a small norm)."""
    m = copy.deepcopy(model).double()
    params = list(m.parameters())
    losses = F.cross_entropy(m(x.double()), y, reduction="none")
    total = [torch.zeros_like(p) for p in params]
    for b in range(len(losses)):
        grads = torch.autograd.grad(losses[b], params, retain_graph=True)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        c = bound / (norm + gamma) if gamma is not None else min(1.0, bound / (norm + 1e-6))
        total = [t + c * g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_a_batch_of_one_is_scaled_once(mode, clipping):
    """Flat clipping gave a wrong gradient (96% off), automatic clipping 4.4 C: the class
    token's gradient was scaled in place twice, once as itself and once inside the position
    embeddings'."""
    torch.manual_seed(0)
    model = ClassToken()
    x, y = torch.randn(1, 3, 5), torch.tensor([1])
    bound = 0.05 if clipping == "flat" else 20.0  # automatic: far above the norm, c > 1
    expected = clipped_reference(model, x, y, bound, 0.01 if clipping == "automatic" else None)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=bound, loss_reduction="sum",
                                                          single_backward=mode == "single", clipping=clipping)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(reduction="sum"), "sum")
    criterion(wrapped(x), y).backward()
    for (n, p), e in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-5, atol=1e-7 * bound, msg=n)
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
    assert norm <= bound * (1 + 1e-6)
    # The gradients autograd handed over are the parameters' own: no two share memory.
    grads = [p.grad for p in model.parameters()]
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)


@pytest.mark.parametrize("mode", MODES)
def test_a_vit_batch_of_one_is_exact(mode):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).train()
    x, y = torch.randn(1, 3, 8, 8), torch.tensor([2])

    class Logits(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixels):
            return self.inner(pixel_values=pixels).logits

    net = Logits(model)
    for clipping, bound, gamma in [("flat", 0.05, None), ("automatic", 50.0, 0.01)]:
        expected = clipped_reference(net, x, y, bound, gamma)
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=bound, loss_reduction="sum",
                                                              single_backward=mode == "single", clipping=clipping)
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(reduction="sum"), "sum")
        net.zero_grad(set_to_none=True)
        criterion(wrapped(x), y).backward()
        for (n, p), e in zip(net.named_parameters(), expected):
            torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6 * bound, msg=n)
        wrapped.remove_hooks()


# ---------------------------------------------------------------------------- models that stress the graph walk
class InPlaceMLP(nn.Module):
    """A Linear whose output is changed in place (ReLU(inplace=True)), a branch that joins
    later, and a LayerNorm between Linears."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 5)
        self.side = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.a(x), inplace=True)
        return self.head(self.norm(self.b(h) + self.side(x)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_in_place_and_branches(mode, input_requires_grad):
    torch.manual_seed(3)
    model = InPlaceMLP()
    x = torch.randn(6, 6, requires_grad=input_requires_grad)
    y = torch.randint(0, 3, (6,))
    check_clipped_sums(model, [(x, y)], mode, "mean", True)


class Reused(nn.Module):
    """One Linear called twice, between LayerNorms."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.shared = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.shared(self.inp(x)))
        return self.head(self.norm(self.shared(h)).mean(1))


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("mode", MODES + NORMS_MODES)
def test_reused_layer(mode, ghost):
    torch.manual_seed(4)
    batches = [(torch.randn(5, 3, 4), torch.randint(0, 3, (5,))), (torch.randn(2, 3, 4), torch.randint(0, 3, (2,)))]
    check_clipped_sums(Reused(), batches, mode, "sum", True, ghost=ghost)


class TiedClassifier(nn.Module):
    """Token embedding (with padding) -> Linear -> mean -> output layer tied to the embedding."""

    def __init__(self, V: int = 9, d: int = 5):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, V)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids))).mean(1))


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", MODES + NORMS_MODES)
def test_tied_embedding_and_output_layer(mode, loss_reduction):
    """The tied weight's norm includes the cross term of its two uses (clipped from norms), or
    comes from the sum of its uses' per-sample gradients (small ones); its clipped gradient is
    the sum of both uses' clipped sums."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    batches = []
    for B in (5, 3):
        ids = torch.randint(0, 9, (B, 4), generator=g)
        ids[0, :2] = 0
        batches.append((ids, torch.randint(0, 9, (B,), generator=g)))
    check_clipped_sums(TiedClassifier(), batches, mode, loss_reduction, True)


@pytest.mark.parametrize("mode", MODES)
def test_two_forwards_then_two_backwards(mode):
    """Each loss is clipped on its own graph even when both forwards ran first."""
    cfg = NetConfig()
    model = build(cfg, seed=5)
    batches = [make_batch(cfg, B=4, T=3, seed=30), make_batch(cfg, B=3, T=2, seed=31)]
    ref_model = copy.deepcopy(model)
    refs = [per_sample_grads(ref_model, x, y, per_sample_loss) for x, y in batches]
    wrapped = wrap(model, mode, loss_reduction="sum", max_grad_norm=0.3)
    criterion = dp_criterion(wrapped, "sum")
    losses = [criterion(wrapped(x), y) for x, y in batches]
    expected = {}
    for loss, ref in zip(losses, refs):
        loss.backward()
        norms = wrapped.per_sample_gradient_norms
        assert_norms_close(norms, total_norm(ref))
        coef = (0.3 / (norms + 1e-6)).clamp(max=1.0).double()
        for n, g in ref.items():
            expected[n] = expected.get(n, 0) + torch.einsum("b,b...->...", coef, g)
    for n, p in model.named_parameters():
        assert_tensor_close(p.grad, expected[n], n)


class TwoHeads(nn.Module):
    """A shared body and two heads; ``which`` says which head the next forward uses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)
        self.which = "a"

    def forward(self, x):
        return getattr(self, self.which)(torch.tanh(self.body(x)))


@pytest.mark.parametrize("mode", MODES + ["opacus-protocol"])
def test_norms_are_those_of_the_pass(mode):
    """Two forwards through different heads, then the two backward passes: the second pass's
    norms leave out the head only the first pass reached (no stale norms)."""
    torch.manual_seed(13)
    model = TwoHeads()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    refs = {}
    for head in "ab":
        model.which = head
        refs[head] = total_norm(per_sample_grads(model, x, y, per_sample_loss))
    wrapped = wrap(model, "double" if mode == "opacus-protocol" else mode, loss_reduction="sum")
    losses = {}
    for head in "ab":
        model.which = head
        losses[head] = per_sample_loss(wrapped(x), y)
    for head in "ab":
        if mode == "opacus-protocol":
            losses[head].sum().backward()
        else:
            wrapped.clipped_backward(losses[head])
        assert_norms_close(wrapped.get_norm_sample(), refs[head], f"head {head}")
        wrapped.zero_grad()


# ---------------------------------------------------------------------------- what the norm pass computes
class OpShapes(TorchDispatchMode):
    """Records the output shapes of the matrix products and embedding backwards that run."""

    WATCHED = ("aten.mm", "aten.addmm", "aten.embedding_dense_backward")

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active and str(func).startswith(self.WATCHED):
            self.shapes.append((str(func), tuple(out.shape)))
        return out


def _weight_gradients(rec: OpShapes, model: nn.Module):
    weights = {tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")}
    return [(op, s) for op, s in rec.shapes if s in weights or "embedding_dense_backward" in op]


def test_norm_pass_computes_no_weight_gradient():
    """Until the second pass starts (hooks disabled), no weight-gradient GEMM and no dense
    embedding gradient runs; a plain hooked backward, as Opacus's first pass does, runs them."""
    # B = 5 and B * T = 15 are no layer's out-features: only a weight gradient has a weight's shape.
    cfg = NetConfig(V=9, d=8, k=2, q=5, r=3, c=4)
    model = build(cfg, seed=6)
    x, y = make_batch(cfg, B=5, T=3, seed=7)

    wrapped = wrap(copy.deepcopy(model), "double")
    with OpShapes() as rec:
        losses = per_sample_loss(wrapped(x), y)
        hooks_off = wrapped._path.hooks_off

        @contextlib.contextmanager
        def second_pass_starts():
            rec.active = False
            with hooks_off():
                yield

        wrapped._path.hooks_off = second_pass_starts
        wrapped.clipped_backward(losses)
    assert rec.shapes, "the recorder saw no matrix product"
    assert _weight_gradients(rec, model) == []

    plain = wrap(copy.deepcopy(model), "double")
    with OpShapes() as rec:
        per_sample_loss(plain(x), y).mean().backward()
    assert _weight_gradients(rec, model), "the check must see the weight gradients of a plain backward"


# ---------------------------------------------------------------------------- memory
def _live_tensors_of_shape(shape) -> int:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated torch attributes touched by the scan
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == shape)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_kept_after_backward(mode):
    """Once backward returns, no layer input or backprop stays alive, even while the caller
    still holds the loss (and so the graph)."""
    torch.manual_seed(8)
    B, width = 4, 37  # no parameter (or gradient) has the shape (B, width) of the layers' inputs
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.LayerNorm(width), nn.Linear(width, width),
                          nn.Tanh(), nn.Linear(width, 2))
    wrapped = wrap(model, mode, loss_reduction="sum")
    loss = dp_criterion(wrapped, "sum")(wrapped(torch.randn(B, 5)), torch.randint(0, 2, (B,)))
    loss.backward()
    assert _live_tensors_of_shape((B, width)) == 0
    assert all(p.grad is not None for p in model.parameters())
    del loss


# ---------------------------------------------------------------------------- misuse
def test_plain_backward_of_a_single_backward_wrapper_raises():
    model = build(NetConfig(), seed=9)
    x, y = make_batch(NetConfig(), B=3, T=2, seed=9)
    wrapped = wrap(model, "single")
    with pytest.raises(RuntimeError, match="single_backward=True.*DPLossFastGradientClipping"):
        per_sample_loss(wrapped(x), y).mean().backward()
    # The wrapper is usable afterwards.
    wrapped.zero_grad()
    dp_criterion(wrapped, "mean")(wrapped(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_clipped_backward_refuses_what_it_cannot_clip(mode):
    model = build(NetConfig(), seed=10)
    x, y = make_batch(NetConfig(), B=3, T=2, seed=10)
    wrapped = wrap(model, mode)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        wrapped.clipped_backward(per_sample_loss(wrapped(x), y)[:, None])
    with pytest.raises(ValueError, match="3 losses for a batch of 2"):
        wrapped.clipped_backward(torch.cat([per_sample_loss(wrapped(x[:2]), y[:2]), torch.ones(1)]))
    with pytest.raises(ValueError, match="no autograd graph"):
        with torch.no_grad():
            wrapped.clipped_backward(per_sample_loss(wrapped(x), y))
    wrapped.disable_hooks()
    losses = per_sample_loss(wrapped(x), y)
    wrapped.enable_hooks()
    with pytest.raises(RuntimeError, match="depends on no layer this wrapper hooked"):
        wrapped.clipped_backward(losses)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------- the loss wrapper
def test_dp_loss_checks_reductions():
    wrapped = wrap(build(NetConfig(), seed=11), "single", loss_reduction="mean")
    with pytest.raises(ValueError, match="reduce the loss the same way"):
        dpgrad.DPLossFastGradientClipping(wrapped, SimpleNamespace(loss_reduction="sum"), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="loss_reduction = 'none'"):
        dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), loss_reduction="none")

    def criterion(logits, target):  # no reduction attribute: the module's is used
        return F.cross_entropy(logits, target, reduction=criterion.reduction)

    loss = dpgrad.DPLossFastGradientClipping(wrapped, None, criterion)
    assert criterion.reduction == "mean" and loss.loss_reduction == "mean"


@pytest.mark.parametrize("mode", MODES)
def test_the_readme_recipe_on_a_language_model(mode):
    """The README's recipe as a language model's user writes it: the flattened logits' token
    losses are refused where the criterion is called, the message naming shape=; with it, each
    sequence is a sample, and p.grad is the clipped sum of the sequences' own gradients. The
    loss converts with float() as with item()."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(13)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=29, n_positions=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    net = transformers.GPT2LMHeadModel(cfg)
    B, T, V = 4, 6, cfg.vocab_size
    ids = torch.randint(0, V, (B, T))
    reference = copy.deepcopy(net)
    model = wrap(net, mode, max_grad_norm=0.05)
    criterion = dpgrad.DPLossFastGradientClipping(model, None, nn.CrossEntropyLoss())

    logits = model(ids).logits
    with pytest.raises(ValueError, match=r"24 losses for a batch of 4 samples.*shape=logits.shape\[:2\]"):
        criterion(logits.reshape(-1, V), ids.reshape(-1))
    with pytest.raises(ValueError, match=r"shape \(4, 6\) for a batch of 4 samples: give one loss per sample"):
        dpgrad.DPLossFastGradientClipping(model, None, nn.MSELoss())(logits[..., 0], ids.float())
    loss = criterion(logits.reshape(-1, V), ids.reshape(-1), shape=logits.shape[:2])
    loss.backward()

    params = [p for p in reference.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(F.cross_entropy(reference(ids[b:b + 1]).logits[0], ids[b]), params) for b in range(B)]
    norms = torch.stack([torch.sqrt(sum(g.double().square().sum() for g in sample)) for sample in grads])
    coefs = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    # p.grad holds the clipped sum; the optimizer divides by the expected batch size.
    expected = [sum(coefs[b] * grads[b][i].double() for b in range(B)) for i in range(len(params))]
    for (name, p), want in zip(((n, p) for n, p in net.named_parameters() if p.requires_grad), expected):
        torch.testing.assert_close(p.grad.double(), want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert float(loss) == loss.item() == pytest.approx(F.cross_entropy(logits.reshape(-1, V), ids.reshape(-1)).item())


def test_dp_loss_per_sequence_and_arithmetic():
    """shape=(B, T): one loss per sequence, the mean over the tokens not equal to
    ignore_index; scalar arithmetic acts on every sample's loss."""
    torch.manual_seed(12)
    B, T, V = 3, 5, 7
    logits = torch.randn(B, T, V, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    targets[0, 2:] = -100
    targets[2, :] = -100  # a sequence with nothing to predict
    wrapped = wrap(nn.Linear(2, 2), "single")
    ce = nn.CrossEntropyLoss()
    loss = dpgrad.DPLossFastGradientClipping(wrapped, None, ce)(logits.view(-1, V), targets.view(-1), shape=(B, T, V))
    assert ce.reduction == "mean"  # restored
    token = F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(B, T)
    valid = (targets != -100).sum(1)
    expected = torch.stack([token[0].sum() / 2, token[1].sum() / T, torch.zeros(())])
    assert valid.tolist() == [2, T, 0]
    torch.testing.assert_close(loss.loss_per_sample, expected)
    torch.testing.assert_close(loss.detach(), expected.mean())
    assert loss.item() == pytest.approx(expected.mean().item())
    torch.testing.assert_close((2 * loss / 4 - 1 + loss).loss_per_sample, expected * 1.5 - 1)
    torch.testing.assert_close((-loss).loss_per_sample, -expected)
    torch.testing.assert_close((1 - loss).loss_per_sample, 1 - expected)
    summed = dpgrad.DPLossFastGradientClipping(wrap(nn.Linear(2, 2), "single", loss_reduction="sum"), None,
                                               nn.CrossEntropyLoss(reduction="sum"), "sum")
    torch.testing.assert_close(summed(logits.view(-1, V), targets.view(-1), shape=(B, T)).loss_per_sample,
                               token.sum(1))
    with pytest.raises(ValueError, match="reduced by 'mean' and 'sum'"):
        loss + summed(logits.view(-1, V), targets.view(-1), shape=(B, T))


class BiasOnly4D(nn.Module):
    """A Linear with a frozen weight (bias-only fine-tuning) on 4-D inputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 20)
        self.lin.weight.requires_grad_(False)
        self.head = nn.Linear(20, 3)

    def forward(self, x):
        return self.head(self.lin(x).tanh().mean(dim=(1, 2)))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("mode", MODES)
def test_bias_only_layer_on_4d_inputs(mode, device):
    """A frozen weight's bias is clipped from its token sums alone (on a GPU this reached an
    untuned kernel that crashed in some Triton versions)."""
    torch.manual_seed(0)
    model = BiasOnly4D().to(device)
    reference = copy.deepcopy(model).double()
    wrapped = wrap(model, mode, loss_reduction="sum", max_grad_norm=0.5)
    x, y = torch.randn(6, 3, 5, 12, device=device), torch.randint(0, 3, (6,), device=device)
    wrapped.clipped_backward(F.cross_entropy(wrapped(x), y, reduction="none"))
    ref = per_sample_grads(reference, x.double(), y, per_sample_loss)
    norms = wrapped.per_sample_gradient_norms
    assert_norms_close(norms.cpu(), total_norm(ref).cpu())
    coef = (0.5 / (norms + 1e-6)).clamp(max=1.0).double()
    for n, p in model.named_parameters():
        if n in ref:
            assert_tensor_close(p.grad, torch.einsum("b,b...->...", coef, ref[n]), n)
        else:
            assert p.grad is None, n
