"""Grad samplers for normalisation layers: ``nn.LayerNorm`` and ``nn.RMSNorm``.

Their per-sample gradients are as small as their parameters, so ghost clipping takes norms
of these directly.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpgrad.registry import register_grad_sampler


def _sum_to_param(x: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Sum (B, *, *param.shape) over every dimension but the batch and the parameter's own."""
    dims = list(range(1, x.dim() - param.dim()))
    return x.sum(dim=dims) if dims else x


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(
    layer: nn.LayerNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of LayerNorm's weight and bias, (B, *normalized_shape) each."""
    x = activations[0]
    out = {}
    if layer.weight is not None and layer.weight.requires_grad:
        normed = F.layer_norm(x, layer.normalized_shape, eps=layer.eps)
        out[layer.weight] = _sum_to_param(normed.to(backprops.dtype) * backprops, layer.weight)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = _sum_to_param(backprops, layer.bias)
    return out


@register_grad_sampler(nn.RMSNorm)
def rms_norm_grad_sample(
    layer: nn.RMSNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of RMSNorm's weight, (B, *normalized_shape)."""
    x = activations[0]
    if layer.weight is None or not layer.weight.requires_grad:
        return {}
    normed = F.rms_norm(x, layer.normalized_shape, eps=layer.eps)
    return {layer.weight: _sum_to_param(normed.to(backprops.dtype) * backprops, layer.weight)}
