"""Per-sample gradients of LayerNorm and RMSNorm layers normalised over their last dimension,
in Triton, for a group of layers of one shape in one launch.

For a sample b with inputs x_t (T rows of d) and backprops g_t:
- weight: ``sum_t x̂_t ⊙ g_t``, with ``x̂_t = (x_t - mean(x_t)) / sqrt(var(x_t) + eps)``
  (LayerNorm; biased variance, as the forward pass) or ``x_t / sqrt(mean(x_t^2) + eps)``
  (RMSNorm), rounded to x's dtype first where the layer's forward does so; or, given the
  normalised inputs themselves (what the forward multiplied the weight by), ``x̂_t = x_t``;
- bias: ``sum_t g_t``.
One program owns a run of one sample's rows and holds a whole row (d elements) in registers:
it normalises each row in fp32 and accumulates both sums in fp32. Runs of rows are split
across programs when the group has few samples (B = 1, long context); their partial sums are
then added by one reduction. Layer l's tensors are read where they are (a table of their
addresses); offsets are int64.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import ROUND_TO, cdiv, check_dtypes, empty, launch, placeholder, round_to_bf16
from .triton_common import grouped, layer_pointer

# A row is held whole: rows longer than this take the eager path (``norm_layer_fits``); longer
# rows would spill registers.
MAX_D = 4096
# Elements of each [BT, BD] tile (and of each [BD] accumulator) per thread: more spill
# registers to the stack in fp32 (compiled for sm_80, sm_90 and sm_100:
# tests/test_kernel_compile.py).
_PER_THREAD = 8
# Programs to aim for when splitting the rows of few samples.
_TARGET_PROGRAMS = 1024


@triton.jit(do_not_specialize=["B", "T", "per_split", "eps", "form", "round_to", "grouped"])
def _norm_layer_grad_sample_kernel(
    X, G, X_PTRS, G_PTRS, GW, GB,
    B, T, d, eps,
    s_xb, s_xt, s_xd, s_gb, s_gt, s_gd,
    splits, per_split, form, round_to, grouped,
    WITH_WEIGHT: tl.constexpr, WITH_BIAS: tl.constexpr,
    BD: tl.constexpr, BT: tl.constexpr,
):
    # One flat grid axis over (layer and sample, run of rows): L * B may exceed 65535.
    pid = tl.program_id(0).to(tl.int64)
    i_lb = pid // splits
    i_s = pid % splits
    p_x = layer_pointer(X, X_PTRS, i_lb // B, grouped)
    p_g = layer_pointer(G, G_PTRS, i_lb // B, grouped)
    i_b = i_lb % B
    o_d = tl.arange(0, BD).to(tl.int64)
    m_d = o_d < d
    t_start = i_s * per_split
    t_end = tl.minimum(t_start + per_split, T)
    b_w = tl.zeros((BD,), dtype=tl.float32)
    b_bias = tl.zeros((BD,), dtype=tl.float32)
    for t0 in range(t_start, t_end, BT):
        o_t = t0 + tl.arange(0, BT).to(tl.int64)
        m = (o_t[:, None] < t_end) & m_d[None, :]
        # [BT, BD]; masked elements are zeros, and a masked row's backprops are zeros, so it adds nothing.
        b_g = tl.load(p_g + i_b * s_gb + o_t[:, None] * s_gt + o_d[None, :] * s_gd, mask=m, other=0.0).to(tl.float32)
        if WITH_WEIGHT:
            b_x = tl.load(p_x + i_b * s_xb + o_t[:, None] * s_xt + o_d[None, :] * s_xd, mask=m, other=0.0)
            b_x = b_x.to(tl.float32)
            if form == 2:  # normalised already
                b_n = b_x
            else:
                if form == 1:  # RMSNorm
                    b_xc = b_x
                else:
                    b_xc = tl.where(m, b_x - (tl.sum(b_x, axis=1) / d)[:, None], 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(b_xc * b_xc, axis=1) / d + eps)
                b_n = b_xc * rstd[:, None]
                if round_to == 1:  # to fp16
                    b_n = b_n.to(tl.float16).to(tl.float32)
                elif round_to == 2:
                    b_n = round_to_bf16(b_n)
            b_w += tl.sum(b_n * b_g, axis=0)
        if WITH_BIAS:
            b_bias += tl.sum(b_g, axis=0)
    if WITH_WEIGHT:
        tl.store(GW + (i_lb * splits + i_s) * d + o_d, b_w, mask=m_d)
    if WITH_BIAS:
        tl.store(GB + (i_lb * splits + i_s) * d + o_d, b_bias, mask=m_d)


def blocks(d: int) -> Tuple[int, int, int]:
    """(BD, BT, num_warps) of a launch on rows of ``d`` elements: a whole row per block, BT rows
    a step, as many as keep each [BT, BD] tile at ``_PER_THREAD`` elements per thread (up to
    16 rows); 8 warps from 256 elements (fewer spill on some targets)."""
    BD = triton.next_power_of_2(d)
    num_warps = 4 if BD <= 128 else 16 if BD == 2048 else 8  # 2048 spills on some targets with 8
    return BD, max(1, min(16, _PER_THREAD * 32 * min(num_warps, 8) // BD)), num_warps


def norm_layer_fits(X: torch.Tensor) -> bool:
    """Whether the kernel takes inputs like X: [B, d] or [B, T, d], d at most ``MAX_D``, of a
    dtype it reads (fp32/bf16/fp16)."""
    return X.dim() in (2, 3) and 0 < X.shape[-1] <= MAX_D and X.dtype in (torch.float32, torch.bfloat16,
                                                                          torch.float16)


def norm_layer_grad_sample_grouped(
    Xs: Sequence[torch.Tensor],
    Gs: Sequence[torch.Tensor],
    eps: float,
    *,
    rms: bool,
    rounded: bool = False,
    normalized: bool = False,
    weight: bool = True,
    bias: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per-sample weight and bias gradients of L LayerNorm (or RMSNorm, ``rms``) layers of one
    shape, normalised over the last dimension, in one launch, accumulated in fp32.

    Args:
        Xs: L inputs, [B, d] or [B, T, d] each, one dtype (fp32/bf16/fp16) and one set of
            strides; d at most ``MAX_D``.
        Gs: L backprops of the layers' outputs, of Xs's shape, one dtype and one set of strides
            (not necessarily Xs's).
        eps: the layers' epsilon, as their forward passes add it.
        rms: RMSNorm (no mean subtracted) rather than LayerNorm.
        rounded: the normalised inputs are rounded to the inputs' dtype before the weight
            multiplies them (Hugging Face's Llama-family RMSNorm).
        normalized: Xs are the normalised inputs already, what the forward multiplied the
            weight by: no statistics are taken, nothing is rounded (``eps``, ``rms`` and
            ``rounded`` are not read).
        weight: return the weight gradients.
        bias: return the bias gradients.

    Returns:
        (weight gradients [L * B, d] or None, bias gradients [L * B, d] or None), fp32, layer
        by layer.
    """
    X, G = Xs[0], Gs[0]
    check_dtypes("norm_layer_grad_sample", X, G)
    if not norm_layer_fits(X) or G.shape != X.shape:
        raise ValueError(f"norm_layer_grad_sample takes inputs [B, d] or [B, T, d] with d <= {MAX_D} and "
                         f"backprops of their shape, got {tuple(X.shape)} and {tuple(G.shape)}")
    gx, gg = grouped(Xs), grouped(Gs)
    x_strides, g_strides = gx.strides, gg.strides
    if X.dim() == 2:  # one row per sample
        x_strides, g_strides = (x_strides[0], 0, x_strides[1]), (g_strides[0], 0, g_strides[1])
    B, d = X.shape[0], X.shape[-1]
    T = 1 if X.dim() == 2 else X.shape[1]
    LB = len(Xs) * B
    BD, BT, num_warps = blocks(d)
    # Split a sample's rows when the group has too few samples to fill the device.
    splits = max(1, min(cdiv(T, BT), _TARGET_PROGRAMS // max(LB, 1)))
    per_split = max(BT, cdiv(cdiv(T, splits), BT) * BT)  # T = 0: one empty split
    splits = max(1, cdiv(T, per_split))
    device = X.device
    gw = empty((LB, splits, d), torch.float32, device) if weight else None
    gb = empty((LB, splits, d), torch.float32, device) if bias else None
    if LB > 0 and T > 0 and (weight or bias):
        unused = placeholder(device)
        launch(
            _norm_layer_grad_sample_kernel, (LB * splits,),
            X, G, gx.table, gg.table,
            unused if gw is None else gw, unused if gb is None else gb,
            B, T, d, float(eps),
            *x_strides, *g_strides,
            splits, per_split, 2 if normalized else int(rms), ROUND_TO.get(X.dtype, 0) if rounded else 0, gx.on,
            WITH_WEIGHT=weight, WITH_BIAS=bias,
            BD=BD, BT=BT,
            num_warps=num_warps,
        )
    elif LB > 0:  # no rows: the gradients are zeros
        gw = None if gw is None else gw.zero_()
        gb = None if gb is None else gb.zero_()

    def total(parts: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if parts is None:
            return None
        return parts[:, 0] if splits == 1 else parts.sum(dim=1)

    return total(gw), total(gb)
