"""Grad samplers for normalisation layers: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``,
and the RMSNorm of Hugging Face's Llama family (``HF_RMS_NORMS``, registered by dotted path:
dpgrad does not import transformers).

GroupNorm normalises each sample's (C/g, *spatial) block per group and scales channel c by
weight[c]: its per-sample gradients are ``sum_s x̂[c, s] g[c, s]`` and ``sum_s g[c, s]``, (B, C),
from a kernel of its own on the Triton backend (``group_norm_grad_sample``).

Their per-sample gradients are as small as their parameters, so ghost clipping takes norms
of these directly; ``NormLayerGroup`` computes those of many such layers at once.

The Llama family's RMSNorm computes ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``, the
normalisation in fp32 whatever x's dtype and rounded to it before the weight: its per-sample
weight gradient is ``sum_t round(x̂_t) ⊙ g_t``. Autograd saves ``round(x̂)`` for the weight's
gradient and not x (the residual stream, which the non-private step frees at once), so the
hooks keep that tensor of autograd's (``rms_norm_kept_inputs``) rather than x, marked
``NORMALIZED``: no memory of their own while the model's activations are alive. Where it cannot
be read without unpacking it (saved-tensor hooks in force: checkpointing, offloading), they
keep x, and x̂ is computed here by the forward's arithmetic.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpgrad.samplers import registry
from dpgrad.kernels.backend import guarded
from dpgrad.kernels import reference
from dpgrad.kernels.reference import accumulation_dtype, same_layout
from dpgrad.backward.layer_inputs import saved_operand
from dpgrad.samplers.registry import register_grad_sample_group, register_grad_sampler, register_kept_inputs
from dpgrad.samplers.groups import Group, cat, clipped_sums_of, row_norms, stackable, trainable

# Classes whose forward is exactly Llama's RMSNorm (checked against torch.func in the tests).
HF_RMS_NORMS = [f"transformers.models.{m}.modeling_{m}.{c}RMSNorm" for m, c in (
    ("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
    ("phi3", "Phi3"))]
LAYERS = [nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, *HF_RMS_NORMS]


def _sum_tokens(x: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Sum (N, *, *shape) over every dimension but the first and the trailing ``shape``, in ``dtype``."""
    dims = list(range(1, x.dim() - len(shape)))
    return x.sum(dim=dims, dtype=dtype) if dims else x.to(dtype)


def _llama_family(layer: nn.Module) -> bool:
    return not isinstance(layer, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm))


def _shape(layer: nn.Module) -> Tuple[int, ...]:
    """The trailing dimensions the layer normalises (GroupNorm: its channels, dimension 1)."""
    if isinstance(layer, nn.GroupNorm):
        return (layer.num_channels,)
    return tuple(layer.weight.shape) if _llama_family(layer) else tuple(layer.normalized_shape)


def _eps(layer: nn.Module, x: torch.Tensor) -> float:
    if _llama_family(layer):
        return layer.variance_epsilon
    # RMSNorm's eps=None means the input dtype's epsilon, as in the forward pass, not the upcast's.
    if isinstance(layer, nn.RMSNorm) and layer.eps is None:
        return torch.finfo(x.dtype).eps
    return layer.eps


class _Normalized:
    """The mark of a record whose first activation is what the layer's forward multiplied its
    weight by, not its input."""

    def __repr__(self) -> str:
        return "NORMALIZED"


NORMALIZED = _Normalized()


def given_normalized(activations) -> bool:
    """Whether ``activations`` (a record's) hold the normalised input (``rms_norm_kept_inputs``)."""
    return len(activations) > 1 and activations[1] is NORMALIZED


def _normalized(layer: nn.Module, x: torch.Tensor, acc: torch.dtype, given: bool = False) -> torch.Tensor:
    """What the layer's forward multiplies its weight by, in ``acc``: x itself where ``given``."""
    if given:
        return x.to(acc)
    shape = _shape(layer)
    if isinstance(layer, nn.GroupNorm):
        return F.group_norm(x.to(acc), layer.num_groups, eps=layer.eps)
    if _llama_family(layer):  # as its forward computes it
        x32 = x.to(torch.float32)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _eps(layer, x))).to(x.dtype).to(acc)
    norm = F.rms_norm if isinstance(layer, nn.RMSNorm) else F.layer_norm
    return norm(x.to(acc), shape, eps=_eps(layer, x))


