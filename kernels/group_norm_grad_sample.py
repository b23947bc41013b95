"""Per-sample gradients of GroupNorm layers in Triton, for a group of layers of one shape in one
launch.

A GroupNorm with C channels in g groups normalises each sample's block of C/g channels times S
positions (``(x - mean) / sqrt(var + eps)``, the biased variance over the block, as the forward
pass) and scales channel c by weight[c]. For sample b, channel c:
- weight: ``sum_s x̂[c, s] g[c, s]``;
- bias: ``sum_s g[c, s]``.
One program owns one (sample, group) block and reads it twice: its mean first, then the
centred squares for the variance beside the per-channel sums, all in fp32 (two passes: no
cancellation of a large mean). Layer l's tensors are read where they are (a table of their
addresses); offsets are int64; any strides, the spatial positions flattened to one stride.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import check_dtypes, empty, grouped, launch, layer_pointer, placeholder

# A group's channels are held whole along one tile axis: more take the eager path (a block of
# 256 spills registers on some targets and Triton versions: tests/test_kernel_compile.py).
MAX_GROUP_CHANNELS = 128
# Elements of each [BC, BS] tile per thread (three fp32 accumulators of that shape).
_PER_THREAD = 8


@triton.jit(do_not_specialize=["B", "C", "S", "CG", "eps", "grouped"])
def _group_norm_grad_sample_kernel(
    X, G, X_PTRS, G_PTRS, GW, GB,
    B, C, S, CG, eps,
    s_xb, s_xc, s_xs, s_gb, s_gc, s_gs,
    grouped,
    WITH_WEIGHT: tl.constexpr, WITH_BIAS: tl.constexpr,
    BC: tl.constexpr, BS: tl.constexpr,
):
    # One flat grid axis over (layer and sample, group).
    pid = tl.program_id(0).to(tl.int64)
    groups = C // CG
    i_lb = pid // groups
    i_g = pid % groups
    p_x = layer_pointer(X, X_PTRS, i_lb // B, grouped)
    p_g = layer_pointer(G, G_PTRS, i_lb // B, grouped)
    i_b = i_lb % B
    o_k = tl.arange(0, BC).to(tl.int64)
    m_c = o_k < CG
    o_c = i_g * CG + o_k
    n = (CG * S).to(tl.float32)
    mean = 0.0
    if WITH_WEIGHT:
        b_sum = tl.zeros((BC, BS), dtype=tl.float32)
        for s0 in range(0, S, BS):
            o_s = s0 + tl.arange(0, BS).to(tl.int64)
            m = m_c[:, None] & (o_s[None, :] < S)
            # [BC, BS]
            b_sum += tl.load(p_x + i_b * s_xb + o_c[:, None] * s_xc + o_s[None, :] * s_xs, mask=m,
                             other=0.0).to(tl.float32)
        mean = tl.sum(tl.sum(b_sum, axis=1), axis=0) / n
    b_sq = tl.zeros((BC, BS), dtype=tl.float32)
    b_xg = tl.zeros((BC, BS), dtype=tl.float32)
    b_g = tl.zeros((BC, BS), dtype=tl.float32)
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS).to(tl.int64)
        m = m_c[:, None] & (o_s[None, :] < S)
        b_gr = tl.load(p_g + i_b * s_gb + o_c[:, None] * s_gc + o_s[None, :] * s_gs, mask=m, other=0.0).to(tl.float32)
        if WITH_WEIGHT:
            b_x = tl.load(p_x + i_b * s_xb + o_c[:, None] * s_xc + o_s[None, :] * s_xs, mask=m, other=0.0)
            b_xc = tl.where(m, b_x.to(tl.float32) - mean, 0.0)
            b_sq += b_xc * b_xc
            b_xg += b_xc * b_gr
        if WITH_BIAS:
            b_g += b_gr
    if WITH_WEIGHT:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(b_sq, axis=1), axis=0) / n + eps)
        tl.store(GW + i_lb * C + o_c, tl.sum(b_xg, axis=1) * rstd, mask=m_c)
    if WITH_BIAS:
        tl.store(GB + i_lb * C + o_c, tl.sum(b_g, axis=1), mask=m_c)


def blocks(channels_per_group: int) -> Tuple[int, int, int]:
    """(BC, BS, num_warps) of a launch: a group's channels whole (at least 8 rows: few compiled
    variants), as many positions a step (at least 8) as keep each tile at ``_PER_THREAD``
    elements per thread."""
    BC = max(8, triton.next_power_of_2(channels_per_group))
    num_warps = 4
    return BC, max(8, _PER_THREAD * 32 * num_warps // BC), num_warps


def _flat_spatial_stride(x: torch.Tensor) -> Optional[int]:
    """The stride of x's spatial positions taken as one dimension (x (B, C, *spatial)), or None
    where they do not flatten to one stride."""
    dims = x.shape[2:]
    strides = x.stride()[2:]
    for i in range(len(dims) - 1):
        if dims[i] > 1 and strides[i] != strides[i + 1] * dims[i + 1]:
            return None
    return strides[-1] if dims else 1


def group_norm_fits(X: torch.Tensor, groups: int) -> bool:
    """Whether the kernel takes inputs like X (B, C, *spatial) normalised in ``groups``: at most
    ``MAX_GROUP_CHANNELS`` channels a group, positions of one stride, a dtype it reads."""
    return (X.dim() >= 2 and X.shape[1] % groups == 0 and 0 < X.shape[1] // groups <= MAX_GROUP_CHANNELS
            and X.dtype in (torch.float32, torch.bfloat16, torch.float16) and _flat_spatial_stride(X) is not None)


def group_norm_grad_sample_grouped(
    Xs: Sequence[torch.Tensor],
    Gs: Sequence[torch.Tensor],
    groups: int,
    eps: float,
    *,
    weight: bool = True,
    bias: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per-sample weight and bias gradients of L GroupNorm layers of one shape in one launch,
    accumulated in fp32.

    Args:
        Xs: L inputs (B, C, *spatial), one dtype (fp32/bf16/fp16) and one set of strides, their
            spatial positions of one stride (``group_norm_fits``).
        Gs: L backprops of the layers' outputs, of Xs's shape, one dtype and one set of strides.
        groups: the layers' number of groups (C divisible by it).
        eps: the layers' epsilon.
        weight, bias: return the weight / bias gradients.

    Returns:
        (weight gradients [L * B, C] or None, bias gradients [L * B, C] or None), fp32, layer by
        layer.
    """
    X, G = Xs[0], Gs[0]
    check_dtypes("group_norm_grad_sample", X, G)
    if not group_norm_fits(X, groups) or G.shape != X.shape or not group_norm_fits(G, groups):
        raise ValueError(f"group_norm_grad_sample takes inputs (B, C, *spatial) with C / groups <= "
                         f"{MAX_GROUP_CHANNELS} and backprops of their shape, got {tuple(X.shape)} and "
                         f"{tuple(G.shape)} in {groups} groups")
    gx, gg = grouped(Xs), grouped(Gs)
    B, C = X.shape[:2]
    S = math.prod(X.shape[2:])
    LB = len(Xs) * B
    CG = C // groups
    device = X.device
    gw = empty((LB, C), torch.float32, device) if weight else None
    gb = empty((LB, C), torch.float32, device) if bias else None
    if LB > 0 and S == 0:  # no positions: the gradients are zeros
        return None if gw is None else gw.zero_(), None if gb is None else gb.zero_()
    if LB > 0 and (weight or bias):
        BC, BS, num_warps = blocks(CG)
        unused = placeholder(device)
        launch(
            _group_norm_grad_sample_kernel, (LB * groups,),
            X, G, gx.table, gg.table,
            unused if gw is None else gw, unused if gb is None else gb,
            B, C, S, CG, float(eps),
            gx.strides[0], gx.strides[1], _flat_spatial_stride(X),
            gg.strides[0], gg.strides[1], _flat_spatial_stride(G),
            gx.on,
            WITH_WEIGHT=weight, WITH_BIAS=bias,
            BC=BC, BS=BS,
            num_warps=num_warps,
        )
    return gw, gb


__all__ = ["MAX_GROUP_CHANNELS", "blocks", "group_norm_fits", "group_norm_grad_sample_grouped"]
