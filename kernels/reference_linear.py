"""Eager-PyTorch versions of the Linear launchers (``dpgrad.kernels.reference`` re-exports them).

Per-sample gradients and their squared norms by the direct, Gram ("ghost norm") and outer
algorithms, the clipped gradient sums, the bias terms, and the cross term of a parameter used
twice (``outer_sum_inner``), which the embedding's Gram norm uses too. Shapes as in
``reference``: A (B, T, d) inputs, G (B, T, p) backprops.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .reference_common import (
    CHUNK_ELEMENTS,
    SQ_NORMS_WHOLE_ELEMENTS,
    accumulation_dtype,
    autocast_operand,
    autocast_operands,
    autocast_rounded,
    baddbmm_acc,
    batch_slices,
    bmm_acc,
    sq_norms,
)


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
