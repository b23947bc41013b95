"""The guarantee's second half: each sample's contribution is its own.

Clipping bounds each sample's contribution only if row b of every hooked layer's inputs and
backprops, and per-sample loss b, belong to sample b alone. A loss or a layer that mixes
samples (a batch statistic, in-batch negatives, attention across the batch), losses in
another order than the batch, a batch reordered between layers, or a layer run with its batch
on another dimension break that without any parameter going unclipped. Probes find them from
what autograd computes, for every pair of samples at once:

- the probe sets (``probe_sets``): sets S_1..S_n of the batch's samples such that for any two
  samples i != j some S_k holds i and not j. Sample i gets the i-th subset of size n // 2 of
  {1..n}, and S_k holds the samples whose subset holds k; two distinct subsets of one size
  never contain each other, so i's has some k that j's lacks. n is the least with
  C(n, n // 2) >= B (Sperner's bound: no family of fewer sets separates every ordered pair):
  2 sets for B = 2, 5 for 8, 8 for 64, 13 for 1024.
- the model's probe (at the end of a forward pass whose layout is new): for each set, one
  backward pass from the model's outputs, a random vector on the set's rows and zeros
  elsewhere, to the outputs of the hooked layers. Each hooked layer's backprops must be zero
  on every row outside the set, up to rounding (below). A dependency of an output row i on a
  hooked row j is found by the set that holds i and not j: every one autograd can see that is
  stronger than the tolerance, whatever the draw (the random values, of sizes 1 to 2, leave
  no row of the set weighing little, and make the set's rows cancel each other to under the
  tolerance with a chance of the tolerance's order).
- the loss's probe (in ``clipped_backward``, once per layout of the loss): for each set, the
  gradient of the set's losses (random weights) at the model's outputs (and at any hooked
  output the loss reads directly), only through the loss's own operations. Reaching outside
  the set: the losses come in another order than the batch, or the loss mixes samples. Where
  the model's probe has not run (a new layout after ``clipped_backward`` was seen), this pass
  goes on through the model, to every hooked output: one set of probes instead of two.

"Up to rounding": a probe reaches a row where that row's gradient (its norm) is more than
``TOLERANCE`` (1e-4 in fp32, 2e-2 in bf16 and fp16, the forward probe's) of the largest of
the set's own rows at the same place. A statistic of the batch that cancels exactly on paper
leaves its rounding in the gradient: the losses of ``logits - logits.max()`` reach the row
holding the batch's largest logit by 1 - sum(softmax), about 1e-7 of the set's rows in fp32,
which is not mixing. Mixing weaker than the tolerance is not found, by these probes as by the
forward probe. A set whose own rows' gradients are themselves at the dtype's rounding (every
sample in it predicted with near certainty) leaves that rounding no margin; a layout's first
step seldom has one.

A layout counts as checked only once a probe of it reached the rows of at least two samples
(a batch of 0 or 1 samples, or one whose losses but one weigh zero, proves nothing): until
then every pass of the layout is probed. All the probes of one check are read on the host at
once. Nothing reaches ``p.grad`` or the per-sample state from a probe: it asks autograd for
layer outputs' gradients only, and the hooks read them without recording. What autograd cannot
see is the forward probe's (``dpgrad.checks.forward_probe``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from typing import List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node

# What every refusal ends with.
TURN_OFF = ("If the model and the loss are per-sample by construction, pass check_independence=False to the "
            "wrapper (or make_private / PrivacyArguments); that gives up this check.")
NOTHING_REACHED = "Nothing has reached p.grad from this pass."

# How far a row may move, relative to its own size (the forward probe), or a probe's gradient
# reach a row outside its set, relative to the set's largest row there (the backward probes),
# before it counts: rounding (a GPU kernel rounding a row differently, a shift the samples' own
# operations cancel on paper) is not mixing. Mixing weaker than this is not found.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


class SampleMixingError(RuntimeError):
    """A sample's rows, or its loss, depend on other samples: clipping would not bound its
    contribution. Raised before anything reaches ``p.grad``."""


def probe_count(batch: int) -> int:
    """How many probe sets a batch of ``batch`` samples takes (``probe_sets``)."""
    if batch < 2:
        return 0
    n = 2
    while math.comb(n, n // 2) < batch:
        n += 1
    return n


def probe_sets(batch: int) -> List[Tuple[int, ...]]:
    """Sets of samples such that for every two samples i != j of a batch of ``batch``, some set
    holds i and not j (see the module docstring); none for a batch of fewer than two."""
    n = probe_count(batch)
    sets: List[List[int]] = [[] for _ in range(n)]
    for sample, code in zip(range(batch), itertools.combinations(range(n), n // 2)):
        for k in code:
            sets[k].append(sample)
    return [tuple(s) for s in sets if 0 < len(s) < batch]


class Draws:
    """The probes' random numbers, from a stream of their own: seeded by torch's initial seed
    (a seeded run probes alike), never drawing from torch's generators."""

    def __init__(self):
        self._random = random.Random(torch.initial_seed())

    def generator(self, device: torch.device) -> torch.Generator:
        """A torch generator on ``device``, seeded from this stream."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self._random.getrandbits(62))
        return generator

    def on_rows(self, like: torch.Tensor, rows: "RowSet", batch_dim: int) -> torch.Tensor:
        """Values like ``like`` on ``rows`` along ``batch_dim``, of random signs and sizes
        uniform in [1, 2]; zeros elsewhere."""
        drawn = torch.rand(like.shape, generator=self.generator(like.device), device=like.device,
                           dtype=like.dtype if like.is_floating_point() else torch.float32) * 2 - 1
        # Sizes kept off zero: the tolerance is relative to the set's largest row, so a
        # dependency through a row whose weight drew near zero could pass under it.
        values = torch.where(drawn < 0, drawn - 1, drawn + 1)
        return values * along(rows.mask(like.device), like, batch_dim).to(values.dtype)


class RowSet:
    """Some samples of a batch (``samples``), and their (B,) mask on a device (``mask``)."""

    def __init__(self, samples: Sequence[int], table: "RowSets", index: int):
        self.samples, self._table, self._index = tuple(samples), table, index

    def mask(self, device: torch.device) -> torch.Tensor:
        return self._table.on(device)[self._index]


class RowSets(list):
    """The probe sets of a batch as ``RowSet``s, their masks one table per device, copied
    there once (a mask made from the sets' indices on the host would be copied at each use,
    and on a GPU wait for its queue)."""

    def __init__(self, batch: int, sets: Sequence[Sequence[int]]):
        super().__init__(RowSet(s, self, k) for k, s in enumerate(sets))
        self.batch = batch
        self._tables = {}

    def on(self, device: torch.device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            held = [set(rows.samples) for rows in self]
            table = torch.tensor([[i in s for i in range(self.batch)] for s in held], dtype=torch.bool)
            table = self._tables[device] = table.view(len(self), self.batch).to(device)
        return table


def along(mask: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """A (B,) ``mask`` shaped to broadcast against ``like`` along ``dim``."""
    shape = [1] * like.dim()
    shape[dim] = like.shape[dim]
    return mask.view(shape)


class Probe:
    """What one probe (one set of samples, ``rows``) saw: for each hooked output (or model
    output) its gradient reached, which rows it reached beyond rounding (the module
    docstring). ``observe`` queues the flags on the device; ``Probes.read`` reads every
    probe's at once."""

    def __init__(self, rows: RowSet, batch: int, batch_dim: int, hooks: bool = True):
        self.rows, self.samples = rows, list(rows.samples)
        self.batch, self.batch_dim = batch, batch_dim
        self.hooks = hooks  # whether the hooked layers' backprops are read (else only what is handed in)
        # (where, one (B,) flag vector per dimension that may hold the batch)
        self._seen: List[Tuple[str, List[torch.Tensor]]] = []

    def _flags(self, grad: torch.Tensor, dim: int) -> torch.Tensor:
        rows = grad.detach().movedim(dim, 0).reshape(self.batch, -1)
        wide = torch.promote_types(rows.dtype, torch.float32)
        sizes = torch.linalg.vector_norm(rows, dim=1, dtype=wide)
        own = self.rows.mask(grad.device)
        # Rounding is relative to what was summed, the set's own rows: a shift their operations
        # cancel on paper (logits - logits.max()) leaves a few units of the dtype's precision of
        # them on the row it came from. NaN compares false (a non-finite gradient is the finite
        # check's to report), and a non-finite own row does not widen the tolerance for others.
        scale = torch.where(own & sizes.isfinite(), sizes, 0.0).amax()
        return sizes > TOLERANCE.get(rows.dtype, TOLERANCE[torch.float32]) * scale

    def observe(self, where: str, grad: Optional[torch.Tensor]) -> None:
        """A hooked layer's backprops: the batch on ``batch_dim``."""
        if grad is None or grad.dim() <= self.batch_dim or grad.shape[self.batch_dim] != self.batch:
            return
        self._seen.append((where, [self._flags(grad, self.batch_dim)]))

    def observe_output(self, where: str, grad: Optional[torch.Tensor]) -> None:
        """A model output's gradient, whose batch may lie on any dimension of size B (a model
        wrapped with batch_first=False may still return (B, ...)): it is its own samples' if
        some such dimension holds it."""
        if grad is None:
            return
        dims = [d for d in range(grad.dim()) if grad.shape[d] == self.batch]
        dims.sort(key=lambda d: d != self.batch_dim)
        if dims:
            self._seen.append((where, [self._flags(grad, d) for d in dims]))


