"""LoRA on a parameter (peft's ``ParamWrapper``, what ``target_parameters`` and "all-linear"
put on a mixture-of-experts router): the wrapped layer runs with ``W + scaling * B A`` in place
of its parameter ``W``, the adapters' ``lora_A`` and ``lora_B`` never being called on the
activations. Their per-sample gradients come from torch.func, taking the wrapper whole (its
children included, ``registry.register_whole``), recomputed per sample by ``forward`` below:
the same weights, passed to the innermost layer by ``functional_call`` where peft's own forward
registers a parametrization (an in-place change that torch.func cannot follow)."""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Tuple

import torch
import torch.nn as nn
from torch.func import functional_call

from dpgrad.samplers.experts import (
    _grouped_linear,
    is_grouped_experts,
    is_zero_experts,
    pair_factors,
    segment_clipped_sum,
    segment_grad_sample,
    segment_sq_norms,
)
from dpgrad.samplers.registry import (
    class_path,
    register_clipped_sum_sampler,
    register_grad_sampler,
    register_norm_sampler,
    register_structure,
    register_whole,
)

PARAM_WRAPPER = "peft.tuners.lora.layer.ParamWrapper"


@register_whole(PARAM_WRAPPER)
def forward(wrapper: nn.Module, *args, **kwargs):
    """``wrapper``'s output, its layer (the innermost of nested wrappers, one per adapted
    parameter) called with each adapted parameter plus its active adapters' delta weights."""
    weights, layer = {}, wrapper
    while class_path(type(layer)) == PARAM_WRAPPER:
        name = layer.parameter_name
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if active and not (layer.disable_adapters or layer.merged):
            base = weights.get(name, getattr(layer.get_base_layer(), name))
            for adapter in active:
                base = base + layer.get_delta_weight(adapter)
            weights[name] = base
        layer = layer.base_layer
    return functional_call(layer, weights, args, kwargs) if weights else layer(*args, **kwargs)


# ------------------------------------------------------------------ LoRA on grouped experts
# peft adapts an (E, p, q) experts parameter with r ranks per expert: ``W_e + s lhs_e rhs_e``,
# lhs (E, p, r) and rhs (E, r, q) views of lora_A.weight (E*r, in) and lora_B.weight (out, r*E)
# (``ParamWrapper.get_delta_factors``). A pair adding ``left ⊗ right`` to ``W_e``'s gradient adds
# ``left ⊗ (s rhs_e right)`` to lhs_e's and ``(s lhs_e^T left) ⊗ right`` to rhs_e's: the adapters
# are experts parameters of their own, with factors one small product away from the experts'.
def chain(module: nn.Module) -> Tuple[nn.Module, List[nn.Module]]:
    """The innermost layer under nested ParamWrappers, and the wrappers, outermost first."""
    wrappers = []
    while class_path(type(module)) == PARAM_WRAPPER:
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def is_lora_experts(module: nn.Module) -> bool:
    """A ParamWrapper (outermost or not) over grouped experts (or LongCat-Flash's)."""
    inner, wrappers = chain(module)
    return bool(wrappers) and (is_grouped_experts(inner) or is_zero_experts(inner))


@register_structure(is_lora_experts)
class LoraExperts(nn.Module):
    """The registry's key for peft's ParamWrappers over grouped experts (``is_lora_experts``)."""


class _Adapted(NamedTuple):
    wrapper: nn.Module
    adapter: str
    name: str  # the experts parameter it adapts


def _adapted(wrappers: List[nn.Module]) -> List[_Adapted]:
    out = []
    for w in wrappers:
        if not (w.disable_adapters or w.merged):
            out += [_Adapted(w, a, w.parameter_name) for a in w.active_adapters if a in w.lora_A]
    return out


def _layouts(item: _Adapted, E: int):
    """``(lhs, rhs, scaling, swapped)`` of one adapter, detached."""
    lhs, rhs, scaling = item.wrapper.get_delta_factors(item.adapter)
    return lhs.detach(), rhs.detach(), scaling, item.wrapper._did_swap_in_out_features


