"""The finish plan of a backward pass: how the records of a pass are grouped before their norms.

A record (a hooked call of a layer: its inputs and backprops) is clipped from its norm
("ghost": its layer type's norm group, or its norm sampler) or from its per-sample gradients
(its layer has no norm sampler, or they are small beside what book-keeping would keep, as a
LoRA adapter's are); the uses of a parameter called several times are all of one kind. Records
are batched into groups by layer type and shapes (``dpgrad.samplers.groups``), within one
clipping group (per-layer or per-block clipping) and one FSDP2 parameter group (a sharded
model in single backward: its clipped sums are reduce-scattered a parameter group at a time).
A plan is made once for a pass of given layers, shapes, dtypes and trainable parameters, and
reused by every pass like it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.samplers import registry
from dpgrad.samplers.groups import GradSampleGroup, Group, Record, SamplerGroup, group_records, record_bytes

# A layer is clipped from its per-sample gradients when they (fp32) take at most this fraction
# of the memory of the inputs and backprops that book-keeping would keep for it, or when they
# have at most this many elements over the batch (too small to matter, and fewer operations).
GRAD_SAMPLE_MEMORY_FRACTION = 0.25
TINY_GRAD_SAMPLE_ELEMENTS = 1 << 18
# Finish plans kept per path: one per pass layout (a batch size under Poisson sampling).
MAX_PLANS = 64


class PlannedGroup(NamedTuple):
    """A group of a finish plan: what makes it from its records, their indices in the pass,
    and its FSDP2 parameter group (None for a model not sharded)."""

    make: Callable[[List[Record]], Group]
    indices: Tuple[int, ...]
    shard: Optional[int]


@dataclass
class FinishPlan:
    """How a pass's records are served: its groups; ``by_norm``, the indices of the records
    clipped from their norms; ``combined``, whether a parameter has several rows to combine
    (known after the first pass of the plan)."""

    groups: List[PlannedGroup]
    by_norm: Tuple[int, ...]
    combined: Optional[bool] = None


def record_key(layer: nn.Module, params: Tuple[nn.Parameter, ...], record: Record) -> tuple:
    """What a record's place in a finish plan depends on: its layer, which of the layer's
    parameters train, and the shapes, dtypes and devices of its inputs and backprops."""
    backprops = record.backprops
    return (layer, tuple(p.requires_grad for p in params), backprops.shape, backprops.dtype, backprops.device,
            *((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a) for a in record.inputs))


def _norm_group_class(layer: nn.Module) -> Optional[type]:
    return registry.NORM_GROUPS.get(type(layer))


class Planner:
    """The finish plans of a ``ClippingPath`` (``path``), whose layers, shared parameters,
    FSDP2 parameter groups and clipping groups it reads; with the layers' clipping groups,
    found once per hooking of the model (``forget`` at a new hooking)."""

    def __init__(self, path):
        self.path = path
        self.forget()

    def forget(self) -> None:
        self._plans: Dict[tuple, FinishPlan] = {}
        self._layer_groups: Dict[nn.Module, tuple] = {}  # a layer's clipping groups
        self._group_layers: Optional[Dict[int, List[nn.Module]]] = None  # a clipping group's layers

    def plan(self, records: List[Record], memory_bound: bool = False) -> FinishPlan:
        """How the pass's records are grouped, planned once for a pass of the same layers,
        shapes, dtypes and trainable parameters (a training loop's every step): see ``_plan``."""
        key = (registry.version, len(self.path.shared), self.path.ghost, self.path.single_backward, memory_bound,
               *(record_key(rec.layer, self.path._own_params[rec.layer], rec) for rec in records))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:  # Poisson batches: one plan per batch size seen
                self._plans.clear()
            plan = self._plans[key] = self._plan(records, memory_bound)
        return plan

    def _plan(self, records: List[Record], memory_bound: bool = False) -> FinishPlan:
        """A record is clipped from its per-sample gradients when its layer has no norm
        sampler or when they are small (``small_grad_sample``), else from its norm ("ghost").
        A parameter used by several records gets the norm of its summed gradient: from the
        sum of its per-sample gradients, or, for ghost uses, from the uses' norms and cross
        terms."""
        uses: Dict[nn.Parameter, List[int]] = {}
        ghost: List[bool] = []
        for i, rec in enumerate(records):
            for p in self.path.layer_params(rec.layer):
                uses.setdefault(p, []).append(i)
            ghost.append(self.path.uses_norm_sampler(rec.layer) and not self.small_grad_sample(rec, memory_bound))
        shared_uses = set()
        for p, at in uses.items():
            if len(at) < 2:
                continue
            ghost_layer = next((records[i].layer for i in at if self.path.uses_norm_sampler(records[i].layer)), None)
            if ghost_layer is not None and p not in self.path.shared:
                raise NotImplementedError(
                    f"parameter '{self.path.param_name(p)}' of layer '{self.path.layer_names[ghost_layer]}' "
                    "received two gradient contributions in one backward pass (several forward "
                    "passes before one backward); ghost clipping combines the uses of one forward "
                    "pass only. Run backward after every forward pass."
                )
            # A parameter's uses are all summed as per-sample gradients or all ghost.
            if any(ghost[i] for i in at):
                for i in at:
                    ghost[i] = True
            shared_uses.update(at)
        by_norm = [i for i in range(len(records)) if ghost[i]]
        summed = [i for i in range(len(records)) if not ghost[i] and i in shared_uses]
        alone = [i for i in range(len(records)) if not ghost[i] and i not in shared_uses]
        groups = (self._norm_groups(records, by_norm) + self._grad_sample_groups(records, alone)
                  + self._summed_groups(records, summed))
        return FinishPlan(groups, tuple(by_norm))

    def _norm_groups(self, records: List[Record], at: List[int]) -> List[PlannedGroup]:
        """Records clipped from their norms: batched by their layer type's norm group where it
        has one (``registry.register_norm_group``), else one ``SamplerGroup`` each."""
        return [PlannedGroup(make, indices, shard) for shard, part in self._by_shard(records, at)
                for make, indices in group_records(records, part, _norm_group_class, SamplerGroup, self.clip_key())]

    def _grad_sample_groups(self, records: List[Record], at: List[int]) -> List[PlannedGroup]:
        """Records clipped from their own per-sample gradients: batched by their layer type's
        group where it has one (``registry.register_grad_sample_group``)."""
        return [PlannedGroup(make, indices, shard) for shard, part in self._by_shard(records, at)
                for make, indices in group_records(records, part, self._grad_sample_group_class,
                                                   self._grad_sample_group, self.clip_key())]

    def _summed_groups(self, records: List[Record], at: List[int]) -> List[PlannedGroup]:
        """Records whose per-sample gradients are summed per parameter before their norms."""
        return [PlannedGroup(self._grad_sample_group, tuple(part), shard) for shard, part in self._by_shard(records, at)]

    def _grad_sample_group(self, records: List[Record]) -> Group:
        return GradSampleGroup(records, sampler_for=self.path.grad_sampler)

    def _grad_sample_group_class(self, layer: nn.Module) -> Optional[type]:
        return None if layer in self.path.functorch_layers else registry.GRAD_SAMPLE_GROUPS.get(type(layer))

    def _by_shard(self, records: List[Record], at: List[int]) -> List[Tuple[Optional[int], List[int]]]:
        """``at`` split by the FSDP2 parameter group of each record's layer, in order of first
        appearance: (group, indices); one part (None, at) for a model not sharded, or where
        the groups serve norms alone (double backward: FSDP's own pass makes the gradients).
        On a sharded model in single-backward mode no group spans two FSDP2 parameter groups:
        their clipped sums are reduce-scattered one parameter group at a time."""
        if self.path.sharded is None or not self.path.single_backward:
            return [(None, at)] if at else []
        parts: Dict[int, List[int]] = {}
        for i in at:
            parts.setdefault(self.path.sharded.group_of[records[i].layer], []).append(i)
        return list(parts.items())

    def small_grad_sample(self, record: Record, memory_bound: bool = False) -> bool:
        """Whether a layer's per-sample gradients (fp32) take a small fraction of the memory of
        the inputs and backprops book-keeping would keep for it, or are tiny: then its norms and
        clipped sums come from them, with fewer flops and less memory (a LoRA adapter's are far
        smaller than its inputs). ``memory_bound`` (records served early because memory is
        short): whenever they take less memory than the record."""
        layer = record.layer
        if layer in self.path.functorch_layers or type(layer) not in self.path.GRAD_SAMPLERS:
            return False
        elements = record.backprops.shape[0] * sum(p.numel() for p in self.path.layer_params(layer))
        kept = record_bytes(record)
        fraction = 1.0 if memory_bound else GRAD_SAMPLE_MEMORY_FRACTION
        return elements <= TINY_GRAD_SAMPLE_ELEMENTS or 4 * elements <= fraction * kept

    def clip_key(self) -> Optional[Callable[[nn.Module], tuple]]:
        """With clipping groups: what records batched into one group must share, their layers'
        clipping groups."""
        return None if self.path.clip_groups is None else self.groups_of_layer

    def groups_of_layer(self, layer: nn.Module) -> tuple:
        """The clipping group of each of a layer's trainable parameters, in their order (records
        batched into one clipped sum have them alike: one coefficient row per parameter place),
        found once per hooking of the model (``group_of`` refuses a parameter in none)."""
        found = self._layer_groups.get(layer)
        if found is None:
            found = self._layer_groups[layer] = tuple(self.path.clip_groups.group_of(p, self.path.param_name(p))
                                                      for p in self.path.layer_params(layer))
        return found

    def layers_of_group(self, g: int) -> List[nn.Module]:
        """The hooked layers holding a parameter of clipping group ``g``, trainable or not, found
        once per hooking of the model."""
        if self._group_layers is None:
            self._group_layers = {}
            for layer, params in self.path._own_params.items():
                for h in {self.path.clip_groups.index[p] for p in params if p in self.path.clip_groups.index}:
                    self._group_layers.setdefault(h, []).append(layer)
        return self._group_layers.get(g, [])


__all__ = ["FinishPlan", "GRAD_SAMPLE_MEMORY_FRACTION", "MAX_PLANS", "PlannedGroup", "Planner",
           "TINY_GRAD_SAMPLE_ELEMENTS", "record_key"]