def per_sample_grads(layer: nn.Module, x: torch.Tensor, backprops: torch.Tensor, normalized: bool = False
                     ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per-sample gradients of the weight and the bias (None where frozen or absent), (N,
    *normalized_shape) each, in fp32 (fp64 for fp64). Activations and backprops may differ in
    dtype (autocast): they meet in the accumulation dtype. ``normalized``: x is what the
    forward multiplied the weight by (``NORMALIZED``), not the layer's input."""
    weight, bias = trainable(layer)
    acc = accumulation_dtype(x, backprops)
    shape = _shape(layer)
    gw = gb = None
    # GroupNorm's channels are dimension 1: summed over the spatial dimensions after it.
    total = _sum_spatial if isinstance(layer, nn.GroupNorm) else _sum_tokens
    if weight:
        # The product promotes half backprops to the accumulation dtype: no copy of its own.
        gw = total(_normalized(layer, x, acc, normalized) * backprops, shape, acc)
    if bias:
        gb = total(backprops, shape, acc)
    return gw, gb


def _sum_spatial(x: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Sum (N, C, *spatial) over the spatial dimensions (none for (N, C)), in ``dtype``: (N, C)."""
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:])).sum(2, dtype=dtype)


@register_grad_sampler(LAYERS)
def norm_layer_grad_sample(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a LayerNorm's, RMSNorm's or GroupNorm's weight and bias, (B,
    *weight.shape) each, in the parameters' dtypes."""
    gw, gb = per_sample_grads(layer, activations[0], backprops, given_normalized(activations))
    out = {}
    if gw is not None:
        out[layer.weight] = gw.to(layer.weight.dtype)
    if gb is not None:
        out[layer.bias] = gb.to(layer.bias.dtype)
    return out


def _group_grads(ops, layers: List[nn.Module], xs: List[torch.Tensor], gs: List[torch.Tensor], normalized: bool):
    """The per-sample (weight, bias) gradients of the layers (None where frozen or absent), (L*B,
    *normalized_shape) each, layer by layer; ``normalized``: xs are the normalised inputs
    (``NORMALIZED``). Triton: one launch for the group, each layer's tensors read where they
    are. Eager: one computation on the concatenated inputs when they are small, else one per
    layer."""
    layer = layers[0]
    weight, bias = trainable(layer)
    if isinstance(layer, nn.GroupNorm):
        if ops is not reference and ops.group_norm_fits(xs[0], layer.num_groups):
            return ops.group_norm_grad_sample_grouped(xs, gs, layer.num_groups, layer.eps, weight=weight, bias=bias)
    elif ops is not reference and ops.norm_layer_fits(xs[0]):
        return ops.norm_layer_grad_sample_grouped(xs, gs, _eps(layer, xs[0]), rms=not isinstance(layer, nn.LayerNorm),
                                                  rounded=_llama_family(layer), normalized=normalized,
                                                  weight=weight, bias=bias)
    if stackable(xs) and stackable(gs):
        return per_sample_grads(layer, cat(xs), cat(gs), normalized)
    parts = [per_sample_grads(layer, x, g, normalized) for layer, x, g in zip(layers, xs, gs)]
    return tuple(None if parts[0][i] is None else cat([part[i] for part in parts]) for i in (0, 1))


@register_kept_inputs(HF_RMS_NORMS)
def rms_norm_kept_inputs(layer: nn.Module, inputs, output: torch.Tensor) -> list:
    """What the hooks keep of a call of a Llama-family RMSNorm: ``[round(x̂), NORMALIZED]``, the
    tensor its forward multiplied the weight by, as autograd saved it for the weight's gradient
    (no copy); its input ``[x]`` where that cannot be read as it is (saved-tensor hooks in force,
    a forward other than the family's) or where the samplers in force for it are not these."""
    kept = list(inputs)
    x = kept[0] if len(kept) == 1 else None
    node = output.grad_fn
    if (not isinstance(x, torch.Tensor) or type(node).__name__ != "MulBackward0"
            or not registry.served_by(type(layer), __name__)):
        return kept
    normed = saved_operand(node, "_saved_other")  # weight * normed: the weight's gradient reads normed
    if normed is None or normed.shape != x.shape or normed.dtype != x.dtype:
        return kept
    return [normed, NORMALIZED]


@register_grad_sample_group(LAYERS)
class NormLayerGroup(Group):
    """LayerNorm, RMSNorm or GroupNorm layers with the same settings and input shapes: the per-sample
    gradients of all of them at once (one Triton launch, or, eager, from their concatenated
    inputs when small), kept in fp32 for their norms and clipped sums."""

    mixed_clip_groups = True  # each layer clipped with its own group's coefficients

    @classmethod
    def key(cls, layer, activations, backprops):
        x = activations[0]
        return (type(layer), _shape(layer), getattr(layer, "num_groups", None), _eps(layer, x), *trainable(layer),
                given_normalized(activations), x.shape, x.dtype,
                backprops.shape, backprops.dtype, x.device)

    def norms(self):
        layers = [layer for layer, _, _ in self.records]
        normalized = given_normalized(self.records[0][1])
        xs = [activations[0] for _, activations, _ in self.records]
        gs = [backprops for _, _, backprops in self.records]
        self.records = []
        layer = layers[0]
        if len(_shape(layer)) == 1 and same_layout(xs) and same_layout(gs):
            grads = guarded("per-sample gradients", layer, (xs[0], gs[0]),
                            lambda ops: _group_grads(ops, layers, xs, gs, normalized))
        else:
            grads = _group_grads(reference, layers, xs, gs, normalized)
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
