"""Eager-PyTorch versions of every dpgrad launcher.

This file is both the CPU fallback and the test oracle of the Triton kernels. Tensors in,
tensors out: no modules, no hooks, no autograd.

Shapes (B batch, T tokens, d in-features, p out-features, V vocabulary):
    A    (B, T, d)  layer inputs (activations)
    G    (B, T, p)  gradients of each sample's loss w.r.t. the layer outputs (backprops)
    ids  (B, T)     token ids of an embedding layer

Norms are returned *squared*, one per sample, in float32 (float64 when an input is float64).
Large intermediates are built one slice of the batch at a time, so memory stays bounded
whatever B is.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterator, NamedTuple, Optional, Tuple

import torch

from . import conv_unfold
from .conv_unfold import ConvGeometry

NAME = "eager"

# Upper bound on the elements of one batch slice's intermediate tensor.
CHUNK_ELEMENTS = 1 << 24
# Above this many elements a (B, V, d) embedding grad sample gets a warning.
EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS = 1 << 28


def same_layout(tensors) -> bool:
    """Whether tensors share shape, dtype and strides: one grouped kernel launch reads them all
    where they are (``triton_common.grouped``)."""
    first = tensors[0]
    return all(t.shape == first.shape and t.dtype == first.dtype and t.stride() == first.stride() for t in tensors)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs accumulate in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


HALF = (torch.float16, torch.bfloat16)


def autocast_operand(x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    """``x`` as the matmul took it beside ``partner`` (``autocast_operands`` for one operand):
    rounded to the half dtype of ``partner`` if ``x`` is fp32 beside a half ``partner``."""
    if x.dtype == torch.float32 and partner.is_floating_point() and partner.dtype in HALF:
        return x.to(partner.dtype)
    return x


def autocast_operands(A: torch.Tensor, G: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A Linear's inputs and backprops as its matmul under ``torch.autocast`` took them: an
    fp32 one beside a half one is rounded to that half dtype (the forward pass multiplied the
    input cast to the autocast dtype, so autograd's weight gradient is ``G^T cast(A)``; for
    Conv1D's swapped roles, likewise). Other pairs are returned as they are."""
    return autocast_operand(A, G), autocast_operand(G, A)


