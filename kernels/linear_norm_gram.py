"""Linear per-sample weight norms, "gram" (ghost norm): ``<A_b A_b^T, G_b G_b^T>_F``, in Triton.

On the skeleton of gemm_tiles.py: an item is one (t-block i, t-block j) pair of one sample,
i <= j only (the Gram matrices are symmetric; an off-diagonal pair counts twice). It builds both
Gram tiles ``A_i A_j^T`` (K = d) and ``G_i G_j^T`` (K = p), [BT, BT] each, on the tensor cores
with fp32 accumulators, and writes the sum of their product as one partial (no atomics: the
result is the same from run to run). About B*T^2*(p+d) flops, no (B, T, T) tensor in memory.
A persistent grid walks the (layer, sample, pair) items; each base is 64-bit, each offset
inside a tile 32-bit (``check_offsets``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .gemm_tiles import check_offsets, layer_base, operands, triangle
from .triton_common import INTERPRET, autocast_as, cdiv, dot_fp32, family_configs, launch
from .triton_common import skeleton_family
from .triton_common import min_block, persistent_programs, prune_for

# 128-token tiles with the warps two fp32 accumulators need (8), 64 for short sequences; fp32's
# dots run on the CUDA cores, whose operands take registers the tensor cores' do not.
CONFIGS = family_configs("_linear_gram_norm_kernel", skeleton_family, {
    "half": ["BK=32 BT=128 w8", "BK=32 BT=128 w8 s4", "BK=64 BT=64 w4", "BK=64 BT=64 w4 s4"],
    "autocast": ["BK=32 BT=128 w8", "BK=64 BT=64 w8"],
    "fp32": ["BK=32 BT=64 w8", "BK=32 BT=32 w4", "BK=32 BT=32 w8"],
    "half unaligned": ["BK=32 BT=64 w8", "BK=32 BT=32 w4"],
    "autocast unaligned": ["BK=32 BT=64 w8", "BK=32 BT=32 w8"],
    "fp32 unaligned": ["BK=32 BT=32 w4", "BK=32 BT=32 w8"],
}, interpret=dict(BT=16, BK=32))
_MIN_BT = min_block(CONFIGS, "BT")
_MAX_BT = max(c.kwargs["BT"] for c in CONFIGS)
_MAX_BK = max(c.kwargs["BK"] for c in CONFIGS)


@triton.jit
def _gram_tile(x_i, x_j, n, s_t, m_i, m_j, OTHER: tl.constexpr, UPCAST: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr):
    """``X[rows i] @ X[rows j]^T`` as a [BT, BT] fp32 tile over n features in steps of BK, from
    the bases of the two row blocks (``m_i``, ``m_j``: which of their rows are in T); X's values as
    autocast gave them to the layer's matmul with an operand of dtype ``OTHER`` (``autocast_as``:
    fp32 inputs beside bf16 backprops are rounded to bf16). Products of the inputs' own dtype
    accumulate in fp32, as the layer's own GEMMs do (the precision contract,
    docs/guarantees.md)."""
    o_k = tl.arange(0, BK)
    r = tl.arange(0, BT)
    off_i = r[:, None] * s_t + o_k[None, :]  # [BT, BK], features contiguous
    off_j = o_k[:, None] + r[None, :] * s_t  # [BK, BT]
    acc = tl.zeros((BT, BT), dtype=tl.float32)
    for k0 in range(0, n, BK):
        m_k = (k0 + o_k) < n
        b_i = autocast_as(tl.load(x_i + off_i, mask=m_i[:, None] & m_k[None, :], other=0.0), OTHER)
        b_j = autocast_as(tl.load(x_j + off_j, mask=m_k[:, None] & m_j[None, :], other=0.0), OTHER)
        acc = dot_fp32(b_i, b_j, acc, UPCAST)
        x_i += BK
        x_j += BK
    return acc


# Pair slots depend on the block size, so partials of a config tried while tuning must be
# cleared (reset_to_zero); slots past a config's pairs are never written and must stay zero.
@triton.autotune(configs=CONFIGS, key=["p", "d", "A_ALIGN", "G_ALIGN"], reset_to_zero=["SQ"],
                 prune_configs_by=prune_for("_linear_gram_norm_kernel"))
@triton.jit(do_not_specialize=["B", "T", "LB", "grouped"])
def _linear_gram_norm_kernel(
    A, G, A_OFFS, G_OFFS, SQ,
    B, T, p, d,
    s_ab, s_at, s_gb, s_gt,
    LB, n_pairs_max, grouped,
    UPCAST: tl.constexpr, A_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    n_t = tl.cdiv(T, BT)
    pairs = n_t * (n_t + 1) // 2
    for item in tl.range(tl.program_id(0), LB * pairs, tl.num_programs(0)):
        i_lb = item // pairs
        q = item % pairs
        i, j = triangle(q)
        b = (i_lb % B).to(tl.int64)
        p_a = layer_base(A, A_OFFS, i_lb // B, grouped, A_ALIGN) + b * s_ab
        p_g = layer_base(G, G_OFFS, i_lb // B, grouped, G_ALIGN) + b * s_gb
        r = tl.arange(0, BT)
        m_i = i * BT + r < T
        m_j = j * BT + r < T
        t_i = (i * BT).to(tl.int64)
        t_j = (j * BT).to(tl.int64)
        aa = _gram_tile(p_a + t_i * s_at, p_a + t_j * s_at, d, s_at, m_i, m_j, G.dtype.element_ty, UPCAST,
                        BT, BK)
        gg = _gram_tile(p_g + t_i * s_gt, p_g + t_j * s_gt, p, s_gt, m_i, m_j, A.dtype.element_ty, UPCAST,
                        BT, BK)
        weight = tl.where(i < j, 2.0, 1.0)
        tl.store(SQ + i_lb.to(tl.int64) * n_pairs_max + q, weight * tl.sum(aa * gg))


def linear_weight_sq_norm_gram(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms ``<A_b A_b^T, G_b G_b^T>_F``, by [BT, BT] tiles
    of both Gram matrices (only t <= t' tiles; no [B, T, T] tensor).

    Args:
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides (strided features are copied).
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides (strided features are copied).

    Returns:
        [B] fp32.
    """
    return linear_weight_sq_norm_gram_grouped([A], [G])


