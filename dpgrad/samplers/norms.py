"""Grad samplers for normalisation layers: ``nn.LayerNorm`` and ``nn.RMSNorm``.

Their per-sample gradients are as small as their parameters, so ghost clipping takes norms
of these directly; ``NormLayerGroup`` computes those of many such layers at once.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpgrad.kernels.reference import accumulation_dtype
from dpgrad.registry import register_grad_sample_group, register_grad_sampler
from dpgrad.samplers.groups import Group, cat, clipped_sums_of, row_norms, stackable


def _sum_tokens(x: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Sum (N, *, *shape) over every dimension but the first and the trailing ``shape``, in ``dtype``."""
    dims = list(range(1, x.dim() - len(shape)))
    return x.sum(dim=dims, dtype=dtype) if dims else x.to(dtype)


def _eps(layer: nn.Module, x: torch.Tensor) -> float:
    # RMSNorm's eps=None means the input dtype's epsilon, as in the forward pass, not the upcast's.
    if isinstance(layer, nn.RMSNorm) and layer.eps is None:
        return torch.finfo(x.dtype).eps
    return layer.eps


def _trainable(layer: nn.Module) -> Tuple[bool, bool]:
    weight = getattr(layer, "weight", None) is not None and layer.weight.requires_grad
    bias = getattr(layer, "bias", None) is not None and layer.bias.requires_grad
    return weight, bias


def per_sample_grads(layer: nn.Module, x: torch.Tensor, backprops: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per-sample gradients of the weight and the bias (None where frozen or absent), (N,
    *normalized_shape) each, in fp32 (fp64 for fp64). Activations and backprops may differ in
    dtype (autocast): they meet in the accumulation dtype."""
    weight, bias = _trainable(layer)
    acc = accumulation_dtype(x, backprops)
    shape = layer.normalized_shape
    gw = gb = None
    if weight:
        norm = F.rms_norm if isinstance(layer, nn.RMSNorm) else F.layer_norm
        normed = norm(x.to(acc), shape, eps=_eps(layer, x))
        # The product promotes half backprops to the accumulation dtype: no copy of its own.
        gw = _sum_tokens(normed * backprops, shape, acc)
    if bias:
        gb = _sum_tokens(backprops, shape, acc)
    return gw, gb


@register_grad_sampler([nn.LayerNorm, nn.RMSNorm])
def norm_layer_grad_sample(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a LayerNorm's or RMSNorm's weight and bias, (B,
    *normalized_shape) each, in the parameters' dtypes."""
    gw, gb = per_sample_grads(layer, activations[0], backprops)
    out = {}
    if gw is not None:
        out[layer.weight] = gw.to(layer.weight.dtype)
    if gb is not None:
        out[layer.bias] = gb.to(layer.bias.dtype)
    return out


@register_grad_sample_group([nn.LayerNorm, nn.RMSNorm])
class NormLayerGroup(Group):
    """LayerNorm or RMSNorm layers with the same settings and input shapes: the per-sample
    gradients of all of them from their concatenated inputs (when small), kept in fp32 for
    their norms and clipped sums."""

    @classmethod
    def key(cls, layer, activations, backprops):
        x = activations[0]
        return (type(layer), tuple(layer.normalized_shape), _eps(layer, x), *_trainable(layer), x.shape, x.dtype,
                backprops.shape, backprops.dtype, x.device)

    def norms(self):
        layers = [layer for layer, _, _ in self.records]
        xs = [activations[0] for _, activations, _ in self.records]
        gs = [backprops for _, _, backprops in self.records]
        self.records = []
        if stackable(xs) and stackable(gs):
            grads = per_sample_grads(layers[0], cat(xs), cat(gs))
        else:
            parts = [per_sample_grads(layer, x, g) for layer, x, g in zip(layers, xs, gs)]
            grads = tuple(None if parts[0][i] is None else cat([part[i] for part in parts]) for i in (0, 1))
        kept = [g for g in grads if g is not None]
        # Weight and bias gradients have the same shape: one tensor (K*L*B, *shape) for both.
        self._grads = kept[0] if len(kept) == 1 else torch.cat(kept)
        self._params = [getattr(layer, attr) for g, attr in zip(grads, ("weight", "bias")) if g is not None
                        for layer in layers]
        return self._params, [row_norms(self._grads)]

    def clipped_sums(self, coef):
        params, g = self._params, self._grads
        self._grads = None
        return clipped_sums_of(params, coef, g)
