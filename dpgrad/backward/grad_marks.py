"""What ``p.grad`` holds between dpgrad's backward passes and the DP optimizer's steps.

A DP step releases, once, the clipped sums of one logical batch: its physical batches, or
several loader batches accumulated (whose number the accountant multiplies the sample rate
by). ``p.grad`` is where a clipped backward pass leaves its sums and where the optimizer takes
them, and loops differ in when they clear it (``zero_grad()`` before each forward pass, after
every step, only after the step that is not skipped, or never) and in how many passes they run
before a step. So that each sample counts once whatever the loop, every pass leaves a mark
(``GradMark``) on each parameter it gave a gradient: the gradient tensor and its version, the
optimizer's ``summed_grad`` as it was, the loader batches the gradient holds, whether it was
clipped and the loss scale it carries. At the next clipped pass (``before_pass``):

- a marked gradient nothing has touched since: the pass adds to it (gradient accumulation,
  one more loader batch); refused under Poisson sampling, as Opacus refuses it (the accountant's
  rate describes one Poisson batch per step), and where the optimizer would not count it;
- anything else (a step took the gradient into ``summed_grad`` or released it, ``zero_grad()``
  zeroed it, a gradient dpgrad did not make): the pass starts from nothing, so no sum is taken
  twice (cleared once the pass's own checks have passed);
- a plain backward's unclipped gradient, untouched: refused (touched anywhere, it goes with
  the rest).

In a step captured in a CUDA graph the marks are the graphed step's to keep (``dpgrad.graphs``):
its replays run no Python.

The DP optimizer (``dpgrad.opacus.optimizers``) reads the marks before its step
(``held_batches``): an unclipped gradient, or a loss scale nothing removed, is refused there,
and the loader batches the gradient holds are its ``accumulated_iterations``. A mark is a few
attributes read per parameter and pass (the reading stops at the first gradient a step took);
it never reads a value on the device.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import torch

from dpgrad.checks.guarantee import UnclippedGradientError

# Each parameter's mark, by the parameter's id (not on it: a copy or a pickle of the model carries
# none). A mark outliving its parameter is inert: its gradient is no other parameter's.
_MARKS: Dict[int, "GradMark"] = {}

POISSON_ACCUMULATION = (
    "Poisson sampling is not compatible with gradient accumulation: p.grad already holds the clipped "
    "gradient of a batch no optimizer step has taken, and the accountant's sample rate describes one "
    "Poisson batch per step. Call optimizer.step() after every batch; to run a large batch in parts, use "
    "Opacus's BatchMemoryManager or make_private(physical_batch_size=...), which step after each part."
)

UNCOUNTED_ACCUMULATION = (
    "p.grad already holds the clipped gradient of a batch no optimizer step has taken, and this optimizer "
    "({kind}) counts one batch per step, so the accountant would record the sample rate of one batch for "
    "several. Accumulate batches with dpgrad's DP optimizer (dpgrad.opacus.DPOptimizerFastGradientClipping, "
    "Opacus's arguments), which counts them; or call optimizer.step() after every batch."
)

UNCLIPPED = (
    "p.grad of {names} holds the unclipped gradient of a plain loss.backward() through the ghost-clipping "
    "wrapper (its first pass gives the per-sample norms only; Opacus's loss wrapper clears p.grad and "
    "adds the clipped gradient in a second pass): {then}. Compute the loss with the criterion make_private "
    "returns, or dpgrad.DPLossFastGradientClipping, whose backward() clips; or, to keep your own "
    "criterion, use grad_sample_mode='hooks' (dpgrad.GradSampleModule, which clips in the optimizer)."
)


class PassMark(NamedTuple):
    """What a pass left in ``p.grad``, the same for every parameter it reached."""

    batches: int  # the loader batches the gradients hold
    clipped: bool  # False: a plain backward's unclipped gradient
    scale: Optional[torch.Tensor]  # the loss scale the gradients carry (a GradScaler's), None: none
    names: Callable[[torch.Tensor], str]  # a parameter's name, for the messages


# Per parameter: (its gradient, the gradient's version, the optimizer's ``summed_grad``, its
# version, the pass's ``PassMark``), the tensors weakly. A version moves with any change in
# place (zero_grad, unscaling, an accumulation).
GradMark = Tuple[weakref.ref, int, Optional[weakref.ref], int, PassMark]


def _summed(p: torch.Tensor) -> Tuple[Optional[torch.Tensor], int]:
    summed = p.__dict__.get("summed_grad")
    return summed, (summed._version if isinstance(summed, torch.Tensor) else -1)


def _pending(p: torch.Tensor, grad: torch.Tensor) -> Optional[PassMark]:
    """The mark of the pass that left ``grad`` (``p.grad``), if nothing touched it since and no
    step took it; None otherwise."""
    mark = _MARKS.get(id(p))
    if mark is None or mark[0]() is not grad or grad._version != mark[1]:
        return None
    summed, version = _summed(p)
    was = None if mark[2] is None else mark[2]()
    return mark[4] if summed is was and version == mark[3] else None


def before_pass(params: Iterable[torch.Tensor], *, another_batch: bool, accumulation_allowed: bool,
                counted: bool = True, optimizer_kind: str = "",
                scale: Optional[torch.Tensor] = None) -> Tuple[int, bool]:
    """What a clipped pass finds in ``p.grad``: the loader batches it holds, to be added to (0:
    none), and whether the pass must first clear it (``start_anew``: a step took it, or it is
    no sum of dpgrad's; an unclipped gradient then goes too). Reads attributes only; changes
    nothing.

    ``another_batch``: the pass is of a batch the loader drew anew (False: another physical
    part of the batch before it). ``accumulation_allowed``: False under Poisson sampling.
    ``counted``: whether the optimizer counts accumulated batches. ``scale``: the loss scale
    of the pass's losses. Raises, before anything is touched, for an unclipped gradient it
    would add to, an accumulation that cannot be accounted, or one of losses scaled otherwise.
    """
    marks = []
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        mark = _pending(p, grad)
        if mark is None:
            return 0, True  # a step took the gradients (or zero_grad() cleared them): a new sum begins
        marks.append((p, mark))
    if not marks:
        return 0, False
    unclipped = [mark.names(p) for p, mark in marks if not mark.clipped]
    if unclipped:
        raise UnclippedGradientError(UNCLIPPED.format(
            names=unclipped, then="a clipped backward pass would add to it. Nothing has reached p.grad from "
            "this pass; call optimizer.zero_grad() first"))
    if another_batch:
        if not accumulation_allowed:
            raise ValueError(POISSON_ACCUMULATION)
        if not counted:
            raise ValueError(UNCOUNTED_ACCUMULATION.format(kind=optimizer_kind))
    if {mark.scale is not None for _, mark in marks} != {scale is not None}:
        raise ValueError("p.grad holds gradients of losses scaled otherwise than this pass's (one scaled by a "
                         "GradScaler, the other not): scale every loss of a step alike, or step between them")
    return max(mark.batches for _, mark in marks), False


def start_anew(params: Iterable[torch.Tensor]) -> None:
    """Clear ``p.grad`` for a pass that begins a new sum (``before_pass`` said so), once the
    guarantee's checks have passed: a refused pass leaves ``p.grad`` as it found it."""
    for p in params:
        p.grad = None


def after_pass(params: Iterable[torch.Tensor], names: Callable[[torch.Tensor], str], batches: int,
               clipped: bool = True, scale: Optional[torch.Tensor] = None) -> None:
    """Mark what a pass left in ``p.grad`` (``names``: a parameter's name, for the messages)."""
    mark, ref = PassMark(batches, clipped, scale, names), weakref.ref
    for p in params:
        grad = p.grad
        if grad is not None:
            summed = p.__dict__.get("summed_grad")
            _MARKS[id(p)] = (ref(grad), grad._version, None if summed is None else ref(summed),
                             summed._version if summed is not None else -1, mark)


def held_batches(params: Iterable[torch.Tensor], scaler_step: bool) -> int:
    """The loader batches the gradients hold for a step (at least 1), read before it.

    Raises UnclippedGradientError where a plain backward's unclipped gradient is still there,
    and ValueError where a gradient carries a loss scale and the step does not come from
    ``GradScaler.step`` (``scaler_step``), which removes it.
    """
    held, unclipped, scaled = 1, [], []
    for p in params:
        entry, grad = _MARKS.get(id(p)), p.grad
        if entry is None or grad is None or entry[0]() is not grad:
            continue  # (changed in place, it is the same sum: unscaled, or zeroed)
        mark = entry[4]
        if not mark.clipped and grad._version == entry[1]:
            unclipped.append(mark.names(p))
        if mark.scale is not None and not scaler_step:
            scaled.append(mark.names(p))
        held = max(held, mark.batches)
    if unclipped:
        raise UnclippedGradientError(UNCLIPPED.format(
            names=unclipped, then="this step would release it with noise for the clipping bound. Nothing was "
            "released"))
    if scaled:
        raise ValueError(
            f"p.grad of {scaled} holds gradients scaled by a GradScaler's loss scale (scaler.scale(loss)."
            "backward()): step with scaler.step(optimizer), then scaler.update(), which remove the scale before "
            "the noise is added and skip a step whose gradients overflowed. Nothing was released.")
    return held


def clear(params: Iterable[torch.Tensor]) -> None:
    """Forget the marks of ``params`` (the wrapper taken off the model)."""
    for p in params:
        _MARKS.pop(id(p), None)


__all__ = ["GradMark", "PassMark", "after_pass", "before_pass", "clear", "held_batches", "start_anew"]
