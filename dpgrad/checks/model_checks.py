"""What a model must be for dpgrad's wrappers to take it, checked before anything is touched.

``validate`` names the trainable layers that have no per-sample gradients (BatchNorm, an
Embedding that scales its gradient by frequency); ``refuse_wrapped`` refuses a
model that already carries per-sample hooks. The checks of each forward pass are the path's
(``dpgrad.backward.backward_pass``, ``dpgrad.backward.layer_inputs``); those of the graph, the guarantee's
(``dpgrad.checks.guarantee``).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, List

import torch.nn as nn


def own_trainable(module: nn.Module) -> bool:
    """Whether ``module`` has trainable parameters of its own: not its children's, nor one it
    registers under a second name where a child holds it too (BERT's prediction head's
    ``bias``, its decoder Linear's bias: the child's uses are the parameter's)."""
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not own:
        return False
    below = {id(p) for child in module.children() for p in child.parameters()}
    return any(id(p) not in below for p in own)


def validate(module: nn.Module, *, strict: bool = False, sampled: Callable[[nn.Module], bool] = lambda m: False
             ) -> List[NotImplementedError]:
    """Trainable layers dpgrad cannot treat per sample (a trainable BatchNorm, an Embedding that
    scales its gradient by frequency). ``sampled(layer)``: whether the layer's own samplers take
    it (kept for callers; a layer torch.func takes whole may hold buffers, constants it reads:
    its recomputation reads them live, and one whose forward changes them is refused at that
    forward, ``dpgrad.backward.backward_pass``). Returns the errors, each with ``args``
    ``(message, layer_name)``; raises the first with all of them listed if ``strict``, else warns."""
    errors = []
    for name, m in module.named_modules():
        if not own_trainable(m):
            continue
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            # Even without running statistics, training mode normalises by the batch's own.
            errors.append(NotImplementedError(
                f"layer '{name}' ({type(m).__name__}) is trainable, and BatchNorm normalises each "
                "sample by statistics of the whole batch, so one sample's gradient depends on the "
                "others and per-sample gradients are undefined. Replace it by GroupNorm (e.g. "
                "nn.GroupNorm(min(32, C), C); opacus.validators.ModuleValidator.fix does this), freeze "
                "it with requires_grad_(False) and keep it in eval mode, or pass strict=False to skip it.",
                name))
        elif isinstance(m, nn.Embedding) and m.scale_grad_by_freq:
            errors.append(NotImplementedError(
                f"layer '{name}' (Embedding) has scale_grad_by_freq=True: each row's gradient is "
                "scaled by its frequency in the whole batch, so one sample's gradient depends on "
                "the others and per-sample gradients are undefined. Construct it with "
                "scale_grad_by_freq=False, freeze it with requires_grad_(False), or pass "
                "strict=False to skip it.", name))
    if strict and errors:
        raise NotImplementedError("\n".join(e.args[0] for e in errors))
    if errors:
        warnings.warn("strict=False: these layers get no per-sample gradients: "
                      + ", ".join(repr(e.args[1]) for e in errors), stacklevel=caller_level())
    return errors


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside dpgrad (the user's line that wrapped)."""
    package = os.path.dirname(__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def refuse_wrapped(m: nn.Module) -> None:
    """Raise before touching ``m`` if it, or a submodule, already carries per-sample hooks."""
    for name, sub in m.named_modules():
        if hasattr(sub, "autograd_grad_sample_hooks"):
            where = f"its submodule '{name}'" if name else "it"
            raise ValueError(
                f"this model is already wrapped for per-sample gradients ({where} carries "
                f"{type(sub).__name__} hooks). Wrap the original module once: call "
                ".to_standard_module() on the existing wrapper to get it back."
            )
