"""When the independence probes run, for one wrapper's backward path.

The probes themselves are ``dpgrad.checks.independence`` (backward: what autograd sees) and
``dpgrad.checks.forward_probe`` (forward: what it does not). ``IndependenceCheck`` decides when they
run and runs them through the path, the backward probes first (their errors name the layers):

- at the end of a forward pass whose layout (``BackwardPath.end_forward``'s key) has not been
  checked yet: the backward probes from the model's outputs, then the model's forward probe;
  unless the path probes its per-sample losses through the model instead (the clipping path
  once ``clipped_backward`` was seen: one set of backward probes, not two), which then runs
  both;
- in ``clipped_backward``, for a loss layout not checked yet: the backward probes from the
  per-sample losses (through the model where its probes were left to them), then the loss's
  forward probe when ``DPLossFastGradientClipping`` computed the losses (``note_loss``).

A layout is checked once a probe of it was conclusive (it reached rows of two samples at
least): a batch of 0 or 1 samples probes nothing and checks nothing, so the next batch of the
layout is probed. ``recheck_independence=N`` probes again every N forward passes (a model
whose mixing depends on the data, or on a flag the graph does not show). Under FSDP2, whose
forward and backward passes are collectives, the ranks agree on the batch size to probe for and
on the outcome (all-reduces, on the steps that probe).
"""

from __future__ import annotations

import warnings
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from dpgrad.backward.autograd_graph import grad_keeping_graph, refusing_reentrant, region
from dpgrad.checks.forward_probe import HeldState, Perturb, probe_runs
from dpgrad.checks.guarantee import VerifiedLayouts, tensors_in
from dpgrad.checks.independence import (
    LOSS_CAUSES,
    MODEL_CAUSES,
    NOTHING_REACHED,
    OUTPUT,
    TURN_OFF,
    Draws,
    Probes,
    RowSet,
    RowSets,
    SampleMixingError,
    conclusive,
    describe_output,
    elsewhere_error,
    hooked_edges_reached,
    listed,
    loss_mixing_error,
    model_mixing_error,
    output_batch_dim,
    probe_count,
    probe_sets,
)

# What a probe says where it meets a reentrant checkpoint, which torch.autograd.grad cannot pass.
REENTRANT = (
    "the model uses reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True, the default "
    "of Hugging Face's gradient_checkpointing_enable() before transformers 5), and dpgrad's independence check "
    "backpropagates its probes to the hooked layers with torch.autograd.grad, which a reentrant checkpoint refuses. "
    "Use non-reentrant checkpointing: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False), or "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}). " + TURN_OFF
    + " " + NOTHING_REACHED)



# Recomputes the per-sample losses with the outputs and targets of some samples changed (None:
# unchanged), for the loss's forward probe; its second argument gives a generator per device.
Recompute = Callable[[Optional[Sequence[int]], Callable[[torch.device], torch.Generator]], torch.Tensor]


class Pending(NamedTuple):
    """A forward pass whose probes wait for its per-sample losses."""

    forward_id: int
    layout: Optional[tuple]  # the model's layout, checked once the loss's probes are conclusive
    call: Optional[Tuple[tuple, dict]]  # the forward pass's arguments, for the model's forward probe


class Noted(NamedTuple):
    """A criterion call's per-sample losses, kept for the loss's forward probe."""

    node: object  # the autograd node of the losses
    key: object  # the layout of the graph from the model's outputs to them
    recompute: Recompute
    modules: list  # the criterion's modules (their state held fixed across the runs)


