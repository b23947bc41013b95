"""``ClippingPath``: the backward path of the ghost-clipping wrapper, its passes' lifecycle.

Its ``finish`` takes the per-sample gradient norms of a pass's records: grouped by layer type
and shapes by the pass's finish plan (``dpgrad.backward.finish_plan``, made once for a pass of given
layers, shapes and trainable parameters, and reused), each group's norms in a few batched
operations, rows of one (P, B) matrix; ``p._norm_sample`` and the total norm (B,) from it.
``clipped_backward`` runs a norm pass that asks autograd for the hooked outputs' gradients
only, takes the coefficients ``min(1, C / (norm + 1e-6))`` once (``dpgrad.clipping.coefficients``), and
then either each group's clipped sums, which reach ``p.grad`` through autograd's own
accumulation, each group letting go of its inputs as it is summed (single backward,
``dpgrad.backward.clipped_sums``), or a second backward pass of ``sum_b c_b loss_b`` with the hooks off
(double backward, Opacus's protocol).

With clipping groups (``dpgrad.clipping.groups``: per-layer or per-block clipping) single
backward clips each group as soon as the records of all its layers are in
(``dpgrad.backward.group_flush``), so a pass holds the records of the groups not yet complete, not the
whole model's.

A parameter used more than once (an input embedding tied to the output layer, a layer
called twice) gets the exact norm of its summed per-sample gradient, ``sqrt(sum_i |g_i|^2 +
2 sum_{i<j} <g_i, g_j>)``: each use's norm from its norm sampler, each cross term from the
uses' factors (``registry.register_factor_sampler``), never a per-sample gradient.
"""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.samplers import registry
from dpgrad.backward.autograd_graph import grad_keeping_graph, region
from dpgrad.backward.backward_pass import BackwardPath, FiniteCheck
from dpgrad.backward.clipped_sums import ClippedSums
from dpgrad.clipping.coefficients import clipping_coefficients
from dpgrad.backward.finish_plan import Planner
from dpgrad.backward.fsdp import ShardedParameters
from dpgrad.checks.guarantee import sequence_number
from dpgrad.kernels import reference
from dpgrad.backward.group_flush import EarlyNorms, GroupFlush
from dpgrad.samplers.groups import Group, Record
from dpgrad.tuning import get_tuner

REENTRANT_CHECKPOINT = (
    "the model uses reentrant activation checkpointing (torch.utils.checkpoint with "
    "use_reentrant=True, the default of Hugging Face's gradient_checkpointing_enable() before "
    "transformers 5), whose recomputation runs a backward pass of its own inside dpgrad's: the "
    "ghost-clipping wrapper cannot take the norms through it. Use non-reentrant checkpointing: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
    "(transformers 5: activation_checkpointing_enable(), non-reentrant by default), or "
    "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)."
)


class NormPass(Enum):
    """What a backward pass through the clipping path is."""

    PLAIN = "plain"  # loss.backward(): the norms, then the caller's own second pass (Opacus's protocol)
    NORMS_ONLY = "norms only"  # clipped_backward's first pass in double backward
    KEEP_FOR_CLIPPING = "keep for clipping"  # single backward: the norms, then the clipped sums from the records
    ONE_SAMPLE = "one sample"  # a batch of one: the plain gradient is the per-sample one; nothing recorded