class Probes:
    """The probes of one check, one per set of samples (``sets``: ``RowSets`` of the batch's
    probe sets), read together."""

    def __init__(self, sets: RowSets, batch_dim: int, hooks: bool = True):
        self.batch, self.batch_dim, self.hooks = sets.batch, batch_dim, hooks
        self.sets = sets
        self.done: List[Probe] = []

    def __iter__(self):
        for rows in self.sets:
            probe = Probe(rows, self.batch, self.batch_dim, self.hooks)
            self.done.append(probe)
            yield probe

    def read(self) -> Tuple[List[Tuple[Probe, List[Tuple[str, List[int]]]]], Set[int]]:
        """``(found, reached)``, with one wait for the device: for each probe whose gradients
        reached rows outside its samples' along every dimension that may hold the batch, the
        places, in the order seen, and the rows reached of each (along the dimension with
        the fewest); and every row any probe reached, its own samples' included."""
        flags = [f for probe in self.done for _, fs in probe._seen for f in fs]
        if not flags:
            return [], set()
        nonzero: List[List[int]] = [[] for _ in flags]
        for k, r in torch.stack(flags).nonzero().tolist():  # the one wait
            nonzero[k].append(r)
        found, reached, i = [], set(), 0
        for probe in self.done:
            own, offenders = set(probe.samples), []
            for where, fs in probe._seen:
                candidates = nonzero[i:i + len(fs)]
                i += len(fs)
                reached.update(candidates[0])  # along the batch's own dimension
                if not any(set(rows) <= own for rows in candidates):
                    offenders.append((where, min(candidates, key=len)))
            if offenders:
                found.append((probe, offenders))
        return found, reached


