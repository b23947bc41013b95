"""Per-layer and per-block clipping in one backward pass: each clipping group clipped as soon as
its records are all in.

With clipping groups (``dpgrad.clipping_groups``) a group's coefficients need only its own
norms, so single backward clips each group as soon as the records of all its layers are in (in
the backward hook of its last layer), and lets go of their inputs there: a pass holds the
records of the groups not yet complete, not the whole model's. The sums wait (on the device,
in ``held``) for the pass's finite check before they reach ``p.grad``, as flat clipping's do.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.backward_pass import region
from dpgrad.samplers.groups import Record


class GroupFlush:
    """The clipping-group flush of a ``ClippingPath`` (``path``) in single backward: its kept
    records (``path._records``), the sums it has taken (``held``), and each flush's parameters
    and norm rows for the pass's norms (``flushed``)."""

    def __init__(self, path):
        self.path = path
        self.held: Dict[nn.Parameter, torch.Tensor] = {}
        self.flushed: List[Tuple[List[nn.Parameter], torch.Tensor]] = []  # (params, norm rows)

    def after(self, record: Record) -> None:
        """Clip the kept records whose clipping groups are complete now that ``record`` is in:
        no layer with a parameter in them has a call of a forward pass still to be recorded
        (``_unrecorded``), and no kept record of another, incomplete group shares a group with
        them (a group's norm takes all of its records at once)."""
        path = self.path
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
        with torch.no_grad(), region("dpgrad.clip_group"):
            self.flush(now)

    def flush(self, records: List[Record]) -> None:
        """The norms of ``records`` (whole clipping groups), their groups' coefficients, and
        their clipped sums into ``held``; the records' inputs are let go of."""
        path = self.path
        params, rows, kernel_groups = path._norm_rows([path.batch_front(rec) for rec in records])
        records.clear()
        if rows is None:
            return
        if path.loss_reduction == "mean":
            rows = rows * rows.shape[1]
        self.flushed.append((params, rows))
        coefs = path.sums.coefficients(path.clip_groups.coefficients(path.clip_groups.norms(params, rows)))
        path.sums.sum_groups([group for group, _ in kernel_groups], coefs, self.held)

    def rows(self) -> Optional[Tuple[List[nn.Parameter], torch.Tensor]]:
        """At the end of the pass: the records of groups not complete (a layer whose output
        reached no loss) flushed too, then every flushed parameter and its norm row (P, B),
        or None where the pass had none."""
        self.flush(self.path._records)
        flushed, self.flushed = self.flushed, []
        if not flushed:
            return None
        params = [p for ps, _ in flushed for p in ps]
        return params, torch.cat([r for _, r in flushed]) if len(flushed) > 1 else flushed[0][1]


__all__ = ["GroupFlush"]
