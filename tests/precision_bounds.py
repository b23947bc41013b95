"""The precision contract's error model, as bounds a result is checked against.

dpgrad's kernels multiply the inputs in their own dtype (bf16 and fp16 products are exact in
fp32) and accumulate in fp32, as the non-private step's GEMMs do. A sum of K terms accumulated
in fp32, in any order, is off by at most ``gamma(K)`` times the sum of the terms' magnitudes
(Higham, Accuracy and Stability of Numerical Algorithms, 3.1): for a product ``X^T Y`` over K
rows, elementwise ``gamma(K + 1) |X|^T |Y|`` (the one more for an fp32 product's rounding).
The bounds below follow from that, for each result, computed in float64 from the same rounded
operands the kernel read: the tolerance of a test is what fp32 accumulation over that K can
lose on that data, not one figure for every K (a worst case: the errors met are far below).
"""

from __future__ import annotations

import math
import torch

U32 = 2.0 ** -24  # fp32's unit roundoff
# The unit roundoff of a result rounded to its dtype.
UNIT = {torch.float32: U32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float64: 2.0 ** -53}


def gamma(k: int) -> float:
    """``k u / (1 - k u)``, u fp32's unit roundoff: the bound of k fp32 roundings."""
    return k * U32 / (1 - k * U32)


def reduction_depth(n: int) -> int:
    """Roundings of a sum of ``n`` terms by blocks and trees (a tile's ``tl.sum``, partials summed
    by torch): the depth of a binary tree, with room for the blocks' sequential parts."""
    return math.ceil(math.log2(max(n, 2))) + 16


def product_bound(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of fp32's error on ``X^T Y`` over their first axis (K rows)."""
    return gamma(X.shape[0] + 1) * (X.double().abs().T @ Y.double().abs())


def direct_sq_norm_bound(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """(B,): the bound on ``| ||G_b^T A_b||^2 computed - exact |``: each tile entry off by
    ``E = gamma(T + 1) |G_b|^T |A_b|``, so its square by ``E (2 |W| + E)``, then the sum of
    squares' own roundings."""
    out = []
    for a, g in zip(A.double(), G.double()):
        W = g.T @ a
        E = product_bound(g, a)
        sq = (E * (2 * W.abs() + E)).sum()
        out.append(sq + gamma(reduction_depth(W.numel())) * (W.square().sum() + sq))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def gram_sq_norm_bound(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """(B,): the same for ``<A_b A_b^T, G_b G_b^T>``: Gram entries off by ``gamma(d + 1) |A||A|^T``
    and ``gamma(p + 1) |G||G|^T``, their products by what those make of each other, then the
    sum over T^2 pairs."""
    out = []
    for a, g in zip(A.double(), G.double()):
        Sa, Sg = a @ a.T, g @ g.T
        Ea = product_bound(a.T, a.T)
        Eg = product_bound(g.T, g.T)
        pair = Ea * Sg.abs() + Sa.abs() * Eg + Ea * Eg + U32 * (Sa.abs() + Ea) * (Sg.abs() + Eg)
        total = (Sa * Sg).abs().sum() + pair.sum()
        out.append(pair.sum() + gamma(reduction_depth(Sa.numel())) * total)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def clipped_sum_bound(A: torch.Tensor, G: torch.Tensor, coef: torch.Tensor,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on ``sum_b c_b G_b^T A_b``: every product accumulates in fp32 over the
    batch's B * T tokens (scaled once in fp32, summed over samples), ``gamma(B T + 3)`` of the
    magnitudes, and the result rounded to ``out_dtype``."""
    B, T = A.shape[:2]
    c = coef.double().abs().view(-1, 1, 1)
    mags = torch.einsum("btp,btd->pd", (c * G.double().abs()), A.double().abs())
    exact = torch.einsum("b,btp,btd->pd", coef.double(), G.double(), A.double())
    return gamma(B * T + 3) * mags + UNIT[out_dtype] * (exact.abs() + gamma(B * T + 3) * mags)


def grad_sample_bound(A: torch.Tensor, G: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on the per-sample gradients ``G_b^T A_b`` (B, p, d): fp32 over T, then
    rounded to ``out_dtype``."""
    exact = torch.einsum("btp,btd->bpd", G.double(), A.double())
    mags = gamma(A.shape[1] + 1) * torch.einsum("btp,btd->bpd", G.double().abs(), A.double().abs())
    return mags + UNIT[out_dtype] * (exact.abs() + mags)


def embedding_sq_norm_bound(G: torch.Tensor) -> torch.Tensor:
    """(B,): the bound on an Embedding's squared per-sample norm ``sum_v ||sum_{t: x_t = v}
    g_t||^2``: each segment's sum off by ``gamma(T)`` of its magnitudes, its square by what that
    makes of it; the segments' magnitudes squared add up to at most the sample's (the square of
    a sum of non-negative parts bounds the sum of their squares)."""
    B, T, d = G.shape
    mags = G.double().abs().sum(1)  # (B, d)
    e = gamma(T)
    sq = e * (2 + e) * mags.square().sum(1)
    return sq + gamma(reduction_depth(T * d)) * (mags.square().sum(1) + sq)


def within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    """How much of ``bound`` the error uses (at most 1 passes), with float64's own slack."""
    got, exact, bound = got.double().cpu(), exact.double().cpu(), bound.double().cpu()
    err = (got - exact).abs()
    slack = 1e-12 * exact.abs().max().item() if exact.numel() else 0.0
    return (err / (bound + slack + 1e-300)).max().item() if err.numel() else 0.0


def rescaled_backprops_delta(dtype: torch.dtype, roundings: int) -> float:
    """Double backward under autocast: the relative error of a sample's contribution, whose
    second pass rounds the backprops to ``dtype`` at the scale ``c_b`` where the norm pass
    rounded them at scale 1 (rounding commutes with a scaling by a power of two only). Each
    such rounding leaves an element within ``(1 + u) / (1 - u)`` of ``c_b`` times the norm
    pass's; ``roundings`` counts those whose errors the norm does not average out (the loss's
    gradient into ``dtype``, which all of the sample's gradient goes through; a narrow
    backprop's), then the result's own rounding: ``((1 + u) / (1 - u))^r (1 + u) - 1``, about
    ``(2 r + 1) u``."""
    u = UNIT[dtype]
    return ((1 + u) / (1 - u)) ** roundings * (1 + u) - 1
