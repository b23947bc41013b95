"""What every Triton launcher in dpgrad.kernels shares: configs, buffers, the fp32 dot.

Importing this module imports Triton. ``TRITON_INTERPRET=1`` must be set before that for the
kernels to run on CPU tensors (Triton's interpreter, used by the tests).
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

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


_PLACEHOLDERS: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A one-element tensor to pass for a buffer argument a launch does not use (fp32), or
    for the table of addresses of a launch that is not grouped (int64).

    Some Triton versions' autotuners zero every ``reset_to_zero`` argument before each trial,
    ``None`` included (triton 3.6 fails on it); a real, never-read tensor works on all.
    """
    found = _PLACEHOLDERS.get((device, dtype))
    if found is None:
        found = _PLACEHOLDERS[(device, dtype)] = torch.zeros(1, dtype=dtype, device=device)
    return found


# Configs a kernel may not run with (they spill registers there, found by compiling every
# kernel for the targets: tests/test_kernel_compile.py): kernel -> [(rule, why)], a rule a
# function of (config, capability, pointers) true where the config is kept from the launch.
PRUNE_RULES: Dict[str, List[Tuple[Callable[[Dict[str, Any], int, Dict[str, Optional[str]]], bool], str]]] = {}


def config_name(config: Dict[str, Any]) -> str:
    """A config as the prune rules name it: block sizes in order, warps, stages if not 3 (``"BT=64 w8 s4"``)."""
    blocks = " ".join(f"{k}={v}" for k, v in sorted(config.items()) if k not in ("num_warps", "num_stages"))
    stages = config.get("num_stages", 3)
    return f"{blocks} w{config['num_warps']}" + (f" s{stages}" if stages not in (None, 3) else "")


def linear_family(pointers: Dict[str, Optional[str]]) -> str:
    """A Linear launch's dtypes as a family: "fp32" (both), "half" (one half dtype) or
    "autocast" (fp32 beside a half dtype)."""
    a, g = pointers.get("A"), pointers.get("G")
    return "fp32" if a == g == "fp32" else "half" if a == g else "autocast"


def one_family(name: str) -> Callable[[Dict[str, Optional[str]]], str]:
    """The family of a launch that reads one tensor ``name`` of a floating dtype: "fp32" or "half"."""
    return lambda pointers: "fp32" if pointers.get(name) == "fp32" else "half"


# Why the configs that ``keep_only`` leaves out are pruned.
SPILLS = "spills registers on a target with a supported Triton (3.6, 3.9): tests/test_kernel_compile.py"


def keep_only(kernel: str, family: Callable[[Dict[str, Optional[str]]], str], kept: Dict[str, Sequence[str]],
              why: str = SPILLS) -> None:
    """Adds a rule to ``PRUNE_RULES``: ``kernel`` runs, on tensors of a family listed in
    ``kept``, only with the configs listed there (``config_name``); the rest are pruned for
    ``why``."""
    allowed = {fam: frozenset(names) for fam, names in kept.items()}

    def rule(config, capability, pointers):
        names = allowed.get(family(pointers))
        return names is not None and config_name(config) not in names

    rule.kept = allowed  # for the compile table's check that each name is one of the kernel's configs
    PRUNE_RULES.setdefault(kernel, []).append((rule, why))


def pruned(kernel: str, config: Dict[str, Any], capability: int, pointers: Dict[str, Optional[str]]) -> Optional[str]:
    """Why ``kernel`` (its function's name) may not run with ``config`` (block sizes,
    ``num_warps``) on a GPU of compute ``capability`` (80 for sm_80...) with tensors of these
    Triton types (argument -> "fp32", "bf16", ...; None for an argument passed as None), or
    None where it may (``PRUNE_RULES``; capability 0, the interpreter, prunes nothing)."""
    if not capability:  # Triton's interpreter: no registers to spill
        return None
    for rule, why in PRUNE_RULES.get(kernel, ()):
        if rule(config, capability, pointers):
            return why
    return None


