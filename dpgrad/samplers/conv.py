"""Samplers for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``: any stride, padding ("same",
"valid", ints), dilation, groups (depthwise included), padding mode, with or without bias.

Per sample and group a convolution is a Linear layer over its T output positions, its input
the unfolded patches (``dpgrad.kernels.conv_unfold``). The norms take one of three algorithms,
chosen per shape by the autotuner (kind ``conv_norm``), each with its memory:
- ``gram`` (ghost norm): the Linear Gram algorithm on the unfolded input; the unfolded input
  (T * C_in * K per sample) and, eager, two (T, T) Grams per sample, a batch slice at a time;
- ``direct``: the Linear direct algorithm on the unfolded input; the unfolded input and,
  eager, the per-sample gradients of a batch slice;
- ``grad-sample``: the per-sample gradients (B times the weight, fp32) from one convolution
  backward with the batch folded into the groups, no unfolded input; kept for the clipped sum.
The clipped sum is one convolution backward on the coefficient-scaled backprops (one GEMM-like
pass over B*T per group, cuDNN on a GPU): no unfolded input, no per-sample gradient. A layer
whose per-sample gradients are small beside its inputs (``ClippingPath``'s rule, as for LoRA)
is clipped from them (``ConvGradSampleGroup``). Bias: ``sum_t G_b[t]``, never a Gram.
Half-precision inputs are widened to fp32 for the convolution's backward (autocast: the input
rounded to the backprops' dtype first, as the forward took it).

When memory on the device is short (norms served early, ``dpgrad.backward.group_flush``; the tuner's
``short_of_memory``), the weight norms take, per layer shape, the candidate whose work holds
the least memory per sample (the cost model's ``conv_norm_workspace``: the per-sample
gradients for few channels over many positions, the unfolded input for many channels over
few), in batch slices that hold at most the layer's own input and backprops.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from dpgrad.kernels import reference
from dpgrad.kernels.conv_unfold import ConvGeometry, grouped_backprops, unfold
from dpgrad.kernels.reference import accumulation_dtype
from dpgrad.samplers.registry import (
    register_clipped_sum_sampler,
    register_factor_sampler,
    register_grad_sample_group,
    register_grad_sampler,
    register_norm_group,
    register_norm_sampler,
)
from dpgrad.samplers.groups import Coefficients, Group, cat, clipped_sums_of, row_norms, trainable, weights_then_biases
from dpgrad.tuning import get_tuner

LAYERS = [nn.Conv1d, nn.Conv2d, nn.Conv3d]


def geometry(layer: nn.Module) -> ConvGeometry:
    """The layer's ``ConvGeometry``, with the padding its forward applies."""
    pad = getattr(layer, "_reversed_padding_repeated_twice", None)
    if pad is None:  # a torch without the attribute: ints only
        pad = [q for p in reversed(layer.padding) for q in (p, p)]
    return ConvGeometry(tuple(layer.kernel_size), tuple(layer.stride), tuple(layer.dilation), tuple(pad),
                        layer.padding_mode, layer.groups)


def _bias_sums(G: torch.Tensor) -> torch.Tensor:
    """Per-sample bias gradients ``sum_t G_b[t]``: (B, C_out, *out) -> (B, C_out) fp32 (fp64)."""
    return G.flatten(2).sum(2, dtype=accumulation_dtype(G))


@register_grad_sampler(LAYERS)
def conv_grad_sample(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                     ) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients in the parameters' dtypes: weight (B, *weight.shape), bias (B, C_out)."""
    x, G = activations[0], backprops
    weight, bias = trainable(layer)
    out = {}
    if weight:
        out[layer.weight] = reference.conv_per_sample(x, G, geometry(layer), tuple(layer.weight.shape)).to(
            layer.weight.dtype)
    if bias:
        out[layer.bias] = _bias_sums(G).to(layer.bias.dtype)
    return out


@register_norm_sampler(LAYERS)
def conv_norm_sample(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                     ) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms, (B,) each, by the algorithm the autotuner picked."""
    params, norms = ConvGroup([(layer, activations, backprops)]).norms()
    return dict(zip(params, norms))


@register_clipped_sum_sampler(LAYERS)
def conv_clipped_sum(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                     coef: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradients ``sum_b c_b g_b`` in the parameters' dtypes, coef (B,): the weight's by
    one convolution backward on the scaled backprops."""
    return dict(ConvGroup([(layer, activations, backprops)]).clipped_sums(Coefficients(coef)))


