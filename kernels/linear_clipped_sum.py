"""Linear clipped gradient sum ``(c ⊙ G)^T A``, in Triton (the single-backward mode).

``sum_b c_b * G_b^T A_b`` (p, d) and ``sum_b c_b * sum_t G_b[t]`` (p,). One program owns one
(p, d) tile (and one split of the batch): for each sample it accumulates ``G_b^T A_b`` in fp32
over the tokens, on the tensor cores for half inputs, and adds it scaled by ``c_b`` in fp32,
so neither A nor G is ever copied or rescaled in its own low precision. Splits, when used,
write fp32 partials that are summed in a fixed order (deterministic).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .linear_grad_sample import TILES, sample_tile, tile_offsets
from .triton_common import INTERPRET, cdiv, check_dtypes, configs, empty, keep_only, launch, linear_family, prune_for
from .triton_common import grouped, layer_pointer

# The per-sample kernel's tiles (tuned separately: the loop over samples differs), and for fp32
# smaller ones, the only ones that do not spill there (its [BP, BD] sum stays in registers
# beside the sample's product).
CONFIGS = configs(TILES + [dict(BP=32, BD=32, BT=16), dict(BP=32, BD=64, BT=16), dict(BP=64, BD=32, BT=16)],
                  interpret=dict(BP=32, BD=32, BT=32))
keep_only("_linear_clipped_sum_kernel", linear_family, {
    "fp32": ["BD=32 BP=32 BT=16 w8", "BD=64 BP=32 BT=16 w8"],
    "half": ["BD=64 BP=64 BT=32 w8", "BD=64 BP=64 BT=64 w8", "BD=128 BP=64 BT=32 w8", "BD=64 BP=128 BT=32 w8"],
    "autocast": ["BD=64 BP=64 BT=32 w8"],
})
# Enough programs to fill a large GPU; below it the batch is split (partials cost memory).
_TARGET_PROGRAMS = 512
_MAX_PARTIAL_ELEMENTS = 1 << 26


@triton.autotune(configs=CONFIGS, key=["p", "d", "WITH_BIAS"],
                 prune_configs_by=prune_for("_linear_clipped_sum_kernel"))
@triton.jit(do_not_specialize=["B", "T", "s_cl", "samples_per_split", "grouped"])
def _linear_clipped_sum_kernel(
    A, G, A_PTRS, G_PTRS, COEF, W, BIAS,
    B, T, p, d,
    s_ab, s_at, s_ad, s_gb, s_gt, s_gp, s_cl,
    samples_per_split, grouped,
    WITH_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BP: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
):
    i_tile = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)  # the layer of a grouped launch
    A = layer_pointer(A, A_PTRS, i_l, grouped)
    G = layer_pointer(G, G_PTRS, i_l, grouped)
    i_part = i_l * tl.num_programs(1) + i_split  # partials are laid out by layer, then split
    i_p, i_d, o_p, o_d, m_p, m_d = tile_offsets(i_tile, p, d, BP, BD)
    b_w = tl.zeros((BP, BD), dtype=tl.float32)
    b_bias = tl.zeros((BP,), dtype=tl.float32)
    b_start = i_split * samples_per_split
    b_end = tl.minimum(b_start + samples_per_split, B)
    for i_b in range(b_start, b_end):
        # The sample's own sum first, on the tensor cores; the scaling is in fp32.
        b_ws, b_bs = sample_tile(A, G, i_b, o_p, o_d, m_p, m_d, T, s_ab, s_at, s_ad, s_gb, s_gt, s_gp,
                                 WITH_BIAS, UPCAST, BP, BD, BT)
        c = tl.load(COEF + i_l * s_cl + i_b).to(tl.float32)  # s_cl 0: one row for every layer
        b_w += c * b_ws
        if WITH_BIAS:
            b_bias += c * b_bs

    tl.store(W + i_part * p * d + o_p[:, None] * d + o_d[None, :], b_w.to(W.dtype.element_ty),
             mask=m_p[:, None] & m_d[None, :])
    if WITH_BIAS:
        if i_d == 0:
            tl.store(BIAS + i_part * p + o_p, b_bias.to(BIAS.dtype.element_ty), mask=m_p)


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
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides.
        G: backprops, [B, T, p], A's dtype family (fp32/bf16/fp16), any strides.
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
    A, G = As[0], Gs[0]
    check_dtypes("linear_clipped_sum", A, G)
    ga, gg = grouped(As), grouped(Gs)
    L = len(As)
    B, T, d = A.shape
    p = G.shape[2]
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
    tiles = cdiv(p, 64) * cdiv(d, 64)
    splits = max(1, min(B, _TARGET_PROGRAMS // (tiles * L), _MAX_PARTIAL_ELEMENTS // (p * d * L)))
    per_split = cdiv(B, splits)
    splits = cdiv(B, per_split)
    part_dtype = out_dtype if splits == 1 else torch.float32
    w = empty((L, splits, p, d), part_dtype, device)
    b = empty((L, splits, p), part_dtype, device) if bias else None
    launch(_linear_clipped_sum_kernel, lambda meta: (cdiv(p, meta["BP"]) * cdiv(d, meta["BD"]), splits, L),
        A, G, ga.table, gg.table, coef, w, b,
        B, T, p, d,
        *ga.strides, *gg.strides, coef.stride(0) if L > 1 else 0,
        per_split, ga.on,
        WITH_BIAS=bias, UPCAST=INTERPRET,
    )
    if splits > 1:
        w = w.sum(dim=1).to(out_dtype)
        b = b.sum(dim=1).to(out_dtype) if bias else None
    else:
        w = w[:, 0]
        b = b[:, 0] if bias else None
    return list(zip(w.unbind(0), b.unbind(0) if bias else [None] * L))
