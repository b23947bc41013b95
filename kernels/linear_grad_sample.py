"""Linear per-sample gradients as a batched outer product ``W_b = G_b^T A_b``, in Triton.

One program owns one (p, d) tile of one sample: it runs over the sample's tokens, accumulating
``G_b[t0:t1]^T A_b[t0:t1]`` in fp32 registers, and then, as asked,
- stores the tile in the output dtype (the per-sample gradient),
- squares and sums it (the per-sample squared norm, an epilogue of the same pass),
- and, in the programs of the first d tile, sums the backprops over tokens (the bias).
With the store switched off this is the "direct" norm (linear_norm_direct.py): the tiles
never leave registers and the extra memory is one fp32 partial per (sample, tile).

A and G are read through their strides (no copies); offsets are int64.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .linear_token_sum import token_sum_grouped
from .reference import LinearPerSample
from .triton_common import INTERPRET, cdiv, check_dtypes, configs, dot_fp32
from .triton_common import empty, keep_only, launch, linear_family, min_block, placeholder, prune_for
from .triton_common import grouped, layer_pointer

# (128, 128) tiles spill on every target in every dtype.
TILES = [dict(BP=bp, BD=bd, BT=bt) for bp, bd in ((64, 64), (128, 64), (64, 128)) for bt in (32, 64)]
CONFIGS = configs(TILES + [dict(BP=64, BD=64, BT=16)], interpret=dict(BP=32, BD=32, BT=32))
# The configs that spill no register on any target with any supported Triton (3.6 and 3.9), by
# the dtypes of A and G: fp32 tiles hold twice the bytes, and an fp32 input beside half
# backprops is rounded in registers.
keep_only("_linear_per_sample_kernel", linear_family, {
    "fp32": ["BD=64 BP=64 BT=16 w8"],
    "half": ["BD=64 BP=64 BT=32 w4", "BD=64 BP=64 BT=32 w8", "BD=64 BP=64 BT=64 w8", "BD=128 BP=64 BT=32 w8",
             "BD=128 BP=64 BT=64 w8", "BD=64 BP=128 BT=64 w8"],
    "autocast": ["BD=64 BP=64 BT=32 w4", "BD=64 BP=64 BT=32 w8", "BD=64 BP=128 BT=32 w8"],
})
_MIN_BP = min_block(CONFIGS, "BP")
_MIN_BD = min_block(CONFIGS, "BD")


@triton.jit
def tile_offsets(i_tile, p, d, BP: tl.constexpr, BD: tl.constexpr):
    """Row (p) and column (d) offsets and masks of tile ``i_tile`` of a (p, d) matrix."""
    n_d = tl.cdiv(d, BD)
    i_p = i_tile // n_d
    i_d = i_tile % n_d
    o_p = i_p * BP + tl.arange(0, BP).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD).to(tl.int64)
    return i_p, i_d, o_p, o_d, o_p < p, o_d < d


@triton.jit
def sample_tile(
    A, G, i_b, o_p, o_d, m_p, m_d, T,
    s_ab, s_at, s_ad, s_gb, s_gt, s_gp,
    WITH_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BP: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
):
    """One sample's ``G_b^T A_b`` tile [BP, BD] and (with WITH_BIAS) ``sum_t G_b[t]`` [BP], fp32."""
    b_w = tl.zeros((BP, BD), dtype=tl.float32)
    b_bias = tl.zeros((BP,), dtype=tl.float32)
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT).to(tl.int64)
        m_t = o_t < T
        # [BP, BT]
        b_g = tl.load(G + i_b * s_gb + o_t[None, :] * s_gt + o_p[:, None] * s_gp,
                      mask=m_p[:, None] & m_t[None, :], other=0.0)
        # [BT, BD]
        b_a = tl.load(A + i_b * s_ab + o_t[:, None] * s_at + o_d[None, :] * s_ad,
                      mask=m_t[:, None] & m_d[None, :], other=0.0)
        b_w = dot_fp32(b_g, b_a, b_w, UPCAST)
        if WITH_BIAS:
            b_bias += tl.sum(b_g.to(tl.float32), axis=1)
    return b_w, b_bias


# The norm partials sit in zero-filled buffers laid out for the smallest tiles; a config that
# was only tried while tuning must not leave its partials there (reset_to_zero).
@triton.autotune(configs=CONFIGS, key=["p", "d", "WRITE_GRAD", "WITH_BIAS", "WITH_NORM"],
                 reset_to_zero=["W_SQ", "BIAS_SQ"],
                 prune_configs_by=prune_for("_linear_per_sample_kernel"))
