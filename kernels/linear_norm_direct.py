"""Linear per-sample weight norms, "direct": tiles of ``G_b^T A_b`` squared in registers.

A batched GEMM (a sample per batch: M = p, N = d, K = T) on the skeleton of gemm_tiles.py,
with its epilogue squaring and summing each tile instead of storing it: 2*B*T*p*d flops, the
weight-gradient GEMM's, and one fp32 partial per (sample, tile); the per-sample gradient is
never written. A persistent grid walks the (layer, sample, tile) items, their K loops
flattened into one pipeline (at T = 128 an item is only two steps of K).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .gemm_tiles import GEMM_TILES, check_offsets, columns, grouped_tile, k_offsets, k_tile, layer_base
from .gemm_tiles import operands
from .triton_common import INTERPRET, cdiv, dot_fp32, family_configs, launch, min_block
from .triton_common import persistent_programs, prune_for, skeleton_family

CONFIGS = family_configs("_linear_direct_norm_kernel", skeleton_family, GEMM_TILES,
                         interpret=dict(BM=32, BN=32, BK=16, GROUP=2))
_MIN = (min_block(CONFIGS, "BM"), min_block(CONFIGS, "BN"))
_MAX = (max(c.kwargs["BM"] for c in CONFIGS), max(c.kwargs["BN"] for c in CONFIGS))
_MAX_BK = max(c.kwargs["BK"] for c in CONFIGS)


# Partials are laid out for the smallest tiles: what a config tried while tuning leaves is
# cleared (reset_to_zero).
@triton.autotune(configs=CONFIGS, key=["p", "d", "A_ALIGN", "G_ALIGN"], reset_to_zero=["SQ"],
                 prune_configs_by=prune_for("_linear_direct_norm_kernel"))
@triton.jit(do_not_specialize=["B", "T", "LB", "grouped"])
def _linear_direct_norm_kernel(
    A, G, A_OFFS, G_OFFS, SQ,
    B, T, p, d,
    s_ab, s_at, s_gb, s_gt,
    LB, n_tiles_max, grouped,
    UPCAST: tl.constexpr, A_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):
    n_m = tl.cdiv(p, BM)
    n_n = tl.cdiv(d, BN)
    tiles = n_m * n_n
    n_items = LB * tiles  # (layer, sample, tile), LB the layers' samples
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0), flatten=True):
        i_lb = item // tiles
        tile = item % tiles
        i_m, i_n = grouped_tile(tile, n_m, n_n, GROUP)
        b = (i_lb % B).to(tl.int64)
        # The sample's tile corner: 64-bit; the offsets inside the tile 32-bit.
        p_a = layer_base(A, A_OFFS, i_lb // B, grouped, A_ALIGN) + b * s_ab
        p_g = layer_base(G, G_OFFS, i_lb // B, grouped, G_ALIGN) + b * s_gb
        p_a += i_n * BN
        p_g += i_m * BM
        o_m, m_m = columns(i_m, p, BM)
        o_n, m_n = columns(i_n, d, BN)
        off_g = k_offsets(o_m, s_gt, BK)
        off_a = k_offsets(o_n, s_at, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, T, BK):
            b_g = k_tile(p_g, off_g, k0, T, m_m, BK)  # [BK, BM]
            b_a = k_tile(p_a, off_a, k0, T, m_n, BK)  # [BK, BN]
            acc = dot_fp32(tl.trans(b_g), b_a, acc, UPCAST)
            p_g += BK * s_gt
            p_a += BK * s_at
        tl.store(SQ + i_lb.to(tl.int64) * n_tiles_max + tile, tl.sum(acc * acc))


def linear_weight_sq_norm_direct(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms ``||G_b^T A_b||_F^2``.

    Args:
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides (strided features are copied).
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides (strided features are copied).

    Returns:
        [B] fp32.
    """
    return linear_weight_sq_norm_direct_grouped([A], [G])


def linear_weight_sq_norm_direct_grouped(As: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``linear_weight_sq_norm_direct`` of L layers of one shape in one launch, each layer's
    tensors read where they are (a table of their addresses: no copies).

    Args:
        As: L inputs, [B, T, d] each, one dtype (fp32/bf16/fp16) and one set of strides.
        Gs: L backprops, [B, T, p] each, likewise.

    Returns:
        [L * B] fp32, layer by layer.
    """
    A, G, ga, gg, B, T, d, p = operands("linear_weight_sq_norm_direct", As, Gs)
    LB = len(As) * B
    n_tiles_max = cdiv(p, _MIN[0]) * cdiv(d, _MIN[1])
    # Bigger tiles fill a prefix of each row; the rest must add zero.
    sq = torch.zeros(LB, n_tiles_max, dtype=torch.float32, device=A.device)
    if LB * T * p * d > 0:
        check_offsets("linear_weight_sq_norm_direct", _MAX_BK, (A.stride(1), _MAX[1]), (G.stride(1), _MAX[0]))
        launch(_linear_direct_norm_kernel,
               lambda meta: (persistent_programs(A.device, LB * cdiv(p, meta["BM"]) * cdiv(d, meta["BN"])),),
               A, G, ga.table, gg.table, sq,
               B, T, p, d, *ga.strides[:2], *gg.strides[:2],
               LB, n_tiles_max, ga.on, UPCAST=INTERPRET, A_ALIGN=ga.align, G_ALIGN=gg.align)
    return sq.sum(dim=1, dtype=torch.float64).float()
