"""Convolutions seen as Linear layers over their unfolded inputs, and their weight gradients
by the convolution's own backward.

A convolution with C_in input channels, C_out output channels, g groups and a kernel of K
positions (k1 * k2 * ...), producing T output positions per sample, is per sample and group a
Linear layer over T tokens: row t of the unfolded input U (B*g, T, C_in/g * K) is the input
patch output position t reads (``unfold``), row t of the grouped backprops (B*g, T, C_out/g)
the output gradient there (``grouped_backprops``). The per-sample weight gradient of group j
is ``G_bj^T U_bj``, and the weight (C_out, C_in/g, *k) is those g blocks stacked, so every
Linear algorithm (direct, Gram) applies unchanged, with squared norms summed over the groups.
U holds about K / prod(stride) times the input's elements; the functions that need it build
it one batch slice at a time.

The weight gradient itself needs no unfolding: the convolution's backward (cuDNN on a GPU)
computes ``sum_b G_b^T U_b`` as one GEMM-like pass over B*T (``weight_gradient``), and the
per-sample gradients (B, C_out, C_in/g, *k) are the same call with the batch folded into the
groups (``per_sample_weight``).

Tensors in, tensors out; ``ConvGeometry`` describes the layer (``dpgrad.samplers.conv``
builds it from an ``nn.Conv*d``).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Tuple

import torch
import torch.nn.functional as F


class ConvGeometry(NamedTuple):
    """What a convolution's weight gradient depends on besides its inputs.

    ``pad`` is in ``F.pad``'s order (last spatial dimension first, (before, after) each), as
    the layer's forward pads: an int padding, "same" (the odd element after) or "valid".
    """

    kernel_size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dilation: Tuple[int, ...]
    pad: Tuple[int, ...]
    padding_mode: str  # "zeros", "reflect", "replicate" or "circular"
    groups: int

    @property
    def dims(self) -> int:
        return len(self.kernel_size)

    @property
    def positions(self) -> int:
        """K: the kernel's positions."""
        return math.prod(self.kernel_size)


def _symmetric_zeros(geom: ConvGeometry) -> bool:
    pad = geom.pad
    return geom.padding_mode == "zeros" and all(pad[i] == pad[i + 1] for i in range(0, len(pad), 2))


def padded(x: torch.Tensor, geom: ConvGeometry) -> Tuple[torch.Tensor, List[int]]:
    """The input as the convolution reads it, and the padding left to the convolution: x itself
    with its symmetric zero padding, else a padded copy (reflect, replicate, circular, or
    "same" with an even span) with none."""
    if _symmetric_zeros(geom):
        return x, [geom.pad[2 * (geom.dims - 1 - i)] for i in range(geom.dims)]
    mode = "constant" if geom.padding_mode == "zeros" else geom.padding_mode
    return F.pad(x, list(geom.pad), mode=mode), [0] * geom.dims


def unfold(x: torch.Tensor, geom: ConvGeometry, rows_contiguous: bool = True) -> torch.Tensor:
    """The unfolded input: x (B, C_in, *S) -> (B*g, T, C_in/g * K), each row the patch one
    output position reads, its columns in the weight's (C_in/g, *k) order. A copy of
    B*T*C_in*K elements. With ``rows_contiguous=False`` a 2-D convolution's comes from
    ``F.unfold`` (im2col, faster than the strided copy on a CPU) as a transposed view, its columns
    contiguous instead (for products that take either layout, as torch's do)."""
    if not rows_contiguous and geom.dims == 2:
        xp, padding = padded(x, geom)
        B, C = x.shape[:2]
        U = F.unfold(xp, geom.kernel_size, dilation=geom.dilation, padding=padding, stride=geom.stride)
        return U.view(B * geom.groups, (C // geom.groups) * geom.positions, -1).transpose(1, 2)
    mode = "constant" if geom.padding_mode == "zeros" else geom.padding_mode
    u = F.pad(x, list(geom.pad), mode=mode) if any(geom.pad) else x
    B, C = x.shape[:2]
    n, g = geom.dims, geom.groups
    for i in range(n):
        span = geom.dilation[i] * (geom.kernel_size[i] - 1) + 1
        u = u.unfold(2 + i, span, geom.stride[i])  # window appended as the last dimension
        if geom.dilation[i] > 1:
            u = u[..., ::geom.dilation[i]]
    out = u.shape[2:2 + n]
    # (B, g, C/g, *out, *k) -> (B, g, *out, C/g, *k)
    u = u.reshape(B, g, C // g, *out, *geom.kernel_size)
    order = [0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n)]
    return u.permute(order).reshape(B * g, math.prod(out), (C // g) * geom.positions)


def grouped_backprops(G: torch.Tensor, groups: int) -> torch.Tensor:
    """Output gradients (B, C_out, *out) -> (B*g, T, C_out/g), the Linear layout of ``unfold``'s
    groups (a copy unless C_out/g or T is 1 with the strides allowing a view)."""
    B, C = G.shape[:2]
    T = math.prod(G.shape[2:])
    return G.reshape(B, groups, C // groups, T).transpose(2, 3).reshape(B * groups, T, C // groups)


def weight_gradient(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry, weight_shape: Tuple[int, ...]) -> torch.Tensor:
    """``sum_b G_b^T U_b`` in the weight's shape by the convolution's backward: x (B, C_in, *S),
    G (B, C_out, *out) of one dtype; the result in it (accumulated by the backend)."""
    xp, padding = padded(x, geom)
    # The backward reads the weight's shape and dtype only: a broadcast zero stands for it.
    weight = G.new_zeros(()).expand(weight_shape)
    return torch.ops.aten.convolution_backward(
        G, xp, weight, None, list(geom.stride), padding, list(geom.dilation), False, [0] * geom.dims,
        geom.groups, [False, True, False])[1]


def per_sample_weight(x: torch.Tensor, G: torch.Tensor, geom: ConvGeometry, weight_shape: Tuple[int, ...]) -> torch.Tensor:
    """Per-sample weight gradients (B, *weight_shape): one convolution backward with the batch
    folded into the groups (B*g groups), no unfolded input. x and G of one dtype."""
    B = x.shape[0]
    if B == 0:
        return G.new_zeros((0, *weight_shape))
    x1 = x.reshape(1, B * x.shape[1], *x.shape[2:])
    G1 = G.reshape(1, B * G.shape[1], *G.shape[2:])
    grouped = weight_gradient(x1, G1, geom._replace(groups=B * geom.groups), (B * weight_shape[0], *weight_shape[1:]))
    return grouped.view(B, *weight_shape)


__all__ = ["ConvGeometry", "grouped_backprops", "padded", "per_sample_weight", "unfold", "weight_gradient"]
