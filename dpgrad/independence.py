"""The guarantee's second half: each sample's contribution is its own.

Clipping bounds each sample's contribution only if row b of every hooked layer's inputs and
backprops, and per-sample loss b, belong to sample b alone. A loss or a layer that mixes
samples (a batch statistic, in-batch negatives, attention across the batch), losses in
another order than the batch, a batch reordered between layers, or a layer run with its batch
on another dimension break that without any parameter going unclipped. A probe finds them
all, whatever op does the mixing, from what autograd itself computes:

- the model's probe (at the end of a forward pass whose layout is new): one backward pass
  from the model's outputs, with a random vector on the rows of one sample j (drawn at
  random) and zeros elsewhere, to the outputs of the hooked layers. Each hooked layer's
  backprops must be zero on every row but j's: a non-zero elsewhere is a mix between that
  layer and the model's output.
- the loss's probe (in ``clipped_backward``, once per layout of the loss): the gradient of
  loss j alone at the model's outputs (and at any hooked output the loss reads directly),
  only through the loss's own operations. Non-zero on one other row: the losses come in
  another order than the batch; on more: the loss mixes samples. Where the
  model's probe has not run (a new layout after ``clipped_backward`` was seen, or outputs
  whose batch dimension cannot be told), this pass goes on through the model, to every
  hooked output: one probe instead of two.

Each probe is exact for the sample it draws: every other sample that j's rows reach, or
that reaches j's loss, is found. A batch statistic, attention across the batch, a loss over
the batch or a layer run time-first involve every sample, and are found at any draw; a
reordering is found when it moves j (reversing a batch of B moves all but the middle
sample, a single swap of two samples only those two: one draw in B/2 finds that). What it
costs: one extra backward pass through the model, with its retained
graph, and a few host synchronisations (three with the clipping wrapper), on the first step
of each layout (a training loop's first step); the loss's probe runs the loss's operations
once more. Nothing reaches
``p.grad`` or the per-sample state from a probe: it asks autograd for layer outputs' gradients
only, and the hooks read them without recording. Mixing before the first hooked layer in
tensors that need no gradient (the data pipeline's, e.g. inputs normalised by the batch's own
statistics) is outside what autograd reaches, and so outside the probe.
"""

from __future__ import annotations

import random
from collections import deque
from typing import List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node

# What every refusal ends with.
TURN_OFF = ("If the model and the loss are per-sample by construction, pass check_independence=False to the "
            "wrapper (or make_private / PrivacyArguments); that gives up this check.")
NOTHING_REACHED = "Nothing has reached p.grad from this pass."


class SampleMixingError(RuntimeError):
    """A sample's rows, or its loss, depend on other samples: clipping would not bound its
    contribution. Raised before anything reaches ``p.grad``."""


class Draws:
    """The probes' random choices (a sample, a vector), from a stream of their own: seeded by
    torch's initial seed (a seeded run probes alike), never drawing from torch's generators."""

    def __init__(self):
        self._random = random.Random(torch.initial_seed())

    def samples(self, candidates: Sequence[int]) -> List[int]:
        """The probed samples: one of ``candidates``, at random."""
        return [candidates[self._random.randrange(len(candidates))]]

    def row_vector(self, like: torch.Tensor, rows: Sequence[int], batch_dim: int) -> torch.Tensor:
        """Zeros like ``like`` but for standard normal ``rows`` along ``batch_dim``."""
        generator = torch.Generator(device=like.device)
        generator.manual_seed(self._random.getrandbits(62))
        out = torch.zeros_like(like, memory_format=torch.contiguous_format)
        for row in rows:
            values = torch.randn(out.select(batch_dim, row).shape, generator=generator, device=like.device)
            out.select(batch_dim, row).copy_(values)
        return out


class Probe:
    """What one probe saw: for each hooked output (or model output) its gradient reached,
    which rows outside the probed samples' are not zero. ``observe`` queues the check on
    the device; ``offenders`` reads all of them at once."""

    def __init__(self, samples: List[int], batch: int, batch_dim: int, hooks: bool = True):
        self.samples, self.batch, self.batch_dim = samples, batch, batch_dim
        self.hooks = hooks  # whether the hooked layers' backprops are read (else only what is handed in)
        # (where, one (B,) flag vector per dimension that may hold the batch)
        self._seen: List[Tuple[str, List[torch.Tensor]]] = []

    def _flags(self, grad: torch.Tensor, dim: int) -> torch.Tensor:
        rows = grad.detach().movedim(dim, 0).reshape(self.batch, -1)
        # NaN compares false: a non-finite gradient is the finite check's to report.
        return (rows.abs() > 0).any(dim=1)

    def observe(self, where: str, grad: Optional[torch.Tensor]) -> None:
        """A hooked layer's backprops: the batch on ``batch_dim``."""
        if grad is None or grad.dim() <= self.batch_dim or grad.shape[self.batch_dim] != self.batch:
            return
        self._seen.append((where, [self._flags(grad, self.batch_dim)]))

    def observe_output(self, where: str, grad: Optional[torch.Tensor]) -> None:
        """A model output's gradient, whose batch may lie on any dimension of size B (a model
        wrapped with batch_first=False may still return (B, ...)): it is its own sample's if
        some such dimension holds it."""
        if grad is None:
            return
        dims = [d for d in range(grad.dim()) if grad.shape[d] == self.batch]
        dims.sort(key=lambda d: d != self.batch_dim)
        if dims:
            self._seen.append((where, [self._flags(grad, d) for d in dims]))

    def offenders(self) -> List[Tuple[str, List[int]]]:
        """``(where, rows)`` for each place whose gradient is non-zero on rows outside the
        probed samples' along every dimension that may hold the batch, in the order seen;
        ``rows``: the non-zero rows along the dimension with the fewest."""
        if not self._seen:
            return []
        flags = [f for _, fs in self._seen for f in fs]
        nonzero: List[List[int]] = [[] for _ in flags]
        for k, r in (torch.stack(flags) if len(flags) > 1 else flags[0][None]).nonzero().tolist():  # the one wait
            nonzero[k].append(r)
        found, i = [], 0
        for where, fs in self._seen:
            candidates = nonzero[i:i + len(fs)]
            i += len(fs)
            if not any(set(rows) <= set(self.samples) for rows in candidates):
                found.append((where, min(candidates, key=len)))
        return found


