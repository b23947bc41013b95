"""The precision contract (docs/guarantees.md, "Precision"): products of the inputs' own dtype
accumulated in fp32, as the non-private step's GEMMs do, no compensated sums.

Every Linear norm, per-sample gradient and clipped sum, and the Embedding norm, on the eager
backend and on the Triton kernels (the interpreter on a CPU), against float64 of the same
rounded operands (bf16 and fp16 tensors widened exactly; autocast's fp32 input rounded to bf16
as the layer's matmul rounded it), within the bound fp32 accumulation over that result's K
can lose on that data (``tests/precision_bounds.py``): random inputs at several K, a real
model's own A and G (a two-layer Hugging Face GPT-2), and sums of thousands of equal positive
terms, the case that a running fp32 sum handles worst, which torch's own fp32 GEMM is held to
as well.
"""

from __future__ import annotations

import pytest
import torch

from dpgrad.kernels import reference as R
from precision_bounds import (
    clipped_sum_bound,
    direct_sq_norm_bound,
    embedding_sq_norm_bound,
    gamma,
    gram_sq_norm_bound,
    grad_sample_bound,
    within,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def backends():
    found = [pytest.param(R, id="eager")]
    try:
        from dpgrad.kernels import triton_ops
    except ImportError:  # no Triton: the eager backend alone
        return found
    return found + [pytest.param(triton_ops, id="triton")]


BACKENDS = backends()


def operands(B, T, d, p, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    A = (torch.randn(B, T, d, generator=g) * scale).to(dtype).to(DEVICE)
    G = (torch.randn(B, T, p, generator=g) / scale).to(dtype).to(DEVICE)
    return A, G


def exact_direct(A, G):
    return torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))


def exact_gram(A, G):
    a, g = A.double(), G.double()
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


# (B, T, d, p): K = T for the direct norm, d and p for the Gram norm.
# - (1, 257, 24, 40): the direct norm's long K, T = 257 (17 K-tiles of the interpreter's BK = 16,
#   a tail of one); one sample, whose bound is its own: a second one is only another draw, at
#   the cost of 153 more Gram tile pairs under the interpreter.
# - (1, 16, 1030, 130): the Gram norm's long K. Both Gram matrices are built by the same loop
#   (linear_norm_gram._gram_tile, K in steps of BK = 32), so A's d = 1030 (33 K-tiles, a tail
#   of 6) is the long accumulation that p = 700 was too; p = 130 (5 K-tiles, a tail of 2) is
#   still accumulated over several tiles, and the direct norm's (p, d) tiles, which cost the
#   interpreter one program step each and have nothing to do with K, are 165 instead of 726.
SHAPES = [(3, 7, 45, 29), (1, 257, 24, 40), (1, 16, 1030, 130)]


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_norms_within_fp32_accumulation(ops, dtype, shape):
    A, G = operands(*shape, dtype)
    for name, fn, exact, bound in [("direct", ops.linear_weight_sq_norm_direct, exact_direct, direct_sq_norm_bound),
                                   ("gram", ops.linear_weight_sq_norm_gram, exact_gram, gram_sq_norm_bound)]:
        used = within(fn(A, G), exact(A, G), bound(A, G))
        assert used <= 1, f"{name}: {used:.3g} of the fp32 bound"


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_sample_gradients_and_clipped_sums_within_fp32_accumulation(ops, dtype):
    A, G = operands(3, 130, 24, 20, dtype, seed=1)
    exact = torch.einsum("btp,btd->bpd", G.double(), A.double())
    got = ops.linear_per_sample(A, G, grad=True, out_dtype=torch.float32).weight
    assert within(got, exact, grad_sample_bound(A, G, torch.float32)) <= 1
    coef = torch.tensor([1.0, 0.37, 0.001], device=DEVICE)
    w, _ = ops.linear_clipped_sum(A, G, coef, out_dtype=torch.float32)
    assert within(w, torch.einsum("b,bpd->pd", coef.double(), exact), clipped_sum_bound(A, G, coef)) <= 1


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_norms_within_fp32_accumulation(ops, dtype):
    g = torch.Generator().manual_seed(2)
    # Few tokens: long segments, each a running fp32 sum of about T / V = 60 rows (8 steps of
    # the interpreter's BR = 8). K is T: one sample of 300 tokens keeps it; the interpreter runs
    # a program per position and d-tile, so more samples only cost.
    B, T, V, d = 1, 300, 5, 33
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    G = torch.randn(B, T, d, generator=g).to(dtype).to(DEVICE)
    exact = R.embedding_sq_norm(ids.cpu(), G.double().cpu(), V)
    assert within(ops.embedding_sq_norm(ids, G, V), exact, embedding_sq_norm_bound(G)) <= 1


