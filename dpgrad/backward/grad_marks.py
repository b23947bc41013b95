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
- a plain backward's unclipped gradient, untouched: refused.

In a step captured in a CUDA graph the marks are the graphed step's to keep (``dpgrad.graphs``):
its replays run no Python.

The DP optimizer (``dpgrad.opacus.optimizers``) reads the marks before its step
(``held_batches``): an unclipped gradient, or a loss scale nothing removed, is refused there,
and the loader batches the gradient holds are its ``accumulated_iterations``. A mark is a few
attributes read per parameter and pass; it never reads a value on the device.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

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


class GradMark(NamedTuple):
    """What a pass left in a parameter's ``p.grad``."""

    grad: weakref.ref  # the gradient tensor
    version: int  # its version then: an in-place change (zero_grad, unscaling) moves it
    summed: Optional[weakref.ref]  # the optimizer's ``summed_grad`` then (None: none)
    summed_version: int
    batches: int  # the loader batches the gradient holds
    clipped: bool  # False: a plain backward's unclipped gradient
    scale: Optional[torch.Tensor]  # the loss scale the gradient carries (a GradScaler's), None: none
    name: str


def _summed(p: torch.Tensor) -> Tuple[Optional[torch.Tensor], int]:
    summed = getattr(p, "summed_grad", None)
    return summed, (summed._version if isinstance(summed, torch.Tensor) else -1)


def _untouched(p: torch.Tensor, mark: Optional[GradMark]) -> bool:
    """Whether ``p.grad`` is, unchanged, what the mark was left on, and no step took it since."""
    grad = p.grad
    if mark is None or grad is None or mark.grad() is not grad or grad._version != mark.version:
        return False
    summed, version = _summed(p)
    was = None if mark.summed is None else mark.summed()
    return summed is was and version == mark.summed_version


def before_pass(params: Iterable[torch.Tensor], *, another_batch: bool, accumulation_allowed: bool,
                counted: bool = True, optimizer_kind: str = "",
                scale: Optional[torch.Tensor] = None) -> Tuple[int, bool]:
    """What a clipped pass finds in ``p.grad``: the loader batches it holds, to be added to (0:
    none), and whether the pass must first clear it (``start_anew``: a step took it, or it is
    no sum of dpgrad's). Reads attributes only; changes nothing.

    ``another_batch``: the pass is of a batch the loader drew anew (False: another physical
    part of the batch before it). ``accumulation_allowed``: False under Poisson sampling.
    ``counted``: whether the optimizer counts accumulated batches. ``scale``: the loss scale
    of the pass's losses. Raises, before anything is touched, for an unclipped gradient, an
    accumulation that cannot be accounted, or one of losses scaled otherwise.
    """
    params = list(params)
    held, touched, unclipped, scales = 0, False, [], set()
    for p in params:
        if p.grad is None:
            continue
        mark = _MARKS.get(id(p))
        if not _untouched(p, mark):
            touched = True
        elif not mark.clipped:
            unclipped.append(mark.name)
        else:
            held = max(held, mark.batches)
            scales.add(mark.scale is not None)
    if unclipped:
        raise UnclippedGradientError(UNCLIPPED.format(
            names=unclipped, then="a clipped backward pass would add to it. Nothing has reached p.grad from "
            "this pass; call optimizer.zero_grad() first"))
    if touched:
        return 0, True  # a step took the gradients (or zero_grad() cleared them): a new sum begins
    if held and another_batch:
        if not accumulation_allowed:
            raise ValueError(POISSON_ACCUMULATION)
        if not counted:
            raise ValueError(UNCOUNTED_ACCUMULATION.format(kind=optimizer_kind))
    if held and scales != {scale is not None}:
        raise ValueError("p.grad holds gradients of losses scaled otherwise than this pass's (one scaled by a "
                         "GradScaler, the other not): scale every loss of a step alike, or step between them")
    return held, False


def start_anew(params: Iterable[torch.Tensor]) -> None:
    """Clear ``p.grad`` for a pass that begins a new sum (``before_pass`` said so), once the
    guarantee's checks have passed: a refused pass leaves ``p.grad`` as it found it."""
    for p in params:
        p.grad = None


def after_pass(params: Iterable[torch.Tensor], names, batches: int, clipped: bool = True,
               scale: Optional[torch.Tensor] = None) -> None:
    """Mark what a pass left in ``p.grad`` (``names``: a parameter's name for the messages)."""
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        summed, version = _summed(p)
        _MARKS[id(p)] = GradMark(weakref.ref(grad), grad._version, None if summed is None else weakref.ref(summed),
                                    version, batches, clipped, scale, names(p))


def held_batches(params: Iterable[torch.Tensor], scaler_step: bool) -> int:
    """The loader batches the gradients hold for a step (at least 1), read before it.

    Raises UnclippedGradientError where a plain backward's unclipped gradient is still there,
    and ValueError where a gradient carries a loss scale and the step does not come from
    ``GradScaler.step`` (``scaler_step``), which removes it.
    """
    held, unclipped, scaled = 1, [], []
    for p in params:
        mark = _MARKS.get(id(p))
        grad = p.grad
        if mark is None or grad is None or mark.grad() is not grad:
            continue  # (changed in place, it is the same sum: unscaled, or zeroed)
        if not mark.clipped and grad._version == mark.version:
            unclipped.append(mark.name)
        if mark.scale is not None and not scaler_step:
            scaled.append(mark.name)
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


__all__ = ["GradMark", "after_pass", "before_pass", "clear", "held_batches", "start_anew"]