@register_factor_sampler(LAYERS)
def conv_factors(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                 ) -> Dict[nn.Parameter, Tuple[torch.Tensor, torch.Tensor]]:
    """The per-sample gradients as sums of outer products: the weight's (C_out, C_in/g * K) as
    ``sum_{t, j} G_j[t] ⊗ U_j[t]`` over positions and groups (G_j: the backprops of group j's
    outputs, zero elsewhere; U_j: its unfolded inputs), the bias's ``sum_t G[t] ⊗ 1``."""
    x, G = activations[0], backprops
    weight, bias = trainable(layer)
    B, C_out = G.shape[:2]
    out = {}
    if weight:
        geom = geometry(layer)
        g = geom.groups
        Gg = grouped_backprops(G, g)  # (B*g, T, C_out/g)
        T = Gg.shape[1]
        if g > 1:  # group j's rows of the (C_out, .) weight only: block-diagonal left factors
            eye = torch.eye(g, dtype=G.dtype, device=G.device)
            left = (Gg.view(B, g, T, 1, C_out // g) * eye.view(1, g, 1, g, 1)).reshape(B, g * T, C_out)
        else:
            left = Gg
        out[layer.weight] = (left, unfold(x, geom).reshape(B, g * T, -1))
    if bias:
        rows = G.flatten(2).transpose(1, 2)
        out[layer.bias] = (rows, rows.new_ones(1, 1, 1).expand(B, rows.shape[1], 1))
    return out


@register_norm_group(LAYERS)
class ConvGroup(Group):
    """Convolutions with the same settings, shapes and dtypes: the weight norms by the
    candidate the autotuner chose for the shape (once per group), layer by layer; the bias
    token sums taken once in fp32 for their norms and clipped sums."""

    mixed_clip_groups = True  # each layer clipped with its own group's coefficients

    per_sample = False  # whether the weights are clipped from their per-sample gradients

    @classmethod
    def key(cls, layer, activations, backprops):
        x = activations[0]
        return (geometry(layer), *trainable(layer), x.shape, x.dtype, backprops.shape, backprops.dtype,
                layer.weight.dtype, x.device)

    def __init__(self, records):
        super().__init__(records)
        self._layers = [layer for layer, _, _ in records]
        self._inputs = [(activations[0], backprops) for _, activations, backprops in records]
        self.records = []
        self._geom = geometry(self._layers[0])
        self._grads = None  # per-sample weight gradients (L*B, ...) where the norms made them
        self._bias = None  # (L*B, C_out)

    def _params(self) -> List[nn.Parameter]:
        return weights_then_biases(self._layers)

    def _record_bytes(self) -> int:
        """The bytes of one layer's input and backprops: what taking its norm may hold at once
        when memory is short (``Tuner.select_by_memory``), no more than serving the record
        early lets go of."""
        x, G = self._inputs[0]
        return x.numel() * x.element_size() + G.numel() * G.element_size()

    def norms(self):
        weight, bias = trainable(self._layers[0])
        layer, geom, rows = self._layers[0], self._geom, []
        if weight:
            shape = tuple(layer.weight.shape)
            if self.per_sample:
                self._grads = cat([reference.conv_per_sample(x, G, geom, shape) for x, G in self._inputs])
                rows.append(row_norms(self._grads))
            else:
                inputs = [(x, G, geom) for x, G in self._inputs]
                tuner = get_tuner()
                options = {}
                if tuner.memory_is_short:
                    cand, options["batch_slice"] = tuner.select_by_memory("conv_norm", inputs, self._layers,
                                                                          self._record_bytes())
                else:
                    cand = tuner.select_group("conv_norm", inputs, self._layers)
                # Whatever the algorithm, nothing is kept for the clipped sums (a convolution
                # backward): the planner sent these layers here because their per-sample
                # gradients are not small beside their inputs (ConvGradSampleGroup keeps those
                # that are), and "grad-sample" takes them a batch slice at a time.
                rows.append(cat([tuner.run("conv_norm", cand, args, lyr, lambda c, args=args: c.run(*args, **options))
                                 for args, lyr in zip(inputs, self._layers)]).sqrt())
        if bias:
            self._bias = cat([_bias_sums(G) for _, G in self._inputs])
            rows.append(torch.linalg.vector_norm(self._bias, dim=1))
        if self._grads is not None or not weight:  # what the clipped sums need is in the gradients now
            self._inputs = []
        return self._params(), rows

    def clipped_sums(self, coef):
        layers, inputs = self._layers, self._inputs
        weight, bias = trainable(layers[0])
        grads, bias_sums = self._grads, self._bias
        self._inputs, self._grads, self._bias = [], None, None
        out = []
        if weight:
            weights = [layer.weight for layer in layers]
            if grads is not None:
                out += clipped_sums_of(weights, coef, grads)
            else:
                for w, (x, G) in zip(weights, inputs):  # each with its clipping group's coefficients
                    out.append((w, reference.conv_clipped_sum(x, G, coef.of([w]).like(G), self._geom, tuple(w.shape),
                                                              out_dtype=w.dtype)))
        if bias:
            if bias_sums is None:
                bias_sums = cat([_bias_sums(G) for _, G in inputs])
            out += clipped_sums_of([layer.bias for layer in layers], coef, bias_sums)
        return out


@register_grad_sample_group(LAYERS)
class ConvGradSampleGroup(ConvGroup):
    """Convolutions clipped from their per-sample gradients (fp32, from one convolution backward
    per layer): those whose gradients are small beside the inputs and backprops, or all of them
    without ghost clipping."""

    per_sample = True


__all__ = ["ConvGradSampleGroup", "ConvGroup", "conv_clipped_sum", "conv_factors", "conv_grad_sample",
           "conv_norm_sample", "geometry"]
