"""Which implementation of the kernels runs for a given set of tensors.

- ``triton``: the Triton kernels (``dpgrad.kernels.triton_ops``), for CUDA tensors when
  Triton can be imported;
- ``eager``: the PyTorch reference (``dpgrad.kernels.reference``) for everything else.

``DPGRAD_BACKEND=eager|triton`` forces one (``auto``, the default, chooses as above). Forced
``triton`` on CPU tensors needs Triton's interpreter (``TRITON_INTERPRET=1``, set before
anything imports Triton): slow, and meant for testing. float64 tensors always take the eager
path: the kernels accumulate in fp32, which would throw away the precision asked for.
Both modules have the same functions, so callers write ``ops_for(A, G).linear_...(A, G)``.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

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
