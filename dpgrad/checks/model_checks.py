"""What a model must be for dpgrad's wrappers to take it, checked before anything is touched.

``validate`` names the trainable layers that have no per-sample gradients (BatchNorm, an
Embedding that scales its gradient by frequency); ``refuse_wrapped`` refuses a
model that already carries per-sample hooks. The checks of each forward pass are the path's
(``dpgrad.backward.backward_pass``, ``dpgrad.backward.layer_inputs``); those of the graph, the guarantee's
(``dpgrad.checks.guarantee``).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import warnings
from typing import Callable, List, Optional, Tuple

import torch.nn as nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm


def own_trainable(module: nn.Module) -> bool:
    """Whether ``module`` has trainable parameters of its own: not its children's, nor one it
    registers under a second name where a child holds it too (BERT's prediction head's
    ``bias``, its decoder Linear's bias: the child's uses are the parameter's)."""
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not own:
        return False
    below = {id(p) for child in module.children() for p in child.parameters()}
    return any(id(p) not in below for p in own)


# ``self.<child>.weight`` (or ``.bias``) read in a forward for its value, not its dtype or shape.
_CHILD_PARAMETER = re.compile(r"self\.(\w+)\.(?:weight|bias)\b(?!\s*\.\s*(?:dtype|device|shape|size|ndim|dim|data|"
                              r"requires_grad|numel|is_|to\b))")


# ``self.<child>.<method>(`` : a method of a child other than its forward; ``self.<child>(``.
_CHILD_METHOD = re.compile(r"self\.(\w+)\.(\w+)\s*\(")
_CHILD_CALL = re.compile(r"self\.(\w+)\s*\(")


@functools.lru_cache(maxsize=None)
def _children_read(cls: type) -> Tuple[frozenset, frozenset]:
    """The attribute names whose ``weight`` or ``bias`` the class's forward reads directly, and
    the (attribute, method) pairs it calls, for children its forward never calls (a child also
    called, as Bloom's MLP calls its projection but for one setting, is the child's layer)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return frozenset(), frozenset()
    called = set(_CHILD_CALL.findall(source))
    return (frozenset(n for n in _CHILD_PARAMETER.findall(source) if n not in called),
            frozenset((n, m) for n, m in _CHILD_METHOD.findall(source) if n not in called))


def uses_child_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s forward computes with a child layer's trainable weight or bias
    itself rather than calling the child (``causal_conv1d_fn(x, self.conv.weight, ...)``, as
    short convolutions of hybrid models do; ``F.linear(x, self.classifier.weight)``), or calls
    a method of the child's own class other than its forward (Gemma 3n's
    ``self.altup.correct(...)``), or holds trainable parameters in an ``nn.ParameterList`` or
    ``nn.ParameterDict``, which cannot be called (Reformer's axial position embeddings): such a
    module is one layer with its children, taken whole by torch.func."""
    children = module._modules
    if any(isinstance(c, (nn.ParameterList, nn.ParameterDict)) and any(p.requires_grad for p in c.parameters())
           for c in children.values()):
        return True
    names, methods = _children_read(type(module))
    read = {n for n in names if n in children}
    read |= {n for n, m in methods if n in children and m != "forward" and _own_method(children[n], m)}
    return any(children[n] is not None and any(p.requires_grad for p in children[n].parameters(recurse=False))
               for n in read)


def _own_method(child: Optional[nn.Module], name: str) -> bool:
    """Whether ``name`` is a method the child's class defines beyond ``nn.Module``'s."""
    return child is not None and not hasattr(nn.Module, name) and callable(getattr(type(child), name, None))


# How a refusal of a trainable layer ends: the other ways out.
_OR_FREEZE = "freeze it with requires_grad_(False), or pass strict=False to skip it."


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
                "scale_grad_by_freq=False, " + _OR_FREEZE, name))
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            errors.append(NotImplementedError(
                f"layer '{name}' ({type(m).__name__}) has sparse=True: its gradient is a sparse tensor, which "
                "per-sample clipping does not take, and the Gaussian noise of a DP step reaches every row anyway. "
                "Construct it with sparse=False (and an optimizer for dense gradients), " + _OR_FREEZE, name))
        elif isinstance(m, nn.RNNBase):
            errors.append(NotImplementedError(
                f"layer '{name}' ({type(m).__name__}) is torch's fused recurrent layer (its weights flattened for one "
                "kernel over the whole batch), which dpgrad's torch.func recomputation cannot run one sample at a "
                "time. Use Opacus's drop-in "
                f"opacus.layers.DP{type(m).__name__} (built from Linear layers, which dpgrad clips per sample; with "
                "batch_first=True in a batch-first model), " + _OR_FREEZE, name))
        elif (hook := _computed_weight(m)) is not None:
            function = "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
            errors.append(NotImplementedError(
                f"layer '{name}' ({type(m).__name__}) has its {hook.name} from torch.nn.utils.{function}, "
                f"computed by a forward pre-hook into a tensor that is no parameter, from which per-sample "
                f"gradients of its parameters cannot be taken. Use the parametrization instead, "
                f"torch.nn.utils.parametrizations.{function} (torch.nn.utils.remove_{function}(layer) first), "
                "which dpgrad takes per sample (spectral_norm in eval mode, where it changes no buffer); "
                + _OR_FREEZE, name))
    if strict and errors:
        raise NotImplementedError("\n".join(e.args[0] for e in errors))
    if errors:
        warnings.warn("strict=False: these layers get no per-sample gradients: "
                      + ", ".join(repr(e.args[1]) for e in errors), stacklevel=caller_level())
    return errors


def _computed_weight(m: nn.Module):
    """The forward pre-hook of ``torch.nn.utils.weight_norm`` or ``spectral_norm`` on ``m``, or None."""
    return next((h for h in m._forward_pre_hooks.values() if isinstance(h, (WeightNorm, SpectralNorm))), None)


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
