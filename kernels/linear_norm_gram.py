"""Linear per-sample weight norms, "gram" (ghost norm): ``<A_b A_b^T, G_b G_b^T>_F``, in Triton.

One program owns one (t-block i, t-block j) pair of one sample: it builds both Gram tiles
``A_i A_j^T`` and ``G_i G_j^T`` (BT x BT) in fp32 registers, over d and p in chunks, and
writes the sum of their product as one partial. Only i <= j pairs do work (the Gram matrices
are symmetric; an off-diagonal pair counts twice), so about B*T^2*(p+d) flops and no
(B, T, T) tensor in memory. A and G are read through their strides; offsets are int64.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .triton_common import INTERPRET, autocast_as, cdiv, check_dtypes, configs, dot_fp32, keep_only, launch
from .triton_common import linear_family, min_block, prune_for
from .triton_common import grouped, layer_pointer

# BT = 128 spills on every target (two [BT, BT] fp32 Gram tiles), and
# Triton 3.6 miscompiles one such config for sm_90 (BT=128, BK=32, 4 warps, half inputs with
# d = 1 and unit token stride: an out-of-range shared-memory access on an H100).
CONFIGS = configs(
    [dict(BT=bt, BK=bk) for bt in (32, 64) for bk in (32, 64)],
    interpret=dict(BT=16, BK=32),
)
keep_only("_linear_gram_norm_kernel", linear_family, {
    "fp32": ["BK=32 BT=32 w8", "BK=32 BT=64 w8", "BK=64 BT=32 w8"],
    "half": ["BK=32 BT=32 w4", "BK=32 BT=32 w8", "BK=64 BT=64 w8"],
    "autocast": ["BK=32 BT=32 w4", "BK=64 BT=64 w8"],
})
_MIN_BT = min_block(CONFIGS, "BT")


@triton.jit
def _gram_tile(X, i_b, o_i, o_j, T, n, s_b, s_t, s_n, OTHER: tl.constexpr, UPCAST: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr):
    """``X_b[o_i] @ X_b[o_j]^T`` as a [BT, BT] fp32 tile, over n in chunks of BK; X's values
    as autocast gave them to the layer's matmul with an operand of dtype ``OTHER``
    (``autocast_as``: fp32 inputs beside bf16 backprops are rounded to bf16). The products of
    the inputs' own dtype accumulate in fp32, as the layer's own GEMMs do (the precision
    contract, docs/guarantees.md)."""
    b_acc = tl.zeros((BT, BT), dtype=tl.float32)
    for k0 in range(0, n, BK):
        o_k = k0 + tl.arange(0, BK).to(tl.int64)
        m_k = o_k < n
        # [BT, BK]
        b_xi = tl.load(X + i_b * s_b + o_i[:, None] * s_t + o_k[None, :] * s_n,
                       mask=(o_i[:, None] < T) & m_k[None, :], other=0.0)
        # [BK, BT]
        b_xj = tl.load(X + i_b * s_b + o_j[None, :] * s_t + o_k[:, None] * s_n,
                       mask=(o_j[None, :] < T) & m_k[:, None], other=0.0)
        b_xi = autocast_as(b_xi, OTHER)
        b_xj = autocast_as(b_xj, OTHER)
        b_acc = dot_fp32(b_xi, b_xj, b_acc, UPCAST)
    return b_acc


# Pair slots depend on the block size, so partials of a config tried while tuning must be
# cleared (reset_to_zero); i > j slots are never written and must stay zero.
@triton.autotune(configs=CONFIGS, key=["p", "d"], reset_to_zero=["SQ"],
                 prune_configs_by=prune_for("_linear_gram_norm_kernel"))
@triton.jit(do_not_specialize=["B", "T", "grouped"])
def _linear_gram_norm_kernel(
    A, G, A_PTRS, G_PTRS, SQ,
    B, T, p, d,
    s_ab, s_at, s_ad, s_gb, s_gt, s_gp,
    n_pairs_max, grouped,
    UPCAST: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    # One flat grid axis: (layer, sample, pair) counts can exceed the 65535 limit of the others.
    pid = tl.program_id(0).to(tl.int64)
    n_t = tl.cdiv(T, BT)
    i_lb = pid // (n_t * n_t)  # the sample over the group's layers
    i_pair = pid % (n_t * n_t)
    i = i_pair // n_t
    j = i_pair % n_t
    if i <= j:
        i_l = i_lb // B
        i_b = i_lb % B
        p_a = layer_pointer(A, A_PTRS, i_l, grouped)
        p_g = layer_pointer(G, G_PTRS, i_l, grouped)
        o_i = i * BT + tl.arange(0, BT).to(tl.int64)
        o_j = j * BT + tl.arange(0, BT).to(tl.int64)
        b_aa = _gram_tile(p_a, i_b, o_i, o_j, T, d, s_ab, s_at, s_ad, G.dtype.element_ty, UPCAST, BT, BK)
        b_gg = _gram_tile(p_g, i_b, o_i, o_j, T, p, s_gb, s_gt, s_gp, A.dtype.element_ty, UPCAST, BT, BK)
        weight = tl.where(i < j, 2.0, 1.0)
        tl.store(SQ + i_lb * n_pairs_max + i_pair, weight * tl.sum(b_aa * b_gg))


def linear_weight_sq_norm_gram(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms ``<A_b A_b^T, G_b G_b^T>_F``, by [BT, BT] tiles
    of both Gram matrices (only t <= t' tiles; no [B, T, T] tensor).

    Args:
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides.
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides.

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
    A, G = As[0], Gs[0]
    check_dtypes("linear_weight_sq_norm_gram", A, G)
    ga, gg = grouped(As), grouped(Gs)
    B, T, d = A.shape
    p = G.shape[2]
    LB = len(As) * B
    n_pairs_max = cdiv(T, _MIN_BT) ** 2
    # Pairs with i > j, and pairs beyond the autotuned block count, stay zero.
    sq = torch.zeros(LB, n_pairs_max, dtype=torch.float32, device=A.device)
    if LB * T > 0:
        launch(_linear_gram_norm_kernel, lambda meta: (cdiv(T, meta["BT"]) ** 2 * LB,),
            A, G, ga.table, gg.table, sq,
            B, T, p, d, *ga.strides, *gg.strides, n_pairs_max, ga.on, UPCAST=INTERPRET,
        )
    # Rounding can take an exact zero slightly below it.
    return sq.sum(dim=1).clamp_min(0)