class ClippingPath(BackwardPath):
    """The ghost-clipping wrapper's path (see the module docstring).

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
                                          "_group_flush", "_early", "records_peak", "planner", "_row_indices", "sums")

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

    # ------------------------------------------------------------------ the layers
    def uses_norm_sampler(self, layer: nn.Module) -> bool:
        """Whether the layer is clipped from its norm alone (single backward: only if it can
        also sum it clipped)."""
        kind = type(layer)
        return (self.ghost and kind in self.NORM_SAMPLERS
                and (not self.single_backward or kind in self.CLIPPED_SUM_SAMPLERS))

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

        Raises, before the model is touched, where a shared parameter's norm cannot be exact:
        a ghost-clipped use beside a per-sample-gradient one, or a layer without a factor
        sampler.
        """
        owners: Dict[nn.Parameter, Dict[str, bool]] = {}
        for name, layer in hooked.items():
            for p in layer.parameters(recurse=whole[layer]):
                if p.requires_grad:
                    owners.setdefault(p, {})[name] = self.uses_norm_sampler(layer)
        shared = set()
        for p, layers in owners.items():
            if len(layers) < 2 or not any(layers.values()):
                continue
            names = list(layers)
            if not all(layers.values()):
                raise NotImplementedError(
                    f"layers {names} share one parameter, and ghost clipping takes the norms of "
                    f"{[n for n, g in layers.items() if g]} from norm samplers but of "
                    f"{[n for n, g in layers.items() if not g]} from per-sample gradients, which "
                    "cannot be combined exactly. Untie the parameter, or wrap with "
                    "use_ghost_clipping=False."
                )
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

    def keep(self, record: Record) -> None:
        if self._norm_pass is NormPass.ONE_SAMPLE:
            return  # its inputs were let go of: the gradient comes from autograd
        if self.single_backward and self._norm_pass is NormPass.PLAIN:
            why, opacus = ("has single_backward=True", "needs single_backward=False")
            if self.clip_groups is not None:  # one pass in either mode
                why, opacus = ("clips by groups, in one backward pass", "cannot clip by groups")
            raise RuntimeError(
                f"layer '{self.layer_names[record.layer]}': this wrapper {why}, so "
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
            if self.loss_reduction == "mean":
                rows = rows * rows.shape[1]
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
        on the device if the pass's values were not finite; ``last``: the outcome is then
        reported at the next forward pass (``FiniteReports``), with no host wait now."""
        check = self._finite
        if check is None:
            return
        check.withhold(tensors)
        if last:
            self._finite = None
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

    # ------------------------------------------------------------------ the norms
    def _norm_rows(self, records: List[Record], memory_bound: bool = False
                   ) -> Tuple[List[nn.Parameter], Optional[torch.Tensor], list]:
        """The pass's parameters (each once), their per-sample gradient norms (P, B), and the
        groups made (with their FSDP2 group), by the pass's plan (``Planner.plan``): each
        group's norms, then, for a parameter used by several records, the norm of its summed
        gradient. ``memory_bound``: records served early to free memory (``EarlyNorms``), a
        layer clipped from its per-sample gradients wherever they are smaller than its record."""
        if not records:
            return [], None, []
        plan = self.planner.plan(records, memory_bound)
        groups = [(planned.make([records[i] for i in planned.indices]), planned.shard) for planned in plan.groups]
        params, pieces = [], []
        for group, _ in groups:
            ps, rows = group.norms()
            params += ps
            pieces += rows
        if self.sharded is not None:  # the samplers saw FSDP's unsharded copies
            params = self.sharded.canonical(params)
        if not params:
            return [], None, groups
        rows = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(len(params), -1)
        if plan.combined is None:
            plan.combined = len(params) != len(set(params))
        if plan.combined:
            params, rows = self._combine_uses(params, rows, [records[i] for i in plan.by_norm])
        return params, rows, groups

    def _combine_uses(self, params, rows, shared_records: List[Record]):
        """One row per parameter: a parameter with several uses gets the norm of its summed
        gradient, ``sqrt(sum_i |g_i|^2 + 2 sum_{i<j} <g_i, g_j>)``, the cross terms from the
        uses' factors (never a per-sample gradient)."""
        index: Dict[nn.Parameter, List[int]] = {}
        for i, p in enumerate(params):
            index.setdefault(p, []).append(i)
        factors: Dict[nn.Parameter, list] = {}
        for layer, inputs, backprops in shared_records:
            mine = [p for p in self.layer_params(layer) if p in self.shared and len(index.get(p, ())) > 1]
            if mine:
                found = self.FACTOR_SAMPLERS[type(layer)](layer, inputs, backprops)
                if self.sharded is not None:
                    found = self.sharded.canonical_keys(found)
                for p in mine:
                    factors.setdefault(p, []).append(found[p])
        once = [i for p, rows_of in index.items() if len(rows_of) == 1 for i in rows_of]
        out_params = [params[i] for i in once]
        combined = []
        for p, rows_of in index.items():
            if len(rows_of) == 1:
                continue
            sq = rows.index_select(0, self._row_index(rows_of, rows.device)).square().sum(0)
            uses = factors[p]
            for i in range(len(uses)):
                for j in range(i + 1, len(uses)):
                    # torch's own kernels on every backend (triton_ops re-exports reference's).
                    sq = torch.add(sq, reference.outer_sum_inner(*uses[i], *uses[j]).to(sq.dtype), alpha=2)
            # Rounding can take the square of an exact zero (opposite uses) slightly below it.
            combined.append(sq.clamp_min(0).sqrt())
            out_params.append(p)
        kept = rows.index_select(0, self._row_index(once, rows.device))
        return out_params, torch.cat([kept, torch.stack(combined)])

    def _row_index(self, rows: List[int], device: torch.device) -> torch.Tensor:
        """``rows`` as an index tensor on ``device``, made once: indexing by a Python list
        copies the list to the device at every call, which on a GPU waits for the queue."""
        key = (tuple(rows), device)
        found = self._row_indices.get(key)
        if found is None:
            found = self._row_indices[key] = torch.tensor(rows, dtype=torch.int64, device=device)
        return found

    # ------------------------------------------------------------------ clipped backward
    def clipped_backward(self, loss_per_sample: torch.Tensor, max_grad_norm) -> torch.Tensor:
        """Add ``sum_b c_b * grad(loss_b)`` to ``p.grad``, ``c_b`` from the norms of this pass
        and ``max_grad_norm``; returns the per-sample norms (see the wrapper's method)."""
        if loss_per_sample.dim() != 1:
            raise ValueError(
                f"clipped_backward takes one loss per sample, shape (B,), not {tuple(loss_per_sample.shape)}; "
                "for a loss per token, reduce each sequence first (DPLossFastGradientClipping's shape=)"
            )
        if loss_per_sample.grad_fn is None:
            raise ValueError("the per-sample losses have no autograd graph (computed under torch.no_grad()?)")
        # The batch's loss as the sum of the samples' losses, whose backward under "mean" starts
        # from 1/B (a constant made once per B): the backprops of the mean loss, as the
        # non-private step has them, without the mean's own operations.
        reduced = loss_per_sample.sum(0)
        seed = self.sums.constant(1.0 / max(loss_per_sample.shape[0], 1), reduced) if self.loss_reduction == "mean" \
            else None
        targets = self._edges.targets(reduced.grad_fn, lowest=self.memory_short)
        if not targets:
            raise RuntimeError(
                "the loss depends on no layer this wrapper hooked: run the forward pass through "
                "the wrapper with hooks enabled and gradients on"
            )
        self._verify_loss(loss_per_sample, targets)
        self._clipped_seen = True
        if loss_per_sample.shape[0] == 1 and self._one_sample_is_plain():
            return self._clip_one_sample(reduced, max_grad_norm)
        self._norm_pass = NormPass.KEEP_FOR_CLIPPING if self.single_backward else NormPass.NORMS_ONLY
        try:
            try:
                if self.single_backward:
                    torch.autograd.grad(reduced, targets, seed, allow_unused=True)
                else:  # the second pass goes through the same graph
                    grad_keeping_graph(reduced, targets, seed, allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant=True" in str(error):
                    raise RuntimeError(REENTRANT_CHECKPOINT) from error
                raise
            del targets
            self._edges.release()
            norms = self.norm_sample()
            if norms.shape != loss_per_sample.shape:
                raise ValueError(
                    f"{loss_per_sample.shape[0]} losses for a batch of {norms.shape[0]} samples: "
                    "give one loss per sample"
                )
            if callable(max_grad_norm):  # the bound from the norms (adaptive clipping)
                max_grad_norm = max_grad_norm(norms)
            # With clipping groups each group was clipped with its own coefficients (``GroupFlush``).
            if self.single_backward:
                self.sums.hand_off(None if self.clip_groups is not None else clipping_coefficients(
                    norms, max_grad_norm, self.gamma, self.sums.scale(norms.shape[0])))
            else:
                coef = clipping_coefficients(norms, max_grad_norm, self.gamma) if self.clip_groups is None else None
                self._second_pass(coef.to(loss_per_sample.device) * loss_per_sample)
        finally:
            self._norm_pass = NormPass.PLAIN
            self._kept, self._finite, self._group_flush.held = [], None, {}
        return norms

    def _second_pass(self, weighted: torch.Tensor) -> None:
        """Double backward's second pass: ``sum_b c_b grad(loss_b)`` (``weighted``: the losses
        times their coefficients) to ``p.grad``, with the hooks off. The gradients are taken
        with ``torch.autograd.grad`` and handed to ``p.grad`` as single backward hands its sums
        (``ClippedSums.to_grad``), withheld on the device if the norms were not finite; on a
        model sharded by FSDP2, whose reduce-scatter runs in the pass itself, the host waits
        for the check first and the pass is a plain backward."""
        if self.sharded is not None:
            self._wait_finite()
            with self.hooks_off():
                weighted.sum().backward()
            return
        params = self.trainable_parameters
        with self.hooks_off():
            grads = torch.autograd.grad(weighted.sum(), params, allow_unused=True)
        held = {p: g for p, g in zip(params, grads) if g is not None}
        del grads
        self._withhold_if_not_finite(held.values())
        self.sums.to_grad([held])

    def _one_sample_is_plain(self) -> bool:
        """Whether a loss of one sample can be clipped from its plain gradient: a forward pass of
        one sample, on a model that is not sharded and has no trainable layer skipped."""
        return (self._forward_batch == 1 and self.sharded is None
                and not any(p.requires_grad for p in self.unhooked))

    def _clip_one_sample(self, loss: torch.Tensor, max_grad_norm) -> torch.Tensor:
        """A batch of one sample: its per-sample gradient is the plain gradient. One backward
        pass computes it (as the non-private step would), its norm is one reduction, and the
        clipped gradient ``c * g`` (``clipping_coefficients``) reaches ``p.grad`` as in single
        backward: no norm or clipped-sum kernel runs, and nothing is recorded."""
        self._check_trainable_since_forward()  # before autograd is asked for those of the forward
        params = list(self.trainable_parameters)
        self._norm_pass = NormPass.ONE_SAMPLE
        try:
            try:
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant=True" in str(error):
                    raise RuntimeError(REENTRANT_CHECKPOINT) from error
                raise
        finally:
            self._norm_pass = NormPass.PLAIN
        self._edges.release()
        reached = [(p, g) for p, g in zip(params, grads) if g is not None]
        if not reached:
            raise RuntimeError("the loss reaches no trainable parameter: nothing to clip")
        params, grads = [p for p, _ in reached], [g for _, g in reached]
        with torch.no_grad():
            acc = reference.accumulation_dtype(*grads)  # fp32 norms of half gradients, as everywhere
            rows = torch.stack(torch._foreach_norm(grads, 2, dtype=acc))
            for p, norm in zip(params, rows.unbind(0)):
                p._norm_sample = norm.view(1)
                p.grad_sample = None
            self.pass_norm = torch.linalg.vector_norm(rows).view(1)
            if self.check_finite:
                self._finite = FiniteCheck([self.pass_norm], lambda: [(self.param_name(p), n) for p, n in
                                                                      zip(params, rows)], "gradient norms",
                                           self.finite_reports)
            groups = self.clip_groups
            if callable(max_grad_norm):  # the bound from the norm (adaptive clipping)
                max_grad_norm = max_grad_norm(self.pass_norm)
            if groups is None:
                coefs = [clipping_coefficients(self.pass_norm, max_grad_norm, self.gamma).view(())]
            else:  # each parameter by its group's coefficient
                self.group_norms = groups.norms(params, rows.view(-1, 1))
                coef = groups.coefficients(self.group_norms).view(-1)
                coefs = list(coef.index_select(0, groups.rows(params, coef.device)).unbind(0))
            grads = scaled(grads, coefs)
            self._withhold_if_not_finite(grads)
        held = [dict(zip(params, grads))]
        del grads, reached
        self.sums.to_grad(held)
        return self.pass_norm

    def _verify_loss(self, loss_per_sample: torch.Tensor, targets: list) -> None:
        """The guarantee's checks of the graph between the loss and the model's outputs (the
        model's own graph is checked at the end of its forward pass), when its layout is new:
        every parameter it reaches clipped; and each loss its own sample's, through the model
        too where its probes were left to the loss's (``dpgrad.checks.independence_check``)."""
        edges = self._edges
        root = loss_per_sample.grad_fn
        outputs = set(edges.outputs)
        key = self._loss_key(loss_per_sample)
        if key not in self._verified:
            self._verify([root], [], lambda node: node in outputs or edges.marked(node), in_loss=True)
            self._verified.add(key)
        if self.check_independence:
            self.independence.probe_loss(loss_per_sample, key, targets)

    def _loss_key(self, loss_per_sample: torch.Tensor, what: str = "loss") -> tuple:
        """The layout of the graph from the model's outputs to the per-sample losses."""
        edges = self._edges
        return (self._scan_version, what, sequence_number(loss_per_sample.grad_fn) - edges.output_seq,
                bool(edges.outputs))

    def note_loss(self, loss_per_sample: torch.Tensor, recompute, modules=()) -> None:
        """Per-sample losses from a criterion that ``recompute(samples)`` calls again with the
        outputs and targets of ``samples`` changed: the loss's forward probe
        (``dpgrad.checks.forward_probe``) runs in their backward pass, where it is due."""
        if self.check_independence and loss_per_sample.grad_fn is not None:
            self.independence.note_loss(loss_per_sample, self._loss_key(loss_per_sample, "criterion"), recompute,
                                        modules)

    def probes_model_at_forward(self) -> bool:
        # Once clipped_backward has been seen, its probe of the per-sample losses takes the
        # model too: one extra backward pass per new layout, not two.
        return not self._clipped_seen


def owned(grads: List[torch.Tensor]) -> List[bool]:
    """Which of the gradients ``torch.autograd.grad`` returned are each the only view of their
    memory: autograd can return one parameter's gradient as a view of another's (at B = 1, a
    class token's inside the position embeddings'), or an expanded tensor; scaled in place,
    such a gradient would scale its neighbour's too."""
    storages: Dict[int, int] = {}
    for g in grads:
        key = g.untyped_storage().data_ptr()
        storages[key] = storages.get(key, 0) + 1
    return [storages[g.untyped_storage().data_ptr()] == 1 and g.is_contiguous() and g.storage_offset() == 0
            and g.untyped_storage().nbytes() == g.numel() * g.element_size() for g in grads]


def scaled(grads: List[torch.Tensor], coefs: List[torch.Tensor]) -> List[torch.Tensor]:
    """``grads`` each times its coefficient (one for all, or one each): in place where a
    gradient is the only view of its memory (``owned``), into a new tensor elsewhere."""
    each = coefs if len(coefs) > 1 else None
    mine = owned(grads)
    inplace = [g for g, m in zip(grads, mine) if m]
    if inplace:
        torch._foreach_mul_(inplace, coefs[0] if each is None else [c for c, m in zip(each, mine) if m])
    return [g if m else g * (coefs[0] if each is None else each[i]) for i, (g, m) in enumerate(zip(grads, mine))]


__all__ = ["ClippingPath", "NormPass"]