_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32"}
_CAPABILITY: Dict[int, int] = {}


def launch_types(named: Dict[str, Any]) -> Tuple[int, Dict[str, Optional[str]]]:
    """The compute capability of the launch's GPU (0 on a CPU) and its tensors' Triton types."""
    pointers: Dict[str, Optional[str]] = {}
    device = None
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            pointers[name] = _TYPES.get(value.dtype, str(value.dtype))
            device = device or (value.device if value.is_cuda else None)
        elif value is None:
            pointers[name] = None
    if device is None:
        return 0, pointers
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        major, minor = torch.cuda.get_device_capability(index)
        _CAPABILITY[index] = 10 * major + minor
    return _CAPABILITY[index], pointers


def _config_dict(config) -> Dict[str, Any]:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def prune_for(kernel: str) -> Dict[str, Callable]:
    """``triton.autotune``'s ``prune_configs_by`` for ``kernel``: the configs ``pruned`` keeps
    for the launch's GPU and tensors (all of them where it would keep none)."""
    def early_config_prune(configs, named_args, **kwargs):
        capability, pointers = launch_facts({**named_args, **kwargs})
        kept = [c for c in configs if pruned(kernel, _config_dict(c), capability, pointers) is None]
        return kept or list(configs)

    return {"early_config_prune": early_config_prune}


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


# CUDA's limits on a grid: 2^31 - 1 blocks along x, 65535 along y and z.
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def checked_grid(name: str, grid):
    """``grid`` (blocks, or a function of a config's blocks to them) raising ValueError where
    it passes CUDA's limits, naming the kernel, instead of a launch that fails or does less."""
    def check(blocks):
        blocks = tuple(blocks)
        for n, limit, axis in zip(blocks, GRID_LIMITS, "xyz"):
            if n > limit:
                raise ValueError(f"{name}: a grid of {blocks} blocks, {n} along {axis}, over CUDA's limit of {limit}: "
                                 "the shapes are too large for this kernel; use the eager backend "
                                 "(DPGRAD_BACKEND=eager) for them")
        return blocks

    return (lambda meta: check(grid(meta))) if callable(grid) else check(grid)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, for every launch of dpgrad's kernels (the one place
    to watch them): an autotuned kernel searches its configs on the first launch of a shape
    key, unless ``configured`` names one for it, which then runs directly. The grid is
    checked against CUDA's limits (``checked_grid``)."""
    fn = kernel.fn if hasattr(kernel, "configs") else kernel
    grid = checked_grid(fn.__name__, grid)
    active = _CONFIGURED.get()
    if active is not None and active[0] is kernel:
        # A config stored before its kernel's rules kept it from this GPU is not run.
        capability, pointers = launch_types({**dict(zip(fn.arg_names, args)), **kwargs})
        if pruned(fn.__name__, active[1], capability, pointers) is None:
            return kernel.fn[grid](*args, **kwargs, **active[1])
    return kernel[grid](*args, **kwargs)


class Grouped(NamedTuple):
    """How a launch reads L tensors of one layout: ``table``, their addresses (int64, on their
    device), read by ``layer_pointer`` (an int64 placeholder for one tensor, passed as
    itself); the ``strides`` they share; ``on``, the kernel's ``grouped`` argument (1 or 0: a
    runtime flag, so one compiled kernel serves both)."""

    table: torch.Tensor
    strides: Tuple[int, ...]
    on: int


def grouped(tensors: Sequence[torch.Tensor]) -> Grouped:
    """What a launch needs to read ``tensors`` (one shape, dtype and set of strides; raises
    ValueError otherwise) where they are. On a GPU the table goes through pinned memory
    without waiting for the device."""
    first = tensors[0]
    if len(tensors) == 1:
        return Grouped(placeholder(first.device, torch.int64), first.stride(), 0)
    if not same_layout(tensors):
        raise ValueError("a grouped launch takes tensors of one shape, dtype and strides")
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if first.device.type == "cuda":
        table = table.pin_memory().to(first.device, non_blocking=True)
    return Grouped(table, first.stride(), 1)


