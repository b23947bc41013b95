"""Eager-PyTorch versions of the convolution launchers (``dpgrad.kernels.reference`` re-exports
them), on ``conv_unfold``'s geometry: per-sample weight gradients, their squared norms by a
Linear algorithm on the unfolded input or from the gradients themselves, and clipped sums by
one convolution backward. The Triton backend uses the same functions with its own Linear
kernels (``triton_ops``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import conv_unfold
from .conv_unfold import ConvGeometry
from .reference_common import accumulation_dtype, autocast_operands, batch_slices, sq_norms
from .reference_linear import linear_weight_sq_norm_direct, linear_weight_sq_norm_gram


def _conv_operands(x: torch.Tensor, G: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A convolution's input and backprops in the accumulation dtype, as autocast's forward took
    them (``autocast_operands``): fp32 copies of half ones, for the convolution's backward."""
    x, G = autocast_operands(x, G)
    acc = accumulation_dtype(x, G)
    return x.to(acc), G.to(acc)


def conv_per_sample(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry, weight_shape: Tuple[int, ...]) -> torch.Tensor:
    """Per-sample weight gradients of a convolution, (B, *weight_shape) in fp32 (fp64 for
    fp64): x (B, C_in, *S), G (B, C_out, *out). B times the weight's memory, no unfolding."""
    return conv_unfold.per_sample_weight(*_conv_operands(x, G), geom, weight_shape)


def conv_weight_sq_norm_grad_sample(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry,
                                    batch_slice: Optional[int] = None) -> torch.Tensor:
    """Squared per-sample weight-gradient norms from the per-sample gradients, a batch slice at
    a time (a slice's gradients at most CHUNK_ELEMENTS, and at most ``batch_slice`` samples
    where it is given): (B,)."""
    B, C_out = x.shape[0], G.shape[1]
    shape = (C_out, x.shape[1] // geom.groups, *geom.kernel_size)
    out = torch.empty(B, dtype=accumulation_dtype(x, G), device=x.device)
    for s in batch_slices(B, math.prod(shape), batch_slice):
        # Slices cut small (memory short) widen their gradients a piece at a time too.
        grads = conv_per_sample(x[s], G[s], geom, shape).flatten(1)
        out[s] = sq_norms(grads, 1, pieces=True if batch_slice is not None else None)
    return out


def conv_weight_sq_norm_unfolded(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry, linear_sq_norm,
                                 batch_slice: Optional[int] = None, rows_contiguous: bool = True) -> torch.Tensor:
    """Squared per-sample weight-gradient norms by a Linear algorithm ``linear_sq_norm(A, G)``
    on the unfolded input (``conv_unfold``; ``rows_contiguous=False`` where ``linear_sq_norm``
    takes a transposed one, as torch's products do), summed over the groups: (B,). The
    unfolded input (T * C_in * K elements per sample) is built a batch slice at a time, of at
    most ``batch_slice`` samples where it is given."""
    B, g = x.shape[0], geom.groups
    T = math.prod(G.shape[2:])
    out = torch.empty(B, dtype=accumulation_dtype(x, G), device=x.device)
    for s in batch_slices(B, T * x.shape[1] * geom.positions, batch_slice):
        U = conv_unfold.unfold(x[s], geom, rows_contiguous)
        out[s] = linear_sq_norm(U, conv_unfold.grouped_backprops(G[s], g)).view(-1, g).sum(1)
    return out


def conv_weight_sq_norm_gram(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry,
                             batch_slice: Optional[int] = None) -> torch.Tensor:
    """``conv_weight_sq_norm_unfolded`` by the Gram ("ghost norm") algorithm: (B,)."""
    return conv_weight_sq_norm_unfolded(x, G, geom, linear_weight_sq_norm_gram, batch_slice, rows_contiguous=False)


def conv_weight_sq_norm_direct(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry,
                               batch_slice: Optional[int] = None) -> torch.Tensor:
    """``conv_weight_sq_norm_unfolded`` by the direct algorithm: (B,)."""
    return conv_weight_sq_norm_unfolded(x, G, geom, linear_weight_sq_norm_direct, batch_slice, rows_contiguous=False)


def conv_clipped_sum(x: torch.Tensor, G: torch.Tensor, coef: torch.Tensor, geom: ConvGeometry,
                     weight_shape: Tuple[int, ...], out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The clipped weight gradient ``sum_b c_b G_b^T U_b`` (weight_shape) by one convolution
    backward on the scaled backprops (no unfolded input, no per-sample gradient); accumulated in
    fp32 (fp64 for fp64), returned in ``out_dtype`` (default G's dtype). coef: (B,)."""
    xa, Ga = _conv_operands(x, G)
    scaled = Ga * coef.to(device=Ga.device, dtype=Ga.dtype).view(-1, *([1] * (Ga.dim() - 1)))
    return conv_unfold.weight_gradient(xa, scaled, geom, weight_shape).to(out_dtype or G.dtype)
