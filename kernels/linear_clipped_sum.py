"""Linear clipped gradient sum ``(c ⊙ G)^T A``, in Triton (the single-backward mode).

``sum_b c_b * G_b^T A_b`` (p, d) and ``sum_b c_b * sum_t G_b[t]`` (p,): one GEMM over the
batch's B * T tokens (M = p, N = d) on the skeleton of gemm_tiles.py, a program per (p, d) tile
and split of the batch (splits fill the GPU when the tiles do not), its loop over the samples
and their tokens flattened into one pipeline. Each sample's products accumulate in fp32 from
zero and are added scaled by ``c_b`` in fp32 (an exact multiple of the sample's own sum, never a
rounded ``c_b g``), so neither A nor G is copied or rescaled in its own low precision. Splits
write fp32 partials that are summed in a fixed order (deterministic).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .gemm_tiles import GEMM_TILES, check_offsets, columns, grouped_tile, k_offsets, k_tile, layer_base
from .gemm_tiles import operands
from .triton_common import INTERPRET, cdiv, dot_fp32, empty, family_configs, launch, prune_for
from .triton_common import skeleton_family

# Two fp32 accumulators (the sum and a sample's) take registers that some of the skeleton's
# tiles leave too few of (they spill on one of sm_80, sm_90, sm_100): narrower tiles or more warps.
_TILES = {**GEMM_TILES,
          "autocast": ["BK=64 BM=128 BN=64 GROUP=8 w8", "BK=32 BM=64 BN=64 GROUP=8 w8"],
          "fp32": ["BK=32 BM=64 BN=64 GROUP=8 w8"],
          "half unaligned": ["BK=32 BM=64 BN=64 GROUP=8 w8"], "autocast unaligned": ["BK=32 BM=64 BN=64 GROUP=8 w8"],
          "fp32 unaligned": ["BK=32 BM=64 BN=32 GROUP=8 w4"]}
CONFIGS = family_configs("_linear_clipped_sum_kernel", skeleton_family, _TILES,
                         interpret=dict(BM=32, BN=32, BK=16, GROUP=2))
_MAX_BM = max(c.kwargs["BM"] for c in CONFIGS)
_MAX_BN = max(c.kwargs["BN"] for c in CONFIGS)
_MAX_BK = max(c.kwargs["BK"] for c in CONFIGS)
# Enough programs to fill a large GPU; below it the batch is split (partials cost memory).
_TARGET_PROGRAMS = 512
_MAX_PARTIAL_ELEMENTS = 1 << 26


@triton.autotune(configs=CONFIGS, key=["p", "d", "WITH_BIAS", "A_ALIGN", "G_ALIGN"],
                 prune_configs_by=prune_for("_linear_clipped_sum_kernel"))
@triton.jit(do_not_specialize=["B", "T", "s_cl", "samples_per_split", "grouped"])
def _linear_clipped_sum_kernel(
    A, G, A_OFFS, G_OFFS, COEF, W, BIAS,
    B, T, p, d,
    s_ab, s_at, s_gb, s_gt, s_cl,
    samples_per_split, grouped,
    WITH_BIAS: tl.constexpr, UPCAST: tl.constexpr, A_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):
    n_m = tl.cdiv(p, BM)
    n_n = tl.cdiv(d, BN)
    i_m, i_n = grouped_tile(tl.program_id(0), n_m, n_n, GROUP)
    i_split = tl.program_id(1)
    i_l = tl.program_id(2)  # the layer of a grouped launch
    i_part = i_l * tl.num_programs(1) + i_split  # partials are laid out by layer, then split
    o_m, m_m = columns(i_m, p, BM)
    o_n, m_n = columns(i_n, d, BN)
    # This tile's corner: 64-bit, and the offsets inside it 32-bit.
    p_a = layer_base(A, A_OFFS, i_l, grouped, A_ALIGN) + i_n * BN
    p_g = layer_base(G, G_OFFS, i_l, grouped, G_ALIGN) + i_m * BM
    off_a = k_offsets(o_n, s_at, BK)
    off_g = k_offsets(o_m, s_gt, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    b_bias = tl.zeros((BM,), dtype=tl.float32)
    b_start = i_split * samples_per_split
    b_end = tl.minimum(b_start + samples_per_split, B)
    for i_b in tl.range(b_start, b_end, flatten=True):
        x_a = p_a + i_b * s_ab.to(tl.int64)
        x_g = p_g + i_b * s_gb.to(tl.int64)
        # The sample's own sum first, on the tensor cores; the scaling is in fp32.
        acc_b = tl.zeros((BM, BN), dtype=tl.float32)
        bias_b = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, T, BK):
            b_g = k_tile(x_g, off_g, k0, T, m_m, BK)  # [BK, BM]
            b_a = k_tile(x_a, off_a, k0, T, m_n, BK)  # [BK, BN]
            acc_b = dot_fp32(tl.trans(b_g), b_a, acc_b, UPCAST)
            if WITH_BIAS:
                bias_b += tl.sum(b_g.to(tl.float32), axis=0)
            x_g += BK * s_gt
            x_a += BK * s_at
        c = tl.load(COEF + i_l * s_cl.to(tl.int64) + i_b).to(tl.float32)  # s_cl 0: one row for every layer
        acc += c * acc_b
        if WITH_BIAS:
            b_bias += c * bias_b
    o_pm = i_m * BM + tl.arange(0, BM)
    o_pn = i_n * BN + tl.arange(0, BN)
    p_w = W + i_part.to(tl.int64) * p * d
    tl.store(p_w + o_pm[:, None].to(tl.int64) * d + o_pn[None, :], acc.to(W.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])
    if WITH_BIAS:
        if i_n == 0:
            tl.store(BIAS + i_part.to(tl.int64) * p + o_pm, b_bias.to(BIAS.dtype.element_ty), mask=m_m)


def linear_clipped_sum(
    A: torch.Tensor,
    G: torch.Tensor,
    coef: torch.Tensor,
    *,
    bias: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Clipped gradient sums of a Linear layer, ``(c ⊙ G)^T A`` and ``sum_b c_b sum_t G_b[t]``,
    accumulated in fp32.

    Args:
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides (strided features are copied).
        G: backprops, [B, T, p], A's dtype family (fp32/bf16/fp16), any strides (strided features are copied).
        coef: clipping factors, [B], any float dtype (applied in fp32 to each sample's tile).
        bias: also return the bias sum.
        out_dtype: the sums' dtype; default G's.

    Returns:
        (weight sum [p, d], bias sum [p] or None), in ``out_dtype``.
    """
    return linear_clipped_sum_grouped([A], [G], coef, bias=bias, out_dtype=out_dtype)[0]


