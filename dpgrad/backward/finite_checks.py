"""The finite check of a backward pass's per-sample values, decided on the device with no
host wait (``FiniteCheck``), and the checks whose outcome the host has not read yet, read and
raised at the next forward pass (``FiniteReports``). A path (``dpgrad.backward.backward_pass``)
makes one check per pass when ``check_finite`` is set and holds its reports."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from dpgrad.backward.autograd_graph import in_region


class FiniteCheck:
    """Whether the per-sample values of one backward pass (rows of (P, B) norms, or per-sample
    gradients) are all finite, decided on the device, with no host wait.

    ``bad`` is a 0-d bool on the device (one float64 sum of the values, then whether it is inf
    or NaN). ``withhold`` uses it to replace, on the device, the pass's clipped gradients by
    zeros when it is set, so no inf or NaN reaches ``p.grad`` whatever the host knows. A copy of
    it travels to host memory behind the work that made it (pinned, non-blocking, an event
    marking it on a GPU): ``ready`` says, without waiting, whether it has arrived; ``report``
    reads it and raises FloatingPointError naming the parameters when it was set; ``wait``
    waits for it first.
    """

    def __init__(self, values: List[torch.Tensor], names: Callable[[], List[Tuple[str, torch.Tensor]]], what: str,
                 reports: Optional["FiniteReports"] = None):
        total = torch.stack([v.sum(dtype=torch.float64) for v in values]).sum() if len(values) > 1 else \
            values[0].sum(dtype=torch.float64)
        self._names, self._what = names, what
        self.bad = (total - total).isnan()  # inf - inf and NaN - NaN are NaN, finite - finite 0
        self._reports = reports
        self.withheld = False  # whether ``withhold`` ran
        self._event = None
        # In a step being captured in a CUDA graph (``dpgrad.graphs``): counted on the device,
        # read by the graphed step after its replays; no host copy (the graph would replay it
        # into the same host memory behind the host's back).
        self.counted = FiniteReports.device_count is not None
        if self.counted:
            FiniteReports.device_count.add_(self.bad)
            return
        # The host copy's memory: one ``reports`` has read before, else new.
        self._host, self._array = reports.host_memory(self.bad.is_cuda) if reports is not None else \
            FiniteReports.new_host_memory(self.bad.is_cuda)
        self._host.copy_(self.bad, non_blocking=True)
        if self.bad.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @in_region("dpgrad.withhold")
    def withhold(self, tensors, fill: float = 0.0) -> None:
        """Zero ``tensors`` (in place, on the device) if the values were not finite (or set them
        to ``fill``): each storage once, through the tensor a view was taken of (one operation
        for the sums of a group of layers made by one product)."""
        self.withheld = True
        seen = set()
        for t in tensors:
            base = t if t._base is None else t._base
            if id(base) not in seen:
                seen.add(id(base))
                base.masked_fill_(self.bad, fill)

    def zeroed(self, tensors) -> List[torch.Tensor]:
        """``tensors`` as new tensors, zeros if the values were not finite (for values a view
        of which autograd may still hold, which ``withhold`` would change in place)."""
        self.withheld = True
        return [t.masked_fill(self.bad, 0) for t in tensors]

    def ready(self) -> bool:
        """Whether the host copy has arrived (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """``report``, once the host copy has arrived (the host waits for the values)."""
        if self.counted:
            raise RuntimeError(
                "a plain loss.backward() through the ghost-clipping wrapper cannot be captured in a "
                "CUDA graph: its finite check makes the host wait for the device before the second "
                "pass. Use the loss wrapper (the criterion make_private returns, or "
                "dpgrad.DPLossFastGradientClipping), whose backward() needs no wait.")
        if self._event is not None:
            self._event.synchronize()
        self.report()

    def report(self) -> None:
        """Raise FloatingPointError, naming the parameters, if a value was not finite (read
        from host memory: call once ``ready``); the message says whether the pass's clipped
        gradients were withheld."""
        if not bool(self._array):
            if self._reports is not None:
                self._reports.free.setdefault(self._event is not None, []).append((self._host, self._array))
            return
        bad = [name for name, value in self._names() if not bool(torch.isfinite(value).all())]
        # Norms come from sums of squares in fp32: a finite gradient whose norm passes
        # sqrt(float32 max), about 1.8e19, has an infinite square.
        huge = (" or a per-sample gradient's norm above about 1.8e19, whose square overflows "
                "float32") if "norms" in self._what else ""
        kept = (" That backward pass added nothing to p.grad (its clipped gradients were replaced by "
                "zeros on the device), so no parameter took inf or NaN from it." if self.withheld else "")
        raise FloatingPointError(
            f"non-finite per-sample {self._what} for parameters {bad}: the loss, the inputs or the "
            f"weights hold inf or NaN (in reduced precision, an overflow){huge}.{kept} Fix the cause "
            "(loss scaling, learning rate, inputs), or pass check_finite=False to skip this check."
        )


class FiniteReports:
    """The finite checks of a path's backward passes whose outcome the host has not read yet
    (``FiniteCheck``, their clipped gradients withheld on the device when not finite): read,
    and raised, at the next forward pass (``poll``) once they have arrived, which needs no wait;
    by ``raise_pending`` (the wrapper's ``raise_if_not_finite``) at once, waiting for them."""

    # Passes whose outcome may be in flight at once: beyond, the host waits for the oldest
    # (a host more than this many passes ahead of the device).
    IN_FLIGHT = 2

    # While a step is captured in a CUDA graph (``dpgrad.graphs``): the device counter of
    # passes that were not finite, which every finite check made then adds to.
    device_count: Optional[torch.Tensor] = None

    def __init__(self):
        self._checks: List[FiniteCheck] = []
        # Host memory of checks read and found finite (with its NumPy view), by whether it is pinned.
        self.free: Dict[bool, List[tuple]] = {}

    def host_memory(self, pinned: bool) -> Tuple[torch.Tensor, "numpy.ndarray"]:
        """A 0-d bool in host memory (pinned for a GPU's copy) for a check's outcome, and a
        NumPy view of it to read it through: one a finite check was read from, or a new one (no
        allocation, and no operation to read it, per step)."""
        free = self.free.get(pinned)
        return free.pop() if free else self.new_host_memory(pinned)

    @staticmethod
    def new_host_memory(pinned: bool) -> Tuple[torch.Tensor, "numpy.ndarray"]:
        host = torch.empty((), dtype=torch.bool, pin_memory=pinned)
        return host, host.numpy()

    def add(self, check: FiniteCheck) -> None:
        if not check.counted:
            self._checks.append(check)

    def poll(self) -> None:
        """Report every check that has arrived, oldest first; wait for the oldest while more
        than ``IN_FLIGHT`` are in flight (not while a step is captured: the graphed step
        reports what came before)."""
        if FiniteReports.device_count is not None:
            return
        while self._checks and (self._checks[0].ready() or len(self._checks) > self.IN_FLIGHT):
            self._checks.pop(0).wait()

    def raise_pending(self) -> None:
        """Report every check, waiting for those in flight."""
        while self._checks:
            self._checks.pop(0).wait()
