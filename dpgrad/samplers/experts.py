"""Samplers for mixture-of-experts weights stored as 3-D tensors: Hugging Face's grouped experts
(``gate_up_proj`` (E, 2I, d) and ``down_proj`` (E, d, I), or ``up_proj``, with or without
biases, transposed or not; Qwen3-MoE, Mixtral, DeepSeek, OLMoE and the other classes its
``use_experts_implementation`` decorates; LongCat-Flash's, beside its zero-computation
experts), called on the tokens flattened, ``(hidden_states (N, d), top_k_index (N, k),
top_k_weights (N, k))``.

The hooks hand these samplers the call unfolded to (B, N / B, ...) (``dpgrad.backward.layer_inputs.
folded_rows``): token i is sample i // (N / B)'s. Each (token, expert) pair adds ``dh ⊗ x`` to its
expert's up projection and ``dz ⊗ u`` to its down projection, where x is the token, h its up
projection, u the gated activation and z the down projection; the routing weight is in dz (the
router's own gradient is the router's layer's). The samplers recompute h, u and z per pair from
the kept inputs with the module's own gating (``_apply_gate``, ``act_fn``) and take dh and dz by
autograd over that recomputation, then the norms, clipped sums and per-sample gradients over the
(expert, sample) segments: the Triton kernels of ``kernels.experts_segments`` on CUDA, the eager
``kernels.reference_experts`` elsewhere.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.kernels.backend import guarded, layer_name
from dpgrad.samplers.registry import (
    register_batch_copies,
    register_clipped_sum_sampler,
    register_grad_sampler,
    register_norm_sampler,
    register_structure,
)


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of transformers' ``use_experts_implementation``."""
    down = getattr(module, "down_proj", None)
    flags = (getattr(module, "has_gate", None), getattr(module, "is_transposed", None))
    return (all(isinstance(f, bool) for f in flags)
            and callable(getattr(module, "_apply_gate", None)) and isinstance(down, nn.Parameter) and down.dim() == 3)


@register_structure(is_grouped_experts)
class GroupedExperts(nn.Module):
    """The registry's key for grouped experts modules (``is_grouped_experts``)."""


def is_dense_experts(module: nn.Module) -> bool:
    """Whether ``module`` is Llama 4's experts: ``gate_up_proj`` (E, d, 2I) and ``down_proj``
    (E, I, d) applied by ``bmm`` to every token, given as E copies of the batch's tokens one
    after the other (each copy scaled by its expert's routing score)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (type(module).__name__ == "Llama4TextExperts" and isinstance(gate_up, nn.Parameter)
            and isinstance(down, nn.Parameter) and gate_up.dim() == 3 and down.dim() == 3
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[2] == 2 * down.shape[1]
            and gate_up.shape[1] == down.shape[2] and callable(getattr(module, "act_fn", None)))


@register_structure(is_dense_experts)
class DenseExperts(nn.Module):
    """The registry's key for Llama 4's experts (``is_dense_experts``)."""


def is_zero_experts(module: nn.Module) -> bool:
    """Whether ``module`` is LongCat-Flash's experts: routed experts as grouped experts'
    (``gate_up_proj`` (E + Z, 2I, d), of which the first E rows are used, ``down_proj`` (E, d, I),
    gated by ``act_fn``), and Z zero-computation experts, the identity, numbered from E."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (type(module).__name__ == "LongcatFlashExperts" and isinstance(gate_up, nn.Parameter)
            and isinstance(down, nn.Parameter) and gate_up.dim() == 3 and down.dim() == 3
            and getattr(module, "num_routed_experts", None) == down.shape[0] <= gate_up.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and callable(getattr(module, "act_fn", None)))


@register_structure(is_zero_experts)
class ZeroExperts(nn.Module):
    """The registry's key for LongCat-Flash's experts (``is_zero_experts``)."""


EXPERTS = [GroupedExperts, DenseExperts, ZeroExperts]


@register_batch_copies(DenseExperts)
def _dense_copies(layer: nn.Module) -> int:
    return layer.gate_up_proj.shape[0]


Factors = Dict[nn.Parameter, Tuple[torch.Tensor, Optional[torch.Tensor]]]


