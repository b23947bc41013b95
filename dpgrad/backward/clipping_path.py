"""``ClippingPath``: the backward path of the ghost-clipping wrapper, its passes' lifecycle.

Its ``finish`` takes the per-sample gradient norms of a pass's records: grouped by layer type
and shapes by the pass's finish plan (``dpgrad.backward.finish_plan``, made once for a pass of given
layers, shapes and trainable parameters, and reused), each group's norms in a few batched
operations, rows of one (P, B) matrix (``dpgrad.backward.norm_rows``); ``p._norm_sample`` and
the total norm (B,) from it. ``clipped_backward`` (``dpgrad.backward.clipped_backward``) runs a
norm pass that asks autograd for the hooked outputs' gradients only, takes the coefficients
``min(1, C / (norm + 1e-6))`` once (``dpgrad.clipping.coefficients``), and then either each
group's clipped sums, which reach ``p.grad`` through autograd's own accumulation, each group
letting go of its inputs as it is summed (single backward, ``dpgrad.backward.clipped_sums``), or
a second backward pass of ``sum_b c_b loss_b`` with the hooks off (double backward, Opacus's
protocol).

With clipping groups (``dpgrad.clipping.groups``: per-layer or per-block clipping) single
backward clips the groups whose records are all in, together, once memory needs it
(``dpgrad.backward.group_flush``), so a pass holds the records of the groups not yet complete
and a little more, not the whole model's.

A parameter used more than once (an input embedding tied to the output layer, a layer
called twice) gets the exact norm of its summed per-sample gradient, ``sqrt(sum_i |g_i|^2 +
2 sum_{i<j} <g_i, g_j>)``: each use's norm from its norm sampler, each cross term from the
uses' factors (``registry.register_factor_sampler``), never a per-sample gradient
(``dpgrad.backward.norm_rows``). The layers whose parameters need them are found here.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from dpgrad.samplers import registry
from dpgrad.backward import grad_marks
from dpgrad.backward.autograd_graph import region
from dpgrad.backward.backward_pass import BackwardPath
from dpgrad.backward.finite_checks import FiniteCheck
from dpgrad.backward.clipped_backward import REENTRANT_CHECKPOINT, RUN_IN_BACKWARD, ClippedBackward, NormPass
from dpgrad.backward.clipped_sums import ClippedSums
from dpgrad.backward.finish_plan import Planner
from dpgrad.backward.fsdp import ShardedParameters
from dpgrad.backward.group_flush import EarlyNorms, GroupFlush
from dpgrad.backward.layer_inputs import recomputing
from dpgrad.backward.norm_rows import NormRows
from dpgrad.samplers.groups import Group, Record
from dpgrad.tuning import get_tuner


class ClippingPath(ClippedBackward, NormRows, BackwardPath):
    """The ghost-clipping wrapper's path (see the module docstring): its clipped backward from
    ``ClippedBackward``, the norms of its records from ``NormRows``.

    Besides ``BackwardPath``'s settings: ``ghost``, norms without per-sample gradients for
    layers with a norm sampler; ``single_backward``, one backward pass per clipped step. Checks
    at construction that parameters several layers share can get exact norms, and takes a
    model sharded by FSDP2 (``dpgrad.backward.fsdp``).
    """

    FACTOR_SAMPLERS = registry.FACTOR_SAMPLERS
    NORM_SAMPLERS = registry.NORM_SAMPLERS
    CLIPPED_SUM_SAMPLERS = registry.CLIPPED_SUM_SAMPLERS
    UNCLIPPED = ("these trainable parameters would get gradients that are not clipped per sample: the "
                 "uses below are not in the per-sample norms, so one sample could move the summed "
                 "gradient by more than max_grad_norm. Nothing has reached p.grad from this pass.")
    TRANSIENT = BackwardPath.TRANSIENT + ("_records", "_norm_pass", "_kept", "_finite", "pass_norm", "group_norms",
                                          "_group_flush", "_early", "records_peak", "planner", "_row_indices", "sums",
                                          "_loss_scale", "_one_batch")

    def __init__(self, model: nn.Module, *, ghost: bool, single_backward: bool, clip_groups=None,
                 gamma: Optional[float] = None, **settings):
        # Clipping groups (dpgrad.clipping.groups.ClipGroups) clip in one backward pass: a second
        # pass of sum_b c_b loss_b has one coefficient per sample, not one per sample and group.
        self.ghost, self.single_backward = ghost, single_backward or clip_groups is not None
        self.clip_groups = clip_groups
        self.gamma = gamma  # automatic clipping's gamma (``clipping_coefficients``); None: Opacus's
        self._clipped_seen = False  # whether clipped_backward ran (then it probes new layouts)
        super().__init__(model, **settings)

    def _init_transient(self) -> None:
        super()._init_transient()
        self._records: List[Record] = []
        self._norm_pass = NormPass.PLAIN
        self._kept: List[Tuple[Group, Optional[int]]] = []  # (group, FSDP2 group) a single backward sums next
        self._finite: Optional[FiniteCheck] = None
        self.pass_norm: Optional[torch.Tensor] = None  # (B,) total norm of the last pass
        self.group_norms: Optional[torch.Tensor] = None  # (G, B) with clipping groups
        # Clipping groups in single backward: each group clipped as soon as its records are all
        # in, its sums held until the end of the pass (withheld there if a norm is not finite).
        self._group_flush = GroupFlush(self)
        self._early = EarlyNorms(self)
        self.records_peak = 0  # the most records held at once in the last pass
        self.planner = Planner(self)  # how a pass's records are grouped (``dpgrad.backward.finish_plan``)
        self._row_indices: Dict[tuple, torch.Tensor] = {}
        self.sums = ClippedSums(self)  # the clipped sums and their hand-off to p.grad
        self._loss_scale: Optional[torch.Tensor] = None  # a clipped pass's loss scale (a GradScaler's)
        self._one_batch: Optional[int] = None  # the passes of the open ``one_batch`` (None: none open)

    # ------------------------------------------------------------------ the layers
    def uses_norm_sampler(self, layer: nn.Module) -> bool:
        """Whether the layer is clipped from its norm alone (single backward: only if it can
        also sum it clipped)."""
        kind = type(layer)
        return (self.ghost and kind in self.NORM_SAMPLERS and not registry.samplers_unmet(layer)
                and (not self.single_backward or kind in self.CLIPPED_SUM_SAMPLERS)
                and layer not in getattr(self, "by_grad_sample", ()))

    def _check_layers(self, model: nn.Module) -> None:
        # Parameters a ghost-clipped layer shares: their uses' factors are kept for the cross
        # terms. Found here for tied weights, in the forward pass for a layer called twice.
        hooked = dict(self.layers_to_hook(model))
        whole = {layer: self.whole(layer) for layer in hooked.values()}
        self.shared = self._shared_ghost_parameters(hooked, whole)
        # A model sharded by FSDP2: its parameter groups, checked before the model is touched.
        self.sharded = ShardedParameters.of(model, hooked, whole, {p: n for n, p in model.named_parameters()})

    def _shared_ghost_parameters(self, hooked: Dict[str, nn.Module], whole: Dict[nn.Module, bool]) -> set:
        """Trainable parameters that several hooked layers use, at least one ghost-clipped.

        A layer with a norm sampler that shares a parameter with a use whose per-sample
        gradients torch.func computes (an embedding subclass with a parameter of its own, tied
        to the output layer) is clipped from its per-sample gradients too (``by_grad_sample``):
        the shared parameter's are then the sum of its uses'. Raises, before the model is
        touched, where a shared parameter's norm cannot be exact: a layer without a factor sampler.
        """
        self.by_grad_sample: Set[nn.Module] = set()
        while True:
            owners: Dict[nn.Parameter, Dict[str, bool]] = {}
            for name, layer in hooked.items():
                for p in layer.parameters(recurse=whole[layer]):
                    if p.requires_grad:
                        owners.setdefault(p, {})[name] = self.uses_norm_sampler(layer)
            mixed = {hooked[n] for layers in owners.values() if len(layers) > 1 and not all(layers.values())
                     for n, ghost in layers.items() if ghost} - self.by_grad_sample
            if not mixed:
                break
            self.by_grad_sample |= mixed
        shared = set()
        for p, layers in owners.items():
            if len(layers) < 2 or not any(layers.values()):
                continue
            names = list(layers)
            self.check_factors({n: hooked[n] for n in names})
            shared.add(p)
        return shared

    def check_factors(self, layers: Dict[str, nn.Module]) -> None:
        """Raise unless every one of these layers, which use one parameter, has a factor sampler."""
        missing = {n: type(layer).__name__ for n, layer in layers.items() if type(layer) not in self.FACTOR_SAMPLERS}
        if missing:
            raise NotImplementedError(
                f"layers {list(layers)} use one parameter under ghost clipping, but {missing} have "
                "no factor sampler (dpgrad.register_factor_sampler), so the norm of the summed "
                "gradient cannot be exact. Register one, untie the parameter, or wrap with "
                "use_ghost_clipping=False."
            )

    def attach(self, root: nn.Module) -> None:
        super().attach(root)
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]

    def _rescan(self) -> None:
        super()._rescan()
        self.planner.forget()
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        super().begin_forward()
        if self.hooks_enabled and torch.is_grad_enabled():
            for p in self.trainable_parameters:
                p._norm_sample = None
            self.pass_norm = None

    def _note_call(self, layer, name, params) -> None:
        if self.uses_norm_sampler(layer) and layer in self._forward_seen and not self.shared.issuperset(params):
            # Called twice: from now on its parameters' uses are combined by their factors.
            self.check_factors({name: layer})
            self.shared.update(params)
        super()._note_call(layer, name, params)

    def _visit_node(self, node) -> None:
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise RuntimeError(REENTRANT_CHECKPOINT)

    def _layer_call(self, layer: nn.Module, inputs, output, again=None) -> Optional[torch.Tensor]:
        if torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled() and self.hooks_enabled \
                and not self.independence.rerunning and not recomputing():
            # A custom autograd Function's backward running the layer again and backpropagating
            # through it there: what reaches its parameters so goes around the clipping.
            raise RuntimeError(RUN_IN_BACKWARD.format(name=self.layer_names.get(layer, "?"), kind=type(layer).__name__))
        return super()._layer_call(layer, inputs, output, again)

    # ------------------------------------------------------------------ a pass
    @property
    def memory_short(self) -> bool:
        """Whether memory in use on the device passed the mark of a pass of this path
        (``dpgrad.backward.group_flush.MemoryMark``), which then let go of records early: from the next
        pass on, the norm pass asks autograd for the lowest hooked outputs only (a walk of the
        graph, ``dpgrad.backward.autograd_graph``), since the gradient autograd returns for each output
        it is asked for stays alive to the end of the pass, records let go of or not. Never set
        on a device whose memory torch does not count (a CPU)."""
        return self._early.mark.found_short or self._group_flush.mark.found_short

    @property
    def lets_go_early(self) -> bool:
        """Whether a pass of this path let go of records before its end: memory was short
        (``memory_short``), or records were served or groups clipped as they came on a device
        whose memory torch does not count. From the next pass on, the norm pass asks autograd
        for the lowest hooked outputs only (see ``memory_short``)."""
        return self.memory_short or self._early.mark.let_go or self._group_flush.mark.let_go

    def keep(self, record: Record) -> None:
        if self._norm_pass is NormPass.ONE_SAMPLE:
            return  # its inputs were let go of: the gradient comes from autograd
        if self.single_backward and self._norm_pass is NormPass.PLAIN:
            why, opacus = ("has single_backward=True", "needs single_backward=False")
            if self.clip_groups is not None:  # one pass in either mode
                why, opacus = ("clips by groups, in one backward pass", "cannot clip by groups")
            raise RuntimeError(
                f"{self.layer_label(record.layer)}: this wrapper {why}, so "
                "its backward pass must come from dpgrad.DPLossFastGradientClipping (loss.backward() "
                "on what it returns) or wrapper.clipped_backward(per_sample_losses). A plain "
                f"backward would leave unclipped gradients in p.grad; Opacus's "
                f"DPLossFastGradientClipping {opacus}."
            )
        self._records.append(record)
        self.records_peak = max(self.records_peak, len(self._records) + len(self._group_flush.ready)
                                + len(self._early.ready))
        if self._norm_pass is NormPass.KEEP_FOR_CLIPPING and self.clip_groups is not None:
            self._group_flush.after(record)
        elif self.clip_groups is None and self.sharded is None:
            self._early.after(record, keep_groups=self._norm_pass is NormPass.KEEP_FOR_CLIPPING)

    def _open_pass(self) -> None:
        # Norms belong to one backward pass: a parameter this pass does not reach has a zero
        # gradient in it, whatever an earlier pass (of another forward) left.
        for p in self.trainable_parameters:
            p._norm_sample = None
        self.pass_norm = None
        self.records_peak = 0

    def _close_pass(self) -> None:
        plain = self._norm_pass is NormPass.PLAIN
        try:
            super()._close_pass()
        finally:
            if plain:
                # A plain loss.backward(): autograd left unclipped gradients in p.grad, which only
                # a clipped second pass after zero_grad() (Opacus's protocol) may replace.
                grad_marks.after_pass(self.trainable_parameters, self.param_name, 1, clipped=False)

    def _clear_pass(self) -> None:
        self._records = []
        self._group_flush.clear()
        self._early.clear()
        super()._clear_pass()

    def finish(self) -> None:
        """The pass's per-sample norms onto ``p._norm_sample`` and ``pass_norm``; in single
        backward, the groups kept for the clipped sums."""
        if self._norm_pass is NormPass.ONE_SAMPLE:
            return
        if self._norm_pass is NormPass.KEEP_FOR_CLIPPING and self.clip_groups is not None:
            found = self._group_flush.rows()
            if found is None:
                return
            params, rows = found
        else:
            ready, served = self._early.take()
            records = [self.batch_front(rec) for rec in ready + self._records]
            self._records = []
            with get_tuner().short_of_memory() if self.memory_short else contextlib.nullcontext():
                params, rows, groups = self._norm_rows(records)
            if served:  # norms taken early in the pass (``EarlyNorms``), then these
                params = [p for ps, _, _ in served for p in ps] + params
                rows = torch.cat([r for _, r, _ in served] + ([rows] if rows is not None else []))
                groups = [g for _, _, gs in served for g in gs] + groups
            if self._norm_pass is NormPass.KEEP_FOR_CLIPPING:
                self._kept = groups
            if rows is None:
                return
            rows = self.per_sample_rows(rows)
        self.pass_norm = torch.linalg.vector_norm(rows, dim=0)
        if self.clip_groups is not None:
            self.group_norms = self.clip_groups.norms(params, rows)
        for p, norm in zip(params, rows.unbind(0)):
            p._norm_sample = norm
            p.grad_sample = None
        if self.check_finite:
            self._finite = FiniteCheck([self.pass_norm], lambda: [(self.param_name(p), n) for p, n in
                                                                    zip(params, rows.unbind(0))], "gradient norms",
                                       self.finite_reports)
            if self._norm_pass is NormPass.PLAIN:
                self._wait_finite()

    def _wait_finite(self) -> None:
        """The host waits for this pass's finite check and raises if it failed (a plain
        ``loss.backward()``, whose second pass is the caller's)."""
        check, self._finite = self._finite, None
        if check is not None:
            with region("dpgrad.wait_finite"):
                check.wait()

    def _withhold_if_not_finite(self, tensors, last: bool = True) -> None:
        """Zero ``tensors`` (this pass's clipped gradients, before they reach ``p.grad`` or FSDP)
        on the device if the pass's values were not finite (NaN under loss scaling); ``last``:
        the outcome is then reported at the next forward pass (``FiniteReports``), with no host
        wait now."""
        check = self._finite
        if check is None:
            return
        scaled = self._loss_scale is not None
        # Under loss scaling an overflow is the GradScaler's to see: NaN, which makes it skip the
        # step and lower its scale, not zeros, and no error at the next forward pass.
        check.withhold(tensors, fill=float("nan") if scaled else 0.0)
        if last:
            self._finite = None
            if not scaled:
                self.finite_reports.add(check)

    def norm_sample(self) -> torch.Tensor:
        """Per-sample gradient norms over all trainable parameters, (B,)."""
        if self.pass_norm is not None and not any(p.requires_grad for p in self.unhooked):
            return self.pass_norm
        missing = [p for p in self.trainable_parameters if getattr(p, "_norm_sample", None) is None]
        present = [p._norm_sample for p in self.trainable_parameters if getattr(p, "_norm_sample", None) is not None]
        if missing and not present:
            raise RuntimeError(
                "no per-sample gradient norms yet: run forward and backward (with hooks enabled) "
                "before get_norm_sample / get_clipping_coef"
            )
        # A parameter no hook sees has an unknown norm, not a zero one.
        skipped = [self.param_name(p) for p in missing if p in self.unhooked]
        if skipped:
            raise RuntimeError(
                f"parameters {skipped} belong to layers skipped under strict=False and have no "
                "per-sample norm, so their gradients cannot be clipped. Freeze them "
                "(requires_grad_(False)) or replace those layers."
            )
        device = present[0].device
        # A trainable parameter the last backward did not reach has a zero gradient.
        stacked = torch.stack([n.to(device) for n in present] + [torch.zeros_like(present[0]) for _ in missing], dim=0)
        return stacked.norm(2, dim=0)

    def probes_model_at_forward(self) -> bool:
        # Once clipped_backward has been seen, its probe of the per-sample losses takes the
        # model too: one extra backward pass per new layout, not two.
        return not self._clipped_seen


__all__ = ["ClippingPath", "NormPass"]