def conclusive(reached: Set[int]) -> bool:
    """Whether probes that reached ``reached`` rows checked a layout: rows of two samples at
    least (one sample, or none, has nobody to mix with)."""
    return len(reached) >= 2


def output_batch_dim(t: torch.Tensor, batch: int, batch_first: bool) -> Optional[int]:
    """Where a model output holds the batch, for the model's probe: dimension 0 under
    batch_first=True; under False the one of dimensions 1 and 0 of size B, if only one is
    (else the output cannot be probed: its batch is not known)."""
    if batch_first:
        return 0 if t.dim() and t.shape[0] == batch else None
    dims = [d for d in (1, 0) if d < t.dim() and t.shape[d] == batch]
    return dims[0] if len(dims) == 1 else None


def listed(rows: Sequence[int], limit: int = 8) -> str:
    rows = list(rows)
    shown = ", ".join(str(r) for r in rows[:limit])
    return f"[{shown}, ...] ({len(rows)} of them)" if len(rows) > limit else f"[{shown}]"


MODEL_CAUSES = (
    "Something between the first of these layers and the model's output combines or reorders "
    "samples: a statistic over the batch (x - x.mean(0), a BatchNorm in training mode), "
    "attention or pooling across the batch, a sort or permutation of the batch, or a layer "
    "run with its batch on another dimension (time-first inputs, (T, B, ...), in a batch of as many "
    "samples as the sequences are long, which dpgrad tells from its first forward pass where they "
    "differ, so start with another batch size; a batch on a dimension after 1), or a "
    "layer shared by all samples whose input's first size equals the batch size by chance (T5's "
    "(T, T) position buckets in a batch of T samples: dpgrad tells it from its first forward pass "
    "whose batch size differs, so start with another batch size). Each "
    "sample's per-sample gradient would then depend on other samples, and clipping it would "
    "not bound that sample's contribution. Keep each sample in its own row, in the batch's "
    "order, between the trainable layers (statistics per sample, e.g. LayerNorm or GroupNorm; "
    "batch_first set as the layers see the batch). ")


