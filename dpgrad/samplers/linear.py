"""Samplers for ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2's projections).

Inputs of any rank (B, *, d) are flattened to (B, T, d) (a view when the strides allow it,
else one copy); 2-D inputs have T = 1. The autotuner (dpgrad.tuning) picks the kernel per
layer shape among those ``dpgrad.backend`` allows: Triton for CUDA tensors, eager otherwise.

``transformers.pytorch_utils.Conv1D`` computes ``x @ W + b`` with W stored (d, p), the
transpose of a Linear's: its per-sample weight gradient ``A_b^T G_b`` is a Linear's with the
roles of A and G swapped, its norm a Linear's. It is registered by dotted path (dpgrad never
imports transformers).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from dpgrad.backend import ops_for
from dpgrad.kernels.reference import accumulation_dtype
from dpgrad.registry import (
    register_clipped_sum_sampler,
    register_factor_sampler,
    register_grad_sampler,
    register_norm_sampler,
)
from dpgrad.tuning import get_tuner

CONV1D = "transformers.pytorch_utils.Conv1D"
LAYERS = [nn.Linear, CONV1D]


def flatten_tokens(activations: torch.Tensor, backprops: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, *, d) inputs and (B, *, p) backprops -> (B, T, d) and (B, T, p)."""
    B = backprops.shape[0]
    T = math.prod(backprops.shape[1:-1])
    A = activations.reshape(B, T, activations.shape[-1])
    G = backprops.reshape(B, T, backprops.shape[-1])
    return A, G


def _trainable(layer: nn.Module) -> Tuple[bool, bool]:
    return layer.weight.requires_grad, layer.bias is not None and layer.bias.requires_grad


def _transposed(layer: nn.Module) -> bool:
    """Whether the weight is stored (d, p), as Conv1D's is, rather than a Linear's (p, d)."""
    return not isinstance(layer, nn.Linear)


def _bias_clipped_sum(ops, G: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_b c_b sum_t G_b[t]`` (p,) from the token sums: no GEMM."""
    acc = accumulation_dtype(G)
    sums = ops.linear_bias_grad_sample(G, out_dtype=acc)
    return (coef.to(device=G.device, dtype=acc) @ sums).to(dtype)


@register_grad_sampler(LAYERS)
def linear_grad_sample(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients in the parameters' dtypes: weight (B, *weight.shape), bias (B, p)."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = _trainable(layer)
    out = {}
    if weight and _transposed(layer):
        ops = get_tuner().select("linear_grad_sample", (A, G), layer).ops()
        out[layer.weight] = ops.linear_per_sample(G, A, out_dtype=layer.weight.dtype).weight
    elif weight:
        ops = get_tuner().select("linear_grad_sample", (A, G), layer).ops()
        res = ops.linear_per_sample(A, G, bias=bias, out_dtype=layer.weight.dtype)
        out[layer.weight] = res.weight
        if bias:
            out[layer.bias] = res.bias.to(layer.bias.dtype)
            return out
    if bias:
        out[layer.bias] = ops_for(A, G).linear_bias_grad_sample(G).to(layer.bias.dtype)
    return out


@register_norm_sampler(LAYERS)
def linear_norm_sample(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms, (B,) each, without per-sample gradients.

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


@register_clipped_sum_sampler(LAYERS)
def linear_clipped_sum(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor, coef: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradients, ``(c ⊙ G)^T A`` (transposed for Conv1D) and ``sum_b c_b sum_t
    G_b[t]`` (p,), in the parameters' dtypes, accumulated in fp32; coef: (B,)."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = _trainable(layer)
    ops = ops_for(A, G)
    out = {}
    if weight and _transposed(layer):
        out[layer.weight] = ops.linear_clipped_sum(G, A, coef, out_dtype=layer.weight.dtype)[0]
    elif weight:
        w, b = ops.linear_clipped_sum(A, G, coef, bias=bias, out_dtype=layer.weight.dtype)
        out[layer.weight] = w
        if bias:
            out[layer.bias] = b.to(layer.bias.dtype)
            return out
    if bias:
        # A frozen weight (bias-only fine-tuning), or a Conv1D: no GEMM, only the token sums.
        out[layer.bias] = _bias_clipped_sum(ops, G, coef, layer.bias.dtype)
    return out


@register_factor_sampler(LAYERS)
def linear_factors(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, Tuple[torch.Tensor, torch.Tensor]]:
    """The per-sample gradients as sums of outer products: weight ``sum_t G[t] ⊗ A[t]``
    (``A[t] ⊗ G[t]`` for Conv1D), bias ``sum_t G[t] ⊗ 1``."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = _trainable(layer)
    out = {}
    if weight:
        out[layer.weight] = (A, G) if _transposed(layer) else (G, A)
    if bias:
        out[layer.bias] = (G, G.new_ones(1, 1, 1).expand(G.shape[0], G.shape[1], 1))
    return out
