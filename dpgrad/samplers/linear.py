"""Samplers for ``nn.Linear``: per-sample gradients and per-sample gradient norms.

Inputs of any rank (B, *, d) are flattened to (B, T, d); 2-D inputs have T = 1.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from dpgrad.kernels import reference
from dpgrad.registry import register_grad_sampler, register_norm_sampler


def flatten_tokens(activations: torch.Tensor, backprops: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, *, d) inputs and (B, *, p) backprops -> (B, T, d) and (B, T, p)."""
    B = backprops.shape[0]
    T = math.prod(backprops.shape[1:-1])
    A = activations.reshape(B, T, activations.shape[-1])
    G = backprops.reshape(B, T, backprops.shape[-1])
    return A, G


@register_grad_sampler(nn.Linear)
def linear_grad_sample(
    layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a Linear layer: weight (B, p, d), bias (B, p)."""
    A, G = flatten_tokens(activations[0], backprops)
    out = {}
    if layer.weight.requires_grad:
        out[layer.weight] = reference.linear_grad_sample(A, G)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = reference.linear_bias_grad_sample(G)
    return out


@register_norm_sampler(nn.Linear)
def linear_norm_sample(
    layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms of a Linear layer, (B,) each, without per-sample gradients.

    The weight norm uses the cheaper of the Gram and direct forms for the layer shape; the
    bias norm is ``||sum_t g_t||``.
    """
    A, G = flatten_tokens(activations[0], backprops)
    out = {}
    if layer.weight.requires_grad:
        out[layer.weight] = reference.linear_weight_sq_norm(A, G).sqrt()
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = reference.linear_bias_sq_norm(G).sqrt()
    return out
