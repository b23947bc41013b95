"""Which implementation of the kernels runs for a given set of tensors.

- ``triton``: the Triton kernels (``dpgrad.kernels.triton_ops``), for CUDA tensors when
  Triton can be imported;
- ``eager``: the PyTorch reference (``dpgrad.kernels.reference``) for everything else.

``DPGRAD_BACKEND=eager|triton`` forces one (``auto``, the default, chooses as above). Forced
``triton`` on CPU tensors needs Triton's interpreter (``TRITON_INTERPRET=1``, set before
anything imports Triton): slow, and meant for testing. float64 tensors always take the eager
path: the kernels accumulate in fp32, which would throw away the precision asked for.
Both modules have the same functions, so callers write ``ops_for(A, G).linear_...(A, G)``.

A Triton kernel that fails to compile or run is never fatal under ``auto``: the work is done
again by the eager function of the same name, with one warning naming the layer, the shapes
and the error, and that work takes the eager path for those shapes from then on (the
autotuner's candidates: ``Tuner.run``, which also remembers it in the tune store; other
kernels: ``guarded``, for the process). Under a forced ``triton`` the failure is raised,
naming the layer.
"""

from __future__ import annotations

import importlib
import os
import warnings
import weakref
from types import ModuleType
from typing import Callable, Dict, TypeVar

import torch

from dpgrad.kernels import reference

ENV_VAR = "DPGRAD_BACKEND"
CHOICES = ("auto", "eager", "triton")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_triton_ops = None
_triton_error = None


def requested() -> str:
    """The backend asked for by ``DPGRAD_BACKEND`` ("auto" when unset)."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r} is not a backend: use one of {', '.join(CHOICES)}")
    return value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_ops() -> ModuleType:
    """The Triton launchers; raises ImportError (with the reason) when Triton is unusable."""
    global _triton_ops, _triton_error
    if _triton_ops is None and _triton_error is None:
        try:
            _triton_ops = importlib.import_module("dpgrad.kernels.triton_ops")
        except Exception as exc:  # a missing or broken Triton install
            _triton_error = exc
    if _triton_ops is None:
        raise ImportError(f"dpgrad's Triton kernels cannot be loaded: {_triton_error!r}; pip install 'dpgrad[triton]'")
    return _triton_ops


def ops_for(*tensors: torch.Tensor) -> ModuleType:
    """The kernel module (``triton_ops`` or ``reference``) that should run on these tensors."""
    mode = requested()
    floats = [t for t in tensors if t.is_floating_point()]
    if mode == "eager" or any(t.dtype not in TRITON_DTYPES for t in floats):
        return reference
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "auto":
        if not on_cuda:
            return reference
        try:
            return triton_ops()
        except ImportError as exc:
            warnings.warn(f"{exc}; falling back to the eager kernels", RuntimeWarning, stacklevel=2)
            return reference
    if not on_cuda and not interpreting():
        raise RuntimeError(
            f"{ENV_VAR}=triton but the tensors are on {tensors[0].device}: Triton kernels run on "
            "CUDA tensors, or on CPU under TRITON_INTERPRET=1 (slow, for testing); unset "
            f"{ENV_VAR} to use the eager kernels"
        )
    return triton_ops()


def name_for(*tensors: torch.Tensor) -> str:
    """"triton" or "eager": what ``ops_for`` picks for these tensors."""
    return ops_for(*tensors).NAME


# The names the wrappers give the layers they hook, for messages about a layer.
_LAYER_NAMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# (what, shapes and dtypes) of untuned work whose Triton kernel failed in this process.
_FAILED: set = set()
_R = TypeVar("_R")


def name_layers(names: Dict[object, str]) -> None:
    """Record ``{layer: name}`` (the names a wrapper uses) for messages about those layers."""
    for layer, name in names.items():
        _LAYER_NAMES[layer] = name


def layer_name(layer) -> str:
    """"'transformer.h.0.attn.c_attn' (Conv1D)", or the class alone for a layer no wrapper named."""
    if layer is None:
        return "a layer"
    name = _LAYER_NAMES.get(layer)
    return f"'{name}' ({type(layer).__name__})" if name is not None else type(layer).__name__


def describe(tensors) -> str:
    """Shapes and dtypes of the tensors among ``tensors``, for messages."""
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors
                     if isinstance(t, torch.Tensor))


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: a compiler's error can run to pages."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def of_layer(layer) -> str:
    """" of layer 'name' (Type)" for messages, or nothing without a layer."""
    return "" if layer is None else f" of layer {layer_name(layer)}"


def kernel_failed(what: str, layer, where: str, exc: BaseException, instead: str) -> None:
    """A Triton kernel doing ``what`` for ``layer`` on ``where`` (its shapes) raised ``exc``:
    raise under a forced ``triton`` backend, else warn that ``instead`` does the work."""
    error, of = first_line(exc), of_layer(layer)
    if requested() == "triton":
        raise RuntimeError(
            f"the Triton kernel for {what}{of} failed on {where}: {error}. "
            f"{ENV_VAR}=triton allows no fallback; unset it to fall back to the eager kernels"
        ) from exc
    warnings.warn(f"dpgrad: the Triton kernel for {what}{of} failed on {where} ({error}); {instead}",
                  RuntimeWarning, stacklevel=3)


def guarded(what: str, layer, tensors: tuple, work: Callable[[ModuleType], _R]) -> _R:
    """``work(ops_for(*tensors))`` for work the autotuner does not choose for: if the Triton
    kernel fails, the eager function does it (``kernel_failed``), and does it for these shapes
    and dtypes from then on in this process."""
    ops = ops_for(*tensors)
    if ops is reference:
        return work(reference)
    key = (what, *((t.shape, t.dtype) for t in tensors))
    if key in _FAILED and requested() != "triton":
        return work(reference)
    try:
        return work(ops)
    except Exception as exc:
        kernel_failed(what, layer, describe(tensors), exc, "the eager kernel does it for these shapes from now on")
        _FAILED.add(key)
        return work(reference)
