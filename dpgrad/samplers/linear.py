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
from dpgrad.kernels import reference
from dpgrad.kernels.reference import accumulation_dtype
from dpgrad.registry import (
    register_clipped_sum_sampler,
    register_factor_sampler,
    register_grad_sample_group,
    register_grad_sampler,
    register_norm_group,
    register_norm_sampler,
)
from dpgrad.samplers.groups import Group, cat, stackable, weighted_sums
from dpgrad.tuning import get_tuner

CONV1D = "transformers.pytorch_utils.Conv1D"
LAYERS = [nn.Linear, CONV1D]


def flatten_tokens(activations: torch.Tensor, backprops: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, *, d) inputs and (B, *, p) backprops -> (B, T, d) and (B, T, p)."""
    if activations.dim() == 3 and backprops.dim() == 3:
        return activations, backprops
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


@register_norm_group(LAYERS)
class LinearGroup(Group):
    """Linear (or Conv1D) layers whose inputs and backprops have the same shapes and dtypes.

    On the eager backend, small ones are concatenated along the batch: one product for all
    their weight norms, one batched product for all their clipped sums. On Triton, each layer
    is one launch of the kernel the autotuner chose for the shape (chosen once per group). The
    bias norms and clipped sums come from the token sums ``sum_t G_b[t]``, never a GEMM.
    """

    @classmethod
    def key(cls, layer, activations, backprops):
        x = activations[0]
        return (_transposed(layer), *_trainable(layer), x.shape, x.dtype, backprops.shape, backprops.dtype,
                layer.weight.dtype, x.device)

    def norms(self):
        layers = [layer for layer, _, _ in self.records]
        flat = [flatten_tokens(activations[0], backprops) for _, activations, backprops in self.records]
        self.records = []
        weight, bias = _trainable(layers[0])
        A0, G0 = flat[0]
        ops = ops_for(A0, G0)
        cand = get_tuner().select_group("linear_norm", flat, layers) if weight else None
        self._layers, self._ops = layers, ops
        self._stacked = ops is reference and (cand is None or cand.backend == "eager") and stackable(
            [g for _, g in flat]) and stackable([a for a, _ in flat])
        params = ([layer.weight for layer in layers] if weight else []) + ([layer.bias for layer in layers] if bias else [])
        if self._stacked:
            A, G = cat([a for a, _ in flat]), cat([g for _, g in flat])
            self._inputs = (A, G)
            rows = []
            if weight:
                rows.append(reference.linear_weight_norm(A, G, cand.algorithm))
            if bias:
                self._bias_sums = G.sum(dim=1, dtype=accumulation_dtype(G))
                rows.append(torch.linalg.vector_norm(self._bias_sums, dim=1))
            return params, cat(rows).view(len(params), G0.shape[0])
        self._inputs = flat
        w_rows, b_rows = [], []
        for A, G in flat:
            if weight and bias and cand.algorithm == "direct":
                res = cand.ops().linear_per_sample(A, G, grad=False, bias=True, norm=True)
                w_rows.append(res.weight_sq_norm)
                b_rows.append(res.bias_sq_norm)
                continue
            if weight:
                w_rows.append(cand.run(A, G))
            if bias:
                b_rows.append(ops.linear_bias_sq_norm(G))
        return params, torch.stack(w_rows + b_rows).sqrt()

    def clipped_sums(self, coef):
        layers, inputs = self._layers, self._inputs
        self._inputs = None
        weight, bias = _trainable(layers[0])
        transposed = _transposed(layers[0])
        out = []
        if self._stacked:
            A, G = inputs
            L, T, d, p = len(layers), A.shape[1], A.shape[2], G.shape[2]
            B = A.shape[0] // L
            if weight:
                acc = accumulation_dtype(A, G)
                A3 = A.view(L, B * T, d).to(acc)
                scaled = G.view(L, B * T, p).to(acc) * coef.per_token(T)
                sums = torch.bmm(A3.mT, scaled) if transposed else torch.bmm(scaled.mT, A3)
                out.extend((layer.weight, s.to(layer.weight.dtype)) for layer, s in zip(layers, sums.unbind(0)))
            if bias:
                sums = weighted_sums(coef, self._bias_sums.view(L, B, p))
                out.extend((layer.bias, s.to(layer.bias.dtype)) for layer, s in zip(layers, sums.unbind(0)))
            self._bias_sums = None
            return out
        ops = self._ops
        for layer, (A, G) in zip(layers, inputs):
            if weight and transposed:
                out.append((layer.weight, ops.linear_clipped_sum(G, A, coef.sample, out_dtype=layer.weight.dtype)[0]))
            elif weight:
                w, b = ops.linear_clipped_sum(A, G, coef.sample, bias=bias, out_dtype=layer.weight.dtype)
                out.append((layer.weight, w))
                if bias:
                    out.append((layer.bias, b.to(layer.bias.dtype)))
                    continue
            if bias:
                out.append((layer.bias, _bias_clipped_sum(ops, G, coef.sample, layer.bias.dtype)))
        return out


@register_grad_sample_group(LAYERS)
class LinearGradSampleGroup(LinearGroup):
    """Linear (or Conv1D) layers clipped from their per-sample gradients, kept in fp32: those
    whose per-sample gradients are small (LoRA adapters, for which they are far smaller than
    the inputs and backprops book-keeping would keep), or all of them without ghost clipping.
    The norms come with the gradients (one pass); the clipped sums are ``coef @ g``, a small
    product. Eager: small groups in one batched product; Triton: one launch per layer."""

    def norms(self):
        layers = [layer for layer, _, _ in self.records]
        flat = [flatten_tokens(activations[0], backprops) for _, activations, backprops in self.records]
        self.records = []
        weight, bias = _trainable(layers[0])
        A0, G0 = flat[0]
        L, B = len(flat), G0.shape[0]
        acc = accumulation_dtype(A0, G0)
        ops = ops_for(A0, G0)
        cand = get_tuner().select_group("linear_grad_sample", flat, layers) if weight else None
        transposed = _transposed(layers[0])
        if ops is reference and (cand is None or cand.backend == "eager") and stackable(
                [g for _, g in flat]) and stackable([a for a, _ in flat]):
            flat = [(cat([a for a, _ in flat]), cat([g for _, g in flat]))]
        w_grads, w_rows, b_grads = [], [], []
        for A, G in flat:
            if weight:
                # Conv1D's (d, p) weight: the same product with the roles of A and G swapped.
                res = cand.ops().linear_per_sample(*((G, A) if transposed else (A, G)), bias=bias and not transposed,
                                                   norm=True, out_dtype=acc)
                w_grads.append(res.weight)
                w_rows.append(res.weight_sq_norm)
                if res.bias is not None:
                    b_grads.append(res.bias)
                    continue
            if bias:
                b_grads.append(ops.linear_bias_grad_sample(G, out_dtype=acc))
        self._layers = layers
        self._grads = (cat(w_grads) if weight else None, cat(b_grads) if bias else None)
        params = ([layer.weight for layer in layers] if weight else []) + ([layer.bias for layer in layers] if bias else [])
        rows = ([cat(w_rows).sqrt()] if weight else []) + ([torch.linalg.vector_norm(self._grads[1], dim=1)] if bias else [])
        return params, cat(rows).view(len(params), B)

    def clipped_sums(self, coef):
        layers, (w, b) = self._layers, self._grads
        self._grads = None
        L = len(layers)
        out = []
        if w is not None:
            sums = weighted_sums(coef, w.view(L, -1, w.shape[1] * w.shape[2])).view(L, w.shape[1], w.shape[2])
            out.extend((layer.weight, s.to(layer.weight.dtype)) for layer, s in zip(layers, sums.unbind(0)))
        if b is not None:
            sums = weighted_sums(coef, b.view(L, -1, b.shape[1]))
            out.extend((layer.bias, s.to(layer.bias.dtype)) for layer, s in zip(layers, sums.unbind(0)))
        return out