def _param(layer: nn.Module, name: str) -> Optional[nn.Parameter]:
    p = getattr(layer, name, None)
    return p if isinstance(p, nn.Parameter) else None


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes (S, q) rows times an (E, q, p) ``w``: bf16 on CUDA (the
    dtype of its fast kernels on every GPU it runs on), each expert's matrix whole in memory,
    and rows and matrices aligned to 16 bytes."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    size = x.element_size()
    return (grouped is not None and x.is_cuda and x.dtype == torch.bfloat16
            and w.dtype == x.dtype and 1 in w.stride()[1:] and w.stride(0) >= w.shape[1] * w.shape[2]
            and all(n * size % 16 == 0 for n in (x.shape[1], w.shape[1], w.shape[2]))
            and all(t.data_ptr() % 16 == 0 for t in (x, w)))


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], order: torch.Tensor,
                    ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Each pair's row through its expert's matrix (pairs grouped by ``order``; ``ends``, (E,)
    int32 on the device, where each expert's group ends). One grouped GEMM where torch has one
    for these tensors (no host sync); otherwise a GEMM per expert."""
    rows = x[order].contiguous()
    w = weight if transposed else weight.transpose(-2, -1)  # (E, q, p)
    if w.stride(0) < w.shape[1] * w.shape[2]:  # experts interleaved (LoRA's adapters viewed per expert)
        w = w.contiguous()
    if _grouped_mm_fits(rows, w):
        y = torch.nn.functional.grouped_mm(rows, w, offs=ends)
    else:
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        y = torch.cat([part @ w[e] for e, part in enumerate(rows.split(counts))])
    if bias is not None:
        y = y + bias[torch.searchsorted(ends, torch.arange(rows.shape[0], device=ends.device, dtype=ends.dtype),
                                        right=True)]
    return y[torch.argsort(order)]


class Pairs(NamedTuple):
    """A call's (token, expert) pairs: per projection name (``gate_up_proj`` or ``up_proj``,
    ``down_proj`` and their ``_bias``) the per-pair ``(left, right)`` factors of its (E, p, q)
    gradient (right None for a bias), each pair's expert and sample, the batch size, the number
    of experts, and the pairs' order grouping them by expert with where each expert's group ends
    (int32, on the device)."""
    factors: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]
    expert: torch.Tensor
    sample: torch.Tensor
    batch: int
    experts: int
    order: torch.Tensor
    ends: torch.Tensor


def pair_factors(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                 weights: Optional[Dict[str, torch.Tensor]] = None) -> Pairs:
    """The factors of every projection of ``layer`` (``Pairs``), recomputed with ``weights``
    (by name) in place of its parameters where given (LoRA's ``W + scaling B A``)."""
    if getattr(layer, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"experts {layer_name(layer)} normalise each expert's output (has_post_expert_norm), which dpgrad's "
            "experts samplers do not recompute yet: freeze the experts (train adapters, or the other layers).")
    if len(activations) < 3 or activations[0].dim() != 3:
        raise ValueError(
            f"experts {layer_name(layer)} got inputs of shapes {[tuple(a.shape) for a in activations]}: dpgrad takes "
            "them as (hidden_states, top_k_index, top_k_weights) with the batch's tokens flattened (B*T rows).")
    weights = weights or {}
    x, index, routing = activations[:3]
    B, T, d = x.shape
    E = layer.down_proj.shape[0]
    k = index.shape[-1]
    x, G = x.reshape(B * T, d), backprops.reshape(B * T, -1)
    token = torch.arange(B * T, device=x.device).repeat_interleave(k)
    expert, weight = index.reshape(-1), routing.reshape(-1).detach()
    # Expert parallelism marks the pairs of other ranks' experts with E, LongCat-Flash its zero
    # experts with E and on: they weigh nothing here.
    weight = weight.masked_fill(expert >= E, 0)
    expert = expert.clamp(max=E - 1)
    sample = token // T
    order = torch.argsort(expert, stable=True)
    # searchsorted, not bincount, whose CUDA version reads the largest expert back to the host.
    ends = torch.searchsorted(expert[order], torch.arange(1, E + 1, device=x.device), out_int32=True)
    gated = getattr(layer, "has_gate", True)  # LongCat-Flash's: gated, (E, p, q), act_fn(gate) * up
    up_name = "gate_up_proj" if gated else "up_proj"

    def live(name: str) -> Optional[torch.Tensor]:
        w = weights[name] if name in weights else _param(layer, name)
        return None if w is None else w.detach()[:E]  # LongCat-Flash's zero experts' rows unused

    up, up_bias, down, down_bias = live(up_name), live(up_name + "_bias"), live("down_proj"), live("down_proj_bias")
    transposed = getattr(layer, "is_transposed", False)
    xs = x[token].detach()
    with torch.enable_grad():
        h = _grouped_linear(xs, up, up_bias, order, ends, transposed).requires_grad_()
        u = _gate(layer, h) if gated else layer.act_fn(h)
        z = _grouped_linear(u, down, down_bias, order, ends, transposed)
        dz, dh = torch.autograd.grad(z * weight.to(z.dtype)[:, None], (z, h), G[token])
    u = u.detach()
    factors = {up_name: (xs, dh) if transposed else (dh, xs), up_name + "_bias": (dh, None),
               "down_proj": (u, dz) if transposed else (dz, u), "down_proj_bias": (dz, None)}
    present = {n: f for n, f in factors.items() if live(n) is not None}
    return Pairs(present, expert, sample, B, E, order, ends)


def _gate(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The gated activation of up projections ``h``, as the module computes it."""
    if hasattr(layer, "_apply_gate"):
        return layer._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return layer.act_fn(gate) * up


def dense_pair_factors(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor) -> Pairs:
    """Llama 4's experts (``is_dense_experts``), given (B, E, T, d) and their backprops: a pair
    per (expert, token), the expert's copy of the token scaled by its routing score (zero off
    its top k), recomputed as the module's ``bmm`` computes it, in the pairs' expert-major order."""
    x, G = activations[0], backprops
    if x.dim() != 4:
        raise ValueError(f"experts {layer_name(layer)} got an input of shape {tuple(x.shape)}: dpgrad takes it as E "
                         "copies of the batch's tokens flattened, (E*B*T, d).")
    B, E, T, d = x.shape
    up, down = layer.gate_up_proj.detach(), layer.down_proj.detach()
    x = x.detach().transpose(0, 1).reshape(E, B * T, d)
    G = G.transpose(0, 1).reshape(E, B * T, -1)
    with torch.enable_grad():
        h = torch.bmm(x, up).requires_grad_()
        gate, up_part = h.chunk(2, dim=-1)
        u = up_part * layer.act_fn(gate)
        z = torch.bmm(u, down)
        dh, = torch.autograd.grad(z, h, G)
    S = E * B * T
    expert = torch.arange(E, device=x.device).repeat_interleave(B * T)
    sample = torch.arange(B, device=x.device).repeat_interleave(T).repeat(E)
    ends = torch.arange(1, E + 1, device=x.device, dtype=torch.int32) * (B * T)
    factors = {"gate_up_proj": (x.reshape(S, d), dh.reshape(S, -1)),
               "down_proj": (u.detach().reshape(S, -1), G.reshape(S, -1))}
    return Pairs(factors, expert, sample, B, E, torch.arange(S, device=x.device), ends)


def expert_factors(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                   ) -> Tuple[Factors, Pairs]:
    """``(factors, pairs)``: for each trainable parameter the per-pair ``(left, right)`` (right
    None for a bias), and the call's ``Pairs``."""
    pairs = (dense_pair_factors if is_dense_experts(layer) else pair_factors)(layer, activations, backprops)
    factors: Factors = {}
    for name, pair in pairs.factors.items():
        p = _param(layer, name)
        if p is not None and p.requires_grad:
            factors[p] = pair
    return factors, pairs


def _on_segments(what: str, layer: nn.Module, left: torch.Tensor, right: Optional[torch.Tensor], work):
    """``work(ops)`` with the Triton segment kernels where the factors are on CUDA, eager
    otherwise or where a kernel fails (``guarded``)."""
    return guarded(what, layer, (left,) if right is None else (left, right), work)


def segment_sq_norms(layer: nn.Module, pairs: Pairs, left: torch.Tensor, right: Optional[torch.Tensor]
                     ) -> torch.Tensor:
    """Per-sample squared norms (B,) of one (E, p, q) gradient (or (E, p) bias) from its factors."""
    return _on_segments("the experts' norms", layer, left, right, lambda ops: ops.experts_sq_norms(
        left, right, pairs.expert, pairs.sample, pairs.experts, pairs.batch))


def segment_clipped_sum(layer: nn.Module, pairs: Pairs, left: torch.Tensor, right: Optional[torch.Tensor],
                        pair_coef: torch.Tensor, dtype: torch.dtype, experts: Optional[int] = None) -> torch.Tensor:
    """The sum over pairs of each pair's clipping coefficient times its outer product, (E, p, q)
    (``experts`` rows where given: a weight with rows for experts no pair has)."""
    return _on_segments("the experts' clipped sum", layer, left, right, lambda ops: ops.experts_clipped_sum(
        left, right, pairs.expert, pair_coef, experts or pairs.experts, dtype))


def segment_grad_sample(layer: nn.Module, pairs: Pairs, left: torch.Tensor, right: Optional[torch.Tensor],
                        dtype: torch.dtype, experts: Optional[int] = None) -> torch.Tensor:
    """Per-sample gradients (B, E, p, q) of one weight (or (B, E, p) of a bias) from its factors
    (``experts`` as for ``segment_clipped_sum``)."""
    return _on_segments("the experts' per-sample gradients", layer, left, right, lambda ops: ops.experts_grad_sample(
        left, right, pairs.expert, pairs.sample, experts or pairs.experts, pairs.batch, dtype))


@register_norm_sampler(EXPERTS)
def experts_norm_sample(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                        ) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms of each expert weight, (B,), over all its experts."""
    factors, pairs = expert_factors(layer, activations, backprops)
    return {p: segment_sq_norms(layer, pairs, left, right).sqrt() for p, (left, right) in factors.items()}


@register_clipped_sum_sampler(EXPERTS)
def experts_clipped_sum(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                        coef: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradients of the expert weights, each of its parameter's shape and dtype."""
    factors, pairs = expert_factors(layer, activations, backprops)
    pair_coef = coef[pairs.sample]
    return {p: segment_clipped_sum(layer, pairs, left, right, pair_coef, p.dtype, p.shape[0])
            for p, (left, right) in factors.items()}


@register_grad_sampler(EXPERTS)
def experts_grad_sample(layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
                        ) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of the expert weights, (B, *parameter.shape)."""
    factors, pairs = expert_factors(layer, activations, backprops)
    return {p: segment_grad_sample(layer, pairs, left, right, p.dtype, p.shape[0])
            for p, (left, right) in factors.items()}