@triton.jit
def layer_pointer(X, X_PTRS, i_l, grouped):
    """Layer ``i_l``'s tensor in a grouped launch (``grouped`` 1: its address read from the
    int64 table ``X_PTRS``, of tensors of X's dtype); X itself otherwise."""
    if grouped:
        X = tl.load(X_PTRS + i_l).to(tl.pointer_type(X.dtype.element_ty))
    return X


# A kernel's ``round_to`` argument: fp32 values rounded to fp16 (1) or bf16 (2) in registers, as
# the dtype's cast of them would be; 0: kept as they are.
ROUND_TO = {torch.float16: 1, torch.bfloat16: 2}


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
    """The kernels take fp32, bf16 and fp16 (accumulating in fp32), one half dtype per launch
    (beside fp32, as autocast makes them); say so for anything else."""
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"{name}: the Triton kernels take float32, bfloat16 or float16 tensors, got "
                f"{t.dtype}; use the eager backend (DPGRAD_BACKEND=eager) for other dtypes"
            )
    halves = {t.dtype for t in tensors if t.dtype != torch.float32}
    if len(halves) > 1:
        raise TypeError(f"{name}: the Triton kernels take one half dtype per launch (beside float32), got "
                        f"{sorted(map(str, halves))}; use the eager backend (DPGRAD_BACKEND=eager) for such a mix")


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


