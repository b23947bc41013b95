"""Linear per-sample weight norms, "direct": tiles of ``G_b^T A_b`` squared in registers.

The tiles are the ones of the per-sample gradient kernel (linear_grad_sample.py) with the
store switched off: 2*B*T*p*d flops, the same as the weight-gradient GEMM, and O(B) extra
memory (one fp32 partial per sample and tile; the per-sample gradient is never written).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .linear_grad_sample import linear_per_sample, linear_per_sample_grouped


def linear_weight_sq_norm_direct(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms ``||G_b^T A_b||_F^2``.

    Args:
        A: inputs, [B, T, d], fp32/bf16/fp16, any strides.
        G: backprops, [B, T, p], fp32/bf16/fp16, any strides.

    Returns:
        [B] fp32.
    """
    return linear_per_sample(A, G, grad=False, norm=True).weight_sq_norm


def linear_weight_sq_norm_direct_grouped(As: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``linear_weight_sq_norm_direct`` of L layers of one shape in one launch.

    Args:
        As: L inputs, [B, T, d] each, one dtype (fp32/bf16/fp16) and one set of strides.
        Gs: L backprops, [B, T, p] each, likewise.

    Returns:
        [L * B] fp32, layer by layer.
    """
    return linear_per_sample_grouped(As, Gs, grad=False, norm=True).weight_sq_norm
