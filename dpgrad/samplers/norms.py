"""Grad samplers for normalisation layers: ``nn.LayerNorm`` and ``nn.RMSNorm``.

Their per-sample gradients are as small as their parameters, so ghost clipping takes norms
of these directly.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpgrad.kernels.reference import accumulation_dtype
from dpgrad.registry import register_grad_sampler


def _sum_to_param(x: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Sum (B, *, *param.shape) over every dimension but the batch and the parameter's own,
    in ``x``'s dtype (fp32 or fp64 here), and return it in the parameter's."""
    dims = list(range(1, x.dim() - param.dim()))
    return (x.sum(dim=dims) if dims else x).to(param.dtype)


def _weight_grad_sample(normed: torch.Tensor, backprops: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum_t normed[t] * g[t]`` per sample. Activations and backprops may differ in dtype
    (autocast): they meet in fp32 (fp64 for fp64)."""
    acc = accumulation_dtype(normed, backprops)
    return _sum_to_param(normed.to(acc) * backprops.to(acc), weight)


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(
    layer: nn.LayerNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of LayerNorm's weight and bias, (B, *normalized_shape) each."""
    x = activations[0]
    out = {}
    if layer.weight is not None and layer.weight.requires_grad:
        normed = F.layer_norm(x.to(accumulation_dtype(x, backprops)), layer.normalized_shape, eps=layer.eps)
        out[layer.weight] = _weight_grad_sample(normed, backprops, layer.weight)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = _sum_to_param(backprops.to(accumulation_dtype(backprops)), layer.bias)
    return out


@register_grad_sampler(nn.RMSNorm)
def rms_norm_grad_sample(
    layer: nn.RMSNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of RMSNorm's weight, (B, *normalized_shape)."""
    x = activations[0]
    if layer.weight is None or not layer.weight.requires_grad:
        return {}
    # eps=None means the input dtype's epsilon, as in the forward pass, not the upcast's.
    eps = layer.eps if layer.eps is not None else torch.finfo(x.dtype).eps
    normed = F.rms_norm(x.to(accumulation_dtype(x, backprops)), layer.normalized_shape, eps=eps)
    return {layer.weight: _weight_grad_sample(normed, backprops, layer.weight)}
