"""The Triton launchers on a CUDA device, at GPT-2 and Llama-7B layer shapes, against float64.

Inputs are drawn in the dtype under test (bf16 unless a test says otherwise) and the oracle is
the same tensors upcast to float64 on the GPU, so what is measured is the kernels' own error
(fp32 accumulation, output rounding), not the rounding of their inputs. Tolerances are
DESIGN.md's and are not to be loosened: squared norms per sample bf16 rel 1e-2, fp32 rel 1e-5;
per-sample gradients and clipped sums, relative Frobenius error 1e-2 (bf16) and 1e-5 (fp32).
References are built one sample and token slice at a time (at most ~0.5 GB of float64).

Runtime: Triton autotunes a kernel once per key (layer dims and dtypes, never T), and that
costs seconds, so every T runs for the norm kernels (nearly free) while the kernels with big
outputs get a few shapes. Skipped without CUDA; collection needs neither CUDA nor Triton.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dpgrad.kernels import reference as R
from dpgrad.kernels import reference_common

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
# DESIGN.md, by input dtype: squared norms per sample; relative Frobenius error of gradients.
RTOL = {BF16: 1e-2, FP32: 1e-5}
# Largest float64 reference slice, in elements (0.5 GB).
REF_CHUNK = 1 << 26
BATCH = 2
SEQ_LENS = (128, 1024, 4096)
# (layer, d, p): GPT-2 small's Linear layers with d = 768, and Llama-7B's.
GPT2 = [("gpt2.attn.c_proj", 768, 768), ("gpt2.attn.c_attn", 768, 2304), ("gpt2.mlp.c_fc", 768, 3072),
        ("gpt2.lm_head", 768, 50257)]
LLAMA7B = [("llama7b.mlp.up_proj", 4096, 11008), ("llama7b.mlp.down_proj", 11008, 4096),
           ("llama7b.attn.q_proj", 4096, 4096)]
# T-major, so that each layer shape's first call (the one that autotunes) is its cheapest.
NORM_CASES = [pytest.param(d, p, T, id=f"{name}-T{T}") for T in SEQ_LENS for name, d, p in GPT2 + LLAMA7B]
# One T per layer shape for the kernel that also writes (B, p, d); p = 50257 has ragged tiles.
FUSED_CASES = [
    pytest.param(768, 2304, 128, id="gpt2.attn.c_attn-T128"),
    pytest.param(768, 50257, 1024, id="gpt2.lm_head-T1024"),
    pytest.param(11008, 4096, 128, id="llama7b.mlp.down_proj-T128"),
    pytest.param(4096, 11008, 4096, id="llama7b.mlp.up_proj-T4096"),
]


@pytest.fixture
def ops(monkeypatch):
    """The Triton launchers, with every buffer they allocate poisoned (NaN), so an element that
    no program wrote cannot pass for a correct value."""
    from dpgrad.kernels import triton_common, triton_ops

    monkeypatch.setattr(triton_common, "POISON", True)
    return triton_ops


@pytest.fixture(autouse=True)
def _seed_and_free_memory():
    torch.manual_seed(0)
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _randn(*shape, dtype=BF16) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=dtype)


def _require_free_gib(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def _token_ids(B: int, T: int, V: int, padding_idx) -> torch.Tensor:
    """Ids like a real batch's: repeats (30% from 16 frequent tokens), the extreme ids 0 and
    V - 1 and a run of high ids (the largest offsets), and a padded tail."""
    ids = torch.randint(0, V, (B, T), device=DEV)
    frequent = torch.randint(0, V, (16,), device=DEV)
    pick = torch.rand(B, T, device=DEV) < 0.3
    ids = torch.where(pick, frequent[torch.randint(0, 16, (B, T), device=DEV)], ids)
    ids[:, 0] = 0
    ids[:, 1] = V - 1
    ids[:, 2:10] = torch.randint(V - 1000, V, (B, 8), device=DEV)
    if padding_idx is not None:
        ids[:, -(T // 8):] = padding_idx
    return ids


def _clip_coef(B: int) -> torch.Tensor:
    """Clipping factors as Opacus makes them: in (0, 1], some samples unclipped (exactly 1)."""
    coef = torch.rand(B, device=DEV).clamp_min(0.05)
    coef[0] = 1.0
    return coef


def _reference_f64(A: torch.Tensor, G: torch.Tensor, b: int):
    """Sample b's weight gradient G_b^T A_b (p, d) and bias gradient (p,), in float64."""
    T, d, p = A.shape[1], A.shape[2], G.shape[2]
    W = torch.zeros(p, d, dtype=FP64, device=DEV)
    bias = torch.zeros(p, dtype=FP64, device=DEV)
    step = max(1, REF_CHUNK // max(p, d))
    for t0 in range(0, T, step):
        g = G[b, t0:t0 + step].double()
        W.addmm_(g.t(), A[b, t0:t0 + step].double())
        bias += g.sum(dim=0)
    return W, bias


def _sq(x: torch.Tensor) -> torch.Tensor:
    """Squared Frobenius norm in float64, without a temporary the size of x."""
    x = x.reshape(-1)
    return torch.dot(x, x)


def _weight_sq_norms_f64(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    return torch.stack([_sq(_reference_f64(A, G, b)[0]) for b in range(A.shape[0])])


def assert_sq_norms_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """Per sample |actual - expected| <= rtol * expected; squared norms come back in fp32."""
    assert actual.dtype == FP32 and actual.shape == expected.shape, (what, actual.dtype, actual.shape)
    err = (actual.double() - expected).abs()
    rel = err / expected.abs().clamp_min(torch.finfo(FP64).tiny)
    # Written as "all <=" so that a NaN fails.
    ok = bool((err <= rtol * expected.abs()).all())
    assert ok, f"{what}: per-sample rel err up to {rel.max().item():.3g} > {rtol}"


def rel_frobenius(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_F / ||expected||_F (NaN if actual holds a NaN, which fails a <=)."""
    return ((actual.double() - expected).norm() / expected.norm()).item()


# ------------------------------------------------------------------------ Linear: norms, grads
@pytest.mark.parametrize("d,p,T", NORM_CASES)
def test_linear_weight_sq_norms_bf16(ops, d, p, T):
    A, G = _randn(BATCH, T, d), _randn(BATCH, T, p)
    expected = _weight_sq_norms_f64(A, G)
    for name, fn in (("direct", ops.linear_weight_sq_norm_direct), ("gram", ops.linear_weight_sq_norm_gram),
                     ("named", lambda A, G: ops.linear_weight_sq_norm(A, G, "direct")),
                     # The eager candidates the autotuner may choose instead, on the tensor cores.
                     ("eager-direct", R.linear_weight_sq_norm_direct), ("eager-gram", R.linear_weight_sq_norm_gram)):
        assert_sq_norms_close(fn(A, G), expected, RTOL[BF16], name)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_eager_gram_chunks_are_added_by_the_gemm(dtype):
    """On this torch the eager Gram norm's chunks go into the running sum through the GEMM
    (baddbmm's out_dtype, checked exact once per device), not as a product written and read
    back; the norms of that path are the bf16 test's above (eager-gram, several chunks)."""
    assert reference_common._gemm_adds_exactly(torch.device(DEV), dtype)
    a = _randn(2, 16, 64, dtype=dtype)
    c = torch.randn(2, 16, 16, device=DEV)
    assert reference_common._adds_in_gemm(c, a, a)
    got = R.baddbmm_acc(c.clone(), a, a.transpose(1, 2))
    want = c.double() + torch.bmm(a.double(), a.double().transpose(1, 2))
    assert rel_frobenius(got, want) <= 1e-6


@pytest.mark.parametrize("values", ["randn", "tf32-probe"])
@pytest.mark.parametrize("d,p,T", [pytest.param(768, 768, 1024, id="gpt2.attn.c_proj-T1024"),
                                   pytest.param(4096, 11008, 128, id="llama7b.mlp.up_proj-T128")])
def test_linear_weight_sq_norms_fp32(ops, d, p, T, values):
    """fp32 norms to rel 1e-5, which a TF32 dot cannot reach. Random inputs would hide TF32
    (its rounding errors cancel in a sum of squares), so the probe fills A and G with
    1 + 2^-12, which TF32 rounds to 1: a TF32 dot is then off by 4 * 2^-12 ~ 1e-3."""
    if values == "randn":
        A, G = _randn(BATCH, T, d, dtype=FP32), _randn(BATCH, T, p, dtype=FP32)
    else:
        A = torch.full((BATCH, T, d), 1 + 2**-12, dtype=FP32, device=DEV)
        G = torch.full((BATCH, T, p), 1 + 2**-12, dtype=FP32, device=DEV)
    expected = _weight_sq_norms_f64(A, G)
    for name, fn in (("direct", ops.linear_weight_sq_norm_direct), ("gram", ops.linear_weight_sq_norm_gram)):
        assert_sq_norms_close(fn(A, G), expected, RTOL[FP32], name)


def _check_linear_per_sample(out, A: torch.Tensor, G: torch.Tensor, samples) -> None:
    """Weight and bias gradients of the given samples, and every sample's squared norms."""
    B, p, d = A.shape[0], G.shape[2], A.shape[2]
    assert out.weight.shape == (B, p, d) and out.weight.dtype == G.dtype
    assert out.bias.shape == (B, p) and out.bias.dtype == G.dtype
    w_sq, b_sq = [], []
    for b in range(B):
        W, bias = _reference_f64(A, G, b)
        if b in samples:
            assert rel_frobenius(out.weight[b], W) <= RTOL[BF16], f"weight gradient of sample {b}"
            assert rel_frobenius(out.bias[b], bias) <= RTOL[BF16], f"bias gradient of sample {b}"
        w_sq.append(_sq(W))
        b_sq.append(_sq(bias))
    assert_sq_norms_close(out.weight_sq_norm, torch.stack(w_sq), RTOL[BF16], "weight norm epilogue")
    assert_sq_norms_close(out.bias_sq_norm, torch.stack(b_sq), RTOL[BF16], "bias norm epilogue")


@pytest.mark.parametrize("d,p,T", FUSED_CASES)
def test_linear_per_sample_with_norm_epilogue(ops, d, p, T):
    A, G = _randn(BATCH, T, d), _randn(BATCH, T, p)
    _check_linear_per_sample(ops.linear_per_sample(A, G, bias=True, norm=True), A, G, range(BATCH))


def test_linear_grad_sample_and_token_sums(ops):
    """The store-only variant of the per-sample kernel at GPT-2's lm_head, the token-sum
    kernels (bias gradients and their norms), and the T = 1 closed form of the weight norm."""
    d, p, T = 768, 50257, 128
    A, G = _randn(BATCH, T, d), _randn(BATCH, T, p)
    W, bias, bias_sq = ops.linear_grad_sample(A, G), ops.linear_bias_grad_sample(G), ops.linear_bias_sq_norm(G)
    assert W.shape == (BATCH, p, d) and W.dtype == BF16 and bias.shape == (BATCH, p) and bias.dtype == BF16
    expected_sq = []
    for b in range(BATCH):
        W_ref, bias_ref = _reference_f64(A, G, b)
        assert rel_frobenius(W[b], W_ref) <= RTOL[BF16], f"weight gradient of sample {b}"
        assert rel_frobenius(bias[b], bias_ref) <= RTOL[BF16], f"bias gradient of sample {b}"
        expected_sq.append(_sq(bias_ref))
    assert_sq_norms_close(bias_sq, torch.stack(expected_sq), RTOL[BF16], "bias norm")

    A1, G1 = _randn(64, 1, 4096), _randn(64, 1, 11008)
    expected = A1.double().square().sum(dim=(1, 2)) * G1.double().square().sum(dim=(1, 2))
    assert_sq_norms_close(ops.linear_weight_sq_norm_outer(A1, G1), expected, RTOL[BF16], "outer")
    assert_sq_norms_close(ops.linear_weight_sq_norm(A1, G1, "outer"), expected, RTOL[BF16], "named outer")


@pytest.mark.parametrize("d,p,T,B,dtype", [
    pytest.param(768, 50257, 1024, 4, BF16, id="gpt2.lm_head-T1024-bf16"),
    pytest.param(4096, 11008, 128, 8, BF16, id="llama7b.mlp.up_proj-T128-bf16"),
    # Few tiles: the batch is split into fp32 partials.
    pytest.param(768, 768, 128, 4, FP32, id="gpt2.attn.c_proj-T128-fp32"),
])
def test_linear_clipped_sum(ops, d, p, T, B, dtype):
    A, G, coef = _randn(B, T, d, dtype=dtype), _randn(B, T, p, dtype=dtype), _clip_coef(B)
    W, bias = ops.linear_clipped_sum(A, G, coef, bias=True)
    assert W.shape == (p, d) and W.dtype == dtype and bias.shape == (p,) and bias.dtype == dtype
    W_ref, bias_ref = R.linear_clipped_sum(A.double(), G.double(), coef.double(), bias=True)
    assert rel_frobenius(W, W_ref) <= RTOL[dtype]
    assert rel_frobenius(bias, bias_ref) <= RTOL[dtype]


# ---------------------------------------------------------------------------------- Embedding
@pytest.mark.parametrize("V,d,padding_idx", [
    pytest.param(50257, 768, 50256, id="gpt2.wte-pad50256"),
    pytest.param(50257, 768, None, id="gpt2.wte-nopad"),
    pytest.param(128256, 4096, 128004, id="llama3.embed_tokens-pad128004"),
])
def test_embedding_sq_norm(ops, V, d, padding_idx):
    B, T = 4, 1024
    ids, G = _token_ids(B, T, V, padding_idx), _randn(B, T, d)
    if padding_idx is not None:
        ids[-1] = padding_idx  # a sample that is all padding has norm exactly 0
    expected = R.embedding_sq_norm(ids, G.double(), V, padding_idx)
    assert_sq_norms_close(ops.embedding_sq_norm(ids, G, V, padding_idx), expected, RTOL[BF16], "embedding")


def test_embedding_clipped_sum(ops):
    """bf16 and fp32 outputs (the fp32 one shows the accumulation is fp32); rows that no kept
    token touches, the padding row among them, stay exactly zero."""
    V, d, pad, B, T = 50257, 768, 50256, 4, 1024
    ids, G, coef = _token_ids(B, T, V, pad), _randn(B, T, d), _clip_coef(B)
    expected = R.embedding_clipped_sum(ids, G.double(), coef.double(), V, pad)
    touched = torch.zeros(V, dtype=torch.bool, device=DEV)
    touched[ids[ids != pad]] = True
    for out_dtype in (None, FP32):
        out = ops.embedding_clipped_sum(ids, G, coef, V, pad, out_dtype=out_dtype)
        assert out.shape == (V, d) and out.dtype == (out_dtype or BF16)
        assert rel_frobenius(out, expected) <= RTOL[out_dtype or BF16], f"out_dtype={out_dtype}"
        assert not out[~touched].any(), f"untouched rows written, out_dtype={out_dtype}"


# ------------------------------------------------------------------------- Mixture of experts
@pytest.mark.parametrize("p,q", [pytest.param(1024, 1024, id="gate_up_proj-2I1024-d1024"),
                                 pytest.param(1024, 512, id="down_proj-d1024-I512")])
def test_experts_segments(ops, p, q):
    """E = 16 experts, 8k tokens routed top-2 (S = 16384 pairs) of B = 8 samples, bf16 factors:
    norms (weight and bias), clipped sums and per-sample gradients against the eager reference
    in float64; the norms twice, bitwise equal (partials added in a fixed order)."""
    E, B, N, k = 16, 8, 8192, 2
    expert = torch.rand(N, E, device=DEV).topk(k, dim=1).indices.reshape(-1)
    sample = torch.arange(N, device=DEV).repeat_interleave(k) // (N // B)
    left, right = _randn(N * k, p), _randn(N * k, q)
    L64, R64 = left.double(), right.double()
    args = (expert, sample, E, B)
    norms = ops.experts_sq_norms(left, right, *args)
    assert_sq_norms_close(norms, R.experts_sq_norms(L64, R64, *args), RTOL[BF16], "experts weight norms")
    assert torch.equal(norms, ops.experts_sq_norms(left, right, *args)), "experts norms differ run to run"
    assert_sq_norms_close(ops.experts_sq_norms(left, None, *args), R.experts_sq_norms(L64, None, *args), RTOL[BF16],
                          "experts bias norms")
    coef = _clip_coef(B)[sample]
    summed = ops.experts_clipped_sum(left, right, expert, coef, E, BF16)
    assert summed.shape == (E, p, q) and summed.dtype == BF16
    assert rel_frobenius(summed, R.experts_clipped_sum(L64, R64, expert, coef.double(), E, FP64)) <= RTOL[BF16]
    per = ops.experts_grad_sample(left, right, *args, BF16)
    assert per.shape == (B, E, p, q) and per.dtype == BF16
    want = R.experts_grad_sample(L64, R64, *args, FP64)
    for b in range(B):
        assert rel_frobenius(per[b], want[b]) <= RTOL[BF16], f"per-sample gradients of sample {b}"


# ------------------------------------------------------------------------------- Determinism
def test_norm_kernels_are_deterministic(ops):
    """Two calls of every norm kernel give bitwise-equal results.

    fp16 on purpose: no other test here uses it and the dtypes are part of every autotune key,
    so each kernel's first call below is its autotuning call, which runs every config on the
    caller's buffers. That call must give the same bits as any later one.
    """
    d, p, T, V, pad = 768, 3072, 1024, 50257, 50256
    A, G = _randn(BATCH, T, d, dtype=FP16), _randn(BATCH, T, p, dtype=FP16)
    A1, G1 = _randn(16, 1, d, dtype=FP16), _randn(16, 1, p, dtype=FP16)
    ids, E = _token_ids(BATCH, T, V, pad), _randn(BATCH, T, d, dtype=FP16)

    def fused():
        out = ops.linear_per_sample(A, G, bias=True, norm=True)
        return out.weight_sq_norm, out.bias_sq_norm

    calls = {
        "direct": lambda: (ops.linear_weight_sq_norm_direct(A, G),),
        "gram": lambda: (ops.linear_weight_sq_norm_gram(A, G),),
        "linear_per_sample norm epilogue": fused,
        "bias": lambda: (ops.linear_bias_sq_norm(G),),
        "outer": lambda: (ops.linear_weight_sq_norm_outer(A1, G1),),
        "embedding": lambda: (ops.embedding_sq_norm(ids, E, V, pad),),
    }
    for name, call in calls.items():
        first, second = call(), call()
        for x, y in zip(first, second):
            assert torch.equal(x, y), f"{name}: {x.tolist()} then {y.tolist()}"


# ---------------------------------------------------------------- above 2^31 elements (int64)
@pytest.mark.parametrize("algorithm,B,T", [
    pytest.param("direct", 5, 131072, id="direct-long-sequences"),
    pytest.param("gram", 640, 1024, id="gram-large-batch"),
])
def test_linear_weight_sq_norm_above_2_31_elements(ops, algorithm, B, T):
    """G of 2.7e9 elements (5.4 GB bf16): the last samples start past element 2^31, so they
    are reached only through int64 offsets (B = 4, T = 131072 would be exactly 2^31)."""
    _require_free_gib(12)
    d, p = 64, 4096
    A, G = _randn(B, T, d), _randn(B, T, p)
    assert G.numel() > 2**31
    actual = getattr(ops, f"linear_weight_sq_norm_{algorithm}")(A, G)
    expected = _weight_sq_norms_f64(A, G)
    del A, G
    assert_sq_norms_close(actual, expected, RTOL[BF16], algorithm)


def test_linear_per_sample_output_above_2_31_elements(ops):
    """Per-sample gradients of Llama-7B's down_proj at B = 50: the (B, p, d) output has 2.25e9
    elements (4.5 GB bf16); the last two samples are stored past element 2^31."""
    _require_free_gib(12)
    B, T, d, p = 50, 16, 11008, 4096
    A, G = _randn(B, T, d), _randn(B, T, p)
    out = ops.linear_per_sample(A, G, bias=True, norm=True)
    assert out.weight.numel() > 2**31
    _check_linear_per_sample(out, A, G, samples=(0, B - 2, B - 1))


def test_embedding_grad_sample_above_2_31_elements(ops):
    """(B, V, d) = (3, 128256, 6144): 2.4e9 elements (4.7 GB bf16). Every row a kept token
    touches equals a float64 row-wise reference; every other row is zero."""
    _require_free_gib(12)
    B, T, V, d, pad = 3, 256, 128256, 6144, 128004
    ids, G = _token_ids(B, T, V, pad), _randn(B, T, d)
    # The test's own premise: some rows of the last sample lie past element 2^31.
    assert ((B - 1) * V + int(ids[-1].max())) * d > 2**31
    with pytest.warns(ResourceWarning):
        out = ops.embedding_grad_sample(ids, G, V, pad)
    assert out.shape == (B, V, d) and out.dtype == BF16
    for b in range(B):
        keep = ids[b] != pad
        rows, inverse = torch.unique(ids[b][keep], return_inverse=True)
        expected = torch.zeros(rows.numel(), d, dtype=FP64, device=DEV).index_add_(0, inverse, G[b][keep].double())
        err = (out[b].index_select(0, rows).double() - expected).norm(dim=1) / expected.norm(dim=1)
        assert bool((err <= RTOL[BF16]).all()), f"sample {b}: row rel err up to {err.max().item():.3g}"
        out[b].index_fill_(0, rows, 0)
    assert not out.any(), "rows that no kept token touches (padding included) must stay zero"


# -------------------------------------------------------------------------------- non-contiguous
def _strided(B: int, T: int, n: int, layout: str) -> torch.Tensor:
    """A (B, T, n) view that is not contiguous, as real activations and backprops can be."""
    if layout == "time-major":
        return _randn(T, B, n).transpose(0, 1)
    return _randn(B, T, 3 * n)[..., n:2 * n]  # one third of a fused q/k/v projection


@pytest.mark.parametrize("layout", ["time-major", "sliced"])
def test_non_contiguous_inputs(ops, layout):
    """Llama-7B's q_proj at T = 1024 and its embedding, read through the strides (no copies)."""
    d = p = 4096
    T, V, pad = 1024, 128256, 128004
    A, G = _strided(BATCH, T, d, layout), _strided(BATCH, T, p, layout)
    assert not A.is_contiguous() and not G.is_contiguous()
    expected = _weight_sq_norms_f64(A, G)
    assert_sq_norms_close(ops.linear_weight_sq_norm_direct(A, G), expected, RTOL[BF16], "direct")
    assert_sq_norms_close(ops.linear_weight_sq_norm_gram(A, G), expected, RTOL[BF16], "gram")
    _check_linear_per_sample(ops.linear_per_sample(A, G, bias=True, norm=True), A, G, range(BATCH))

    coef = _clip_coef(BATCH)
    W, bias = ops.linear_clipped_sum(A, G, coef, bias=True)
    W_ref, bias_ref = R.linear_clipped_sum(A.double(), G.double(), coef.double(), bias=True)
    assert rel_frobenius(W, W_ref) <= RTOL[BF16] and rel_frobenius(bias, bias_ref) <= RTOL[BF16]

    ids = _token_ids(BATCH, T, V, pad).t().contiguous().t()
    E = _strided(BATCH, T, d, layout)
    expected = R.embedding_sq_norm(ids, E.double(), V, pad)
    assert_sq_norms_close(ops.embedding_sq_norm(ids, E, V, pad), expected, RTOL[BF16], "embedding")
