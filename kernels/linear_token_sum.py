"""Closed forms of a Linear layer that only sum over tokens, in Triton.

- bias gradient ``sum_t G_b[t]`` (B, p) and its squared norm ``||sum_t G_b[t]||^2``;
- the weight norm when T == 1 (2-D inputs): ``||a_b||^2 * ||g_b||^2``.
All are O(B*T*n) reads; none needs a Gram matrix. One program owns an n-tile of one sample
and runs over the tokens. Inputs are read through their strides; offsets are int64.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import ROUND_TO, cdiv, check_dtypes, configs, empty
from .triton_common import keep_only, launch, min_block, one_family, placeholder, prune_for, round_to_bf16
from .triton_common import grouped, layer_pointer

CONFIGS = configs(
    [dict(BN=bn, BT=bt) for bn in (128, 256, 512) for bt in (8, 32)],
    interpret=dict(BN=64, BT=16),
    num_warps=(4,),
)
_CLEAN = ["BN=128 BT=8 w4", "BN=128 BT=32 w4", "BN=256 BT=8 w4", "BN=512 BT=8 w4"]
keep_only("_token_sum_kernel", one_family("X"), {"fp32": _CLEAN, "half": _CLEAN})
_MIN_BN = min_block(CONFIGS, "BN")


# Norm partials are laid out for the smallest tiles: clear what tuning leaves (reset_to_zero).
@triton.autotune(configs=CONFIGS, key=["n", "WRITE_SUM", "WITH_NORM"], reset_to_zero=["SQ"],
                 prune_configs_by=prune_for("_token_sum_kernel"))
@triton.jit(do_not_specialize=["B", "T", "grouped", "round_to"])
def _token_sum_kernel(
    X, X_PTRS, SUM, SQ,
    B, T, n,
    s_b, s_t, s_n,
    n_tiles_max, grouped, round_to,
    WRITE_SUM: tl.constexpr, WITH_NORM: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr,
):
    # One flat grid axis: L * B may exceed the 65535 limit of the other axes. Outputs are laid
    # out by the sample over the group's layers (i_lb).
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(n, BN)
    i_lb = pid // n_tiles
    i_n = pid % n_tiles
    p_x = layer_pointer(X, X_PTRS, i_lb // B, grouped)
    i_b = i_lb % B
    o_n = i_n * BN + tl.arange(0, BN).to(tl.int64)
    m_n = o_n < n
    b_sum = tl.zeros((BN,), dtype=tl.float32)
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT).to(tl.int64)
        # [BT, BN]
        b_x = tl.load(p_x + i_b * s_b + o_t[:, None] * s_t + o_n[None, :] * s_n,
                      mask=(o_t[:, None] < T) & m_n[None, :], other=0.0)
        b_x = b_x.to(tl.float32)
        if round_to == 1:  # fp32 inputs as autocast gave them to an fp16 matmul
            b_x = b_x.to(tl.float16).to(tl.float32)
        elif round_to == 2:  # to a bf16 one
            b_x = round_to_bf16(b_x)
        b_sum += tl.sum(b_x, axis=0)
    if WRITE_SUM:
        tl.store(SUM + i_lb * n + o_n, b_sum.to(SUM.dtype.element_ty), mask=m_n)
    if WITH_NORM:
        tl.store(SQ + i_lb * n_tiles_max + i_n, tl.sum(b_sum * b_sum))


def token_sum(
    X: torch.Tensor, *, write_sum: bool = True, norm: bool = False, out_dtype: Optional[torch.dtype] = None
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``S_b = sum_t X_b[t]`` and/or ``||S_b||^2``, summed in fp32.

    Args:
        X: [B, T, n], fp32/bf16/fp16, any strides.
        write_sum: return the sums.
        norm: return their squared norms.
        out_dtype: the sums' dtype; default X's.

    Returns:
        (sums [B, n] in ``out_dtype`` or None, squared norms [B] fp32 or None).
    """
    return token_sum_grouped([X], write_sum=write_sum, norm=norm, out_dtype=out_dtype)


def token_sum_grouped(
    Xs: Sequence[torch.Tensor], *, write_sum: bool = True, norm: bool = False, out_dtype: Optional[torch.dtype] = None,
    round_to: Optional[torch.dtype] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``token_sum`` of L tensors of one shape in one launch, each read where it is.

    Args:
        Xs: L tensors, [B, T, n] each, one dtype (fp32/bf16/fp16) and one set of strides.
        write_sum, norm, out_dtype: as for ``token_sum``.
        round_to: a half dtype to round fp32 values to before they are summed (in registers):
            the inputs of an autocast matmul.

    Returns:
        (sums [L * B, n] or None, squared norms [L * B] fp32 or None), layer by layer.
    """
    X = Xs[0]
    check_dtypes("token_sum", X)
    gx = grouped(Xs)
    B, T, n = X.shape
    LB = len(Xs) * B
    n_tiles_max = cdiv(n, _MIN_BN)
    out = empty((LB, n), out_dtype or X.dtype, X.device) if write_sum else None
    sq = torch.zeros(LB, n_tiles_max, dtype=torch.float32, device=X.device) if norm else None
    if LB * n > 0:
        unused = placeholder(X.device)
        launch(_token_sum_kernel, lambda meta: (cdiv(n, meta["BN"]) * LB,),
            X, gx.table, out, unused if sq is None else sq, B, T, n, *gx.strides,
            n_tiles_max, gx.on, ROUND_TO.get(round_to, 0) if X.dtype == torch.float32 else 0,
            WRITE_SUM=write_sum, WITH_NORM=norm,
        )
    return out, sq.sum(dim=1) if norm else None


def linear_bias_grad_sample_grouped(Gs: Sequence[torch.Tensor], out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``linear_bias_grad_sample`` of L layers of one shape in one launch: [L * B, p], layer by
    layer (Gs: L backprops [B, T, p], one dtype and one set of strides)."""
    return token_sum_grouped(Gs, out_dtype=out_dtype)[0]


def linear_bias_grad_sample(G: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Per-sample bias gradients ``sum_t G_b[t]``, summed in fp32.

    Args:
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides.
        out_dtype: the result's dtype; default G's.

    Returns:
        [B, p] in ``out_dtype``.
    """
    return token_sum(G, out_dtype=out_dtype)[0]


def linear_bias_sq_norm(G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample bias-gradient norms ``||sum_t G_b[t]||^2``.

    Args:
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides.

    Returns:
        [B] fp32.
    """
    return token_sum(G, write_sum=False, norm=True)[1]


def linear_weight_sq_norm_outer_grouped(As: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``linear_weight_sq_norm_outer`` of L layers of one shape in two launches: [L * B] fp32,
    layer by layer (As: L inputs [B, 1, d], Gs: L backprops [B, 1, p], each one dtype and one
    set of strides)."""
    if As[0].shape[1] != 1:
        raise ValueError(f"the 'outer' norm needs T == 1, got T = {As[0].shape[1]}")
    a_dtype, g_dtype = As[0].dtype, Gs[0].dtype
    return (token_sum_grouped(As, write_sum=False, norm=True, round_to=g_dtype)[1]
            * token_sum_grouped(Gs, write_sum=False, norm=True, round_to=a_dtype)[1])


def linear_weight_sq_norm_outer(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight norms when T == 1: ``||a_b||^2 * ||g_b||^2``.

    Args:
        A: inputs, [B, 1, d], fp32/bf16/fp16, any strides.
        G: backprops, [B, 1, p], fp32/bf16/fp16, any strides.

    Returns:
        [B] fp32.
    """
    return linear_weight_sq_norm_outer_grouped([A], [G])