def model_mixing_error(probe: Probe, offenders: List[Tuple[str, List[int]]]) -> SampleMixingError:
    """The refusal of a model whose hooked layers' rows depend on other samples."""
    lines = [f"- {where}: rows {listed(rows)}" for where, rows in _unique(offenders)]
    return SampleMixingError(
        f"samples are mixed inside the model: the gradient of {_which(probe)}'s outputs (a probe of a "
        f"batch of {probe.batch}) reached other samples' rows of these layers' outputs, nearest the "
        "model's output first:\n" + "\n".join(lines) + "\n" + MODEL_CAUSES + TURN_OFF + " " + NOTHING_REACHED)


LOSS_CAUSES = (
    "A per-sample loss that reads other samples (in-batch negatives, a contrastive loss, "
    "outputs normalised by statistics of the batch, a mean over the batch inside each loss) "
    "lets one sample move many losses, so clipping each loss's gradient does not bound that "
    "sample's contribution. Compute loss b from sample b's outputs alone. ")


def loss_mixing_error(probe: Probe, offenders: List[Tuple[str, List[int]]]) -> SampleMixingError:
    """The refusal of per-sample losses that are not each their own sample's."""
    which, own = _which(probe, "loss"), set(probe.samples)
    reordered = all(len(rows) == len(own) and set(rows) != own for _, rows in offenders)
    lines = "\n".join(f"- {where}: rows {listed(rows)}" for where, rows in _unique(offenders))
    if reordered:
        return SampleMixingError(
            f"the per-sample losses are in another order than the batch: {which} depend on other "
            f"samples' rows than their own, {listed(probe.samples)}:\n{lines}\n"
            "Loss b must be sample b's (the b-th row of the model's outputs): compute the losses on "
            "the outputs in the batch's order, not on a shuffled, sorted or reversed copy, and give "
            "them in that order. " + NOTHING_REACHED)
    return SampleMixingError(
        f"the loss mixes samples: {which} depend on other samples' rows besides their own (a probe "
        f"of a batch of {probe.batch}):\n{lines}\n" + LOSS_CAUSES + TURN_OFF + " " + NOTHING_REACHED)


def elsewhere_error(rank: int) -> SampleMixingError:
    """The refusal on a rank whose own probes found nothing, when another rank's did (FSDP2:
    every rank stops at the same step)."""
    return SampleMixingError(
        f"samples are mixed: the independence probe of another rank's batch found it (this is rank {rank}; "
        "that rank's error names the layers or the loss). " + TURN_OFF + " " + NOTHING_REACHED)


def _which(probe: Probe, what: str = "sample") -> str:
    """"sample 3" or "samples [1, 3]" ("loss 3", "the losses of samples [1, 3]")."""
    if len(probe.samples) == 1:
        return f"{what} {probe.samples[0]}"
    shown = listed(probe.samples)
    return f"samples {shown}" if what == "sample" else f"the losses of samples {shown}"


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