# At the end of the module: a line added above the kernels' helpers changes their line numbers,
# and with them Triton's cache keys of every kernel (and the compile test's cache).
def _patch_language_once_per_launch() -> None:
    """Triton's interpreter (3.6 to 3.9) patches ``triton.language`` at the start of a launch
    and again at every call of a ``@triton.jit`` helper inside it, each time walking the
    language modules' members (``inspect.getmembers``): over half of a Linear kernel's launch
    on CPU tensors, for patches the launch already holds (and that helper calls then never
    undo). A helper called while the launch's patches hold takes them as they are; the launch
    itself patches, and undoes, as before."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope") or getattr(original, "dpgrad_once", False):
        return  # another interpreter than 3.6-3.9's: left as it is

    def patch_lang(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return interpreter._LangPatchScope()
        return original(fn)

    patch_lang.dpgrad_once = True
    interpreter._patch_lang = patch_lang


if INTERPRET:
    _patch_language_once_per_launch()


# What follows is added at the end of the module, below the kernels' helpers (see above).
def launch_facts(named: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    """``launch_types``, with the GEMM skeleton's alignment flags (``A_ALIGN``...: constexprs
    of its kernels, from ``relative``), which its families read (``skeleton_family``)."""
    capability, pointers = launch_types(named)
    pointers.update({k: v for k, v in named.items() if k.endswith("_ALIGN")})
    return capability, pointers


def parse_config(name: str) -> Dict[str, int]:
    """The config ``config_name`` names: block sizes, ``num_warps`` and ``num_stages``."""
    out: Dict[str, int] = {"num_stages": 3}
    for part in name.split():
        if "=" in part:
            key, value = part.split("=")
            out[key] = int(value)
        elif part[0] in "ws" and part[1:].isdigit():
            out["num_warps" if part[0] == "w" else "num_stages"] = int(part[1:])
        else:
            raise ValueError(f"{name!r}: {part!r} is not a block size, w<warps> or s<stages>")
    return out


def family_configs(kernel: str, family: Callable[[Dict[str, Optional[str]]], str],
                   per_family: Dict[str, Sequence[str]], interpret: Dict[str, int]) -> List[triton.Config]:
    """A kernel's configs named per family of launch dtypes (``config_name``, ``family``: e.g.
    ``linear_family``): on a GPU the autotuner tries, for a launch, the configs of its family
    only (``keep_only`` prunes the others); under the interpreter only ``interpret``."""
    names = list(dict.fromkeys(n for listed in per_family.values() for n in listed))
    keep_only(kernel, family, per_family, why="tried only on the launches of another dtype family")
    if INTERPRET:
        return [triton.Config(dict(interpret), num_warps=4)]
    out = []
    for name in names:
        c = parse_config(name)
        warps, stages = c.pop("num_warps"), c.pop("num_stages")
        out.append(triton.Config(c, num_warps=warps, num_stages=stages))
    return out


_SMS: Dict[int, int] = {}


def persistent_programs(device: torch.device, items: int) -> int:
    """The programs of a persistent grid walking ``items`` work items: one per streaming
    multiprocessor of the GPU (fewer items: one each); a few under the interpreter, so that
    its programs walk several items as on a GPU."""
    if device.type != "cuda":
        return max(1, min(items, 3))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(items, _SMS[index]))


# Bytes per element of the Triton types the kernels take.
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def skeleton_family(pointers: Dict[str, Any]) -> str:
    """A launch on the GEMM skeleton (gemm_tiles.py) as a family: ``linear_family``, with
    " unaligned" where A's or G's rows do not all start on 16 bytes (``A_ALIGN``, ``G_ALIGN``:
    ``relative``'s alignment in elements): their loads are neither vectorised nor asynchronous,
    and their offsets take the registers wide tiles need."""
    aligned = all(pointers.get(f"{x}_ALIGN", 1) * ELEMENT_BYTES.get(pointers.get(x) or "", 0) >= 16 for x in "AG")
    return linear_family(pointers) + ("" if aligned else " unaligned")


class Relative(NamedTuple):
    """How a launch built on the GEMM skeleton (gemm_tiles.py) reads L tensors of one layout:
    ``table``, each tensor's offset from the first in elements (int64, on their device; a
    placeholder for one tensor), read by ``gemm_tiles.layer_base``; the ``strides`` they share;
    ``on``, the kernel's ``grouped`` flag; ``align``, the largest power of two up to 16 bytes
    (in elements) that divides every offset, the first tensor's address and the sample and
    token strides, so that every row a tile reads starts on it. The kernel may assume it (a
    constexpr): pointers derived from the kernel's own argument keep the alignment Triton
    specialises it on, and with it the asynchronous copies a pointer read from a table loses;
    and the autotuner tries narrower tiles where it is under 16 bytes (``skeleton_family``);
    ``tensors``, the tensors themselves, held with their offsets until the launch."""

    table: torch.Tensor
    strides: Tuple[int, ...]
    on: int
    align: int
    tensors: Tuple[torch.Tensor, ...]


def relative(tensors: Sequence[torch.Tensor]) -> Relative:
    """What a skeleton launch needs to read ``tensors`` (one shape, dtype and set of strides;
    raises ValueError otherwise) where they are. On a GPU the table goes through pinned memory
    without waiting for the device."""
    first = tensors[0]
    size = first.element_size()
    widest = max(1, 16 // size)

    def aligned(values):
        align = widest
        while align > 1 and any(v % align for v in values):
            align //= 2
        return align

    rows = aligned([first.data_ptr() // size if first.data_ptr() % size == 0 else 1, *first.stride()[:2]])
    if len(tensors) == 1:
        return Relative(placeholder(first.device, torch.int64), first.stride(), 0, rows, tuple(tensors))
    if not same_layout(tensors):
        raise ValueError("a grouped launch takes tensors of one shape, dtype and strides")
    offsets = []
    for t in tensors:
        diff = t.data_ptr() - first.data_ptr()
        if diff % size:
            raise ValueError("a grouped launch takes tensors whose addresses differ by whole elements")
        offsets.append(diff // size)
    align = min(rows, aligned(offsets))
    table = torch.tensor(offsets, dtype=torch.int64)
    if first.device.type == "cuda":
        table = table.pin_memory().to(first.device, non_blocking=True)
    return Relative(table, first.stride(), 1, align, tuple(tensors))