def linear_clipped_sum_grouped(
    As: Sequence[torch.Tensor],
    Gs: Sequence[torch.Tensor],
    coef: torch.Tensor,
    *,
    bias: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``linear_clipped_sum`` of L layers of one shape (and one batch) in one launch, each
    layer's tensors read where they are (a table of their addresses: no copies).

    Args:
        As: L inputs, [B, T, d] each, one dtype (fp32/bf16/fp16) and one set of strides.
        Gs: L backprops, [B, T, p] each, likewise.
        coef: clipping factors, [B] for every layer, or [L, B], a row per layer (layers in
            different clipping groups; a row repeated by ``expand`` is read, not copied).
        bias, out_dtype: as for ``linear_clipped_sum``.

    Returns:
        For each layer, (weight sum [p, d], bias sum [p] or None), in ``out_dtype``.
    """
    A, G, ga, gg, B, T, d, p = operands("linear_clipped_sum", As, Gs)
    L = len(As)
    out_dtype = out_dtype or G.dtype
    device = A.device
    coef = coef.to(device=device, dtype=torch.float32)
    if coef.dim() == 1:
        coef = coef.view(1, -1).expand(L, -1)
    if coef.shape != (L, B):
        raise ValueError(f"coef of shape {tuple(coef.shape)} for {L} layers of a batch of {B}: give [B] or [L, B]")
    if coef.stride(1) != 1 or (L > 1 and coef.stride(0) not in (0, B)):
        coef = coef.contiguous()
    if B == 0 or p * d == 0:
        # Nothing to tile (an empty batch, or a layer with no weights): plain torch suffices.
        return [(torch.zeros(p, d, dtype=out_dtype, device=device),
                 torch.einsum("b,btp->p", c, g.float()).to(out_dtype) if bias else None) for c, g in zip(coef, Gs)]
    tiles = cdiv(p, _MAX_BM) * cdiv(d, _MAX_BN)
    splits = max(1, min(B, _TARGET_PROGRAMS // (tiles * L), _MAX_PARTIAL_ELEMENTS // (p * d * L)))
    per_split = cdiv(B, splits)
    splits = cdiv(B, per_split)
    part_dtype = out_dtype if splits == 1 else torch.float32
    w = empty((L, splits, p, d), part_dtype, device)
    b = empty((L, splits, p), part_dtype, device) if bias else None
    check_offsets("linear_clipped_sum", _MAX_BK, (A.stride(1), _MAX_BN), (G.stride(1), _MAX_BM))
    launch(_linear_clipped_sum_kernel, lambda meta: (cdiv(p, meta["BM"]) * cdiv(d, meta["BN"]), splits, L),
        A, G, ga.table, gg.table, coef, w, b,
        B, T, p, d,
        *ga.strides[:2], *gg.strides[:2], coef.stride(0) if L > 1 else 0,
        per_split, ga.on,
        WITH_BIAS=bias, UPCAST=INTERPRET, A_ALIGN=ga.align, G_ALIGN=gg.align,
    )
    if splits > 1:
        w = w.sum(dim=1).to(out_dtype)
        b = b.sum(dim=1).to(out_dtype) if bias else None
    else:
        w = w[:, 0]
        b = b[:, 0] if bias else None
    return list(zip(w.unbind(0), b.unbind(0) if bias else [None] * L))
