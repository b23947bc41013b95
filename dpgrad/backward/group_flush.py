"""Per-layer and per-block clipping in one backward pass: the clipping groups whose records are
all in, clipped together once the memory they hold is needed.

With clipping groups (``dpgrad.clipping.groups``) a group's coefficients need only its own
norms, so single backward can clip a group as soon as the records of all its layers are in (in
the backward hook of its last layer) and let go of their inputs there: a pass then holds the
records of the groups not yet complete, not the whole model's. Clipping each group on its own
launches its layers' kernels apart, where groups clipped together launch the layers of one
shape at once (a transformer's blocks: one launch per shape, not one per block), so complete
groups wait (``ready``) while the memory in use on a CUDA device stays at most the most it has
held (its peak since torch's statistics were last reset, read at the pass's first record): the
forward pass and the loss set that mark, the backward pass frees the forward's activations as
it goes, and the records fill that room without raising the peak. Once memory in use passes
the mark, the complete groups are clipped, all at once; the rest at the end of the pass. On
other devices, whose memory torch does not count, the complete groups are clipped together
whenever their records hold ``UNCOUNTED_SERVE_BYTES`` (a small model's at the end of the pass,
as on a GPU with room, a large one's a few layers at a time). The sums are held (in ``held``)
until the end of the pass, when they are withheld on the device (zeros) if the pass's finite
check failed and handed to ``p.grad``, as flat clipping's are.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.backward.autograd_graph import region
from dpgrad.samplers.groups import Record, record_bytes
from dpgrad.tuning import get_tuner


class GroupFlush:
    """The clipping-group flush of a ``ClippingPath`` (``path``) in single backward: its kept
    records (``path._records``), those of complete groups not clipped yet (``ready``), the sums
    it has taken (``held``), and each flush's parameters and norm rows for the pass's norms
    (``flushed``)."""

    def __init__(self, path):
        self.path = path
        self.held: Dict[nn.Parameter, torch.Tensor] = {}
        self.flushed: List[Tuple[List[nn.Parameter], torch.Tensor]] = []  # (params, norm rows)
        self.ready: List[Record] = []  # the records of complete groups, not clipped yet
        self.mark = MemoryMark()

    def clear(self) -> None:
        """Forget a pass (ended, or abandoned by an error)."""
        self.flushed, self.ready = [], []
        self.mark.clear()

    @staticmethod
    def memory_in_use(device: torch.device, peak: bool = False) -> Optional[int]:
        """Bytes of tensors allocated on ``device`` (CUDA's caching allocator counts them on
        the host: no wait for the device), or with ``peak`` the most it has held since its
        statistics were last reset (``torch.cuda.max_memory_allocated``); None on a device
        whose memory torch does not count (then each complete group is clipped at once)."""
        if device.type != "cuda":
            return None
        stats = torch.cuda.memory.memory_stats_as_nested_dict(device)
        return stats.get("allocated_bytes", {}).get("all", {}).get("peak" if peak else "current")

    def after(self, record: Record) -> None:
        """Set aside (``ready``) the kept records whose clipping groups are complete now that
        ``record`` is in: no layer with a parameter in them has a call of a forward pass still
        to be recorded (``_unrecorded``), and no kept record of another, incomplete group
        shares a group with them (a group's norm takes all of its records at once); and clip
        all that are set aside once they are due (``MemoryMark.due``)."""
        path = self.path
        self.mark.note(record.backprops.device)
        complete: Dict[int, bool] = {}

        def done(g: int) -> bool:
            if g not in complete:
                complete[g] = not any(calls.get(layer) for calls in path._unrecorded.values()
                                      for layer in path.planner.layers_of_group(g))
            return complete[g]

        if not all(done(g) for g in path.planner.groups_of_layer(record.layer)):
            return  # the common case of a layer in the middle of its group: no scan of the others
        touched = [frozenset(path.planner.groups_of_layer(rec.layer)) for rec in path._records]
        ready = [all(done(g) for g in gs) for gs in touched]
        while True:  # a group that a record not ready touches is held back, and its records
            held = {g for gs, r in zip(touched, ready) if not r for g in gs}
            blocked = [i for i, (gs, r) in enumerate(zip(touched, ready)) if r and gs & held]
            if not blocked:
                break
            for i in blocked:
                ready[i] = False
        now = [rec for rec, r in zip(path._records, ready) if r]
        if not now:
            return
        path._records = [rec for rec, r in zip(path._records, ready) if not r]
        self.ready += now
        device = record.backprops.device
        if self.mark.due(device, now):
            # Memory short (not merely uncounted): the norms by the candidates that hold least.
            with torch.no_grad(), region("dpgrad.clip_group"), \
                    get_tuner().short_of_memory() if self.mark.counted(device) else contextlib.nullcontext():
                self.flush(self.ready)

    def flush(self, records: List[Record]) -> None:
        """The norms of ``records`` (whole clipping groups), their groups' coefficients, and
        their clipped sums into ``held``; the records' inputs are let go of."""
        path = self.path
        params, rows, kernel_groups = path._norm_rows([path.batch_front(rec) for rec in records])
        records.clear()
        if rows is None:
            return
        rows = path.per_sample_rows(rows)
        self.flushed.append((params, rows))
        coefs = path.sums.coefficients(path.clip_groups.coefficients(path.clip_groups.norms(params, rows)))
        path.sums.sum_groups([group for group, _ in kernel_groups], coefs, self.held)

    def rows(self) -> Optional[Tuple[List[nn.Parameter], torch.Tensor]]:
        """At the end of the pass: the complete groups not clipped yet and the records of
        groups not complete (a layer whose output reached no loss) flushed, all at once, then
        every flushed parameter and its norm row (P, B), or None where the pass had none."""
        records, self.path._records = self.ready + self.path._records, []
        with get_tuner().short_of_memory() if self.path.memory_short else contextlib.nullcontext():
            self.flush(records)
        flushed = self.flushed
        self.clear()
        if not flushed:
            return None
        params = [p for ps, _ in flushed for p in ps]
        return params, torch.cat([r for _, r in flushed]) if len(flushed) > 1 else flushed[0][1]


class MemoryMark:
    """The most memory a device has held, read at a pass's first record there, and whether
    memory in use has passed it since: what records set aside may take before they are
    served early (``GroupFlush``, ``EarlyNorms``). ``found_short`` stays set, pass after pass,
    once memory in use has passed a pass's mark: the passes that follow ask autograd for the
    lowest hooked outputs only (``ClippingPath.memory_short``), so that the backprops of
    records let go of are not held by autograd instead. On a device whose memory torch does
    not count, the records set aside are due whenever they hold ``UNCOUNTED_SERVE_BYTES``
    (``due``)."""

    def __init__(self):
        # The mark of each device (None where its memory is not counted).
        self._marks: Dict[torch.device, Optional[int]] = {}
        # What the records set aside may grow by before memory in use is read again: the room
        # below the mark at the last reading, less the bytes set aside since.
        self._room: Dict[torch.device, int] = {}
        self.found_short = False
        # Set, pass after pass, once records were let go of early on a device whose memory is
        # not counted (``ClippingPath.lets_go_early``).
        self.let_go = False
        self._uncounted = 0  # what records set aside hold, where memory is not counted, since last due

    def clear(self) -> None:
        self._marks, self._room, self._uncounted = {}, {}, 0

    def note(self, device: torch.device) -> None:
        """Read ``device``'s mark at the pass's first record there."""
        if device not in self._marks:
            self._marks[device] = GroupFlush.memory_in_use(device, peak=True)

    def counted(self, device: torch.device) -> bool:
        return self._marks.get(device) is not None

    def passed(self, device: torch.device, now: List[Record]) -> Optional[bool]:
        """Whether memory in use on ``device`` has passed its mark now that ``now`` are set
        aside; None where it is not counted. It is read only once the records set aside since
        the last reading hold more than the room that reading found (one host call per
        reading)."""
        mark = self._marks.get(device)
        if mark is None:
            return None
        room = self._room.get(device, 0) - sum(record_bytes(rec) for rec in now)
        if room >= 0:
            self._room[device] = room
            return False
        used = GroupFlush.memory_in_use(device)
        if used is None:  # no longer counted (statistics unavailable)
            return None
        self._room[device] = max(0, mark - used)
        if used > mark:
            self.found_short = True
        return used > mark

    def due(self, device: torch.device, now: List[Record]) -> bool:
        """Whether the records set aside are to be served now that ``now`` are set aside too:
        memory in use on ``device`` has passed its mark (``passed``), or, where it is not
        counted, what was set aside since they were last due holds ``UNCOUNTED_SERVE_BYTES``
        (then ``let_go`` is set: the passes that follow let go early)."""
        passed = self.passed(device, now)
        if passed is not None:
            return passed
        self._uncounted += sum(record_bytes(rec) for rec in now)
        if self._uncounted < UNCOUNTED_SERVE_BYTES:
            return False
        self._uncounted, self.let_go = 0, True
        return True


# On a device whose memory torch does not count (a CPU), what records set aside (``EarlyNorms``,
# complete clipping groups in ``GroupFlush``) may hold before they are served.
UNCOUNTED_SERVE_BYTES = 1 << 23


class EarlyNorms:
    """Flat clipping: the records whose norms (and, in single backward, per-sample gradients)
    can be taken before the end of the pass, served there once memory is short, so that the
    pass lets go of their inputs and backprops early.

    A record is set aside (``ready``) once its layer has no other call of a forward pass, kept or
    still to be recorded, and none of its parameters is used by another layer or shared: in a pass for the
    norms alone (double backward's first pass, a plain backward) any such record; in single
    backward one whose per-sample gradients take less memory than its inputs and backprops
    (``Planner.small_grad_sample(memory_bound=True)``: a normalisation layer, a LoRA adapter, a
    convolution of few channels over many positions), which then holds them in place of its
    inputs. Set-aside records are served together (``path._norm_rows``: batched by
    shape as at the end of the pass) when memory in use on a CUDA device passes the most it
    had held when the pass began (``MemoryMark``), and at the end of the pass otherwise. On a
    device whose memory torch does not count (a CPU), they are served whenever they hold
    ``UNCOUNTED_SERVE_BYTES``: a small model's stay batched to the end of the pass, and a large
    one lets go of them as it goes (a convolution network's wide early layers, whose records
    hold several times their per-sample gradients)."""

    def __init__(self, path):
        self.path = path
        self.ready: List[Record] = []
        self.served: List[Tuple[List[nn.Parameter], torch.Tensor, list]] = []  # (params, rows, groups)
        self.mark = MemoryMark()
        self._seen: set = set()  # the layers recorded in this pass

    def clear(self) -> None:
        self.ready, self.served, self._seen = [], [], set()
        self.mark.clear()

    def _eligible(self, record: Record, keep_groups: bool) -> bool:
        path, layer = self.path, record.layer
        seen = layer in self._seen
        self._seen.add(layer)
        if seen or any(calls.get(layer) for calls in path._unrecorded.values()):
            return False  # another call of the layer: their gradients are summed before the norm
        params = path.layer_params(layer)
        if any(p in path.shared or len(path._owners.get(p, ())) > 1 for p in params):
            return False
        # In single backward, a record the plan clips from its per-sample gradients.
        return not keep_groups or not path.uses_norm_sampler(layer) or \
            path.planner.small_grad_sample(record, memory_bound=True)

    def after(self, record: Record, keep_groups: bool) -> None:
        """``record`` is in (the last of ``path._records``): set it aside if it is eligible,
        and serve what is set aside if memory in use has passed the mark, or, on a device
        whose memory torch does not count, once what is set aside holds
        ``UNCOUNTED_SERVE_BYTES``. ``keep_groups``: the groups made are kept for the clipped
        sums (single backward)."""
        device = record.backprops.device
        self.mark.note(device)
        if not self._eligible(record, keep_groups):
            return
        self.path._records.pop()
        self.ready.append(record)
        if self.mark.due(device, [record]):
            self.serve(keep_groups)

    def serve(self, keep_groups: bool) -> None:
        """The norms of the records set aside; their inputs and backprops are let go of."""
        path = self.path
        records, self.ready = [path.batch_front(rec) for rec in self.ready], []
        with torch.no_grad(), region("dpgrad.early_norms"), get_tuner().short_of_memory():
            params, rows, groups = path._norm_rows(records, memory_bound=keep_groups)
        records.clear()
        if rows is not None:
            self.served.append((params, rows, groups if keep_groups else []))

    def take(self) -> Tuple[List[Record], List[Tuple[List[nn.Parameter], torch.Tensor, list]]]:
        """At the end of the pass: the records still set aside and what was served."""
        ready, served = self.ready, self.served
        self.clear()
        return ready, served


__all__ = ["EarlyNorms", "GroupFlush", "MemoryMark", "UNCOUNTED_SERVE_BYTES"]