@triton.jit(do_not_specialize=["B", "T", "grouped"])
def _linear_per_sample_kernel(
    A, G, A_PTRS, G_PTRS, W, BIAS, W_SQ, BIAS_SQ,
    B, T, p, d,
    s_ab, s_at, s_ad, s_gb, s_gt, s_gp,
    n_tiles_max, n_tiles_p_max, grouped,
    WRITE_GRAD: tl.constexpr, WITH_BIAS: tl.constexpr, WITH_NORM: tl.constexpr,
    UPCAST: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
):
    # One flat grid axis: (layer, sample, tile) triples can exceed the 65535 limit of the others.
    # Outputs are laid out by the sample over the group's layers (i_lb).
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(p, BP) * tl.cdiv(d, BD)
    i_lb = pid // n_tiles
    i_tile = pid % n_tiles
    p_a = layer_pointer(A, A_PTRS, i_lb // B, grouped)
    p_g = layer_pointer(G, G_PTRS, i_lb // B, grouped)
    i_p, i_d, o_p, o_d, m_p, m_d = tile_offsets(i_tile, p, d, BP, BD)
    b_w, b_bias = sample_tile(p_a, p_g, i_lb % B, o_p, o_d, m_p, m_d, T, s_ab, s_at, s_ad, s_gb, s_gt, s_gp,
                              WITH_BIAS, UPCAST, BP, BD, BT)
    if WITH_BIAS and WITH_NORM:
        # The norm (and the store) read the bias sum more than once: as the loop's own result,
        # Triton 3.6 cannot compile that (its thread-locality pass asserts the loop's reduced
        # result has one use). Masked rows are zeros already.
        b_bias = tl.where(m_p, b_bias, 0.0)
    if WRITE_GRAD:
        p_w = W + i_lb * p * d + o_p[:, None] * d + o_d[None, :]
        tl.store(p_w, b_w.to(W.dtype.element_ty), mask=m_p[:, None] & m_d[None, :])
    if WITH_NORM:
        # Masked rows and columns are exact zeros, so they add nothing.
        tl.store(W_SQ + i_lb * n_tiles_max + i_tile, tl.sum(b_w * b_w))
    if WITH_BIAS:
        if i_d == 0:
            if WRITE_GRAD:
                tl.store(BIAS + i_lb * p + o_p, b_bias.to(BIAS.dtype.element_ty), mask=m_p)
            if WITH_NORM:
                tl.store(BIAS_SQ + i_lb * n_tiles_p_max + i_p, tl.sum(b_bias * b_bias))


def linear_per_sample(
    A: torch.Tensor,
    G: torch.Tensor,
    *,
    grad: bool = True,
    bias: bool = False,
    norm: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> LinearPerSample:
    """Per-sample Linear gradients and/or their squared norms in one pass over A and G,
    accumulated in fp32. ``grad=False, norm=True`` is the direct norm: no [B, p, d] tensor is
    ever written.

    Args:
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides.
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides.
        grad: return the per-sample gradients ``W_b = G_b^T A_b``.
        bias: also the bias gradients ``sum_t G_b[t]``.
        norm: return the squared norms of those, from the fp32 accumulators rather than from
            the rounded outputs.
        out_dtype: the gradients' dtype; default G's.

    Returns:
        ``LinearPerSample``: weight [B, p, d] and bias [B, p] in ``out_dtype`` (None where not
        asked for), weight_sq_norm and bias_sq_norm [B] fp32 (with ``norm``).
    """
    return linear_per_sample_grouped([A], [G], grad=grad, bias=bias, norm=norm, out_dtype=out_dtype)


def linear_per_sample_grouped(
    As: Sequence[torch.Tensor],
    Gs: Sequence[torch.Tensor],
    *,
    grad: bool = True,
    bias: bool = False,
    norm: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> LinearPerSample:
    """``linear_per_sample`` of L layers of one shape in one launch, each layer's tensors read
    where they are (a table of their addresses: no copies).

    Args:
        As: L inputs, [B, T, d] each, one dtype (fp32/bf16/fp16) and one set of strides.
        Gs: L backprops, [B, T, p] each, likewise.
        grad, bias, norm, out_dtype: as for ``linear_per_sample``.

    Returns:
        ``LinearPerSample`` over the L * B samples, layer by layer: weight [L * B, p, d], bias
        [L * B, p], the squared norms [L * B].
    """
    A, G = As[0], Gs[0]
    check_dtypes("linear_per_sample", A, G)
    ga, gg = grouped(As), grouped(Gs)
    B, T, d = A.shape
    p = G.shape[2]
    LB = len(As) * B
    out_dtype = out_dtype or G.dtype
    device = A.device
    n_tiles_max = cdiv(p, _MIN_BP) * cdiv(d, _MIN_BD)
    n_tiles_p_max = cdiv(p, _MIN_BP)
    w = empty((LB, p, d), out_dtype, device) if grad else None
    b = empty((LB, p), out_dtype, device) if grad and bias else None
    # Bigger autotuned tiles fill only a prefix of these; the rest must add zero.
    w_sq = torch.zeros(LB, n_tiles_max, dtype=torch.float32, device=device) if norm else None
    b_sq = torch.zeros(LB, n_tiles_p_max, dtype=torch.float32, device=device) if norm and bias else None
    if (grad or norm) and LB * p * d > 0:
        unused = placeholder(device)
        launch(_linear_per_sample_kernel, lambda meta: (cdiv(p, meta["BP"]) * cdiv(d, meta["BD"]) * LB,),
            A, G, ga.table, gg.table,
            w, b, unused if w_sq is None else w_sq, unused if b_sq is None else b_sq,
            B, T, p, d,
            *ga.strides, *gg.strides,
            n_tiles_max, n_tiles_p_max, ga.on,
            WRITE_GRAD=grad, WITH_BIAS=bias, WITH_NORM=norm, UPCAST=INTERPRET,
        )
    elif bias and LB * p > 0:
        # No weight tiles (d == 0): the bias comes from its own pass.
        b, bias_sq = token_sum_grouped(Gs, write_sum=grad, norm=norm, out_dtype=out_dtype)
        if norm:
            b_sq = bias_sq[:, None]
    return LinearPerSample(
        weight=w,
        bias=b,
        weight_sq_norm=w_sq.sum(dim=1) if norm else None,
        bias_sq_norm=b_sq.sum(dim=1) if b_sq is not None else None,
    )