def output_batch_dim(t: torch.Tensor, batch: int, batch_first: bool) -> Optional[int]:
    """Where a model output holds the batch, for the model's probe: dimension 0 under
    batch_first=True; under False the one of dimensions 1 and 0 of size B, if only one is
    (else the output cannot be probed: its batch is not known)."""
    if batch_first:
        return 0 if t.dim() and t.shape[0] == batch else None
    dims = [d for d in (1, 0) if d < t.dim() and t.shape[d] == batch]
    return dims[0] if len(dims) == 1 else None


def _rows(rows: List[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in rows[:limit])
    return f"[{shown}{', ...' if len(rows) > limit else ''}] ({len(rows)} of them)" if len(rows) > limit \
        else f"[{shown}]"


def model_mixing_error(probe: Probe, offenders: List[Tuple[str, List[int]]]) -> SampleMixingError:
    """The refusal of a model whose hooked layers' rows depend on other samples."""
    lines = []
    for where, rows in _unique(offenders):
        lines.append(f"- {where}: rows {_rows(rows)}")
    return SampleMixingError(
        f"samples are mixed inside the model: the gradient of {_which(probe)}'s outputs (a probe of a "
        f"batch of {probe.batch}) reached other samples' rows of these layers' outputs, nearest the "
        "model's output first:\n" + "\n".join(lines) + "\n"
        "Something between the first of these layers and the model's output combines or reorders "
        "samples: a statistic over the batch (x - x.mean(0), a BatchNorm in training mode), "
        "attention or pooling across the batch, a sort or permutation of the batch, or a layer "
        "run with its batch on another dimension (time-first inputs under batch_first=True). Each "
        "sample's per-sample gradient would then depend on other samples, and clipping it would "
        "not bound that sample's contribution. Keep each sample in its own row, in the batch's "
        "order, between the trainable layers (statistics per sample, e.g. LayerNorm or GroupNorm; "
        "batch_first set as the layers see the batch). " + TURN_OFF + " " + NOTHING_REACHED)


def loss_mixing_error(probe: Probe, offenders: List[Tuple[str, List[int]]]) -> SampleMixingError:
    """The refusal of per-sample losses that are not each their own sample's."""
    which, own = _which(probe, "loss"), set(probe.samples)
    reordered = all(len(rows) == len(own) and set(rows) != own for _, rows in offenders)
    lines = "\n".join(f"- {where}: rows {_rows(rows)}" for where, rows in _unique(offenders))
    if reordered:
        return SampleMixingError(
            f"the per-sample losses are in another order than the batch: {which} depend on other "
            f"samples' rows than their own, {probe.samples}:\n{lines}\n"
            "Loss b must be sample b's (the b-th row of the model's outputs): compute the losses on "
            "the outputs in the batch's order, not on a shuffled, sorted or reversed copy, and give "
            "them in that order. " + NOTHING_REACHED)
    return SampleMixingError(
        f"the loss mixes samples: {which} depend on other samples' rows besides their own (a probe "
        f"of a batch of {probe.batch}):\n{lines}\n"
        "A per-sample loss that reads other samples (in-batch negatives, a contrastive loss, "
        "outputs normalised by statistics of the batch, a mean over the batch inside each loss) "
        "lets one sample move many losses, so clipping each loss's gradient does not bound that "
        "sample's contribution. Compute loss b from sample b's outputs alone. " + TURN_OFF + " "
        + NOTHING_REACHED)


def _which(probe: Probe, what: str = "sample") -> str:
    """"sample 3" or "samples 1 and 3" ("loss 3", "the losses of samples 1 and 3")."""
    if len(probe.samples) == 1:
        return f"{what} {probe.samples[0]}"
    listed = " and ".join(str(s) for s in probe.samples)
    return f"samples {listed}" if what == "sample" else f"the losses of samples {listed}"


def _unique(offenders: List[Tuple[str, List[int]]]) -> List[Tuple[str, List[int]]]:
    """The first report of each place (a layer called twice is seen twice)."""
    seen, out = set(), []
    for where, rows in offenders:
        if where not in seen:
            seen.add(where)
            out.append((where, rows))
    return out


def hooked_edges_reached(root: Node, outputs: set, mark: object) -> List[GradientEdge]:
    """Edges of the hooked outputs (nodes carrying ``mark``) that ``root`` reaches without
    passing through a node in ``outputs`` (the model's outputs): an auxiliary loss read from
    an inner layer's output."""
    found: List[GradientEdge] = []
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        if node in outputs:
            continue
        marked = node.metadata.get(mark)
        if marked is not None:
            found.extend(GradientEdge(node, nr) for nr in sorted(marked[1]))
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return found


OUTPUT = "the model's output"


def describe_output(t: torch.Tensor, i: int, count: int) -> str:
    """How a message names one of the model's outputs."""
    return OUTPUT + (f" {i}" if count > 1 else "") + f" of shape {tuple(t.shape)}"