def autocast_rounded(x: torch.Tensor, partner: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``x`` in ``acc``, through the half dtype of ``partner`` if ``x`` is fp32 beside a half
    ``partner`` (``autocast_operand``, then widened)."""
    return autocast_operand(x, partner).to(acc)


def batch_slices(batch: int, elements_per_sample: int, samples: Optional[int] = None) -> Iterator[slice]:
    """Slices of range(batch) whose intermediates hold at most CHUNK_ELEMENTS elements, and at
    most ``samples`` samples where it is given."""
    step = max(1, CHUNK_ELEMENTS // max(1, elements_per_sample))
    if samples is not None:
        step = max(1, min(step, samples))
    for start in range(0, batch, step):
        yield slice(start, min(batch, start + step))


# Above this many elements, ``sq_norms`` widens its input to float64 a piece at a time.
SQ_NORMS_WHOLE_ELEMENTS = 1 << 20
# Pieces ``sq_norms`` takes at most: each piece's float64 copy then holds at most a quarter of
# the input's fp32 bytes.
SQ_NORMS_PIECES = 8


def sq_norms(x: torch.Tensor, dim, pieces: Optional[bool] = None) -> torch.Tensor:
    """Squared norms of ``x`` over ``dim`` in one pass over it: one reduction, no squared copy
    of ``x`` written and read back (on a GPU that copy of a batch's per-sample gradients cost
    about as much as the product that made them). The reduction accumulates in float64 (a
    memory-bound pass, no slower for it): a sum of p * d squares in fp32 would lose more than the
    products that made them (sqrt(p d) of fp32's unit, 5e-6 at p d = 7e5), in x's dtype or
    fp32, whichever is wider.

    torch widens the whole input to float64 before reducing it (twice the bytes of fp32
    per-sample gradients): above ``SQ_NORMS_WHOLE_ELEMENTS`` elements, or whatever the size
    with ``pieces`` (memory short), with ``dim`` every dimension after the first and ``x``
    contiguous, the rows are reduced in at most ``SQ_NORMS_PIECES`` pieces of columns, their
    float64 squares added."""
    out = _at_least_fp32(x)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if pieces is None:
        pieces = x.numel() > SQ_NORMS_WHOLE_ELEMENTS
    if (x.dtype == torch.float64 or not pieces or not x.is_contiguous()
            or sorted(d % x.dim() for d in dims) != list(range(1, x.dim()))):
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64).square().to(out)
    rows = x.view(x.shape[0], -1)
    width = -(-rows.shape[1] // SQ_NORMS_PIECES)
    total = None
    for start in range(0, rows.shape[1], width):
        part = torch.linalg.vector_norm(rows[:, start:start + width], dim=1, dtype=torch.float64).square()
        total = part if total is None else total.add_(part)
    return total.to(out)


def _at_least_fp32(x: torch.Tensor) -> torch.dtype:
    """x's dtype or fp32, whichever is wider (decided on the host: no operation dispatched)."""
    return x.dtype if x.dtype == torch.float64 else torch.float32


_OUT_DTYPE_MATMUL: dict = {}


def _half_cuda_pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are CUDA tensors of one half dtype (the matrix units' inputs)."""
    return a.is_cuda and a.dtype == b.dtype and a.dtype in HALF


def bmm_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` accumulated and returned in fp32 (fp64 for fp64 inputs).

    Half-precision CUDA operands go to the matrix units as they are, with an fp32 result
    (``out_dtype``, where this torch has it): no fp32 copies of the operands. Elsewhere the
    operands are widened first (a no-op for fp32 inputs).
    """
    acc = accumulation_dtype(a, b)
    if _half_cuda_pair(a, b):
        supported = _OUT_DTYPE_MATMUL.get(a.device)
        if supported is not False:
            try:
                out = torch.bmm(a, b, out_dtype=acc)
                _OUT_DTYPE_MATMUL[a.device] = True
                return out
            except (TypeError, RuntimeError):  # a torch without bmm's out_dtype
                _OUT_DTYPE_MATMUL[a.device] = False
    return torch.bmm(a.to(acc), b.to(acc))


# Whether a GEMM of this torch adds a half product to an fp32 matrix itself (``baddbmm``'s
# ``out_dtype``), per (device, dtype): checked once on exact small integers.
_GEMM_ADDS: dict = {}


def _gemm_adds_exactly(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.baddbmm(c, a, b, out_dtype=torch.float32)`` with ``a``, ``b`` in ``dtype``
    on ``device`` returns ``c + a @ b`` in fp32: small integers, whose products and sums every
    path computes exactly, so the answer is equality (a torch without the overload, or one
    that dropped ``c``, gives False)."""
    try:
        a = (torch.arange(2 * 8 * 32, device=device) % 7 - 3).to(dtype).view(2, 8, 32)
        c = (torch.arange(2 * 8 * 8, device=device) % 5 - 2).to(torch.float32).view(2, 8, 8)
        got = torch.baddbmm(c, a, a.transpose(1, 2), out_dtype=torch.float32)
        want = c + torch.bmm(a.float(), a.float().transpose(1, 2))
        return got.dtype == torch.float32 and bool(torch.equal(got, want))
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _adds_in_gemm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``baddbmm_acc`` lets the GEMM add its product to ``c``: half CUDA operands, an
    fp32 ``c``, and a torch that does so exactly (``_gemm_adds_exactly``, once per device)."""
    if not (_half_cuda_pair(a, b) and c.dtype == torch.float32):
        return False
    key = (a.device, a.dtype)
    if key not in _GEMM_ADDS:
        _GEMM_ADDS[key] = _gemm_adds_exactly(a.device, a.dtype)
    return _GEMM_ADDS[key]


def baddbmm_acc(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + bmm_acc(a, b)``, ``c`` in the accumulation dtype (and added to in place where the
    product is taken on its own). Half CUDA operands: the GEMM adds its fp32 result to ``c``
    (one pass over ``c``, no product written and read back), where this torch can."""
    if _adds_in_gemm(c, a, b):
        return torch.baddbmm(c, a, b, out_dtype=torch.float32)
    return c.add_(bmm_acc(a, b))


def linear_grad_sample(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients ``W_b = G_b^T A_b``.

    A: (B, T, d), G: (B, T, p) -> (B, p, d) in G's dtype (``autocast_operands``'s values).
    """
    A, G = autocast_operands(A, G)
    return torch.bmm(G.transpose(1, 2), A.to(G.dtype))


class LinearPerSample(NamedTuple):
    """What ``linear_per_sample`` returns; fields not asked for are None."""

    weight: Optional[torch.Tensor]  # (B, p, d)
    bias: Optional[torch.Tensor]  # (B, p)
    weight_sq_norm: Optional[torch.Tensor]  # (B,)
    bias_sq_norm: Optional[torch.Tensor]  # (B,)


def linear_per_sample(
    A: torch.Tensor,
    G: torch.Tensor,
    *,
    grad: bool = True,
    bias: bool = False,
    norm: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> LinearPerSample:
    """Per-sample Linear gradients and/or their squared norms.

    A: (B, T, d), G: (B, T, p). ``grad``: ``W_b = G_b^T A_b`` (B, p, d) and with ``bias`` also
    ``sum_t G_b[t]`` (B, p), computed in fp32 (fp64 for fp64 inputs) and rounded once to
    ``out_dtype`` (default G's dtype). ``norm``: their squared norms (B,), from the unrounded
    sums. An fp32 operand beside a half one is taken as autocast cast it (``autocast_operands``).
    """
    out_dtype = out_dtype or G.dtype
    A, G = autocast_operands(A, G)
    acc = accumulation_dtype(A, G)
    if not grad:
        return LinearPerSample(None, None, linear_weight_sq_norm_direct(A, G) if norm else None,
                               linear_bias_sq_norm(G) if norm and bias else None)
    # The gradients are materialised anyway: their norms come from them, not a second product.
    weight = bmm_acc(G.transpose(1, 2), A)
    bias_sum = G.sum(dim=1, dtype=acc) if bias else None
    return LinearPerSample(
        weight=weight.to(out_dtype),
        bias=bias_sum.to(out_dtype) if bias else None,
        weight_sq_norm=sq_norms(weight, (1, 2)) if norm else None,
        bias_sq_norm=bias_sum.square().sum(dim=1) if norm and bias else None,
    )


def linear_clipped_sum(
    A: torch.Tensor,
    G: torch.Tensor,
    coef: torch.Tensor,
    *,
    bias: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Clipped gradient sums ``(c ⊙ G)^T A`` (p, d) and ``sum_b c_b sum_t G_b[t]`` (p,).

    A: (B, T, d), G: (B, T, p), coef: (B,). Accumulated in fp32 (fp64 for fp64 inputs);
    returned in ``out_dtype`` (default G's dtype). Mixed operands as ``autocast_operands``.
    """
    acc = accumulation_dtype(A, G)
    out_dtype = out_dtype or G.dtype
    p, d = G.shape[-1], A.shape[-1]
    scaled = autocast_rounded(G, A, acc) * coef.to(device=G.device, dtype=acc)[:, None, None]
    weight = scaled.reshape(-1, p).t() @ autocast_rounded(A, G, acc).reshape(-1, d)
    return weight.to(out_dtype), scaled.sum(dim=(0, 1)).to(out_dtype) if bias else None


def coefficients_in(coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clipping coefficients (>= 0) in ``dtype``, never above their value in ``coef``'s dtype.

    Rounding to the nearest half-precision value can raise a coefficient by half a unit in the
    last place (2^-9 of it in bf16), and a sample's clipped gradient above the clipping bound
    by as much, which the noise is not calibrated for. Scaled by ``1 - eps/2`` first (eps: the
    dtype's machine epsilon), the nearest value is at most the coefficient; one too small to be
    represented that way (subnormal) becomes 0. A coefficient already in ``dtype`` is returned
    as it is.
    """
    if coef.dtype == dtype:
        return coef
    if torch.finfo(dtype).bits >= torch.finfo(coef.dtype).bits:
        return coef.to(dtype)
    low = (coef * (1.0 - torch.finfo(dtype).eps / 2)).to(dtype)
    return torch.where(low.to(coef.dtype) > coef, torch.zeros_like(low), low)


def linear_clipped_sum_gemm(
    A: torch.Tensor,
    G: torch.Tensor,
    coef: torch.Tensor,
    *,
    bias: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``linear_clipped_sum`` as one GEMM of the library's (cuBLAS on a GPU) on a scaled operand.

    The smaller of A and G (per position) is multiplied by each sample's coefficient in its own
    dtype, then one product over all B*T positions, accumulated in fp32 by the GEMM and rounded
    once to ``out_dtype``. The scaled operand costs one pass over it and its memory, briefly;
    in half precision it rounds ``c_b * x`` to the input precision (the gradient is rounded to
    it anyway), with the coefficients themselves rounded down (``coefficients_in``). A: (B, T, d),
    G: (B, T, p), coef: (B,) or (B, 1, 1) in any floating dtype (one in the operands' dtype is
    used as it is).
    """
    out_dtype = out_dtype or G.dtype
    A, G = autocast_operands(A, G)
    B, T, d = A.shape
    p = G.shape[-1]
    coef = coef.to(G.device)
    column = coef if coef.dim() == 3 else coef.view(B, 1, 1)
    if d < p:
        A = A * coefficients_in(column, A.dtype)
    else:
        G = G * coefficients_in(column, G.dtype)
    if A.dtype != G.dtype:
        A = A.to(G.dtype)
    weight = torch.mm(G.reshape(B * T, p).t(), A.reshape(B * T, d))
    if not bias:
        return weight.to(out_dtype), None
    acc = accumulation_dtype(G)
    sums = G.sum((0, 1), dtype=acc) if d >= p else torch.mv(G.sum(1, dtype=acc).t(), coef.reshape(B).to(acc))
    return weight.to(out_dtype), sums.to(out_dtype)


def linear_bias_grad_sample(G: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Per-sample bias gradients ``sum_t G_b[t]``: G (B, T, p) -> (B, p) in ``out_dtype``
    (default G's dtype)."""
    return G.sum(dim=1, dtype=out_dtype)


def linear_bias_sq_norm(G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample bias-gradient norms ``||sum_t G_b[t]||^2``: (B, T, p) -> (B,).

    O(B*T*p): the bias never needs a Gram matrix.
    """
    acc = accumulation_dtype(G)
    return G.sum(dim=1, dtype=acc).square().sum(dim=1)


def linear_weight_sq_norm_direct(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms from ``G_b^T A_b``, a batch slice at a time.

    A: (B, T, d), G: (B, T, p) -> (B,). About 2*B*T*p*d flops.
    """
    A, G = autocast_operands(A, G)
    acc = accumulation_dtype(A, G)
    p, d = G.shape[-1], A.shape[-1]
    return _by_slices(p * d, acc, lambda a, g: sq_norms(bmm_acc(g.transpose(1, 2), a), (1, 2)), A, G)


def _by_slices(elements_per_sample: int, dtype: torch.dtype, per_slice, *tensors: torch.Tensor) -> torch.Tensor:
    """(B,) values of ``per_slice`` on the batch slices (``batch_slices``) of ``tensors`` (B
    first), in ``dtype``: one call on the tensors as they are (no slicing, no copy) when the
    batch fits one slice."""
    B = tensors[0].shape[0]
    slices = list(batch_slices(B, elements_per_sample))
    if len(slices) == 1:
        return per_slice(*tensors)
    out = torch.empty(B, dtype=dtype, device=tensors[0].device)
    for s in slices:
        out[s] = per_slice(*(t[s] for t in tensors))
    return out


# Features per product of an eager Gram matrix. The matrix units' fp32 accumulation loses a
# little of each long sum of positive terms (a Gram matrix's diagonal, which dominates a ghost
# norm): with chunks of 2048 features, bf16 norms at Llama-1B's widths came 1.04e-5 below
# float64 on an H200 (against bf16's 1e-2), and the chunks' Gram matrices are added in fp32
# (a few dozen terms at a 128k vocabulary), never one running sum over all of d or p.
GRAM_CHUNK = 2048


def gram_acc(x: torch.Tensor, partner: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x_b y_b^T`` for each sample (``y`` defaults to ``x``: its Gram matrix), (B, T, T') in
    the accumulation dtype, with the values as the layer's matmul took them beside ``partner``
    (``autocast_operands``). Half operands stay half on a GPU (the tensor cores, fp32
    results): a chunk of features at a time, each chunk's product added to the sum by its GEMM
    (``baddbmm_acc``)."""
    y = x if y is None else y
    B, T, n = x.shape
    out = torch.zeros(B, T, y.shape[1], dtype=accumulation_dtype(x, partner), device=x.device) if n == 0 else None
    for k0 in range(0, n, GRAM_CHUNK):
        x_chunk, y_chunk = (x[..., k0:k0 + GRAM_CHUNK], y[..., k0:k0 + GRAM_CHUNK]) if n > GRAM_CHUNK else (x, y)
        left = autocast_operand(x_chunk, partner)
        right = (left if y is x else autocast_operand(y_chunk, partner)).transpose(1, 2)
        out = bmm_acc(left, right) if out is None else baddbmm_acc(out, left, right)
    return out


# Sequences from this many tokens up (an even number) take the eager Gram norm by halves: with
# x = [x1; x2], <A A^T, G G^T> is <A1 A1^T, G1 G1^T> + <A2 A2^T, G2 G2^T> + 2 <A2 A1^T, G2 G1^T>,
# three of the four blocks of each Gram matrix (the upper right one is the lower left's
# mirror): three quarters of the products and of the matrices, in two products a chunk (the
# diagonal blocks of all samples in one) instead of one. Shorter ones are dominated by the
# launch, not the product.
GRAM_HALVES_TOKENS = 512


def gram_by_halves(T: int) -> bool:
    """Whether the eager Gram norm of ``T`` tokens takes its Gram matrices by halves."""
    return T % 2 == 0 and T >= GRAM_HALVES_TOKENS


def _gram_sq_norms(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``<A_b A_b^T, G_b G_b^T>_F`` for each sample of a batch slice, (B,): by halves where
    ``gram_by_halves`` says."""
    B, T, d = A.shape
    if not gram_by_halves(T):
        return (gram_acc(A, G) * gram_acc(G, A)).sum(dim=(1, 2))
    h, p = T // 2, G.shape[-1]
    diagonal = gram_acc(A.reshape(2 * B, h, d), G) * gram_acc(G.reshape(2 * B, h, p), A)
    lower = gram_acc(A[:, h:], G, A[:, :h]) * gram_acc(G[:, h:], A, G[:, :h])
    return diagonal.view(B, -1).sum(1) + 2 * lower.sum(dim=(1, 2))


def linear_weight_sq_norm_gram(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms ``<A_b A_b^T, G_b G_b^T>_F`` ("ghost norm").

    A: (B, T, d), G: (B, T, p) -> (B,). About 2*B*T^2*(p+d) flops in this eager form, three
    quarters of that by halves (``gram_by_halves``).
    """
    T = A.shape[1]
    # Rounding can take an exact zero slightly below it.
    return _by_slices(2 * T * T, accumulation_dtype(A, G), lambda a, g: _gram_sq_norms(a, g).clamp_min(0), A, G)


def linear_weight_sq_norm_outer(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample norms when T == 1: ``||a_b||^2 * ||g_b||^2``. (B, 1, *) -> (B,)."""
    acc = accumulation_dtype(A, G)
    return autocast_rounded(A, G, acc).square().sum(dim=(1, 2)) * autocast_rounded(G, A, acc).square().sum(dim=(1, 2))


def linear_norm_function(functions: dict, A: torch.Tensor, algorithm: str):
    """The function of ``functions`` ({"direct", "gram", "outer"} -> function) for ``algorithm``,
    refusing an unknown name and "outer" for T > 1. Which algorithm is faster for a shape is
    the autotuner's to say (``dpgrad.tuning``), nobody else's."""
    if algorithm not in functions:
        raise ValueError(f"unknown linear norm algorithm {algorithm!r}: use one of {', '.join(functions)}")
    if algorithm == "outer" and A.shape[1] != 1:
        raise ValueError(f"the 'outer' norm needs T == 1, got T = {A.shape[1]}")
    return functions[algorithm]


def linear_weight_sq_norm(A: torch.Tensor, G: torch.Tensor, algorithm: str) -> torch.Tensor:
    """Squared per-sample weight-gradient norms of a Linear layer by the named algorithm
    ("direct", "gram", or "outer" for T == 1): (B, T, d), (B, T, p) -> (B,)."""
    return linear_norm_function(_SQ_NORMS, A, algorithm)(A, G)


def linear_weight_norm(A: torch.Tensor, G: torch.Tensor, algorithm: str) -> torch.Tensor:
    """Per-sample weight-gradient norms (not squared) by ``algorithm``: (B, T, d), (B, T, p) -> (B,)."""
    return linear_weight_norms([(A, G)], algorithm)


def linear_weight_norms(pairs, algorithm: str) -> torch.Tensor:
    """``linear_weight_norm`` of several layers of one shape (``pairs`` of (A, G)), concatenated:
    (L*B,) in the accumulation dtype.

    Few operations per layer for the many layers of a finish step: when the batch fits one
    slice, the direct and outer forms are a single product and one norm per layer, the direct
    norm accumulated as ``sq_norms`` accumulates it and converted once for all the layers; the
    Gram form's squares are clamped at zero and rooted once for all the layers.
    """
    A0, G0 = pairs[0]
    acc = accumulation_dtype(A0, G0)
    B, T, d = A0.shape
    p = G0.shape[-1]

    if algorithm == "gram":  # rounding can take an exact zero slightly below it
        squares = [_by_slices(2 * T * T, acc, _gram_sq_norms, A, G) for A, G in pairs]
        return (squares[0] if len(squares) == 1 else torch.cat(squares)).clamp_min(0).sqrt()

    def norm(A, G):
        if algorithm == "direct" and B * p * d <= CHUNK_ELEMENTS:
            a, g = autocast_operands(A, G)
            grads = bmm_acc(g.mT, a)
            if grads.numel() > SQ_NORMS_WHOLE_ELEMENTS:  # widened to float64 a piece at a time
                return sq_norms(grads, (1, 2)).sqrt()
            return torch.linalg.vector_norm(grads, dim=(1, 2), dtype=torch.float64)
        if algorithm == "outer" and T == 1:
            a, g = autocast_operands(A, G)
            return torch.linalg.vector_norm(a, dim=(1, 2), dtype=acc) * torch.linalg.vector_norm(g, dim=(1, 2),
                                                                                                  dtype=acc)
        return linear_weight_sq_norm(A, G, algorithm).sqrt()

    norms = [norm(A, G) for A, G in pairs]
    return (norms[0] if len(norms) == 1 else torch.cat(norms)).to(acc)


_SQ_NORMS = {"direct": linear_weight_sq_norm_direct, "gram": linear_weight_sq_norm_gram,
             "outer": linear_weight_sq_norm_outer}


def _left_gram(L1: torch.Tensor, L2: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``(L1[t] · L2[s])`` for every token pair, (B, T1, T2); integer L are ids of one-hot rows."""
    ids1, ids2 = not L1.is_floating_point(), not L2.is_floating_point()
    if ids1 and ids2:
        return ((L1[:, :, None] == L2[:, None, :]) & (L1[:, :, None] >= 0)).to(acc)
    if ids1:
        return _left_gram(L2, L1, acc).transpose(1, 2)
    if ids2:
        # One-hot row x_s picks column x_s of each dense row: a gather, never a one-hot.
        B, T1 = L1.shape[:2]
        picked = L1.gather(2, L2.clamp_min(0)[:, None, :].expand(B, T1, L2.shape[1])).to(acc)
        return picked * (L2 >= 0)[:, None, :]
    return torch.bmm(L1.to(acc), L2.to(acc).transpose(1, 2))


def outer_sum_inner(L1: torch.Tensor, R1: torch.Tensor, L2: torch.Tensor, R2: torch.Tensor) -> torch.Tensor:
    """Per-sample inner products ``<sum_t L1_b[t] ⊗ R1_b[t], sum_s L2_b[s] ⊗ R2_b[s]>_F``, (B,).

    L: (B, T, n) dense, or integer token ids (B, T) standing for one-hot rows of length n (an
    id below 0 stands for a zero row); R: (B, T, m). The cross term of a parameter used twice
    (a tied embedding and output layer, a Linear called twice): ``sum_{t,s} (L1[t] · L2[s]) *
    (R1[t] · R2[s])``, one batch slice at a time, never the (n, m) matrices. About
    2*B*T1*T2*(n + m) flops for dense factors; ids cost a gather instead of their n.
    Accumulated in fp32 (fp64 for fp64 inputs).
    """
    acc = accumulation_dtype(*(t for t in (L1, R1, L2, R2) if t.is_floating_point()))
    B, T1, T2 = R1.shape[0], R1.shape[1], R2.shape[1]

    def inner(l1, r1, l2, r2):
        # Each factor as the matmul of its own use took it (autocast: through its partner's dtype).
        r1, r2 = autocast_rounded(r1, L1, acc), autocast_rounded(r2, L2, acc)
        l1 = autocast_rounded(l1, R1, acc) if l1.is_floating_point() else l1
        l2 = autocast_rounded(l2, R2, acc) if l2.is_floating_point() else l2
        return (_left_gram(l1, l2, acc) * torch.bmm(r1, r2.transpose(1, 2))).sum(dim=(1, 2))

    slices = list(batch_slices(B, 3 * T1 * T2))
    if len(slices) == 1:  # the whole batch at once: no output to fill slice by slice
        return inner(L1, R1, L2, R2)
    out = torch.zeros(B, dtype=acc, device=R1.device)
    for s in slices:
        out[s] = inner(L1[s], R1[s], L2[s], R2[s])
    return out


def _embedding_positions(ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int]):
    """Flat (B*T,) token ids with padding positions moved to row ``num_embeddings`` (one past
    the table: an output row that is then dropped), and the backprop rows (B*T, d). No
    position is removed, so no output size depends on the data (no host synchronisation on a
    GPU)."""
    B = ids.shape[0]
    # Not reshape(B, -1): that is ambiguous for an empty batch.
    T = math.prod(ids.shape[1:])
    tok = ids.reshape(B * T).to(torch.int64)
    if padding_idx is not None:
        tok = tok.masked_fill(tok == padding_idx, num_embeddings)
    return tok, G.reshape(B * T, G.shape[-1])


def embedding_sq_norm(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """Squared per-sample embedding-gradient norms ``sum_v ||sum_{t: x_bt = v} g_bt||^2``.

    ids: (B, T) int, G: (B, T, d) -> (B,). The positions are sorted by (sample, token); equal
    pairs form segments whose rows are summed before squaring; positions holding
    ``padding_idx`` contribute nothing, as PyTorch gives that row no gradient. O(B*T*d), and
    every size is known before the data is read.
    """
    acc = accumulation_dtype(G)
    B = ids.shape[0]
    tok, rows = _embedding_positions(ids, G, num_embeddings, padding_idx)
    n = tok.numel()
    if n == 0:
        return torch.zeros(B, dtype=acc, device=G.device)
    # (sample, token) as one key; the sample of each position and its key's offset are made
    # once per shape.
    sample = _cached(("sample", B, n, G.device), lambda: torch.arange(n, device=G.device) // (n // B))
    offset = _cached(("offset", B, n, num_embeddings, G.device), lambda: sample * (num_embeddings + 1))
    key = offset + tok
    if padding_idx is not None:
        # Padding sorts into segments of its own, beyond every sample's: index B of the output.
        key = key.masked_fill(tok == num_embeddings, B * (num_embeddings + 1))
    sorted_key, order = torch.sort(key)
    starts = torch.ones(n, dtype=torch.int64, device=G.device)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    segment = torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)
    summed = torch.zeros(n, rows.shape[-1], dtype=acc, device=G.device).index_add_(0, segment, rows.to(acc))
    owner = torch.zeros(n, dtype=torch.int64, device=G.device).scatter_(
        0, segment, sample if padding_idx is None else key // (num_embeddings + 1))
    out = torch.zeros(B + 1, dtype=acc, device=G.device).index_add_(0, owner, summed.square().sum(1))
    return out[:B]


def embedding_sq_norm_gram(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """``embedding_sq_norm`` as ``sum_{t,s} [x_bt = x_bs] <g_bt, g_bs>``: (B,).

    O(B*T^2*d) flops and a (B, T, T) intermediate per batch slice: few operations for short
    sequences. Padding positions count as no token.
    """
    B = ids.shape[0]
    T = math.prod(ids.shape[1:])
    flat = ids.reshape(B, T)
    if padding_idx is not None:
        flat = flat.masked_fill(flat == padding_idx, -1)
    rows = G.reshape(B, T, G.shape[-1])
    return outer_sum_inner(flat, rows, flat, rows)


def embedding_grad_sample_warning(B: int, num_embeddings: int, d: int, element_size: int) -> str:
    """The warning for a large (B, V, d) per-sample embedding gradient."""
    gib = B * num_embeddings * d * element_size / 2**30
    return (
        f"materialising per-sample embedding gradients of shape ({B}, {num_embeddings}, {d}) "
        f"({gib:.1f} GiB); ghost clipping (GradSampleModuleFastGradientClipping) computes "
        "their norms without them"
    )


def embedding_grad_sample(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """Per-sample embedding gradients: (B, T) ids, (B, T, d) backprops -> (B, V, d).

    Inherently B*V*d memory; warns when that is large. The ``padding_idx`` row stays zero.
    """
    B, d = ids.shape[0], G.shape[-1]
    if B * num_embeddings * d > EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS:
        warnings.warn(embedding_grad_sample_warning(B, num_embeddings, d, G.element_size()), ResourceWarning, stacklevel=3)
    T = math.prod(ids.shape[1:])
    tok = ids if ids.dim() == 2 else ids.reshape(B, T)
    if padding_idx is not None:
        tok = tok.masked_fill(tok == padding_idx, num_embeddings)  # one spare row per sample
    rows = G if G.dim() == 3 else G.reshape(B, T, d)
    out = torch.zeros(B, num_embeddings + 1, d, dtype=G.dtype, device=G.device)
    # out[b, tok[b, t]] += rows[b, t]: sample b's rows by a (B, 1) index made once per B.
    rows_of = _cached(("rows", B, G.device), lambda: torch.arange(B, device=G.device).view(B, 1))
    out.index_put_((rows_of, tok), rows, accumulate=True)
    return out[:, :num_embeddings]


def embedding_clipped_sum(
    ids: torch.Tensor,
    G: torch.Tensor,
    coef: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Clipped gradient sum of an embedding: ``index_add`` of ``c_b * g_bt`` rows -> (V, d).

    ids: (B, T), G: (B, T, d), coef: (B,). Accumulated in fp32 (fp64 for fp64 inputs);
    returned in ``out_dtype`` (default G's dtype). ``padding_idx`` rows get nothing.
    """
    acc = accumulation_dtype(G)
    tok, rows = _embedding_positions(ids, G, num_embeddings, padding_idx)
    B, T, d = ids.shape[0], math.prod(ids.shape[1:]), G.shape[-1]
    # A spare row takes the padding positions.
    out = torch.zeros(num_embeddings + 1, d, dtype=acc, device=G.device)
    scaled = rows.to(acc).view(B, T, d) * coef.to(device=G.device, dtype=acc).view(B, 1, 1)
    out.index_add_(0, tok, scaled.view(-1, d))
    return out[:num_embeddings].to(out_dtype or G.dtype)


# ---------------------------------------------------------------- convolutions (conv_unfold.py)
def _conv_operands(x: torch.Tensor, G: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A convolution's input and backprops in the accumulation dtype, as autocast's forward took
    them (``autocast_operands``): fp32 copies of half ones, for the convolution's backward."""
    x, G = autocast_operands(x, G)
    acc = accumulation_dtype(x, G)
    return x.to(acc), G.to(acc)


def conv_per_sample(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry, weight_shape: Tuple[int, ...]) -> torch.Tensor:
    """Per-sample weight gradients of a convolution, (B, *weight_shape) in fp32 (fp64 for
    fp64): x (B, C_in, *S), G (B, C_out, *out). B times the weight's memory, no unfolding."""
    return conv_unfold.per_sample_weight(*_conv_operands(x, G), geom, weight_shape)


def conv_weight_sq_norm_grad_sample(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry,
                                    batch_slice: Optional[int] = None) -> torch.Tensor:
    """Squared per-sample weight-gradient norms from the per-sample gradients, a batch slice at
    a time (a slice's gradients at most CHUNK_ELEMENTS, and at most ``batch_slice`` samples
    where it is given): (B,)."""
    B, C_out = x.shape[0], G.shape[1]
    shape = (C_out, x.shape[1] // geom.groups, *geom.kernel_size)
    out = torch.empty(B, dtype=accumulation_dtype(x, G), device=x.device)
    for s in batch_slices(B, math.prod(shape), batch_slice):
        # Slices cut small (memory short) widen their gradients a piece at a time too.
        grads = conv_per_sample(x[s], G[s], geom, shape).flatten(1)
        out[s] = sq_norms(grads, 1, pieces=True if batch_slice is not None else None)
    return out


def conv_weight_sq_norm_unfolded(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry, linear_sq_norm,
                                 batch_slice: Optional[int] = None) -> torch.Tensor:
    """Squared per-sample weight-gradient norms by a Linear algorithm ``linear_sq_norm(A, G)``
    on the unfolded input (``conv_unfold``), summed over the groups: (B,). The unfolded input
    (T * C_in * K elements per sample) is built a batch slice at a time, of at most
    ``batch_slice`` samples where it is given."""
    B, g = x.shape[0], geom.groups
    T = math.prod(G.shape[2:])
    out = torch.empty(B, dtype=accumulation_dtype(x, G), device=x.device)
    for s in batch_slices(B, T * x.shape[1] * geom.positions, batch_slice):
        U = conv_unfold.unfold(x[s], geom)
        out[s] = linear_sq_norm(U, conv_unfold.grouped_backprops(G[s], g)).view(-1, g).sum(1)
    return out


def conv_weight_sq_norm_gram(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry,
                             batch_slice: Optional[int] = None) -> torch.Tensor:
    """``conv_weight_sq_norm_unfolded`` by the Gram ("ghost norm") algorithm: (B,)."""
    return conv_weight_sq_norm_unfolded(x, G, geom, linear_weight_sq_norm_gram, batch_slice)


def conv_weight_sq_norm_direct(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry,
                               batch_slice: Optional[int] = None) -> torch.Tensor:
    """``conv_weight_sq_norm_unfolded`` by the direct algorithm: (B,)."""
    return conv_weight_sq_norm_unfolded(x, G, geom, linear_weight_sq_norm_direct, batch_slice)


def conv_clipped_sum(x: torch.Tensor, G: torch.Tensor, coef: torch.Tensor, geom: ConvGeometry,
                     weight_shape: Tuple[int, ...], out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The clipped weight gradient ``sum_b c_b G_b^T U_b`` (weight_shape) by one convolution
    backward on the scaled backprops (no unfolded input, no per-sample gradient); accumulated in
    fp32 (fp64 for fp64), returned in ``out_dtype`` (default G's dtype). coef: (B,)."""
    xa, Ga = _conv_operands(x, G)
    scaled = Ga * coef.to(device=Ga.device, dtype=Ga.dtype).view(-1, *([1] * (Ga.dim() - 1)))
    return conv_unfold.weight_gradient(xa, scaled, geom, weight_shape).to(out_dtype or G.dtype)


_CACHED: dict = {}


def _cached(key: tuple, make):
    """An index tensor that depends on shapes alone (``key``), made once: a position's sample,
    for instance, rather than an ``arange`` and a division at every call."""
    found = _CACHED.get(key)
    if found is None:
        if len(_CACHED) > 256:  # Poisson batch sizes: keep the cache small
            _CACHED.clear()
        found = _CACHED[key] = make()
    return found