def lora_experts_factors(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor):
    """``(factors, views, experts, pairs)``: per trainable parameter of the unit (adapters' and
    the experts' own) its per-pair factors and the number of experts it has rows for, and for
    each adapter parameter the function taking an (..., E, a, b) tensor in the factors' layout
    to the parameter's own."""
    inner, wrappers = chain(layer)
    adapted = _adapted(wrappers)
    weights: Dict[str, torch.Tensor] = {}
    layouts = {}
    for item in adapted:
        lhs, rhs, scaling, swapped = layouts[item] = _layouts(item, inner.down_proj.shape[0])
        base = weights.get(item.name, getattr(inner, item.name).detach())
        weights[item.name] = torch.baddbmm(base, lhs, rhs, alpha=scaling)
    pairs = pair_factors(inner, activations, backprops, weights)
    factors, views, experts = {}, {}, {}
    for name, pair in pairs.factors.items():
        p = getattr(inner, name)
        if isinstance(p, nn.Parameter) and p.requires_grad:
            factors[p], experts[p] = pair, p.shape[0]
    for item in adapted:
        lhs, rhs, scaling, swapped = layouts[item]
        left, right = pairs.factors[item.name]
        d_lhs = (left, scaling * _grouped(right, rhs, pairs, transposed=False))  # (E, p, r)
        d_rhs = (scaling * _grouped(left, lhs, pairs, transposed=True), right)  # (E, r, q)
        A, Bw = item.wrapper.lora_A[item.adapter].weight, item.wrapper.lora_B[item.adapter].weight
        # lora_A viewed (E, r, in), lora_B viewed (E, out, r); unswapped: lhs = A^T, rhs = B^T.
        a_pair, b_pair = (d_rhs, d_lhs) if swapped else (d_lhs[::-1], d_rhs[::-1])
        for p, pair, view in ((A, a_pair, _a_view(A)), (Bw, b_pair, _b_view(Bw))):
            if p.requires_grad:
                factors[p], views[p], experts[p] = pair, view, getattr(inner, item.name).shape[0]
    return factors, views, experts, pairs


def _grouped(rows: torch.Tensor, weight: torch.Tensor, pairs, transposed: bool) -> torch.Tensor:
    """Each pair's ``rows`` through its expert's ``weight`` (``rows @ w.T``, or ``rows @ w``;
    rows of experts no pair has, LongCat-Flash's zero experts', left out)."""
    return _grouped_linear(rows, weight[:pairs.experts].to(rows.dtype), None, pairs.order, pairs.ends, transposed)


def _a_view(A: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
    """(..., E, r, in) -> lora_A.weight's (..., E*r, in)."""
    return lambda t: t.reshape(*t.shape[:-3], A.shape[0], A.shape[1])


def _b_view(Bw: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
    """(..., E, out, r) -> lora_B.weight's (..., out, r*E), whose (out, r, E) view is permuted."""
    return lambda t: t.movedim(-3, -1).reshape(*t.shape[:-3], Bw.shape[0], Bw.shape[1])


@register_norm_sampler(LoraExperts)
def lora_experts_norm_sample(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                             ) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms of the adapters (and any trainable experts weight), (B,)."""
    factors, _, _, pairs = lora_experts_factors(layer, activations, backprops)
    return {p: segment_sq_norms(layer, pairs, left, right).sqrt()
            for p, (left, right) in factors.items()}


@register_clipped_sum_sampler(LoraExperts)
def lora_experts_clipped_sum(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                             coef: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradients, each of its parameter's shape and dtype."""
    factors, views, experts, pairs = lora_experts_factors(layer, activations, backprops)
    pair_coef = coef[pairs.sample]
    out = {}
    for p, (left, right) in factors.items():
        g = segment_clipped_sum(layer, pairs, left, right, pair_coef, p.dtype, experts[p])
        out[p] = views[p](g) if p in views else g
    return out


@register_grad_sampler(LoraExperts)
def lora_experts_grad_sample(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                             ) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients, (B, *parameter.shape)."""
    factors, views, experts, pairs = lora_experts_factors(layer, activations, backprops)
    out = {}
    for p, (left, right) in factors.items():
        g = segment_grad_sample(layer, pairs, left, right, p.dtype, experts[p])
        out[p] = views[p](g) if p in views else g
    return out
