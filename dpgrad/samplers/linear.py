"""Samplers for ``nn.Linear``: per-sample gradients and per-sample gradient norms.

Inputs of any rank (B, *, d) are flattened to (B, T, d) (a view when the strides allow it,
else one copy); 2-D inputs have T = 1. The autotuner (dpgrad.tuning) picks the kernel per
layer shape among those ``dpgrad.backend`` allows: Triton for CUDA tensors, eager otherwise.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from dpgrad.backend import ops_for
from dpgrad.kernels.reference import accumulation_dtype
from dpgrad.tuning import get_tuner
from dpgrad.registry import register_clipped_sum_sampler, register_grad_sampler, register_norm_sampler


def flatten_tokens(activations: torch.Tensor, backprops: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, *, d) inputs and (B, *, p) backprops -> (B, T, d) and (B, T, p)."""
    B = backprops.shape[0]
    T = math.prod(backprops.shape[1:-1])
    A = activations.reshape(B, T, activations.shape[-1])
    G = backprops.reshape(B, T, backprops.shape[-1])
    return A, G


def _trainable(layer: nn.Linear) -> Tuple[bool, bool]:
    return layer.weight.requires_grad, layer.bias is not None and layer.bias.requires_grad


@register_grad_sampler(nn.Linear)
def linear_grad_sample(
    layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a Linear layer in the parameters' dtypes: weight (B, p, d), bias (B, p)."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = _trainable(layer)
    out = {}
    if weight:
        ops = get_tuner().select("linear_grad_sample", (A, G), layer).ops()
        res = ops.linear_per_sample(A, G, bias=bias, out_dtype=layer.weight.dtype)
        out[layer.weight] = res.weight
        if bias:
            out[layer.bias] = res.bias.to(layer.bias.dtype)
    elif bias:
        out[layer.bias] = ops_for(A, G).linear_bias_grad_sample(G).to(layer.bias.dtype)
    return out


@register_norm_sampler(nn.Linear)
def linear_norm_sample(
    layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms of a Linear layer, (B,) each, without per-sample gradients.

    The weight norm uses the candidate the autotuner picked for the shape (outer when T = 1,
    else Gram or direct, on Triton or eager); the bias norm is ``||sum_t g_t||``, fused into
    the direct pass when that is the choice.
    """
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = _trainable(layer)
    out = {}
    if weight:
        cand = get_tuner().select("linear_norm", (A, G), layer)
        if bias and cand.algorithm == "direct":
            res = cand.ops().linear_per_sample(A, G, grad=False, bias=True, norm=True)
            return {layer.weight: res.weight_sq_norm.sqrt(), layer.bias: res.bias_sq_norm.sqrt()}
        out[layer.weight] = cand.run(A, G).sqrt()
    if bias:
        out[layer.bias] = ops_for(A, G).linear_bias_sq_norm(G).sqrt()
    return out


@register_clipped_sum_sampler(nn.Linear)
def linear_clipped_sum(
    layer: nn.Linear, activations: List[torch.Tensor], backprops: torch.Tensor, coef: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradients of a Linear layer, ``(c ⊙ G)^T A`` (p, d) and ``sum_b c_b sum_t G_b[t]``
    (p,), in the parameters' dtypes, accumulated in fp32; coef: (B,)."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = _trainable(layer)
    ops = ops_for(A, G)
    out = {}
    if weight:
        w, b = ops.linear_clipped_sum(A, G, coef, bias=bias, out_dtype=layer.weight.dtype)
        out[layer.weight] = w
        if bias:
            out[layer.bias] = b.to(layer.bias.dtype)
    elif bias:
        # A frozen weight (e.g. bias-only fine-tuning): no GEMM, only the token sums.
        acc = accumulation_dtype(G)
        sums = ops.linear_bias_grad_sample(G, out_dtype=acc)
        out[layer.bias] = (coef.to(device=G.device, dtype=acc) @ sums).to(layer.bias.dtype)
    return out