class IndependenceCheck:
    """The independence probes of one path (see the module docstring)."""

    def __init__(self, path):
        self.path = path
        self.draws = Draws()
        self.probed = VerifiedLayouts()  # layouts (of the model, of the loss) probed conclusively
        self.call: Optional[Tuple[tuple, dict]] = None  # the forward pass's arguments, until it ends
        self.perturb: Optional[Perturb] = None  # in a forward probe's run: the hooked outputs' change
        self.rerunning = False  # a forward probe's run is in progress
        self.forwards = 0
        self.due = False  # a re-check is due (``every``)
        self.pending: Optional[Pending] = None
        self.losses: List[Noted] = []  # this forward pass's criterion calls, for the loss's forward probe

    @property
    def every(self) -> Optional[int]:
        """Probe again every this many forward passes (the path's ``recheck_independence``)."""
        return getattr(self.path, "recheck_independence", None)

    def clear(self) -> None:
        self.probed.clear()

    # ------------------------------------------------------------------ the model
    def begin_forward(self, args: tuple, kwargs: dict) -> None:
        self.call = (args, kwargs)
        self.losses = []

    def end_forward(self, key: tuple, outputs: List[torch.Tensor]) -> None:
        """A forward pass with hooked calls has ended (``key``: its layout)."""
        path = self.path
        call, self.call = self.call, None
        self.forwards += 1
        if self.every is not None and self.forwards % self.every == 0:
            self.due = True
        self.pending = None
        if key in self.probed and not self.due:
            return
        forward_id = path._edges.forward_id
        if not path.probes_model_at_forward():
            # The loss's probes take the model too; a re-check probes the loss again.
            self.pending = Pending(forward_id, key, call)
            return
        batch = self._batch(path._forward_batch or 0)
        if batch < 2:
            return  # nothing to mix yet: the next pass of this layout is probed
        with _region():
            done = self._probe_model(outputs, batch)
            if call is not None:
                self._forward_probe_model(call, batch)
        if not done:
            # Nothing probed (no output holds the batch where it can be told): the loss's
            # probes take the model.
            self.pending = Pending(forward_id, key, None)
            return
        self.probed.add(key)
        if self.due:  # a re-check: the loss's probes too
            self.due = False
            self.pending = Pending(forward_id, None, None)

    def _probe_model(self, outputs: List[torch.Tensor], batch: int) -> bool:
        """The backward probes from the model's outputs to this forward pass's hooked outputs,
        whose hooks read the gradients. Raises ``SampleMixingError`` naming the layers a probe
        reached outside its samples; whether the probes were conclusive (False where no
        output holds the batch where it can be told: nothing probed)."""
        path = self.path
        own = path._forward_batch or 0
        placed = [(t, output_batch_dim(t, own, path.batch_first)) for t in outputs
                  if t.requires_grad and t.is_floating_point()]
        placed = [(t, d) for t, d in placed if d is not None]
        targets = path._edges.all_edges()
        if not placed or not targets:
            return self._agreed(False)
        tensors = [t for t, _ in placed]
        probes = Probes(self._sets(own, batch), path.batch_dim)
        for probe in probes:
            vectors = [self.draws.on_rows(t, probe.rows, d) for t, d in placed]
            path._probing = probe
            try:
                with refusing_reentrant(REENTRANT):
                    grad_keeping_graph(tensors, targets, vectors, allow_unused=True)
            finally:
                path._probing = None
        found, reached = probes.read()
        self._agree(bool(found))
        if found:
            raise model_mixing_error(*found[0])
        return self._agreed(conclusive(reached))

    def _forward_probe_model(self, call: Tuple[tuple, dict], batch: int) -> None:
        """The model's forward probe (``dpgrad.checks.forward_probe``)."""
        path = self.path
        args, kwargs = call
        own = path._forward_batch or 0
        held = HeldState(path.model.modules())

        def run(rows: Optional[RowSet]) -> List[torch.Tensor]:
            if rows is not None:
                self.perturb = Perturb(rows, own, path.batch_dim, self.draws.generator)
            try:
                return tensors_in(held.run(lambda: path.model(*args, **kwargs)))
            finally:
                self.perturb = None

        def places(outputs: List[torch.Tensor]):
            count = len(outputs)
            found = []
            for i, t in enumerate(outputs):
                d = output_batch_dim(t, own, path.batch_first)
                if d is not None:
                    found.append((describe_output(t, i, count), t, d))
            return found

        self.rerunning = True
        try:
            with held:
                moved = probe_runs(self._sets(own, batch), run, places)
        except Exception as error:  # the model cannot run again as it was: nothing to compare
            return _unprobed("the model", error)
        finally:
            self.rerunning = False
        self._agree(bool(moved))
        if moved:
            samples = moved[0][0]
            lines = "\n".join(f"- {where}: rows {listed(rows)}" for s, where, rows in moved if s == samples)
            raise SampleMixingError(
                "samples are mixed inside the model where autograd does not see it: with the outputs of "
                f"the hooked layers changed on the rows of samples {listed(samples)} (the forward probe of "
                f"a batch of {own}), the model's outputs moved on other samples' rows:\n{lines}\n"
                "Something after the first hooked layer reads other samples without a gradient: a "
                "statistic of the batch under detach() or torch.no_grad(), a buffer set in the forward "
                "pass from the batch and read after, a custom autograd.Function that mixes samples in "
                "its forward only. " + MODEL_CAUSES + TURN_OFF + " " + NOTHING_REACHED)

    # ------------------------------------------------------------------ the loss
    def note_loss(self, losses: torch.Tensor, key: object, recompute: Recompute,
                  modules: Sequence[torch.nn.Module]) -> None:
        """The criterion of ``DPLossFastGradientClipping`` gave per-sample ``losses`` (``key``:
        the layout of the graph from the model's outputs to them): kept for the loss's forward
        probe, where that is due, until their backward pass (or the next forward pass)."""
        if key not in self.probed or self._pending_now() is not None:
            self.losses.append(Noted(losses.grad_fn, key, recompute, list(modules)))

    def _noted(self, losses: torch.Tensor) -> Optional["Noted"]:
        """The criterion call whose losses ``losses`` come from (scaled, weighted or summed
        after it: a few autograd nodes away), taken off the list."""
        if not self.losses:
            return None
        nodes = {entry.node: entry for entry in self.losses}
        seen, queue = {losses.grad_fn}, [losses.grad_fn]
        while queue and len(seen) < 64:
            node = queue.pop(0)
            if node in nodes:
                self.losses.remove(nodes[node])
                return nodes[node]
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    queue.append(child)
        return None

    def probe_loss(self, losses: torch.Tensor, key: tuple, targets: list) -> None:
        """The probes of the per-sample losses (in ``clipped_backward``) where due: backward from
        the losses, through the model where its probes were left to them (``targets``: the
        hooked outputs the norm pass asks for), then the forward probes left."""
        pending = self._pending_now()
        noted = self._noted(losses)
        if key in self.probed and pending is None and noted is None:
            return
        batch = self._batch(losses.shape[0])
        if batch < 2:
            return
        through = targets if pending is not None and pending.layout is not None else []
        with _region():
            done = True
            if key not in self.probed or pending is not None:
                done = self._probe_loss(losses, through, batch)
            if pending is not None and pending.call is not None:
                self._forward_probe_model(pending.call, batch)
            if noted is not None:
                self._forward_probe_loss(losses, noted.recompute, noted.modules, batch)
        if done:
            self.probed.add(key)
            if noted is not None:
                self.probed.add(noted.key)
            if pending is not None:
                if pending.layout is not None:
                    self.probed.add(pending.layout)
                self.due = False
            self.pending = None

    def _probe_loss(self, losses: torch.Tensor, through: list, batch: int) -> bool:
        """The backward probes from the per-sample losses to the model's outputs (and to the
        hooked outputs the loss reads directly, and ``through``). Raises ``SampleMixingError``;
        whether they were conclusive."""
        path = self.path
        edges = path._edges
        own = losses.shape[0]
        inner = hooked_edges_reached(losses.grad_fn, set(edges.outputs), edges.mark)
        targets = edges.output_edges + inner + list(through)
        if not targets:
            return self._agreed(False)
        # The hooks read the backprops of the hooked outputs the loss reaches; the model's
        # outputs are read here.
        probes = Probes(self._sets(own, batch), path.batch_dim, hooks=bool(inner or through))
        count = len(edges.output_edges)
        for probe in probes:
            weights = self.draws.on_rows(losses, probe.rows, 0)
            path._probing = probe
            try:
                with refusing_reentrant(REENTRANT):
                    grads = grad_keeping_graph(losses, targets, weights, allow_unused=True)
            finally:
                path._probing = None
            for i, (grad, shape) in enumerate(zip(grads, edges.output_shapes)):
                if grad is not None and tuple(grad.shape) == shape:
                    probe.observe_output(describe_output(grad, i, count), grad)
            del grads
        found, reached = probes.read()
        self._agree(bool(found))
        for probe, offenders in found:
            at_outputs = [(w, rows) for w, rows in offenders if w.startswith(OUTPUT)]
            if at_outputs:
                raise loss_mixing_error(probe, at_outputs)
        if found:
            # The outputs are clean: layers read by the loss directly (``inner``), or the model.
            probe, offenders = found[0]
            raise model_mixing_error(probe, offenders) if through else loss_mixing_error(probe, offenders)
        return self._agreed(conclusive(reached))

    def _forward_probe_loss(self, losses: torch.Tensor, recompute: Recompute, modules: list, batch: int) -> None:
        """The loss's forward probe (``dpgrad.checks.forward_probe``)."""
        own = losses.shape[0]
        try:
            with HeldState(m for module in modules for m in module.modules()) as held:
                moved = probe_runs(self._sets(own, batch),
                                   lambda s: [held.run(lambda: recompute(s, self.draws.generator))],
                                   lambda outs: [("the per-sample losses", outs[0], 0)])
        except Exception as error:  # the criterion cannot run on the changed outputs and targets
            return _unprobed("the criterion", error)
        self._agree(bool(moved))
        if moved:
            samples, _, rows = moved[0]
            raise SampleMixingError(
                "the loss mixes samples where autograd does not see it: with the outputs and the targets "
                f"of samples {listed(samples)} changed (the loss's forward probe, a batch of {own}), the "
                f"losses of samples {listed(rows)} moved. A loss that reads other samples' targets (label "
                "smoothing toward the batch's labels) or a statistic of the batch under detach() (losses "
                "scaled by the batch's largest) lets one sample move other samples' gradients. "
                + LOSS_CAUSES + TURN_OFF + " " + NOTHING_REACHED)

    # ------------------------------------------------------------------ helpers
    def _pending_now(self) -> Optional[Pending]:
        pending = self.pending
        return pending if pending is not None and pending.forward_id == self.path._edges.forward_id else None

    def _sets(self, own: int, batch: int) -> RowSets:
        """This rank's probe sets (its batch: ``own``), padded with empty ones to as many as a
        batch of ``batch`` takes (under FSDP2, the largest of any rank's: every rank runs as
        many passes, which are collectives)."""
        sets = probe_sets(own)
        return RowSets(own, sets + [()] * (probe_count(batch) - len(sets)))

    def _distributed(self) -> bool:
        return (self.path.sharded is not None and torch.distributed.is_available()
                and torch.distributed.is_initialized())

    def _batch(self, own: int) -> int:
        """The batch size the probes run for: this rank's, or under FSDP2 the largest of any
        rank's (one all-reduce)."""
        return self._all_reduce_max(own) if self._distributed() else own

    def _agree(self, found: bool) -> None:
        """Under FSDP2, raise on every rank when one rank's probe found mixing (that rank's
        own error is raised by the caller)."""
        if self._distributed() and self._all_reduce_max(int(found)) and not found:
            raise elsewhere_error(torch.distributed.get_rank())

    def _agreed(self, done: bool) -> bool:
        """Under FSDP2, conclusive where any rank's probes were: the ranks check one layout."""
        return bool(self._all_reduce_max(int(done))) if self._distributed() else done

    def _all_reduce_max(self, value: int) -> int:
        p = next(self.path.model.parameters(), None)
        device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
        if torch.distributed.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([value], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())


def _unprobed(what: str, error: Exception) -> None:
    warnings.warn(f"dpgrad: the independence check's forward probe could not run {what} again "
                  f"({type(error).__name__}: {error}); mixing that autograd cannot see is not checked "
                  "for this layout (dpgrad.checks.forward_probe)", RuntimeWarning, stacklevel=3)


def check_every(every: Optional[int]) -> Optional[int]:
    """``recheck_independence`` checked: None, or a whole number of steps."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"recheck_independence = {every!r}: give a number of forward passes (1 or more), "
                         "or None to probe only new layouts")
    return every


def _region():
    return region("dpgrad.independence_probe")