def linear_weight_sq_norm_gram_grouped(As: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``linear_weight_sq_norm_gram`` of L layers of one shape in one launch, each layer's
    tensors read where they are (a table of their addresses: no copies).

    Args:
        As: L inputs, [B, T, d] each, one dtype (fp32/bf16/fp16) and one set of strides.
        Gs: L backprops, [B, T, p] each, likewise.

    Returns:
        [L * B] fp32, layer by layer.
    """
    A, G, ga, gg, B, T, d, p = operands("linear_weight_sq_norm_gram", As, Gs)
    LB = len(As) * B
    n_small = cdiv(T, _MIN_BT)
    n_pairs_max = n_small * (n_small + 1) // 2
    # Slots past a config's pairs stay zero.
    sq = torch.zeros(LB, n_pairs_max, dtype=torch.float32, device=A.device)
    if LB * T > 0:
        check_offsets("linear_weight_sq_norm_gram", _MAX_BT, (A.stride(1), _MAX_BK), (G.stride(1), _MAX_BK))

        def grid(meta):
            n_t = cdiv(T, meta["BT"])
            return (persistent_programs(A.device, LB * n_t * (n_t + 1) // 2),)

        launch(_linear_gram_norm_kernel, grid,
               A, G, ga.table, gg.table, sq,
               B, T, p, d, *ga.strides[:2], *gg.strides[:2], LB, n_pairs_max, ga.on,
               UPCAST=INTERPRET, A_ALIGN=ga.align, G_ALIGN=gg.align)
    # Rounding can take an exact zero slightly below it.
    return sq.sum(dim=1, dtype=torch.float64).clamp_min(0).float()