@pytest.mark.parametrize("ops", BACKENDS)
def test_autocast_pairs_are_the_rounded_computation(ops):
    """An fp32 input beside bf16 backprops: the norms of ``G_b^T bf16(A_b)``, what autograd's
    weight gradient multiplies, to the fp32 bound of that computation."""
    A, G = operands(2, 40, 30, 20, torch.float32, seed=3)
    G = G.to(torch.bfloat16)
    rounded = A.to(torch.bfloat16)
    for name, fn, exact, bound in [("direct", ops.linear_weight_sq_norm_direct, exact_direct, direct_sq_norm_bound),
                                   ("gram", ops.linear_weight_sq_norm_gram, exact_gram, gram_sq_norm_bound)]:
        used = within(fn(A, G), exact(rounded, G), bound(rounded, G))
        assert used <= 1, f"{name}: {used:.3g} of the fp32 bound"


@pytest.mark.parametrize("ops", BACKENDS)
def test_sums_of_equal_positive_terms(ops):
    """32768 features of 1 + 2^-8: a Gram entry is a running sum of equal positive terms, the
    worst case of fp32 accumulation (each chunk's low bits are lost once the sum is large).
    dpgrad's Gram norm is held to what fp32 accumulation over 32768 terms may lose, as torch's
    own fp32 GEMM of the same values is (the non-private step's arithmetic)."""
    T, n, v = 16, 1 << 15, 1 + 2 ** -8
    A = torch.full((1, T, n), v, dtype=torch.float32, device=DEVICE)
    exact = torch.tensor([T * T * (n * v * v) ** 2], dtype=torch.float64)
    bound = gram_sq_norm_bound(A, A)
    assert within(ops.linear_weight_sq_norm_gram(A, A), exact, bound) <= 1
    gemm = (A[0] @ A[0].T).double()  # one fp32 Gram matrix, by torch
    assert within(gemm, torch.full_like(gemm, n * v * v), torch.full_like(gemm, gamma(n + 1) * n * v * v)) <= 1


def gpt2_layer_operands(dtype):
    """The inputs and backprops of a two-layer GPT-2's first MLP projection (c_fc, a Conv1D:
    inputs (B, T, 64), backprops (B, T, 256)) on a batch of token ids."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=97, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(dtype)
    seen = {}
    layer = model.transformer.h[0].mlp.c_fc

    def keep(module, args, out):
        seen["A"] = args[0].detach()
        out.register_hook(lambda g: seen.__setitem__("G", g.detach()))

    layer.register_forward_hook(keep)
    ids = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(4))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return seen["A"].to(DEVICE), seen["G"].to(DEVICE)


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_real_models_inputs_and_backprops(ops, dtype):
    A, G = gpt2_layer_operands(dtype)
    for name, fn, exact, bound in [("direct", ops.linear_weight_sq_norm_direct, exact_direct, direct_sq_norm_bound),
                                   ("gram", ops.linear_weight_sq_norm_gram, exact_gram, gram_sq_norm_bound)]:
        used = within(fn(A, G), exact(A, G), bound(A, G))
        assert used <= 1, f"{name}: {used:.3g} of the fp32 bound"
