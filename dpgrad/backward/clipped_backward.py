"""The clipped backward of the ghost-clipping wrapper: per-sample losses in, clipped sums out.

``clipped_backward`` checks the graph between the model's outputs and the per-sample losses
(where its layout is new), runs a norm pass that asks autograd for the hooked outputs'
gradients only, takes the coefficients ``min(1, C / (norm + 1e-6))`` once
(``dpgrad.clipping.coefficients``), and then either each group's clipped sums, which reach
``p.grad`` through autograd's own accumulation (single backward, ``dpgrad.backward.clipped_sums``),
or a second backward pass of ``sum_b c_b loss_b`` with the hooks off (double backward, Opacus's
protocol). A batch of one sample is clipped from its plain gradient, with nothing recorded.
What kind of pass the clipping path is in (``NormPass``) is set here.
"""

from __future__ import annotations

from enum import Enum
from typing import Dict, List, Optional

import torch

from dpgrad.backward import grad_marks
from dpgrad.backward.autograd_graph import grad_keeping_graph, refusing_reentrant
from dpgrad.backward.finite_checks import FiniteCheck, FiniteReports
from dpgrad.checks.guarantee import sequence_number
from dpgrad.clipping.coefficients import clipping_coefficients
from dpgrad.kernels import reference

REENTRANT_CHECKPOINT = (
    "the model uses reentrant activation checkpointing (torch.utils.checkpoint with "
    "use_reentrant=True, the default of Hugging Face's gradient_checkpointing_enable() before "
    "transformers 5), whose recomputation runs a backward pass of its own inside dpgrad's: the "
    "ghost-clipping wrapper cannot take the norms through it. Use non-reentrant checkpointing: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
    "(transformers 5: activation_checkpointing_enable(), non-reentrant by default), or "
    "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)."
)

RUN_IN_BACKWARD = (
    "layer '{name}' ({kind}) ran inside the backward pass, with gradients on: a custom autograd Function "
    "runs it again in its backward and backpropagates through it there (reversible layers, as Reformer's; "
    "reentrant activation checkpointing), so what reaches its parameters goes around the ghost-clipping "
    "wrapper's per-sample clipping. Use a model without reversible layers, non-reentrant checkpointing "
    "(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)), or dpgrad.GradSampleModule, whose "
    "hooks run again in that backward pass."
)


class NormPass(Enum):
    """What a backward pass through the clipping path is."""

    PLAIN = "plain"  # loss.backward(): the norms, then the caller's own second pass (Opacus's protocol)
    NORMS_ONLY = "norms only"  # clipped_backward's first pass in double backward
    KEEP_FOR_CLIPPING = "keep for clipping"  # single backward: the norms, then the clipped sums from the records
    ONE_SAMPLE = "one sample"  # a batch of one: the plain gradient is the per-sample one; nothing recorded


class ClippedBackward:
    """The clipped backward of a ``ClippingPath`` (see the module docstring): a mixin of the
    path, whose norm pass it runs and whose norms, clipped sums (``sums``) and finite check it
    uses."""

    def clipped_backward(self, loss_per_sample: torch.Tensor, max_grad_norm, *, counted: bool = True,
                         optimizer_kind: str = "", loss_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Add ``sum_b c_b * grad(loss_b)`` to ``p.grad``, ``c_b`` from the norms of this pass
        and ``max_grad_norm``; returns the per-sample norms (see the wrapper's method).

        ``p.grad`` is first made ready (``dpgrad.backward.grad_marks.before_pass``: what a step
        took is not added to; ``counted`` and ``optimizer_kind`` say whether an accumulation may be
        accounted; a pass after the first in ``one_batch`` is another part of the same batch) and
        marked after. ``loss_scale``: the factor the losses
        were multiplied by (a GradScaler's, a 0-d tensor): the norms are divided by it, so the
        clipping bounds the unscaled gradients, and ``p.grad`` gets the clipped sums times it."""
        if loss_per_sample.dim() != 1:
            raise ValueError(
                f"clipped_backward takes one loss per sample, shape (B,), not {tuple(loss_per_sample.shape)}; "
                "for a loss per token, reduce each sequence first (DPLossFastGradientClipping's shape=)"
            )
        if loss_per_sample.grad_fn is None:
            raise ValueError("the per-sample losses have no autograd graph (computed under torch.no_grad()?)")
        if loss_scale is not None and self.sharded is not None and not self.single_backward:
            raise ValueError("loss scaling (a GradScaler) on a model sharded by FSDP2 takes single_backward=True: "
                             "double backward's second pass runs after a host wait for the finite check there")
        params = self.trainable_parameters
        marked = FiniteReports.device_count is None  # (a step being captured: the graphed step keeps them)
        another_batch = self.another_batch() if marked else True
        held, anew = grad_marks.before_pass(params, another_batch=another_batch,
                                            accumulation_allowed=self.grad_accumulation_allowed, counted=counted,
                                            optimizer_kind=optimizer_kind, scale=loss_scale) if marked else (0, False)
        self._loss_scale = loss_scale
        try:
            norms = self._clipped(loss_per_sample, max_grad_norm, params if anew else None)
        finally:
            self._loss_scale = None
        if marked:
            grad_marks.after_pass(params, self.param_name, max(1, held + another_batch), scale=loss_scale)
        return norms

    def another_batch(self) -> bool:
        """Whether the next clipped pass is of a batch the loader drew anew: always, but for the
        passes after the first in the wrapper's ``one_batch`` (physical parts of one batch)."""
        if self._one_batch is None:
            return True
        self._one_batch += 1
        return self._one_batch == 1

    def _clipped(self, loss_per_sample: torch.Tensor, max_grad_norm, anew=None) -> torch.Tensor:
        # The batch's loss as the sum of the samples' losses, whose backward under "mean" starts
        # from 1/B (a constant made once per B): the backprops of the mean loss, as the
        # non-private step has them, without the mean's own operations.
        reduced = loss_per_sample.sum(0)
        seed = self.sums.constant(1.0 / max(loss_per_sample.shape[0], 1), reduced) if self.loss_reduction == "mean" \
            else None
        targets = self._edges.targets(reduced.grad_fn, lowest=self.lets_go_early)
        if not targets:
            raise RuntimeError(
                "the loss depends on no layer this wrapper hooked: run the forward pass through "
                "the wrapper with hooks enabled and gradients on"
            )
        self._verify_loss(loss_per_sample, targets)
        self._clipped_seen = True
        if loss_per_sample.shape[0] == 1 and self._one_sample_is_plain():
            return self._clip_one_sample(reduced, max_grad_norm, anew)
        self._norm_pass = NormPass.KEEP_FOR_CLIPPING if self.single_backward else NormPass.NORMS_ONLY
        try:
            with refusing_reentrant(REENTRANT_CHECKPOINT):
                if self.single_backward:
                    torch.autograd.grad(reduced, targets, seed, allow_unused=True)
                else:  # the second pass goes through the same graph
                    grad_keeping_graph(reduced, targets, seed, allow_unused=True)
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
            if anew is not None:  # the checks passed: what a step took leaves p.grad before the sums come
                grad_marks.start_anew(anew)
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

    def _clip_one_sample(self, loss: torch.Tensor, max_grad_norm, anew=None) -> torch.Tensor:
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
            if self._loss_scale is not None:  # the norms of the unscaled gradients are clipped
                rows = rows / self._loss_scale
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
        if anew is not None:
            grad_marks.start_anew(anew)
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


__all__ = ["ClippedBackward", "NormPass", "REENTRANT_CHECKPOINT", "RUN_IN_BACKWARD"]
