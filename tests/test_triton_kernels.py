"""The Triton launchers (dpgrad.kernels.triton_ops) against kernels/reference.py in float64.

Without a GPU this runs under Triton's interpreter on CPU tensors (tests/conftest.py); with
one, on CUDA. Each launcher gets odd shapes (non-powers of two, T = 1, B = 1, B = 0, T = 0),
contiguous and strided inputs and every input dtype; the reference runs in float64 on the same
inputs, so the error measured is the kernel's own. Buffers the kernels must fill are poisoned
with NaN first, so an unwritten element cannot pass for a zero. The Linear weight norms are
held to the precision contract's bound (tests/precision_bounds.py: what fp32 accumulation over
their K can lose, the same for every input dtype, since the reference takes the same rounded
values); the other results to fp32 rel 1e-5 and, rounded to a half dtype, to its rounding.
"""

from __future__ import annotations

import math
import pytest
import torch

pytest.importorskip("triton")

from dpgrad.kernels import backend  # noqa: E402
from dpgrad.kernels import reference as R  # noqa: E402
from dpgrad.kernels import triton_common  # noqa: E402
from dpgrad.kernels import triton_ops as K  # noqa: E402
from precision_bounds import direct_sq_norm_bound, gram_sq_norm_bound, within  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Squared norms, per sample (relative); the bound for half inputs is 1e-2 and fp16,
# rounded 8x finer than bf16, meets 1e-3 with fp32 accumulation.
NORM_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# Gradients come back in the input dtype: its rounding, per sample (relative Frobenius).
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (B, T, d, p): non-powers of two, single token, single sample, empty batch, no tokens, and
# sizes that cross several tiles of every kernel.
LINEAR_SHAPES = [
    (3, 37, 45, 29),
    (2, 70, 19, 66),
    (1, 1, 33, 17),
    (5, 1, 8, 130),
    (1, 65, 16, 16),  # long T, a tail of one token in every T-tile (BT 32 and 16), 5 Gram row blocks
    (4, 3, 1, 2),
    (0, 5, 7, 3),
    (2, 0, 6, 5),
]
# (B, T, V, d, padding_idx)
EMBEDDING_SHAPES = [
    (3, 17, 11, 45, 0),
    (4, 9, 50, 70, 3),  # three d-tiles of the interpreter's BD = 32 (a full one between), padding mid-table
    (2, 40, 3, 16, None),  # few tokens: long segments
    (1, 1, 5, 3, None),
    (2, 9, 7, 33, 2),
    (0, 5, 7, 4, None),
]


# Every input dtype in both layouts (contiguous, strided). On a GPU each shape takes all six;
# under the interpreter, where the kernels' code is the same for every dtype and layout and only
# the loads' addresses and the roundings differ, each shape takes two (one contiguous, one
# strided), rotating so that each of the six meets at least two shapes.
ALL_LAYOUTS = [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False),
               (torch.float32, True), (torch.bfloat16, False), (torch.float16, True)]


def shapes_and_layouts(shapes):
    params = []
    for i, shape in enumerate(shapes):
        first = 2 * i % len(ALL_LAYOUTS)
        for dtype, strided in ALL_LAYOUTS if DEVICE == "cuda" else ALL_LAYOUTS[first:first + 2]:
            layout = "strided" if strided else "contiguous"
            params.append(pytest.param(shape, dtype, strided, id=f"{shape}-{dtype}-{layout}"))
    return params


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_common, "POISON", True)


def tensor(shape, dtype, strided: bool, seed: int) -> torch.Tensor:
    """A random (B, T, n) tensor; ``strided``: a view with the batch and token axes swapped in
    memory and every other element of the last axis, so no stride is the contiguous one."""
    g = torch.Generator().manual_seed(seed)
    B, T, n = shape
    if not strided:
        return torch.randn(B, T, n, generator=g).to(dtype).to(DEVICE)
    base = torch.randn(T, B, 2 * n, generator=g).to(dtype).to(DEVICE)
    return base.transpose(0, 1)[..., ::2]


def token_ids(B, T, V, padding_idx, strided: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (T, B) if strided else (B, T), generator=g)
    if padding_idx is not None and B * T:
        ids.view(-1)[::4] = padding_idx  # make sure padding positions occur
    ids = ids.to(DEVICE)
    return ids.t() if strided else ids


