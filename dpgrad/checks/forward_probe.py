"""The forward probe: samples mixed where autograd does not look.

The backward probes (``dpgrad.checks.independence``) find every dependency between samples that
autograd computes a gradient for. A forward pass can mix samples outside that: a statistic of
the batch under ``detach()`` or ``no_grad`` (``(h - h.mean(0).detach()) / h.std(0).detach()``),
a buffer set in the forward pass to something of the batch and read after, a custom
``autograd.Function`` whose backward ignores what its forward mixed; in a loss, a detached
statistic of the batch (losses scaled by the batch's largest) or other samples' targets (label
smoothing toward the batch's label histogram). Their gradients carry no trace of it, yet
removing one sample moves the others' per-sample gradients.

So the forward probe moves some samples and watches the others. For each probe set S (the
backward probes' sets: every ordered pair of samples is separated by one), the forward pass
runs again under ``no_grad``, every hooked layer's output changed on S's rows (random values
of the rows' own size added), and the model's outputs on the rows outside S must stay where a
reference run of the same pass leaves them. Each run starts from the same random state (the
same dropout masks), the same buffers (run on copies: the model's own are never written) and
the same module attributes (``self.x = ...`` in a forward pass is undone). The loss's forward
probe (``DPLossFastGradientClipping``) calls the criterion again, the outputs and the targets
changed on S's rows (random values added to floating tensors, integer labels shifted among
the batch's), and the losses outside S must stay.

"Stay" means within ``TOLERANCE`` of the row's size (the backward probes' tolerance too): a
GPU kernel may round a row differently when the shape of its work changes with the probed
rows (a mixture of experts routes tokens by their values), and that is not mixing. What it
cannot see: mixing before the first hooked layer (in the data pipeline), mixing weaker than
the tolerance, side effects outside the modules (a global counter, a file written: they
happen once per run), and mixing that the batch does not switch on (a data-dependent branch:
``recheck_independence`` probes again every N steps).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from dpgrad.checks.independence import TOLERANCE, RowSet, along


def perturbed(value: torch.Tensor, rows: torch.Tensor, batch_dim: int, generator: torch.Generator,
              samples_of: int = 1) -> torch.Tensor:
    """A floating ``value`` with random values of its own size added on ``rows`` (a (B,) mask)
    along ``batch_dim`` (row r covering ``samples_of`` rows from r * samples_of: a flattened
    (B * T, ...) tensor's tokens): every element there changes, none elsewhere."""
    shape = value.shape
    if samples_of > 1:
        value = value.reshape(shape[0] // samples_of, samples_of, *shape[1:])
    mask = along(rows.to(value.device), value, batch_dim)
    noise = torch.randn(value.shape, generator=generator, device=value.device, dtype=value.dtype)
    return torch.where(mask, value + noise * (value.abs() + 1), value).reshape(shape)


def copied(value: torch.Tensor, rows: RowSet, samples_of: int = 1) -> torch.Tensor:
    """``value`` with the rows of the samples of ``rows`` (each ``samples_of`` rows of a
    flattened (B * T, ...) tensor) all set to the first other sample's: values the batch holds,
    so that targets stay valid whatever they encode, and counted differently by the batch
    (unless those rows held that sample's values already)."""
    shape = value.shape
    if samples_of > 1:
        value = value.reshape(shape[0] // samples_of, samples_of, *shape[1:])
    own = set(rows.samples)
    other = next((i for i in range(value.shape[0]) if i not in own), None)
    if other is None or not own:
        return value.reshape(shape)
    mask = along(rows.mask(value.device), value, 0)
    return torch.where(mask, value[other:other + 1], value).reshape(shape)


def moved_rows(reference: torch.Tensor, probed: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """(B,) flags on the device: the rows of ``probed`` that moved from ``reference``, by more
    than ``TOLERANCE`` of the row's norm for floating values (at all for others), or between
    finite and not."""
    ref = reference.movedim(batch_dim, 0).reshape(reference.shape[batch_dim], -1)
    new = probed.movedim(batch_dim, 0).reshape(probed.shape[batch_dim], -1)
    if not ref.is_floating_point():
        return (ref != new).any(dim=1)
    finite = (ref.isfinite() != new.isfinite()).any(dim=1)
    tolerance = TOLERANCE.get(ref.dtype, 1e-4)
    wide = torch.promote_types(ref.dtype, torch.float32)
    diff = torch.linalg.vector_norm((new - ref).nan_to_num(0.0, 0.0, 0.0), dim=1, dtype=wide)
    size = torch.linalg.vector_norm(ref.nan_to_num(0.0, 0.0, 0.0), dim=1, dtype=wide)
    return finite | (diff > tolerance * size)


class HeldState:
    """Forward passes of ``modules`` run again from one state: the random state, the buffers
    and the modules' attributes as they are on entry, before each ``run``; on exit, everything
    as it was. The runs write to copies of the buffers, never to the modules' own (autograd
    may have saved them for the backward pass to come)."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.modules = list(dict.fromkeys(modules))
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "HeldState":
        devices = sorted({p.device.index or 0 for m in self.modules for p in m.parameters(recurse=False)
                          if p.is_cuda})
        if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = [torch.cuda.current_device()]
        self._stack.enter_context(torch.random.fork_rng(devices=devices))
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in devices]
        self._attrs = [dict(m.__dict__) for m in self.modules]
        self._buffers = [dict(m._buffers) for m in self.modules]
        self._copies = [{n: b.detach().clone() for n, b in held.items() if b is not None} for held in self._buffers]
        return self

    def run(self, call: Callable[[], object]) -> object:
        """``call()`` under no_grad, from the held state."""
        self._restore(copies=True)
        torch.set_rng_state(self._cpu_rng)
        for device, state in self._cuda_rng:
            torch.cuda.set_rng_state(state, device)
        with torch.no_grad():
            return call()

    def _restore(self, copies: bool) -> None:
        for m, attrs, held, copied in zip(self.modules, self._attrs, self._buffers, self._copies):
            current = m.__dict__
            for name in [n for n in current if n not in attrs]:
                del current[name]
            for name, value in attrs.items():
                if current.get(name, attrs) is not value:
                    current[name] = value
            m._buffers.clear()
            m._buffers.update(held)
            if copies:
                for name, original in copied.items():
                    # A fresh copy per run: the run may have written to the last one.
                    m._buffers[name] = original.clone()

    def __exit__(self, *exc) -> None:
        try:
            self._restore(copies=False)
        finally:
            self._stack.close()


class Perturb:
    """What a hooked layer's output becomes during a forward probe's run: changed on the
    probed rows (``perturbed``), the rest as computed. ``generator(device)`` gives the random
    numbers' generator for a device."""

    def __init__(self, rows: RowSet, batch: int, batch_dim: int,
                 generator: Callable[[torch.device], torch.Generator]):
        self.rows, self.batch, self.batch_dim = rows, batch, batch_dim
        self._generator = generator
        self._generators: Dict[torch.device, torch.Generator] = {}

    def __call__(self, output, batch_dim: Optional[int] = None):
        """``output`` changed on the probed rows along ``batch_dim`` (the model's where None; a
        layer's call may hold the batch on another, ``dpgrad.backward.layer_inputs.batch_dim_of``)."""
        dim = self.batch_dim if batch_dim is None else batch_dim
        if isinstance(output, torch.Tensor):
            return self._tensor(output, dim)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (self._tensor(output[0], dim),) + output[1:]
        return output

    def _tensor(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if not self.rows.samples or not t.is_floating_point() or t.dim() <= dim or t.shape[dim] != self.batch:
            return t
        generator = self._generators.get(t.device)
        if generator is None:
            generator = self._generators[t.device] = self._generator(t.device)
        return perturbed(t, self.rows.mask(t.device), dim, generator)


# (samples probed, where, rows outside them that moved)
Moved = Tuple[List[int], str, List[int]]


def probe_runs(sets: Sequence[RowSet], run: Callable[[Optional[RowSet]], List[Optional[torch.Tensor]]],
               places: Callable[[List[Optional[torch.Tensor]]], List[Tuple[str, torch.Tensor, int]]]
               ) -> List[Moved]:
    """The forward probe: ``run(None)`` is the reference, ``run(rows)`` the run with the
    samples of ``rows`` moved, each returning its outputs in one order; ``places`` picks from the
    reference's outputs those to watch (``(where, tensor, batch dimension)``). Returns, for
    each run, the places whose rows outside its samples moved, read on the host at once; a
    run's outputs are let go of before the next run."""
    reference = places(run(None))
    if not reference:
        return []
    flags, keys = [], []
    for rows in sets:
        outputs = run(rows)
        for (where, ref, dim), new in zip(reference, outputs):
            if isinstance(new, torch.Tensor) and new.shape == ref.shape and new.dtype == ref.dtype:
                flags.append(moved_rows(ref, new, dim))
                keys.append((rows.samples, where))
        del outputs
    if not flags:
        return []
    found: Dict[int, List[int]] = {}
    for k, r in torch.stack(flags).nonzero().tolist():  # the one wait
        found.setdefault(k, []).append(r)
    moved = []
    for k, rows in sorted(found.items()):
        samples, where = keys[k]
        own = set(samples)
        outside = [r for r in rows if r not in own]
        if outside:
            moved.append((list(samples), where, outside))
    return moved
