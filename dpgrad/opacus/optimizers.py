"""Opacus's DP optimizers for ghost clipping, as dpgrad hands them out: ``DPOptimizerFastGradientClipping``
(one process) and ``DistributedDPOptimizerFastGradientClipping`` (DDP, the noise added on rank 0)
with their per-parameter work batched, and ``FSDPOptimizerFastGradientClipping`` (FSDP2, each
rank the noise of its shards). ``make_private`` (``dpgrad.opacus.engine``) and ``DPTrainer`` put
them in place of Opacus's. Each takes its step as ``StepOnce`` says: whatever the loop, what
it releases holds each sample once."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from opacus.optimizers import DPOptimizerFastGradientClipping as _OpacusDPOptimizerFastGradientClipping
from opacus.optimizers import FSDPOptimizerFastGradientClipping as _OpacusFSDPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from dpgrad.backward import grad_marks
from dpgrad.backward.autograd_graph import eager_when_compiled, in_region


class StepOnce:
    """Opacus's ghost-clipping step (a mixin before Opacus's class), kept right in the loops
    users write (``dpgrad.backward.grad_marks``):

    - before anything, the gradients are read: an unclipped one (a plain ``loss.backward()``
      through the double-backward wrapper) or one scaled by a GradScaler the step does not
      remove is refused; ``accumulated_iterations`` is the number of loader batches ``p.grad``
      holds (several accumulated before one step: the accountant's rate and the mean's divisor
      times it, Opacus's rule for per-sample gradients), not Opacus's fixed 1;
    - a skipped step (``signal_skip_step``: Opacus's BatchMemoryManager, ``physical_batch_size``)
      takes ``p.grad`` into the sum and clears it, and a released step forgets its sum, so that
      whether ``zero_grad()`` comes before each part, after every step, only after the real step
      or never, each part counts once;
    - under ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``: ``scaler.step`` hands over
      its scale and overflow flag instead of unscaling itself): ``p.grad`` is divided by the scale
      before it is summed, and a step whose gradients overflowed (on any rank) releases nothing:
      no noise, no step, not counted by the accountant; the scaler lowers its scale. Where the
      step ends a logical batch run in parts, a part that overflowed withholds the whole batch.
      Whether a step overflows depends on its batch: that event is not covered by the accountant
      (bf16, which needs no loss scaling, avoids it). The overflow flag is read on the host, as
      GradScaler's own step reads it.
    """

    counts_accumulated_batches = True  # the loss wrapper accumulates only for an optimizer that counts
    _step_supports_amp_scaling = True

    @property
    def accumulated_iterations(self) -> int:
        """The loader batches of the step being taken (read from the gradients before it)."""
        return self.__dict__.get("_held_batches", 1)

    def pre_step(self, closure=None) -> bool:
        released = self.__dict__.get("_released")
        if released and all(p.grad is not None and p.grad is grad() and p.grad._version == version
                            for p, grad, version in released):
            raise ValueError("optimizer.step() again with no backward pass since the last step: p.grad still holds "
                             "what that step released. Run a backward pass first (with dpgrad's optimizers, "
                             "optimizer.zero_grad() between steps is optional). Nothing was released.")
        scaler_step = "grad_scale" in self.__dict__  # set by GradScaler.step for this call
        self._held_batches = grad_marks.held_batches(self.params, scaler_step)
        if scaler_step and self._overflowed():
            return False
        if self.__dict__.get("_part_overflowed") and not self._check_skip_next_step(pop_next=False):
            self._check_skip_next_step()
            self._withhold_batch()
            return False
        if scaler_step and self.grad_scale is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, self.grad_scale.to(grads[0].device))
        stepped = super().pre_step(closure)
        if not stepped:
            # Taken into the sum: the next part's backward starts from nothing, whatever zero_grad() does.
            for p in self.params:
                if p.grad is not None and getattr(p, "summed_grad", None) is p.grad:
                    # The sum outlives the step: not in p.grad's memory, which a graphed pass's buffer or
                    # a DDP bucket reuses.
                    p.summed_grad = p.grad.clone()
                p.grad = None
        else:
            # Released: the next step sums anew even where no zero_grad() comes between.
            self._drop_sums()
            self._released = [(p, weakref.ref(p.grad), p.grad._version) for p in self.params if p.grad is not None]
        return stepped

    def _overflowed(self) -> bool:
        """Whether the GradScaler found inf or NaN in the gradients (on any rank); if so, this
        step releases nothing (see the class docstring)."""
        found = self.found_inf.reshape(1).to(torch.float32)
        world = getattr(self, "world_size", 1)
        if world > 1:
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        if not bool(found.item()):
            return False
        for p in self.params:
            p.grad = None
        if self._check_skip_next_step():  # a part of a logical batch: the rest comes, then nothing is released
            self._part_overflowed = True
            self._is_last_step_skipped = True
        else:
            self._withhold_batch()
        return True

    def _withhold_batch(self) -> None:
        """Drop the logical batch's sum: nothing of it is released."""
        self._part_overflowed = False
        self._is_last_step_skipped = False
        for p in self.params:
            p.grad = None
        self._drop_sums()

    def _drop_sums(self) -> None:
        for p in self.params:
            p.summed_grad = None
        for state in getattr(self, "grad_state", {}).values():  # Opacus's FSDP optimizer keeps its sums here
            state["summed_grad"] = None


class DPOptimizerFastGradientClipping(StepOnce, _OpacusDPOptimizerFastGradientClipping):
    """Opacus's ``DPOptimizerFastGradientClipping`` with its per-parameter work batched.

    Same arguments, attributes, step skipping (virtual steps), accountant hooks and result as
    Opacus's: ``p.grad`` becomes ``(p.summed_grad + N(0, (noise_multiplier * max_grad_norm)^2))``
    divided by the expected batch size under "mean". Opacus does it with about five operations
    per parameter (a copy of the gradient, a zero tensor, the noise, the sum, the division);
    on a GPU a model with hundreds of parameters then spends more host time in the optimizer
    than in its backward pass. Here:

    - ``p.summed_grad`` is the clipped gradient itself, not a copy (a copy is made only when
      the step is skipped, whose sum outlives it);
    - the noise of all parameters of one device and dtype is drawn in one call into one
      buffer, already divided by the expected batch size under "mean" (its standard deviation
      divided), the clipped sums are added to it times the same factor (one multi-tensor
      operation, rounded once), and every ``p.grad`` is a view of that buffer: no pass of its
      own for the division (without noise, the sums are divided as Opacus divides them);
    - a trainable parameter the backward pass did not reach (``p.grad`` None) is given a zero
      sum: it receives noise like every other parameter (Opacus's optimizer fails on it).

    - on a CPU, from ``IN_PLACE_NOISE_ELEMENTS`` gradient elements up, the noise is drawn on
      torch's threads, each with a generator of its own (``noise_generators``), a slice at a
      time, and added to the clipped sums in place (``_add_noise_in_place``): a CPU generator
      draws one value after another, and the draw is most of what a DP step adds to the
      non-private one there.

    The noise has Opacus's distribution (independent Gaussians, in the gradient's dtype), but a
    seeded ``generator`` gives other draws than Opacus's per-parameter calls. With
    ``secure_mode`` the noise is drawn by Opacus's own code, parameter by parameter.

    Its step is ``StepOnce``'s: right in every loop (``zero_grad()`` anywhere, accumulation,
    Opacus's BatchMemoryManager), counting the batches accumulated in ``p.grad``
    (``accumulated_iterations``), and under ``torch.amp.GradScaler`` unscaling the gradients
    and releasing nothing for a step that overflowed.
    """

    def accumulate(self):
        summed, grads = [], []
        for p in self.params:
            if p.summed_grad is None:
                # The gradient itself: a skipped step copies it (StepOnce).
                p.summed_grad = p.grad if p.grad is not None else torch.zeros_like(p)
            elif p.grad is not None:
                summed.append(p.summed_grad)
                grads.append(p.grad)
        if summed:
            torch._foreach_add_(summed, grads)

    @eager_when_compiled
    def pre_step(self, closure=None) -> bool:
        return super().pre_step(closure)

    @in_region("dpgrad.noise")
    def add_noise(self):
        if self.secure_mode:
            return super().add_noise()
        # A tensor under adaptive clipping (dpgrad.clipping.adaptive): the bound stays on the device.
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        params = self.params
        for p in params:
            _check_processed_flag(p.summed_grad)
        groups: Dict[Tuple[torch.device, torch.dtype], List[nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.summed_grad.device, p.summed_grad.dtype), []).append(p)
        # Under "mean" the division of scale_grad, folded in here where noise is drawn.
        divisor = self._divisor()
        silent = isinstance(std, (int, float)) and std == 0
        folded = divisor != 1 and not silent
        alpha = 1 / divisor if folded else 1
        for (device, dtype), group in groups.items():
            sizes = [p.numel() for p in group]
            if device.type == "cpu" and sum(sizes) >= IN_PLACE_NOISE_ELEMENTS and not silent:
                _add_noise_in_place([p.summed_grad for p in group], std / divisor, alpha, noise_generators(self))
                for p in group:
                    p.grad = p.summed_grad.view_as(p)  # a tensor of its own: the sum's flags stay on the sum
                continue
            noise = torch.empty(sum(sizes), device=device, dtype=dtype)
            if silent:
                noise.zero_()
            else:
                _draw_noise(noise, std / divisor, self.generator)
            noisy = [piece.view_as(p) for piece, p in zip(noise.split(sizes), group)]
            torch._foreach_add_(noisy, [p.summed_grad for p in group], alpha=alpha)
            for p, g in zip(group, noisy):
                p.grad = g
        self._scaled = folded
        for p in params:
            _mark_as_processed(p.summed_grad)

    def _divisor(self) -> float:
        """What scale_grad divides the noisy sums by: the expected batch size (times the
        accumulated steps) under "mean", else 1."""
        return self.expected_batch_size * self.accumulated_iterations if self.loss_reduction == "mean" else 1

    def scale_grad(self):
        if self.__dict__.pop("_scaled", False):  # add_noise divided them already
            return
        if self.loss_reduction == "mean":
            torch._foreach_div_([p.grad for p in self.params], self._divisor())


# On a CPU, from this many gradient elements up (of one dtype), the noise is drawn a slice of
# NOISE_SLICE elements at a time into small buffers and added in place to the clipped sums, on
# as many threads as torch computes with (at most NOISE_THREADS), each with its own generator
# (``_add_noise_in_place``). A CPU generator draws one value after another, so the draw is the
# largest cost a DP step adds to the non-private one; a buffer the size of the model, new at
# each step, cost as much again (its pages touched for the first time, one by one). Below it
# (and on a GPU) one draw into one buffer for all parameters: fewer operations for the host.
IN_PLACE_NOISE_ELEMENTS = 1 << 22
NOISE_SLICE = 1 << 18
NOISE_THREADS = 8


def noise_generators(optimizer) -> List[Optional[torch.Generator]]:
    """The generators ``_add_noise_in_place`` draws ``optimizer``'s noise on a CPU with: its own
    (``optimizer.generator``, torch's default where None), then one per further thread, made at
    the first call and kept for the optimizer's life, each seeded from the first (seeds distinct
    in the 32 bits a CPU generator keeps: streams that never meet). Their number: torch's threads
    then, at most ``NOISE_THREADS``; the draws of a seeded generator are the same for the same
    number."""
    found = optimizer.__dict__.get("_noise_generators")
    if found is None or found[0] is not optimizer.generator:
        extra = max(1, min(torch.get_num_threads(), NOISE_THREADS)) - 1
        seeds: List[int] = []
        while len(set(seeds)) < extra:
            seeds = torch.randint(0, 1 << 32, (extra,), generator=optimizer.generator).tolist()
        found = optimizer._noise_generators = [optimizer.generator] + [torch.Generator().manual_seed(s) for s in seeds]
    return found


def _draw_noise(noise: torch.Tensor, std, generator) -> torch.Tensor:
    """``noise`` filled with N(0, std^2) in place; ``std`` a float or a 0-d tensor (adaptive
    clipping's bound, kept on the device)."""
    if isinstance(std, torch.Tensor):
        return noise.normal_(0, 1, generator=generator).mul_(std.to(device=noise.device, dtype=noise.dtype))
    return noise.normal_(0, std, generator=generator)


def _add_noise_in_place(sums: List[torch.Tensor], std, alpha: float, generators: List[Optional[torch.Generator]]
                        ) -> None:
    """``sum <- N(0, std^2) + alpha * sum`` for each tensor of ``sums`` (CPU tensors of one
    dtype), in place: their slices of ``NOISE_SLICE`` elements, in order, split into as many
    runs as ``generators``, each run drawn with its own generator on a thread of its own into
    one reused buffer. ``std``: a float, or a 0-d tensor (adaptive clipping's bound)."""
    def run(pieces: List[torch.Tensor], generator) -> None:
        if not pieces:
            return
        buffer = torch.empty(max(p.numel() for p in pieces), dtype=pieces[0].dtype)
        for piece in pieces:
            torch.add(_draw_noise(buffer[:piece.numel()], std, generator), piece, alpha=alpha, out=piece)

    pieces = []
    for t in sums:
        if not t.is_contiguous():  # a whole draw of its own (a rare layout)
            t.copy_(torch.add(_draw_noise(torch.empty(t.shape, dtype=t.dtype), std, generators[0]), t, alpha=alpha))
            continue
        flat = t.view(-1)
        pieces += [flat[start:start + NOISE_SLICE] for start in range(0, flat.numel(), NOISE_SLICE)]
    runs = len(generators)
    bounds = [len(pieces) * k // runs for k in range(runs + 1)]
    parts = [pieces[bounds[k]:bounds[k + 1]] for k in range(runs)]
    if runs == 1:
        return run(parts[0], generators[0])
    # Threads of this call only: none left running for a later fork (a DataLoader's workers) to copy.
    with ThreadPoolExecutor(max_workers=runs - 1, thread_name_prefix="dpgrad-noise") as pool:
        waiting = [pool.submit(run, part, g) for part, g in zip(parts[1:], generators[1:])]
        run(parts[0], generators[0])
        for future in waiting:
            future.result()


class DistributedDPOptimizerFastGradientClipping(DPOptimizerFastGradientClipping):
    """Opacus's ``DistributedDPOptimizerFastGradientClipping`` (the noise added once, on rank
    0, then the ranks' gradients summed, and averaged under "mean"), with the batched noise of
    ``DPOptimizerFastGradientClipping``, which takes a bound on the device: what adaptive
    clipping under DDP uses. Same arguments."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    def add_noise(self):
        if self.rank == 0:
            super().add_noise()
        else:
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)

    def reduce_gradients(self):
        grads = [p.grad for p in self.params if p.requires_grad]
        for g in grads:
            torch.distributed.all_reduce(g, op=torch.distributed.ReduceOp.SUM)
        if self.loss_reduction == "mean" and grads:
            torch._foreach_div_(grads, self.world_size)

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.pre_step():
            self.reduce_gradients()
            return self.original_optimizer.step()
        return None


class FSDPOptimizerFastGradientClipping(StepOnce, _OpacusFSDPOptimizerFastGradientClipping):
    """Opacus's ``FSDPOptimizerFastGradientClipping`` (each rank draws the noise of the whole
    parameter and adds its own shard's slice) taking its step as ``StepOnce`` says. Same
    arguments."""