def assert_rel_per_sample(out: torch.Tensor, ref: torch.Tensor, rtol: float, what: str):
    """Every sample's (first axis) result within ``rtol`` of the reference, relative to its size."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite (unwritten?) elements"
    if out.numel() == 0:
        return
    out64 = out.double().cpu().reshape(out.shape[0], -1) if out.dim() else out.double().cpu().reshape(1, 1)
    ref64 = ref.double().cpu().reshape(out64.shape)
    err = (out64 - ref64).norm(dim=1)
    scale = ref64.norm(dim=1)
    bad = err > rtol * scale + 1e-30
    assert not bad.any(), f"{what}: rel error {(err / scale.clamp_min(1e-300)).max().item():.3g} > {rtol}"


def upcast(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("shape, dtype, strided", shapes_and_layouts(LINEAR_SHAPES))
def test_linear_per_sample_fused(shape, dtype, strided):
    """Gradients, bias and both norm epilogues of one pass, in the input and an fp32 output dtype."""
    B, T, d, p = shape
    A = tensor((B, T, d), dtype, strided, seed=1)
    G = tensor((B, T, p), dtype, strided, seed=2)
    ref = R.linear_per_sample(*upcast(A, G), bias=True, norm=True)
    out = K.linear_per_sample(A, G, bias=True, norm=True)
    assert out.weight.dtype == dtype and out.bias.dtype == dtype
    assert out.weight_sq_norm.dtype == torch.float32
    assert_rel_per_sample(out.weight, ref.weight, GRAD_RTOL[dtype], "weight grad sample")
    assert_rel_per_sample(out.bias, ref.bias, GRAD_RTOL[dtype], "bias grad sample")
    assert within(out.weight_sq_norm, ref.weight_sq_norm, direct_sq_norm_bound(A, G)) <= 1, "weight norm"
    assert_rel_per_sample(out.bias_sq_norm[:, None], ref.bias_sq_norm[:, None], NORM_RTOL[dtype], "bias norm")
    wide = K.linear_per_sample(A, G, out_dtype=torch.float32)
    assert wide.weight.dtype == torch.float32 and wide.bias is None and wide.weight_sq_norm is None
    assert_rel_per_sample(wide.weight, ref.weight, 1e-5, "fp32 output")


@pytest.mark.parametrize("algorithm", ["direct", "gram"])
@pytest.mark.parametrize("shape, dtype, strided", shapes_and_layouts(LINEAR_SHAPES))
def test_linear_weight_norm(shape, dtype, strided, algorithm):
    B, T, d, p = shape
    A = tensor((B, T, d), dtype, strided, seed=3)
    G = tensor((B, T, p), dtype, strided, seed=4)
    out = K.linear_weight_sq_norm(A, G, algorithm)
    ref = R.linear_weight_sq_norm_direct(*upcast(A, G))
    assert out.dtype == torch.float32
    bound = (direct_sq_norm_bound if algorithm == "direct" else gram_sq_norm_bound)(A, G)
    assert within(out, ref, bound) <= 1, f"{algorithm}: {within(out, ref, bound):.3g} of the fp32 bound"


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,d,p", [(4, 33, 17), (1, 130, 5), (0, 3, 4)])
def test_linear_outer_norm_and_bias(B, d, p, dtype, strided):
    """Closed forms: T = 1 weight norms, bias gradients and bias norms."""
    A = tensor((B, 1, d), dtype, strided, seed=5)
    G = tensor((B, 1, p), dtype, strided, seed=6)
    Ad, Gd = upcast(A, G)
    assert_rel_per_sample(K.linear_weight_sq_norm(A, G, "outer")[:, None], R.linear_weight_sq_norm_outer(Ad, Gd)[:, None],
                          NORM_RTOL[dtype], "outer norm")
    G3 = tensor((B, 7, p), dtype, strided, seed=7)
    assert_rel_per_sample(K.linear_bias_sq_norm(G3)[:, None], R.linear_bias_sq_norm(G3.double())[:, None],
                          NORM_RTOL[dtype], "bias norm")
    assert_rel_per_sample(K.linear_bias_grad_sample(G3), R.linear_bias_grad_sample(G3.double()),
                          GRAD_RTOL[dtype], "bias grad sample")
    with pytest.raises(ValueError, match="T == 1"):
        K.linear_weight_sq_norm(G3, G3, "outer")


def test_linear_frozen_weight_paths():
    """Direct norm with the bias fused, and the bias of a layer without weight columns."""
    A = tensor((3, 11, 9), torch.float32, False, seed=8)
    G = tensor((3, 11, 10), torch.float32, False, seed=9)
    out = K.linear_per_sample(A, G, grad=False, bias=True, norm=True)
    ref = R.linear_per_sample(*upcast(A, G), grad=False, bias=True, norm=True)
    assert out.weight is None and out.bias is None
    assert_rel_per_sample(out.weight_sq_norm[:, None], ref.weight_sq_norm[:, None], 1e-5, "direct")
    assert_rel_per_sample(out.bias_sq_norm[:, None], ref.bias_sq_norm[:, None], 1e-5, "fused bias")
    no_cols = K.linear_per_sample(A[..., :0], G, bias=True, norm=True)
    assert no_cols.weight.shape == (3, 10, 0)
    assert_rel_per_sample(no_cols.bias, ref_bias := R.linear_bias_grad_sample(G.double()), 1e-5, "bias, d = 0")
    assert_rel_per_sample(no_cols.bias_sq_norm[:, None], ref_bias.square().sum(1, keepdim=True), 1e-5, "bias norm")


@pytest.mark.parametrize("shape, dtype, strided", shapes_and_layouts(LINEAR_SHAPES))
def test_linear_clipped_sum(shape, dtype, strided):
    B, T, d, p = shape
    A = tensor((B, T, d), dtype, strided, seed=10)
    G = tensor((B, T, p), dtype, strided, seed=11)
    coef = torch.rand(B, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    if B > 1:
        coef[0] = 0.0  # a sample clipped to nothing
    w, b = K.linear_clipped_sum(A, G, coef, bias=True)
    wr, br = R.linear_clipped_sum(*upcast(A, G), coef.double(), bias=True)
    assert w.dtype == dtype and b.dtype == dtype
    assert_rel_per_sample(w[None], wr[None], GRAD_RTOL[dtype], "clipped weight sum")
    assert_rel_per_sample(b[None], br[None], GRAD_RTOL[dtype], "clipped bias sum")
    w32, none = K.linear_clipped_sum(A, G, coef, out_dtype=torch.float32)
    assert none is None and w32.dtype == torch.float32
    assert_rel_per_sample(w32[None], wr[None], 1e-5, "fp32 output")


def test_linear_clipped_sum_batch_splits(monkeypatch):
    """Small layers split the batch over programs; the fp32 partials add up to the same sum."""
    from dpgrad.kernels import linear_clipped_sum as module

    A = tensor((9, 5, 7), torch.float32, False, seed=13)
    G = tensor((9, 5, 6), torch.float32, False, seed=14)
    coef = torch.rand(9, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    wr, br = R.linear_clipped_sum(*upcast(A, G), coef.double(), bias=True)
    for target in (1, 4, 512):
        monkeypatch.setattr(module, "_TARGET_PROGRAMS", target)
        w, b = K.linear_clipped_sum(A, G, coef, bias=True)
        assert_rel_per_sample(w[None], wr[None], 1e-5, f"{target} programs")
        assert_rel_per_sample(b[None], br[None], 1e-5, f"{target} programs")


@pytest.mark.parametrize("shape, dtype, strided", shapes_and_layouts(EMBEDDING_SHAPES))
def test_embedding_kernels(shape, dtype, strided):
    B, T, V, d, padding_idx = shape
    ids = token_ids(B, T, V, padding_idx, strided, seed=16)
    G = tensor((B, T, d), dtype, strided, seed=17)
    Gd = G.double()
    norm = K.embedding_sq_norm(ids, G, V, padding_idx)
    assert norm.dtype == torch.float32
    assert_rel_per_sample(norm[:, None], R.embedding_sq_norm(ids, Gd, V, padding_idx)[:, None],
                          NORM_RTOL[dtype], "embedding norm")
    gs = K.embedding_grad_sample(ids, G, V, padding_idx)
    assert gs.dtype == dtype
    assert_rel_per_sample(gs, R.embedding_grad_sample(ids, Gd, V, padding_idx), GRAD_RTOL[dtype], "grad sample")
    coef = torch.rand(B, generator=torch.Generator().manual_seed(18)).to(DEVICE)
    clipped = K.embedding_clipped_sum(ids, G, coef, V, padding_idx)
    ref = R.embedding_clipped_sum(ids, Gd, coef.double(), V, padding_idx)
    assert clipped.dtype == dtype
    assert_rel_per_sample(clipped[None], ref[None], GRAD_RTOL[dtype], "clipped sum")
    assert K.embedding_clipped_sum(ids, G, coef, V, padding_idx, out_dtype=torch.float32).dtype == torch.float32


def test_embedding_all_padding_and_3d_ids():
    """Only padding: zero norms and gradients. Ids of any rank flatten like the forward does."""
    ids = torch.full((3, 4), 2, device=DEVICE)
    G = tensor((3, 4, 5), torch.float32, False, seed=19)
    assert torch.equal(K.embedding_sq_norm(ids, G, 6, 2), torch.zeros(3, device=DEVICE))
    assert not K.embedding_grad_sample(ids, G, 6, 2).any()
    ids3 = token_ids(2, 12, 9, None, False, seed=20).reshape(2, 3, 4)
    G3 = tensor((2, 12, 8), torch.float32, False, seed=21)
    assert_rel_per_sample(K.embedding_sq_norm(ids3, G3.reshape(2, 3, 4, 8), 9)[:, None],
                          R.embedding_sq_norm(ids3, G3.double(), 9)[:, None], 1e-5, "3-D ids")


def test_embedding_grad_sample_warns_with_the_size(monkeypatch):
    from dpgrad.kernels import embedding_segment_sum as module

    monkeypatch.setattr(module, "EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS", 10)
    with pytest.warns(ResourceWarning, match=r"\(2, 6, 5\)"):
        K.embedding_grad_sample(token_ids(2, 3, 6, None, False, 22), tensor((2, 3, 5), torch.float32, False, 23), 6)


def test_norms_are_deterministic():
    """Run twice, bit for bit: no float atomics decide the summation order."""
    A = tensor((3, 45, 37), torch.bfloat16, False, seed=24)
    G = tensor((3, 45, 29), torch.bfloat16, False, seed=25)
    ids = token_ids(3, 45, 7, 1, False, seed=26)
    for fn in (lambda: K.linear_weight_sq_norm(A, G, "gram"), lambda: K.linear_weight_sq_norm(A, G, "direct"),
               lambda: K.embedding_sq_norm(ids, A, 7, 1)):
        assert torch.equal(fn(), fn())


def test_zero_backprops_give_exactly_zero_norms():
    """A fully masked sample must get norm 0 exactly, not rounding noise (it is then unclipped)."""
    A = tensor((3, 40, 21), torch.float32, False, seed=30)
    G = tensor((3, 40, 18), torch.float32, False, seed=31)
    G[1] = 0
    ids = token_ids(3, 40, 9, None, False, seed=32)
    for out in (K.linear_weight_sq_norm(A, G, "gram"), K.linear_weight_sq_norm(A, G, "direct"),
                K.linear_bias_sq_norm(G), K.embedding_sq_norm(ids, G, 9)):
        assert out[1].item() == 0.0 and (out[[0, 2]] > 0).all()


def _autotune_two_configs(monkeypatch, kernel, small: dict, large: dict):
    """Make ``kernel``'s autotuner try ``small`` (the smallest tiles, which size the partial
    buffers) and then ``large``, and pick ``large``: what a GPU does on a new layer shape."""
    import itertools

    import triton

    monkeypatch.setattr(kernel, "configs", [triton.Config(small), triton.Config(large)])
    monkeypatch.setattr(kernel, "cache", {})
    calls = itertools.count()

    def bench(fn, quantiles):
        fn()
        return [2.0 if next(calls) == 0 else 1.0] * len(quantiles)

    monkeypatch.setitem(kernel.__dict__, "do_bench", bench)


def test_norms_are_right_on_the_call_that_autotunes(monkeypatch):
    """Every config tried while tuning runs on the caller's buffers; partials it leaves in
    slots the chosen config does not write must not reach the norms."""
    from dpgrad.kernels import embedding_segment_sum, linear_grad_sample, linear_norm_gram, linear_token_sum

    _autotune_two_configs(monkeypatch, linear_grad_sample._linear_per_sample_kernel,
                          dict(BP=32, BD=32, BT=32), dict(BP=64, BD=64, BT=32))
    _autotune_two_configs(monkeypatch, linear_norm_gram._linear_gram_norm_kernel,
                          dict(BT=16, BK=32), dict(BT=32, BK=32))
    _autotune_two_configs(monkeypatch, linear_token_sum._token_sum_kernel, dict(BN=64, BT=16), dict(BN=128, BT=16))
    _autotune_two_configs(monkeypatch, embedding_segment_sum._segment_sum_kernel,
                          dict(BD=32, BR=8), dict(BD=64, BR=8))
    A = tensor((3, 45, 45), torch.float32, False, seed=33)
    G = tensor((3, 45, 70), torch.float32, False, seed=34)
    ids = token_ids(3, 45, 9, 0, False, seed=35)
    ref = R.linear_per_sample(*upcast(A, G), bias=True, norm=True)
    fused = K.linear_per_sample(A, G, bias=True, norm=True)
    checks = [
        (fused.weight_sq_norm, ref.weight_sq_norm, "fused weight norm"),
        (fused.bias_sq_norm, ref.bias_sq_norm, "fused bias norm"),
        (K.linear_weight_sq_norm(A, G, "gram"), ref.weight_sq_norm, "gram"),
        (K.linear_bias_sq_norm(G), ref.bias_sq_norm, "token sum"),
        (K.embedding_sq_norm(ids, A, 9, 0), R.embedding_sq_norm(ids, A.double(), 9, 0), "embedding"),
    ]
    for out, want, what in checks:
        assert_rel_per_sample(out[:, None], want[:, None], 1e-5, what)


def test_dtypes_outside_the_kernels_are_refused_with_advice():
    A = torch.zeros(2, 3, 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="DPGRAD_BACKEND=eager"):
        K.linear_weight_sq_norm_direct(A, A)
    # Two half dtypes in one launch (no autocast makes them): the eager kernels take that.
    bf, fp = A.to(torch.bfloat16), A.to(torch.float16)
    with pytest.raises(TypeError, match="one half dtype per launch"):
        K.linear_per_sample(bf, fp)


def test_autotune_keys_are_layer_dims_not_batch_or_tokens():
    """Poisson sampling changes B every step and T varies: neither may trigger retuning."""
    from dpgrad.kernels import (embedding_segment_sum, linear_clipped_sum, linear_grad_sample, linear_norm_direct,
                                linear_norm_gram, linear_token_sum)

    kernels = [linear_grad_sample._linear_per_sample_kernel, linear_norm_gram._linear_gram_norm_kernel,
               linear_norm_direct._linear_direct_norm_kernel,
               linear_clipped_sum._linear_clipped_sum_kernel, linear_token_sum._token_sum_kernel,
               embedding_segment_sum._segment_sum_kernel]
    for kernel in kernels:
        assert not {"B", "T"} & set(kernel.keys), kernel.keys


# ------------------------------------------------------------------------------------ backend
def test_backend_choice(monkeypatch):
    cpu32 = torch.zeros(2, 2)
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.name_for(cpu32) == "eager"  # CPU tensors: eager unless forced
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.name_for(cpu32) == "triton"
    assert backend.name_for(cpu32.double()) == "eager"  # fp64 keeps its precision
    assert backend.name_for(torch.zeros(2, dtype=torch.int64), cpu32.half()) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.ops_for(cpu32)
    monkeypatch.setenv(backend.ENV_VAR, "eager")
    assert backend.name_for(cpu32) == "eager"
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="auto, eager, triton"):
        backend.ops_for(cpu32)


def _as_autocast_gave_them(A, G):
    """float64 of the operands of an autocast matmul: an fp32 one beside a half one rounded to
    that half dtype first (the forward pass multiplied the cast input)."""
    if A.dtype == torch.float32 and G.dtype != torch.float32:
        A = A.to(G.dtype)
    elif G.dtype == torch.float32 and A.dtype != torch.float32:
        G = G.to(A.dtype)
    return A.double(), G.double()


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                    (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("engine", ["triton", "eager"])
def test_mixed_input_dtypes_are_the_autocast_computation(dtypes, engine):
    """An fp32 operand beside a half one (under autocast a Linear's input is fp32 and its
    backprops bf16; Conv1D swaps the roles) is taken as the forward pass's matmul took it,
    cast to the half dtype: per-sample gradients, norms by every algorithm and clipped sums
    equal float64 of those values to fp32 accuracy (the fp32 accumulation's only error), on
    the Triton kernels (on the tensor cores on a GPU) and the eager reference alike."""
    ops = K if engine == "triton" else R
    for T in (21, 1):
        A = tensor((3, T, 19), dtypes[0], False, seed=27)
        G = tensor((3, T, 13), dtypes[1], True, seed=28)
        A64, G64 = _as_autocast_gave_them(A, G)
        W = torch.einsum("btp,btd->bpd", G64, A64)
        out = ops.linear_per_sample(A, G, bias=True, norm=True, out_dtype=torch.float32)
        assert_rel_per_sample(out.weight, W, 1e-5, "weight")
        assert_rel_per_sample(out.weight_sq_norm[:, None], W.square().sum((1, 2))[:, None], 1e-5, "fused norm")
        for algorithm in ("direct", "gram") + (("outer",) if T == 1 else ()):
            assert_rel_per_sample(ops.linear_weight_sq_norm(A, G, algorithm)[:, None],
                                  W.square().sum((1, 2))[:, None], 1e-5, algorithm)
        coef = torch.rand(3, generator=torch.Generator().manual_seed(29)).to(DEVICE)
        w, _ = ops.linear_clipped_sum(A, G, coef, out_dtype=torch.float32)
        assert_rel_per_sample(w[None], torch.einsum("b,bpd->pd", coef.double(), W)[None], 1e-5, "clipped")


def test_wrappers_run_on_the_forced_backend(monkeypatch):
    """DPGRAD_BACKEND=triton routes the samplers through the kernels, with the eager results."""
    import torch.nn as nn

    from dpgrad import GradSampleModule, GradSampleModuleFastGradientClipping

    calls = []
    for name in ("linear_per_sample", "linear_weight_sq_norm_gram", "embedding_sq_norm", "embedding_grad_sample"):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))

    def run(wrapper_cls):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(13, 24, padding_idx=0), nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 5))
        model = model.to(DEVICE)  # the kernels' device: CUDA where there is one
        wrapped = wrapper_cls(model, batch_first=True, loss_reduction="sum")
        ids = torch.randint(0, 13, (4, 3)).to(DEVICE)
        wrapped(ids).square().sum().backward()
        if wrapper_cls is GradSampleModule:
            return [p.grad_sample for p in model.parameters()]
        return [wrapped.get_norm_sample()]

    for wrapper_cls in (GradSampleModule, GradSampleModuleFastGradientClipping):
        monkeypatch.setenv(backend.ENV_VAR, "eager")
        eager = run(wrapper_cls)
        monkeypatch.setenv(backend.ENV_VAR, "triton")
        calls.clear()
        forced = run(wrapper_cls)
        assert calls, f"{wrapper_cls.__name__} never reached the Triton kernels"
        for got, want in zip(forced, eager):
            assert_rel_per_sample(got, want, 1e-5, wrapper_cls.__name__)


# (L, B, T, d, p): a group of L layers of one shape launched at once.
# The third: four layers, p = 66 across three p-tiles of the interpreter's 32 (the last group of
# the clipped sum's rasterisation partial) and two of the token sums' 64, each with a tail.
GROUPED_SHAPES = [(3, 2, 37, 45, 29), (2, 1, 1, 33, 17), (4, 2, 5, 8, 66), (2, 0, 5, 7, 3)]


def _layers(L, B, T, d, p, dtype, strided, seed):
    """L layers' (A, G), each tensor allocated on its own (a grouped launch reads them where they are)."""
    return ([tensor((B, T, d), dtype, strided, seed=seed + 2 * i) for i in range(L)],
            [tensor((B, T, p), dtype, strided, seed=seed + 2 * i + 1) for i in range(L)])


# Every dtype and both layouts, in fewer combinations than the single-layer tests (the grouped
# launch changes where a layer's tensors are read from, not how).
LAYOUTS = ALL_LAYOUTS[:3]


@pytest.mark.parametrize("dtype, strided", LAYOUTS, ids=str)
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=str)
def test_grouped_launches_equal_each_layer(shape, dtype, strided):
    """Every grouped launcher: L layers in one launch give each layer's results, layer by layer,
    as the float64 reference does for that layer alone."""
    L, B, T, d, p = shape
    As, Gs = _layers(L, B, T, d, p, dtype, strided, seed=40)
    coef = torch.rand(B, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    refs = [R.linear_per_sample(*upcast(A, G), bias=True, norm=True) for A, G in zip(As, Gs)]

    def stacked(name):
        return torch.cat([getattr(r, name) for r in refs])

    out = K.linear_per_sample_grouped(As, Gs, bias=True, norm=True)
    assert_rel_per_sample(out.weight, stacked("weight"), GRAD_RTOL[dtype], "grouped grad sample")
    assert_rel_per_sample(out.bias, stacked("bias"), GRAD_RTOL[dtype], "grouped bias grad sample")
    assert_rel_per_sample(out.weight_sq_norm[:, None], stacked("weight_sq_norm")[:, None], NORM_RTOL[dtype],
                          "grouped fused norm")
    for name in ("direct", "gram"):
        got = getattr(K, f"linear_weight_sq_norm_{name}_grouped")(As, Gs)
        assert_rel_per_sample(got[:, None], stacked("weight_sq_norm")[:, None], NORM_RTOL[dtype], f"grouped {name}")
    assert_rel_per_sample(K.linear_bias_grad_sample_grouped(Gs, out_dtype=torch.float32), stacked("bias"),
                          1e-5, "grouped bias sums")
    sums = K.linear_clipped_sum_grouped(As, Gs, coef, bias=True)
    assert len(sums) == L
    for (w, b), A, G in zip(sums, As, Gs):
        wr, br = R.linear_clipped_sum(*upcast(A, G), coef.double(), bias=True)
        assert_rel_per_sample(w[None], wr[None], GRAD_RTOL[dtype], "grouped clipped sum")
        assert_rel_per_sample(b[None], br[None], GRAD_RTOL[dtype], "grouped clipped bias sum")
    # A row of coefficients per layer (layers of one shape in different clipping groups).
    rows = torch.rand(L, B, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    for (w, b), A, G, c in zip(K.linear_clipped_sum_grouped(As, Gs, rows, bias=True), As, Gs, rows):
        wr, br = R.linear_clipped_sum(*upcast(A, G), c.double(), bias=True)
        assert_rel_per_sample(w[None], wr[None], GRAD_RTOL[dtype], "grouped clipped sum, a row per layer")
        assert_rel_per_sample(b[None], br[None], GRAD_RTOL[dtype], "grouped clipped bias sum, a row per layer")
    A1s, G1s = [A[:, :1] for A in As], [G[:, :1] for G in Gs]
    outer = torch.cat([R.linear_weight_sq_norm_outer(*upcast(A, G)) for A, G in zip(A1s, G1s)])
    assert_rel_per_sample(K.linear_weight_sq_norm_outer_grouped(A1s, G1s)[:, None], outer[:, None],
                          NORM_RTOL[dtype], "grouped outer norm")


def test_grouped_launches_refuse_mixed_layouts():
    """A group is one shape, dtype and set of strides: anything else is refused, not misread."""
    A = tensor((2, 5, 6), torch.float32, False, seed=42)
    G = tensor((2, 5, 4), torch.float32, False, seed=43)
    for other in (tensor((2, 5, 6), torch.float32, True, seed=44), A.to(torch.bfloat16), A[:, :4]):
        with pytest.raises(ValueError, match="one shape, dtype and strides"):
            K.linear_per_sample_grouped([A, other], [G, G])
    with pytest.raises(ValueError, match="one shape, dtype and strides"):
        K.linear_clipped_sum_grouped([A, A], [G, G.transpose(0, 1).contiguous().transpose(0, 1)], torch.ones(2))
    for coef in (torch.ones(3), torch.ones(3, 2), torch.ones(2, 3)):  # a row of B per layer, or one for all
        with pytest.raises(ValueError, match=r"give \[B\] or \[L, B\]"):
            K.linear_clipped_sum_grouped([A, A], [G, G], coef.to(DEVICE))


def _norm_layer_reference(x: torch.Tensor, g: torch.Tensor, eps: float, form: str):
    """(weight, bias) per-sample gradients over the last dimension, float64: "layernorm",
    "rmsnorm", "rounded" (Hugging Face's Llama RMSNorm: normalised in fp32, rounded to x's
    dtype before the weight), or "normalized" (x is what the weight multiplied)."""
    if x.dim() == 2:
        x, g = x[:, None], g[:, None]
    d = x.shape[-1]
    if form == "normalized":
        normed = x.double()
    elif form == "rounded":
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    elif form == "rmsnorm":
        normed = torch.nn.functional.rms_norm(x.double(), (d,), eps=eps)
    else:
        normed = torch.nn.functional.layer_norm(x.double(), (d,), eps=eps)
    return (normed * g.double()).sum(1), g.double().sum(1)


# (L, B, T, d): T = None for 2-D inputs [B, d]
NORM_LAYER_SHAPES = [(3, 2, 37, 45), (2, 1, 200, 16), (1, 3, None, 70), (2, 4, 1, 1), (2, 0, 5, 7), (2, 3, 0, 5)]


@pytest.mark.parametrize("form", ["layernorm", "rmsnorm", "rounded", "normalized"])
@pytest.mark.parametrize("dtype, strided", LAYOUTS, ids=str)
@pytest.mark.parametrize("shape", NORM_LAYER_SHAPES, ids=str)
def test_norm_layer_grad_sample(shape, dtype, strided, form):
    """LayerNorm and RMSNorm per-sample gradients of a group in one launch, against float64;
    "normalized": given the normalised inputs, the sums of their products with the backprops."""
    L, B, T, d = shape
    xs, gs = _layers(L, B, 1 if T is None else T, d, d, dtype, strided, seed=50)
    if T is None:
        xs, gs = [x[:, 0] for x in xs], [g[:, 0] for g in gs]
    xs = [x * 3 + 1 for x in xs] if not strided else xs  # a mean to subtract
    eps = 1e-5
    rms, rounded, normalized = form != "layernorm", form == "rounded", form == "normalized"
    gw, gb = K.norm_layer_grad_sample_grouped(xs, gs, eps, rms=rms, rounded=rounded, normalized=normalized,
                                              weight=True, bias=True)
    assert gw.dtype == gb.dtype == torch.float32 and gw.shape == (L * B, d)
    refs = [_norm_layer_reference(x, g, eps, form) for x, g in zip(xs, gs)]
    # fp32 arithmetic on the same inputs; rounded to a half dtype, a normalised value at a
    # rounding boundary may round either way: that dtype's rounding.
    rtol = 1e-5 if dtype == torch.float32 else GRAD_RTOL[dtype] if rounded else 1e-4
    assert_rel_per_sample(gw, torch.cat([w for w, _ in refs]), rtol, "weight")
    assert_rel_per_sample(gb, torch.cat([b for _, b in refs]), rtol, "bias")
    only_bias = K.norm_layer_grad_sample_grouped(xs, gs, eps, rms=rms, rounded=rounded, normalized=normalized,
                                                 weight=False, bias=True)
    assert only_bias[0] is None and torch.equal(only_bias[1], gb)


def test_norm_layer_grad_sample_splits_rows(monkeypatch):
    """Few samples, many rows: the rows are split over programs; the fp32 partials add up."""
    from dpgrad.kernels import norm_layer_grad_sample as module

    xs, gs = _layers(2, 1, 150, 24, 24, torch.float32, False, seed=60)
    refs = [_norm_layer_reference(x, g, 1e-6, "layernorm") for x, g in zip(xs, gs)]
    for target in (1, 8, 4096):
        monkeypatch.setattr(module, "_TARGET_PROGRAMS", target)
        gw, gb = K.norm_layer_grad_sample_grouped(xs, gs, 1e-6, rms=False, weight=True, bias=True)
        assert_rel_per_sample(gw, torch.cat([w for w, _ in refs]), 1e-5, f"{target} programs")
        assert_rel_per_sample(gb, torch.cat([b for _, b in refs]), 1e-5, f"{target} programs")
    with pytest.raises(ValueError, match=f"d <= {module.MAX_D}"):
        K.norm_layer_grad_sample_grouped([xs[0][..., None]], [gs[0][..., None]], 1e-6, rms=False)


def _group_norm_reference(x: torch.Tensor, g: torch.Tensor, groups: int, eps: float):
    """(weight, bias) per-sample GroupNorm gradients, (B, C) float64."""
    normed = torch.nn.functional.group_norm(x.double(), groups, eps=eps) if x.shape[0] else x.double()
    flat = (x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    return (normed * g.double()).reshape(flat).sum(2), g.double().reshape(flat).sum(2)


# (L, B, C, spatial, groups, layout): "nchw", "channels_last" or "strided" (every other channel)
GROUP_NORM_CASES = [(2, 3, 8, (5, 4), 4, "nchw"), (1, 2, 48, (3, 3), 16, "channels_last"), (2, 2, 6, (7,), 3, "nchw"),
                    (1, 2, 32, (2, 3, 2), 1, "strided"), (2, 3, 12, (), 3, "nchw"), (2, 0, 8, (4, 4), 2, "nchw"),
                    (1, 2, 512, (2,), 2, "nchw"), (1, 2, 256, (3,), 2, "nchw")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GROUP_NORM_CASES, ids=str)
def test_group_norm_grad_sample(case, dtype):
    """GroupNorm per-sample gradients of a group of layers in one launch, against float64 of the
    same inputs; weight only, bias only."""
    from dpgrad.kernels.group_norm_grad_sample import MAX_GROUP_CHANNELS

    L, B, C, spatial, groups, layout = case
    gen = torch.Generator().manual_seed(70)

    def make(scale, shift):
        width = 2 * C if layout == "strided" else C
        t = (torch.randn(B, width, *spatial, generator=gen) * scale + shift).to(dtype).to(DEVICE)
        if layout == "strided":
            return t[:, ::2]
        return t.to(memory_format=torch.channels_last) if layout == "channels_last" else t

    xs = [make(3.0, 2.0) for _ in range(L)]  # a mean to subtract
    gs = [make(1.0, 0.0) for _ in range(L)]
    fits = C // groups <= MAX_GROUP_CHANNELS
    assert K.group_norm_fits(xs[0], groups) == fits
    if not fits:
        with pytest.raises(ValueError, match=f"C / groups <= {MAX_GROUP_CHANNELS}"):
            K.group_norm_grad_sample_grouped(xs, gs, groups, 1e-5)
        return
    gw, gb = K.group_norm_grad_sample_grouped(xs, gs, groups, 1e-5, weight=True, bias=True)
    assert gw.dtype == gb.dtype == torch.float32 and gw.shape == gb.shape == (L * B, C)
    refs = [_group_norm_reference(x, g, groups, 1e-5) for x, g in zip(xs, gs)]
    assert_rel_per_sample(gw, torch.cat([w for w, _ in refs]), 1e-5, "weight")
    assert_rel_per_sample(gb, torch.cat([b for _, b in refs]), 1e-5, "bias")
    weight_only = K.group_norm_grad_sample_grouped(xs, gs, groups, 1e-5, weight=True, bias=False)
    bias_only = K.group_norm_grad_sample_grouped(xs, gs, groups, 1e-5, weight=False, bias=True)
    assert weight_only[1] is None and torch.equal(weight_only[0], gw)
    assert bias_only[0] is None and torch.equal(bias_only[1], gb)


# ------------------------------------------------------------------------ Triton versions
def _autotuners():
    """Every ``triton.autotune`` kernel of dpgrad.kernels."""
    from triton.runtime.autotuner import Autotuner

    from dpgrad.kernels import embedding_segment_sum, linear_clipped_sum, linear_grad_sample, linear_norm_gram
    from dpgrad.kernels import linear_token_sum

    modules = (embedding_segment_sum, linear_clipped_sum, linear_grad_sample, linear_norm_gram, linear_token_sum)
    return [k for m in modules for k in vars(m).values() if isinstance(k, Autotuner)]


def test_launches_survive_an_autotuner_that_zeroes_every_reset_argument(monkeypatch):
    """Triton 3.6 (torch 2.11's) zeroes each ``reset_to_zero`` argument before a launch it
    tunes with ``.zero_()``, None included; newer versions skip None. Every launcher, in every
    variant that leaves a buffer unused, must pass a real tensor there (the one place for such
    quirks: triton_common.placeholder). This runs that autotuner's behaviour at every launch."""
    tuners = _autotuners()
    assert {k.fn.__name__ for k in tuners} >= {"_linear_per_sample_kernel", "_linear_gram_norm_kernel",
                                               "_token_sum_kernel", "_segment_sum_kernel"}
    launched = []
    for k in tuners:
        if not k.reset_to_zero:
            continue
        original = k.run

        def run(*args, _k=k, _original=original, **kwargs):
            named = dict(zip(_k.arg_names, args), **kwargs)
            for name in _k.reset_to_zero:
                named[name].zero_()  # AttributeError on None, as in triton 3.6
            launched.append(_k.fn.__name__)
            return _original(*args, **kwargs)

        monkeypatch.setattr(k, "run", run)
    gen = torch.Generator().manual_seed(7)  # a CPU generator: the values are drawn there, then moved
    A, G = (torch.randn(2, 5, n, generator=gen).to(DEVICE) for n in (6, 4))
    A1, G1 = A[:, :1], G[:, :1]
    coef = torch.rand(2, generator=gen).to(DEVICE)
    ids = torch.tensor([[1, 2, 2, 0, 3], [3, 3, 1, 1, 0]], device=DEVICE)
    W = R.linear_grad_sample(A.double(), G.double())
    checks = [
        (K.linear_per_sample(A, G).weight, W),
        (K.linear_per_sample(A, G, bias=True).weight, W),
        (K.linear_per_sample(A, G, grad=False, norm=True).weight_sq_norm, W.square().sum((1, 2))),
        (K.linear_per_sample(A, G, bias=True, norm=True).bias_sq_norm, G.double().sum(1).square().sum(1)),
        (K.linear_weight_sq_norm_gram(A, G), W.square().sum((1, 2))),
        (K.linear_weight_sq_norm_outer(A1, G1), R.linear_grad_sample(A1.double(), G1.double()).square().sum((1, 2))),
        (K.linear_bias_grad_sample(G), G.double().sum(1)),
        (K.linear_bias_sq_norm(G), G.double().sum(1).square().sum(1)),
        (K.linear_clipped_sum(A, G, coef)[0], R.linear_clipped_sum(A.double(), G.double(), coef.double())[0]),
        (K.embedding_grad_sample(ids, G, 4, 0), R.embedding_grad_sample(ids, G.double(), 4, 0)),
        (K.embedding_sq_norm(ids, G, 4, 0), R.embedding_sq_norm(ids, G.double(), 4, 0)),
        (K.embedding_clipped_sum(ids, G, coef, 4, 0), R.embedding_clipped_sum(ids, G.double(), coef.double(), 4, 0)),
    ]
    for i, (got, want) in enumerate(checks):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), f"launch {i}"
    assert set(launched) >= {"_linear_per_sample_kernel", "_linear_gram_norm_kernel", "_token_sum_kernel",
                             "_segment_sum_kernel"}


@pytest.mark.skipif(not triton_common.INTERPRET, reason="Triton's interpreter only")
def test_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """Under Triton's interpreter a launch patches triton.language once, however many programs
    its grid has and helpers they call (the patch walks the language's members: it was over
    half of a launch), and undoes it after; the results are the float64 reference's."""
    import triton.language as tl
    from triton.runtime import interpreter

    walks = []
    original = interpreter._patch_builtin

    def counted(pkg, *args):
        walks.append(pkg)
        return original(pkg, *args)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    per_launch = {}
    # The first launch in a process also patches what Triton's own helpers import (and keeps it).
    K.linear_per_sample(tensor((1, 2, 3), torch.float32, False, 0), tensor((1, 2, 3), torch.float32, False, 0))
    for p in (8, 200):  # one program per sample, then several (p tiles) calling the same helpers
        A, G = tensor((3, 4, 5), torch.float32, False, 1), tensor((3, 4, p), torch.float32, False, 2)
        walks.clear()
        out = K.linear_per_sample(A, G, grad=True, norm=True)
        per_launch[p] = len(walks)
        want = R.linear_per_sample(A.double(), G.double(), grad=True, norm=True)
        torch.testing.assert_close(out.weight_sq_norm.double(), want.weight_sq_norm, rtol=1e-5, atol=0)
        assert tl.core.is_builtin(tl.load), "the launch left triton.language patched"
    assert per_launch[8] == per_launch[200] > 0, per_launch


# ----------------------------------------------------------------- offsets past 2^31 elements
# The skeleton's kernels (gemm_tiles.py) take a 64-bit base per layer, sample and tile and 32-bit
# offsets inside a tile; their launchers check from the sizes that no tile's offsets overflow.
# Meta tensors give the strides of tensors far past 2^31 elements without memory.
SKELETON_LAUNCHERS = {
    "direct": lambda A, G: K.linear_weight_sq_norm_direct(A, G),
    "gram": lambda A, G: K.linear_weight_sq_norm_gram(A, G),
    "clipped sum": lambda A, G: K.linear_clipped_sum(A, G, torch.ones(A.shape[0], device=A.device), bias=True),
}


def _meta(shape, stride):
    return torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("name", SKELETON_LAUNCHERS)
def test_a_tile_past_32_bit_offsets_is_refused_before_its_launch(name, monkeypatch):
    """A token stride of 2^28 elements (a view of every 2^28-th row of a larger tensor): the
    16 to 128 tokens of one tile span 4e9 elements or more, which 32-bit offsets cannot reach.
    Refused with advice, and nothing launched."""
    from dpgrad.kernels import gemm_tiles, linear_clipped_sum, linear_norm_direct, linear_norm_gram

    for module in (linear_clipped_sum, linear_norm_direct, linear_norm_gram):
        monkeypatch.setattr(module, "launch", lambda *a, **k: pytest.fail("launched"))
    B, T, d, p = 2, 128, 64, 32
    far = _meta((B, T, d), (T * 2**28, 2**28, 1))
    near = _meta((B, T, p), (T * p, p, 1))
    for A, G in ((far, near), (_meta((B, T, d), (T * d, d, 1)), _meta((B, T, p), (T * 2**28, 2**28, 1)))):
        with pytest.raises(ValueError, match="past 32-bit offsets: make it contiguous"):
            SKELETON_LAUNCHERS[name](A, G)
    assert gemm_tiles.I32_MAX == 2**31 - 1


@pytest.mark.parametrize("name", SKELETON_LAUNCHERS)
def test_samples_past_2_31_elements_reach_the_kernel_as_64_bit_strides(name, monkeypatch):
    """Samples of 2^16 tokens of 2^16 features (2^32 elements each): sample strides past 2^31
    are no obstacle (the kernels compute each sample's base in 64 bits); they reach the launch
    whole."""
    from dpgrad.kernels import linear_clipped_sum, linear_norm_direct, linear_norm_gram

    seen = []

    def launch(kernel, grid, *args, **kwargs):
        seen.append(args)

    for module in (linear_clipped_sum, linear_norm_direct, linear_norm_gram):
        monkeypatch.setattr(module, "launch", launch)
    B, T, d, p = 3, 2**16, 2**16, 32
    A = _meta((B, T, d), (T * d, d, 1))
    G = _meta((B, T, p), (T * p, p, 1))
    try:
        SKELETON_LAUNCHERS[name](A, G)
    except (NotImplementedError, RuntimeError):  # what follows the launch cannot run on meta tensors
        pass
    assert len(seen) == 1
    ints = [a for a in seen[0] if isinstance(a, int)]
    assert T * d in ints and T * p in ints and T * d > 2**31
