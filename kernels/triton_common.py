"""What every Triton launcher in dpgrad.kernels shares: configs, buffers, the fp32 dot.

Importing this module imports Triton. ``TRITON_INTERPRET=1`` must be set before that for the
kernels to run on CPU tensors (Triton's interpreter, used by the tests).
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .reference import same_layout

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")

# Test hook: when True, every buffer a launcher allocates starts as NaN (or -1 for integers),
# so an element a kernel forgot to write cannot pass for a correct zero.
POISON = False


def configs(candidates: Sequence[Dict[str, int]], interpret: Dict[str, int], num_warps=(4, 8)) -> List[triton.Config]:
    """``triton.Config`` objects for ``triton.autotune``.

    On a GPU every candidate is tried with every warp count. Under the interpreter only the
    ``interpret`` blocks are used: one config means no timing, and warps mean nothing there.
    """
    if INTERPRET:
        return [triton.Config(dict(interpret), num_warps=4)]
    return [triton.Config(dict(c), num_warps=w) for c in candidates for w in num_warps]


def min_block(kernel_configs: Sequence[triton.Config], name: str) -> int:
    """The smallest value a block size takes over the configs: sizes the per-tile buffers."""
    return min(c.kwargs[name] for c in kernel_configs)


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for buffers that a kernel fills completely (poisoned under POISON)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


_PLACEHOLDERS: Dict[torch.device, torch.Tensor] = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor to pass for a buffer argument a launch does not use.

    Some Triton versions' autotuners zero every ``reset_to_zero`` argument before each trial,
    ``None`` included (triton 3.6 fails on it); a real, never-read tensor works on all.
    """
    found = _PLACEHOLDERS.get(device)
    if found is None:
        found = _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return found


# (autotuned kernel, config) to launch directly inside ``configured``.
_CONFIGURED: contextvars.ContextVar[Optional[Tuple[Any, Dict[str, Any]]]] = contextvars.ContextVar(
    "dpgrad_triton_config", default=None)


@contextmanager
def configured(kernel, config: Dict[str, Any]) -> Iterator[None]:
    """Within: ``launch`` runs ``kernel`` (a ``triton.autotune`` kernel) with ``config`` (block
    sizes and ``num_warps``/``num_stages``, as the tune store keeps them), without Triton's
    config search."""
    token = _CONFIGURED.set((kernel, config))
    try:
        yield
    finally:
        _CONFIGURED.reset(token)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, for every launch of dpgrad's kernels (the one place
    to watch them): an autotuned kernel searches its configs on the first launch of a shape
    key, unless ``configured`` names one for it, which then runs directly."""
    active = _CONFIGURED.get()
    if active is not None and active[0] is kernel:
        return kernel.fn[grid](*args, **kwargs, **active[1])
    return kernel[grid](*args, **kwargs)


class Grouped(NamedTuple):
    """How a launch reads L tensors of one layout: ``table``, their addresses (int64, on their
    device), read by ``layer_pointer`` (a placeholder for one tensor, passed as itself); the
    ``strides`` they share; ``on``, the kernel's GROUPED."""

    table: torch.Tensor
    strides: Tuple[int, ...]
    on: bool


def grouped(tensors: Sequence[torch.Tensor]) -> Grouped:
    """What a launch needs to read ``tensors`` (one shape, dtype and set of strides; raises
    ValueError otherwise) where they are. On a GPU the table goes through pinned memory
    without waiting for the device."""
    first = tensors[0]
    if len(tensors) == 1:
        return Grouped(placeholder(first.device), first.stride(), False)
    if not same_layout(tensors):
        raise ValueError("a grouped launch takes tensors of one shape, dtype and strides")
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if first.device.type == "cuda":
        table = table.pin_memory().to(first.device, non_blocking=True)
    return Grouped(table, first.stride(), True)


@triton.jit
def layer_pointer(X, X_PTRS, i_l, GROUPED: tl.constexpr):
    """Layer ``i_l``'s tensor in a grouped launch (its address read from the table ``X_PTRS``,
    of tensors of X's dtype); X itself otherwise."""
    if GROUPED:
        X = tl.load(X_PTRS + i_l).to(tl.pointer_type(X.dtype.element_ty))
    return X


@triton.jit
def round_to_bf16(x):
    """fp32 values rounded to the nearest bfloat16 (ties to even), as fp32: done on the bits,
    so that it rounds alike on every GPU and under the interpreter (whose casts to bfloat16
    truncate)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_dtypes(name: str, *tensors: torch.Tensor) -> None:
    """The kernels take fp32, bf16 and fp16 (accumulating in fp32); say so for anything else."""
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"{name}: the Triton kernels take float32, bfloat16 or float16 tensors, got "
                f"{t.dtype}; use the eager backend (DPGRAD_BACKEND=eager) for other dtypes"
            )


@triton.jit
def autocast_as(x, DTYPE: tl.constexpr):
    """``x`` as ``torch.autocast`` gave it to a matmul whose other operand is of ``DTYPE``: an
    fp32 ``x`` rounded to nearest into a half ``DTYPE`` (the values autograd's weight gradient
    multiplies); any other pair unchanged. bf16 by bits: the interpreter's cast truncates."""
    if x.dtype == tl.float32 and DTYPE != tl.float32:
        if DTYPE == tl.bfloat16:
            x = round_to_bf16(x).to(tl.bfloat16)
        else:
            x = x.to(DTYPE)
    return x


@triton.jit
def dot_fp32(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` accumulated in fp32, never in TF32 (a TF32 norm is not a 1e-5 norm).

    Half-precision operands go to the tensor cores: of one dtype as they are, an fp32 one
    beside a half one as autocast cast it for the layer's matmul (``autocast_as``: an input
    of an autocast Linear is fp32, its backprops bf16). Operands of two different half dtypes,
    and every operand when UPCAST is set, are widened to fp32 in registers (the interpreter's
    half-precision dot is not usable).
    """
    a = autocast_as(a, b.dtype)
    b = autocast_as(b, a.dtype)
    if UPCAST or a.dtype != b.dtype:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
