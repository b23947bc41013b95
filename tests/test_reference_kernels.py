"""kernels/reference.py against naive float64 loops.

Every launcher in ``dpgrad.kernels.reference`` is compared with a per-sample Python loop in
float64 on the same (upcast) inputs, so the only error measured is the launcher's own.
Tolerances follow DESIGN.md: norms fp32 rel 1e-5, bf16 rel 1e-2 (never loosened).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from dpgrad.kernels import reference as R
from dpgrad.kernels import reference_common, reference_embedding, reference_linear
from dpgrad.samplers import embedding as embedding_samplers
from dpgrad.samplers import linear as linear_samplers

# Relative tolerance of per-sample norms, by input dtype (DESIGN.md; fp16 accumulates in fp32
# like bf16 but rounds its inputs 8x finer).
NORM_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# Per-sample gradients come back in the input dtype, so their rounding is the dtype's.
GRAD_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ---------------------------------------------------------------------------- naive references
def naive_linear_grad_sample(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """(B, T, d), (B, T, p) -> (B, p, d) float64: sum over t of the outer products g_bt a_bt^T."""
    B, T, d = A.shape
    p = G.shape[-1]
    out = torch.zeros(B, p, d, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            out[b] += torch.outer(G[b, t].double(), A[b, t].double())
    return out


def naive_bias_grad_sample(G: torch.Tensor) -> torch.Tensor:
    B, T, p = G.shape
    out = torch.zeros(B, p, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            out[b] += G[b, t].double()
    return out


def naive_embedding_grad_sample(ids, G, V, padding_idx) -> torch.Tensor:
    """(B, T) ids, (B, T, d) -> (B, V, d) float64, one position at a time, padding skipped."""
    B = ids.shape[0]
    ids = ids.reshape(B, math.prod(ids.shape[1:]))
    d = G.shape[-1]
    G = G.reshape(B, ids.shape[1], d)
    out = torch.zeros(B, V, d, dtype=torch.float64)
    for b in range(B):
        for t in range(ids.shape[1]):
            v = int(ids[b, t])
            if padding_idx is not None and v == padding_idx:
                continue
            out[b, v] += G[b, t].double()
    return out


def sq_norms(per_sample: torch.Tensor) -> torch.Tensor:
    return per_sample.flatten(1).square().sum(dim=1) if per_sample.shape[0] else per_sample.new_zeros(0)


def assert_norms_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Per-sample relative error of squared norms (rel err of a norm is half of it)."""
    assert actual.shape == expected.shape
    err = (actual.double() - expected).abs()
    bound = rtol * expected.abs()
    bad = err > bound
    assert not bad.any(), f"rel err {(err / expected.abs().clamp_min(1e-300)).max():.3g} > {rtol}"


def assert_tensor_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Element-wise, with an absolute floor scaled to the tensor's magnitude."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * scale)


def make_AG(B, T, d, p, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, T, d, generator=g).to(dtype)
    G = torch.randn(B, T, p, generator=g).to(dtype)
    return A, G


# (B, T, d, p): empty batches, T = 1, long T against few features and the reverse.
LINEAR_SHAPES = [
    (0, 3, 4, 5),
    (1, 1, 3, 2),
    (5, 1, 7, 5),
    (1, 2, 1, 1),
    (3, 2, 64, 48),
    (3, 50, 2, 3),
    (2, 17, 33, 9),
    (4, 8, 96, 80),
    (2, 40, 24, 20),
    (3, 7, 1, 64),
]


# ---------------------------------------------------------------------------- linear
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,d,p", LINEAR_SHAPES)
def test_linear_grad_sample(B, T, d, p, dtype):
    A, G = make_AG(B, T, d, p, dtype)
    out = R.linear_grad_sample(A, G)
    assert out.shape == (B, p, d) and out.dtype == dtype
    assert_tensor_close(out, naive_linear_grad_sample(A, G), GRAD_RTOL[dtype])

    bias = R.linear_bias_grad_sample(G)
    assert bias.shape == (B, p) and bias.dtype == dtype
    assert_tensor_close(bias, naive_bias_grad_sample(G), GRAD_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,d,p", LINEAR_SHAPES)
def test_linear_weight_sq_norm_all_algorithms(B, T, d, p, dtype):
    A, G = make_AG(B, T, d, p, dtype, seed=1)
    expected = sq_norms(naive_linear_grad_sample(A, G))
    acc = torch.float64 if dtype == torch.float64 else torch.float32

    algorithms = ["gram", "direct"] + (["outer"] if T == 1 else [])
    for algorithm in algorithms:
        out = R.linear_weight_sq_norm(A, G, algorithm=algorithm)
        assert out.shape == (B,) and out.dtype == acc, algorithm
        assert_norms_close(out, expected, NORM_RTOL[dtype])
    # The named functions, not only the dispatcher.
    assert_norms_close(R.linear_weight_sq_norm_gram(A, G), expected, NORM_RTOL[dtype])
    assert_norms_close(R.linear_weight_sq_norm_direct(A, G), expected, NORM_RTOL[dtype])
    if T == 1:
        assert_norms_close(R.linear_weight_sq_norm_outer(A, G), expected, NORM_RTOL[dtype])


@pytest.mark.parametrize("T,halves", [(6, False), (6, True), (7, True)], ids=["whole", "halves", "odd-T-whole"])
@pytest.mark.parametrize("pair", ["fp32", "bf16", "fp16", "fp64", "fp32/bf16", "bf16/fp32"])
@pytest.mark.parametrize("d,p", [(13, 7), (10, 3), (0, 4), (4, 0)], ids=["tails", "whole-chunks", "no-inputs", "no-outputs"])
def test_gram_norm_in_feature_chunks(monkeypatch, pair, d, p, T, halves):
    """The eager Gram norm multiplies GRAM_CHUNK features at a time (on a GPU's tensor cores)
    and adds the chunks' Gram matrices: chunks of 5 features here, with a ragged last chunk,
    whole chunks only, a side shorter than a chunk and an empty side; autocast's pairs (fp32
    inputs beside bf16 backprops, and the reverse) use the values their matmul took. By
    halves of the sequence (from GRAM_HALVES_TOKENS tokens, 2 here) the same norms; an odd
    length is taken whole."""
    monkeypatch.setattr(reference_linear, "GRAM_CHUNK", 5)
    monkeypatch.setattr(reference_linear, "GRAM_HALVES_TOKENS", 2 if halves else 10**9)
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
    a_dtype, g_dtype = (names[n] for n in (pair.split("/") * 2)[:2])
    A, G = make_AG(3, T, d, p, torch.float64, seed=4)
    A, G = A.to(a_dtype), G.to(g_dtype)
    rounded_a, rounded_g = R.autocast_operands(A, G)
    expected = sq_norms(naive_linear_grad_sample(rounded_a, rounded_g))
    half = torch.bfloat16 if torch.bfloat16 in (a_dtype, g_dtype) else torch.float16
    rtol = NORM_RTOL[torch.float64 if a_dtype == torch.float64 else torch.float32 if a_dtype == g_dtype == torch.float32 else half]
    got = R.linear_weight_sq_norm_gram(A, G)
    assert got.dtype == (torch.float64 if a_dtype == torch.float64 else torch.float32)
    assert_norms_close(got, expected, rtol)
    if d and p:
        assert (got > 0).all()


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_gram_norm_by_halves_takes_three_quarters_of_the_products(monkeypatch, layout):
    """From GRAM_HALVES_TOKENS tokens (an even count) the eager Gram norm multiplies the two
    diagonal blocks and the lower-left block of each Gram matrix, not the upper-right one:
    three quarters of the multiply-adds of the whole matrices, and the same norms (float64,
    inputs whose rows are not contiguous too)."""
    macs = []
    bmm = R.bmm_acc

    def counting(a, b):
        macs.append(a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        return bmm(a, b)

    monkeypatch.setattr(reference_linear, "bmm_acc", counting)
    B, T, d, p = 3, 16, 9, 5
    A, G = make_AG(B, T, d, p, torch.float64, seed=7)
    if layout == "transposed":
        A = A.transpose(0, 1).contiguous().transpose(0, 1)
        G = G.transpose(0, 1).contiguous().transpose(0, 1)
    expected = sq_norms(naive_linear_grad_sample(A, G))
    monkeypatch.setattr(reference_linear, "GRAM_HALVES_TOKENS", 10**9)
    whole = R.linear_weight_sq_norm_gram(A, G)
    whole_macs, macs[:] = sum(macs), []
    monkeypatch.setattr(reference_linear, "GRAM_HALVES_TOKENS", T)
    halves = R.linear_weight_sq_norm_gram(A, G)
    assert whole_macs == B * T * T * (d + p)
    assert 4 * sum(macs) == 3 * whole_macs
    assert_norms_close(whole, expected, NORM_RTOL[torch.float64])
    assert_norms_close(halves, expected, NORM_RTOL[torch.float64])


def _baddbmm_on_cpu(c, a, b, *, out_dtype=None, **kwargs):
    """torch.baddbmm's out_dtype overload as CUDA has it (CPU has none): c + a @ b in out_dtype."""
    assert out_dtype == torch.float32 and c.dtype == torch.float32 and not kwargs
    return c + torch.bmm(a.to(out_dtype), b.to(out_dtype))


@pytest.mark.parametrize("impl", ["adds", "drops-c", "no-overload"])
def test_gemm_that_adds_is_checked_once_on_exact_values(monkeypatch, impl):
    """baddbmm_acc lets the GEMM add the product only where a check on exact small integers
    finds ``c + a @ b``: a GEMM that dropped ``c``, or a torch without the overload, is never
    used (the product is added on its own instead)."""
    fakes = {
        "adds": _baddbmm_on_cpu,
        "drops-c": lambda c, a, b, *, out_dtype=None: torch.bmm(a.to(out_dtype), b.to(out_dtype)),
        "no-overload": torch.baddbmm,  # CPU: raises for out_dtype
    }
    monkeypatch.setattr(torch, "baddbmm", fakes[impl])
    assert reference_common._gemm_adds_exactly(torch.device("cpu"), torch.bfloat16) is (impl == "adds")
    assert reference_common._gemm_adds_exactly(torch.device("cpu"), torch.float16) is (impl == "adds")


def test_gram_chunks_added_by_the_gemm(monkeypatch):
    """Where the GEMM adds (half CUDA operands, simulated here), each chunk after the first
    goes into the running Gram matrix through baddbmm, and the norms are the chunked ones."""
    calls = []

    def baddbmm(c, a, b, *, out_dtype=None):
        calls.append((c.dtype, a.dtype, tuple(a.shape)))
        return _baddbmm_on_cpu(c, a, b, out_dtype=out_dtype)

    monkeypatch.setattr(reference_linear, "GRAM_CHUNK", 5)
    monkeypatch.setattr(reference_common, "_adds_in_gemm", lambda c, a, b: a.dtype in R.HALF)
    monkeypatch.setattr(torch, "baddbmm", baddbmm)
    A, G = make_AG(3, 6, 13, 7, torch.float64, seed=4)
    A, G = A.to(torch.bfloat16), G.to(torch.bfloat16)
    expected = sq_norms(naive_linear_grad_sample(A, G))
    got = R.linear_weight_sq_norm_gram(A, G)
    # d = 13: chunks of 5, 5, 3; p = 7: 5, 2. The first of each side is a plain product.
    assert calls == [(torch.float32, torch.bfloat16, (3, 6, 5)), (torch.float32, torch.bfloat16, (3, 6, 3)),
                     (torch.float32, torch.bfloat16, (3, 6, 2))]
    assert got.dtype == torch.float32
    assert_norms_close(got, expected, NORM_RTOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,d,p", LINEAR_SHAPES)
def test_linear_bias_sq_norm(B, T, d, p, dtype):
    _, G = make_AG(B, T, d, p, dtype, seed=2)
    out = R.linear_bias_sq_norm(G)
    assert out.shape == (B,)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_norms_close(out, sq_norms(naive_bias_grad_sample(G)), NORM_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,d,p", LINEAR_SHAPES)
def test_linear_per_sample_and_clipped_sum(B, T, d, p, dtype):
    """The fused form returns what the separate functions do; the clipped sum is the
    coefficient-weighted sum of the naive per-sample gradients."""
    A, G = make_AG(B, T, d, p, dtype, seed=5)
    naive_w, naive_b = naive_linear_grad_sample(A, G), naive_bias_grad_sample(G)
    res = R.linear_per_sample(A, G, bias=True, norm=True, out_dtype=torch.float32)
    out_rtol = 1e-5  # fp32 outputs, rounded once from the fp32 (fp64) sums
    assert res.weight.dtype == torch.float32 and res.bias.dtype == torch.float32
    assert_tensor_close(res.weight, naive_w, out_rtol)
    assert_tensor_close(res.bias, naive_b, out_rtol)
    assert_norms_close(res.weight_sq_norm, sq_norms(naive_w), NORM_RTOL[dtype])
    assert_norms_close(res.bias_sq_norm, sq_norms(naive_b), NORM_RTOL[dtype])
    only_norm = R.linear_per_sample(A, G, grad=False, norm=True)
    assert only_norm.weight is None and only_norm.bias is None and only_norm.bias_sq_norm is None

    coef = torch.rand(B, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    w, b = R.linear_clipped_sum(A, G, coef, bias=True)
    assert w.dtype == dtype and b.dtype == dtype
    assert_tensor_close(w, torch.einsum("b,bpd->pd", coef, naive_w), GRAD_RTOL[dtype])
    assert_tensor_close(b, torch.einsum("b,bp->p", coef, naive_b), GRAD_RTOL[dtype])


def test_linear_norm_of_zero_gradient_is_exactly_zero():
    """A sample whose backprops are all zero (e.g. fully masked) must get norm 0, not noise."""
    A, G = make_AG(3, 6, 5, 4, torch.float32)
    G[1] = 0
    for algorithm in ("gram", "direct"):
        out = R.linear_weight_sq_norm(A, G, algorithm=algorithm)
        assert out[1].item() == 0.0
        assert (out[[0, 2]] > 0).all()


def test_linear_norm_algorithm_errors():
    A, G = make_AG(2, 3, 4, 5, torch.float32)
    with pytest.raises(ValueError, match="T == 1"):
        R.linear_weight_sq_norm(A, G, algorithm="outer")
    with pytest.raises(ValueError, match="use one of direct, gram, outer"):
        R.linear_weight_sq_norm(A, G, algorithm="ghost")
    with pytest.raises(TypeError):
        R.linear_weight_sq_norm(A, G)  # the algorithm is the autotuner's choice, always named


def test_accumulation_dtype():
    f32, bf16, f64 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)
    assert R.accumulation_dtype(bf16) == torch.float32
    assert R.accumulation_dtype(bf16, f32) == torch.float32
    assert R.accumulation_dtype(f32, f64) == torch.float64


# ---------------------------------------------------------------------------- batch slicing
def set_chunk_elements(monkeypatch, chunk: int) -> None:
    """CHUNK_ELEMENTS set to ``chunk`` where it is read: the batch slices' and the Linear norms'."""
    monkeypatch.setattr(reference_common, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(reference_linear, "CHUNK_ELEMENTS", chunk)


@pytest.mark.parametrize("batch,per_sample,chunk", [(0, 5, 10), (7, 3, 10), (7, 100, 10), (9, 1, 4), (5, 0, 8)])
def test_batch_slices_cover_the_batch(monkeypatch, batch, per_sample, chunk):
    set_chunk_elements(monkeypatch, chunk)
    slices = list(R.batch_slices(batch, per_sample))
    covered = [i for s in slices for i in range(s.start, s.stop)]
    assert covered == list(range(batch))
    step = max(1, chunk // max(1, per_sample))
    assert all(0 < s.stop - s.start <= step for s in slices)


@pytest.mark.parametrize("chunk", [1, 7, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_slicing_gives_the_same_norms(monkeypatch, chunk, dtype):
    """A tiny CHUNK_ELEMENTS forces one-sample (or few-sample) slices; results must not change."""
    cases = [make_AG(9, 5, 6, 7, dtype, seed=3), make_AG(6, 3, 40, 30, dtype, seed=4)]
    full = [(R.linear_weight_sq_norm_direct(A, G), R.linear_weight_sq_norm_gram(A, G)) for A, G in cases]
    set_chunk_elements(monkeypatch, chunk)
    for (A, G), (direct, gram) in zip(cases, full):
        expected = sq_norms(naive_linear_grad_sample(A, G))
        sliced_direct = R.linear_weight_sq_norm_direct(A, G)
        sliced_gram = R.linear_weight_sq_norm_gram(A, G)
        torch.testing.assert_close(sliced_direct, direct, rtol=1e-6, atol=0)
        torch.testing.assert_close(sliced_gram, gram, rtol=1e-6, atol=0)
        assert_norms_close(sliced_direct, expected, NORM_RTOL[dtype])
        assert_norms_close(sliced_gram, expected, NORM_RTOL[dtype])


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("algorithm", ["direct", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_linear_weight_norms_of_several_layers(monkeypatch, algorithm, dtype, chunk):
    """The norms of several layers of one shape in one call (the finish step's product per
    layer), whole or by batch slices: each layer's per-sample norms, in order, in the
    accumulation dtype; a zero gradient's norm exactly zero."""
    if chunk is not None:
        set_chunk_elements(monkeypatch, chunk)
    pairs = [make_AG(5, 4, 9, 6, dtype, seed=seed) for seed in (1, 2, 3)]
    pairs[1][1][2].zero_()  # layer 1, sample 2: no gradient
    out = R.linear_weight_norms(pairs, algorithm)
    assert out.dtype == R.accumulation_dtype(*pairs[0]) and out.shape == (15,)
    expected = torch.cat([sq_norms(naive_linear_grad_sample(A, G)) for A, G in pairs]).sqrt()
    assert_norms_close(out.square(), expected.square(), NORM_RTOL[dtype])
    assert out[5 + 2] == 0
    torch.testing.assert_close(R.linear_weight_norm(*pairs[2], algorithm), out[10:], rtol=0, atol=0)


# ---------------------------------------------------------------------------- linear samplers
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 6), (4, 3, 6), (3, 2, 5, 6), (2, 1, 1, 6), (0, 3, 6), (1, 6)])
@pytest.mark.parametrize("p", [1, 5, 48])
def test_linear_samplers_any_rank(shape, p, bias):
    """Inputs (B, *, d) of any rank flatten their middle dims into T."""
    torch.manual_seed(0)
    layer = nn.Linear(shape[-1], p, bias=bias)
    x = torch.randn(*shape)
    gy = torch.randn(*shape[:-1], p)
    B = shape[0]
    T = math.prod(shape[1:-1])
    A, G = x.reshape(B, T, shape[-1]), gy.reshape(B, T, p)
    ref_w = naive_linear_grad_sample(A, G)

    grads = linear_samplers.linear_grad_sample(layer, [x], gy)
    assert_tensor_close(grads[layer.weight], ref_w, 1e-5)
    norms = linear_samplers.linear_norm_sample(layer, [x], gy)
    assert_norms_close(norms[layer.weight].double() ** 2, sq_norms(ref_w), 1e-5)
    if bias:
        ref_b = naive_bias_grad_sample(G)
        assert_tensor_close(grads[layer.bias], ref_b, 1e-5)
        assert_norms_close(norms[layer.bias].double() ** 2, sq_norms(ref_b), 1e-5)
    else:
        assert set(grads) == set(norms) == {layer.weight}


def test_linear_samplers_skip_frozen_parameters():
    layer = nn.Linear(4, 3)
    x, gy = torch.randn(2, 5, 4), torch.randn(2, 5, 3)
    layer.weight.requires_grad_(False)
    assert set(linear_samplers.linear_grad_sample(layer, [x], gy)) == {layer.bias}
    assert set(linear_samplers.linear_norm_sample(layer, [x], gy)) == {layer.bias}
    layer.weight.requires_grad_(True)
    layer.bias.requires_grad_(False)
    assert set(linear_samplers.linear_grad_sample(layer, [x], gy)) == {layer.weight}
    assert set(linear_samplers.linear_norm_sample(layer, [x], gy)) == {layer.weight}


# ---------------------------------------------------------------------------- embedding
def random_ids(B, T, V, seed, padding_idx=None, pad_fraction=0.3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    if padding_idx is not None and B * T:
        pad = torch.rand(B, T, generator=g) < pad_fraction
        ids[pad] = padding_idx
    return ids


# (B, T, V, d, padding_idx)
EMBEDDING_SHAPES = [
    (0, 4, 10, 3, 0),
    (1, 1, 5, 2, None),
    (1, 1, 5, 2, 0),
    (4, 1, 7, 3, 6),
    (3, 12, 4, 5, 1),  # small vocabulary: many repeats within a sample
    (5, 9, 50, 8, None),
    (6, 30, 200, 16, 0),
    (2, 64, 3, 1, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("B,T,V,d,padding_idx", EMBEDDING_SHAPES)
def test_embedding(B, T, V, d, padding_idx, dtype):
    ids = random_ids(B, T, V, seed=B * 100 + T, padding_idx=padding_idx)
    G = torch.randn(B, T, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = naive_embedding_grad_sample(ids, G, V, padding_idx)

    gs = R.embedding_grad_sample(ids, G, V, padding_idx)
    assert gs.shape == (B, V, d) and gs.dtype == dtype
    assert_tensor_close(gs, ref, GRAD_RTOL[dtype])
    if padding_idx is not None:
        assert (gs[:, padding_idx] == 0).all()

    sq = R.embedding_sq_norm(ids, G, V, padding_idx)
    assert sq.shape == (B,)
    assert sq.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_norms_close(sq, sq_norms(ref), NORM_RTOL[dtype])

    coef = torch.rand(B, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    clipped = R.embedding_clipped_sum(ids, G, coef, V, padding_idx)
    assert clipped.shape == (V, d) and clipped.dtype == dtype
    assert_tensor_close(clipped, torch.einsum("b,bvd->vd", coef, ref), GRAD_RTOL[dtype])
    assert R.embedding_clipped_sum(ids, G, coef, V, padding_idx, out_dtype=torch.float32).dtype == torch.float32


def test_embedding_repeated_tokens_are_summed_before_squaring():
    ids = torch.tensor([[1, 1, 2, 1], [3, 3, 3, 3], [0, 2, 0, 2]])
    G = torch.randn(3, 4, 2, dtype=torch.float64)
    sq = R.embedding_sq_norm(ids, G, 4, None)
    expected = torch.stack(
        [
            (G[0, [0, 1, 3]].sum(0)).square().sum() + G[0, 2].square().sum(),
            G[1].sum(0).square().sum(),
            G[2, [0, 2]].sum(0).square().sum() + G[2, [1, 3]].sum(0).square().sum(),
        ]
    )
    torch.testing.assert_close(sq, expected, rtol=1e-12, atol=0)
    # The sum of squares of the rows is a different (wrong) number.
    assert not torch.allclose(sq, G.square().sum(dim=(1, 2)))


@pytest.mark.parametrize("padding_idx", [0, 3, None])
def test_embedding_padding(padding_idx):
    """padding_idx positions contribute nothing; with padding_idx=None token 0 is a token."""
    ids = torch.tensor([[0, 0, 1, 3], [3, 3, 3, 3], [0, 0, 0, 0], [2, 0, 2, 3]])
    G = torch.randn(4, 4, 5)
    ref = naive_embedding_grad_sample(ids, G, 4, padding_idx)
    sq = R.embedding_sq_norm(ids, G, 4, padding_idx)
    gs = R.embedding_grad_sample(ids, G, 4, padding_idx)
    assert_norms_close(sq, sq_norms(ref), 1e-5)
    assert_tensor_close(gs, ref, 1e-5)
    if padding_idx == 0:
        assert sq[2].item() == 0.0 and (gs[2] == 0).all()
    if padding_idx == 3:
        assert sq[1].item() == 0.0 and (gs[1] == 0).all()
    if padding_idx is None:
        assert (sq > 0).all()


def test_embedding_all_padding_batch_is_exactly_zero():
    ids = torch.full((3, 5), 2)
    G = torch.randn(3, 5, 4)
    assert torch.equal(R.embedding_sq_norm(ids, G, 6, 2), torch.zeros(3))
    assert torch.equal(R.embedding_grad_sample(ids, G, 6, 2), torch.zeros(3, 6, 4))


@pytest.mark.parametrize("ids_shape", [(5,), (3, 2, 4), (0,), (0, 2, 3)])
def test_embedding_ids_of_any_rank(ids_shape):
    """ids (B,) (one token per sample) and (B, *, *) flatten to (B, T)."""
    V, d = 7, 3
    ids = torch.randint(0, V, ids_shape, generator=torch.Generator().manual_seed(0))
    G = torch.randn(*ids_shape, d)
    ref = naive_embedding_grad_sample(ids, G, V, 1)
    assert_tensor_close(R.embedding_grad_sample(ids, G, V, 1), ref, 1e-5)
    assert_norms_close(R.embedding_sq_norm(ids, G, V, 1), sq_norms(ref), 1e-5)


def test_embedding_large_grad_sample_warns(monkeypatch):
    monkeypatch.setattr(reference_embedding, "EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS", 10)
    with pytest.warns(ResourceWarning, match="ghost clipping"):
        R.embedding_grad_sample(torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3, 4), 5, None)


@pytest.mark.parametrize("padding_idx", [None, 0, -1])
def test_embedding_samplers(padding_idx):
    """The registered samplers, with nn.Embedding's own padding_idx (negative is normalised)."""
    layer = nn.Embedding(9, 4, padding_idx=padding_idx)
    ids = torch.randint(0, 9, (5, 6), generator=torch.Generator().manual_seed(1))
    ids[0] = 8
    ids[1, :3] = 0
    gy = torch.randn(5, 6, 4)
    ref = naive_embedding_grad_sample(ids, gy, 9, layer.padding_idx)
    gs = embedding_samplers.embedding_grad_sample(layer, [ids], gy)[layer.weight]
    assert_tensor_close(gs, ref, 1e-5)
    norm = embedding_samplers.embedding_norm_sample(layer, [ids], gy)[layer.weight]
    assert_norms_close(norm.double() ** 2, sq_norms(ref), 1e-5)
    if padding_idx == -1:
        assert norm[0].item() == 0.0
    layer.weight.requires_grad_(False)
    assert embedding_samplers.embedding_grad_sample(layer, [ids], gy) == {}
    assert embedding_samplers.embedding_norm_sample(layer, [ids], gy) == {}


# ---------------------------------------------------------------------------- uses of one parameter
def naive_outer_sum(L: torch.Tensor, R: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n, m) float64: sum_t L[t] ⊗ R[t], integer L being ids of one-hot rows (< 0: none)."""
    B, T = R.shape[:2]
    out = torch.zeros(B, n, R.shape[-1], dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if L.is_floating_point():
                out[b] += torch.outer(L[b, t].double(), R[b, t].double())
            elif L[b, t] >= 0:
                out[b, L[b, t]] += R[b, t].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kinds", ["dense-dense", "ids-dense", "dense-ids", "ids-ids"])
@pytest.mark.parametrize("B,T1,T2,n,m", [(3, 4, 5, 6, 7), (2, 1, 3, 5, 1), (0, 2, 2, 3, 3), (4, 6, 6, 2, 8)])
def test_outer_sum_inner(B, T1, T2, n, m, kinds, dtype):
    """<W1_b, W2_b> of two per-sample gradients given as outer-product sums, by gathers and
    token-pair Grams, against the matrices themselves."""
    g = torch.Generator().manual_seed(B * 100 + T1 * 10 + T2)

    def left(T, kind):
        if kind == "ids":
            return torch.randint(-1, n, (B, T), generator=g)  # -1: a padding position
        return torch.randn(B, T, n, generator=g).to(dtype)

    k1, k2 = kinds.split("-")
    L1, L2 = left(T1, k1), left(T2, k2)
    R1, R2 = torch.randn(B, T1, m, generator=g).to(dtype), torch.randn(B, T2, m, generator=g).to(dtype)
    expected = (naive_outer_sum(L1, R1, n) * naive_outer_sum(L2, R2, n)).sum(dim=(1, 2))
    got = R.outer_sum_inner(L1, R1, L2, R2)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # A sum of products of either sign: the error is relative to the sum of magnitudes.
    scale = (naive_outer_sum(L1, R1, n).abs() * naive_outer_sum(L2, R2, n).abs()).sum(dim=(1, 2))
    assert ((got.double() - expected).abs() <= NORM_RTOL[torch.float32 if dtype == torch.bfloat16 else dtype]
            * scale + 1e-12).all()


def test_outer_sum_inner_of_a_use_with_itself_is_its_squared_norm():
    A, G = make_AG(3, 5, 4, 6, torch.float64)
    assert_norms_close(R.outer_sum_inner(G, A, G, A), sq_norms(naive_linear_grad_sample(A, G)), 1e-12)
    ids = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(2))
    ids[0, :2] = -1
    ref = naive_outer_sum(ids, G, 7)
    assert_norms_close(R.outer_sum_inner(ids, G, ids, G), sq_norms(ref), 1e-12)


def test_factor_samplers_rebuild_the_per_sample_gradients():
    """Linear (weight and bias) and Embedding (padding dropped) factors sum to the grad samples."""
    linear = nn.Linear(4, 6)
    A, G = make_AG(3, 5, 4, 6, torch.float64)
    factors = linear_samplers.linear_factors(linear.double(), [A], G)
    grads = linear_samplers.linear_grad_sample(linear, [A], G)
    for p in (linear.weight, linear.bias):
        L, Rt = factors[p]
        assert_tensor_close(naive_outer_sum(L, Rt, L.shape[-1]).view(grads[p].shape), grads[p], 1e-12)
    emb = nn.Embedding(7, 6, padding_idx=2).double()
    ids = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(3))
    ids[1, 1] = 2
    (L, Rt), = embedding_samplers.embedding_factors(emb, [ids], G).values()
    assert (L[ids == 2] == -1).all()
    expected = embedding_samplers.embedding_grad_sample(emb, [ids], G)[emb.weight]
    assert_tensor_close(naive_outer_sum(L, Rt, 7), expected, 1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_coefficients_in_half_precision_never_exceed_their_value(dtype):
    """A coefficient rounded up would let a clipped gradient exceed the clipping bound."""
    g = torch.Generator().manual_seed(0)
    coef = torch.cat([torch.rand(100_000, generator=g), torch.tensor([1.0, 0.0, 0.999999, 1e-3, 1e-9])])
    low = R.coefficients_in(coef, dtype)
    assert low.dtype == dtype
    assert (low.float() <= coef).all()
    # Within two units in the last place of the nearest value, where it is a normal number.
    normal = coef >= torch.finfo(dtype).tiny
    assert ((coef - low.float())[normal] <= 2 * torch.finfo(dtype).eps * coef[normal]).all()
    assert R.coefficients_in(coef, torch.float32) is coef
    assert R.coefficients_in(coef, torch.float64).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clipped_sum_gemm_in_half_precision_is_the_float64_sum(dtype):
    g = torch.Generator().manual_seed(1)
    B, T, d, p = 4, 6, 24, 16
    A = torch.randn(B, T, d, generator=g).to(dtype)
    G = torch.randn(B, T, p, generator=g).to(dtype)
    coef = torch.rand(B, generator=g)
    expected = torch.einsum("b,btp,btd->pd", coef.double(), G.double(), A.double())
    for a, gg in ((A, G), (A[..., :12], G)):  # scaling G (d >= p), then A (d < p)
        w, _ = R.linear_clipped_sum_gemm(a, gg, coef)
        ref = expected if a.shape[-1] == d else torch.einsum("b,btp,btd->pd", coef.double(), G.double(),
                                                              a.double())
        assert w.dtype == dtype
        assert (w.double() - ref).norm() <= 1e-2 * ref.norm()
