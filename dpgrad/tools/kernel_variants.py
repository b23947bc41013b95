"""The table of kernel variants ``dpgrad.tools.kernel_compile`` compiles: every way the
launchers of ``dpgrad.kernels`` call a Triton kernel (the dtypes of its tensors, autocast's
fp32-beside-half pairs included, and its constexpr flags), and the check that the table
misses no kernel or flag (``table_problems``). A kernel or a flag added to the kernels is
added here.

Not a part of the library, like ``kernel_compile``: it imports the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

# Pairs of dtypes of a Linear's inputs and backprops (its launchers take one half dtype per
# launch, beside fp32 in autocast's pairs); the first is A's, the second G's.
LINEAR_PAIRS = [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16"), ("fp32", "fp16"),
                ("bf16", "fp32"), ("fp16", "fp32")]
ONE = ["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Variant:
    """One way a launcher calls a kernel: its tensors' types (``pointers``: argument -> Triton
    type, or None for an argument passed as None) and its constexpr ``flags``. ``dots``: what
    its dots must use, "tensor cores" (half operands), "fp32" (no matrix instruction, no
    TF32) or None (it has no dot)."""

    kernel: str  # "module:attr" in dpgrad.kernels
    label: str
    pointers: Tuple[Tuple[str, Optional[str]], ...]
    flags: Tuple[Tuple[str, object], ...]
    dots: Optional[str] = None
    blocks: Tuple[Tuple[str, int], ...] = ()  # constexprs a non-autotuned launch sets (norm layers)
    num_warps: int = 4
    # As a launch on aligned, contiguous tensors specialises it: pointers and integers that
    # Triton may specialise taken as multiples of 16, each innermost stride as the constant 1.
    aligned: bool = False


def _out(a: str, g: str) -> str:
    """The dtype of a Linear's per-sample gradients: its weight's, fp32 beside autocast's pairs."""
    return "fp32" if "fp32" in (a, g) else g


def _dots(a: str, g: str) -> str:
    return "fp32" if a == g == "fp32" else "tensor cores"


def _linear_variants() -> Iterator[Variant]:
    for a, g in LINEAR_PAIRS:
        common = dict(A=a, G=g, A_PTRS="i64", G_PTRS="i64")
        for grad, bias, norm in itertools.product((False, True), repeat=3):
            if not (grad or norm):
                continue
            yield Variant("linear_grad_sample:_linear_per_sample_kernel",
                          f"{a}/{g} grad={grad:d} bias={bias:d} norm={norm:d}",
                          tuple({**common, "W": _out(a, g) if grad else None,
                                 "BIAS": _out(a, g) if grad and bias else None,
                                 "W_SQ": "fp32", "BIAS_SQ": "fp32"}.items()),
                          (("WRITE_GRAD", grad), ("WITH_BIAS", bias), ("WITH_NORM", norm), ("UPCAST", False)),
                          _dots(a, g))
        # The GEMM skeleton's kernels (gemm_tiles.py): tables of offsets, and how aligned they are.
        skeleton = dict(A=a, G=g, A_OFFS="i64", G_OFFS="i64")
        align = (("A_ALIGN", 1), ("G_ALIGN", 1))
        for bias, split in itertools.product((False, True), (False, True)):
            part = "fp32" if split else _out(a, g)  # a batch split sums fp32 partials
            yield Variant("linear_clipped_sum:_linear_clipped_sum_kernel", f"{a}/{g} bias={bias:d} partials={part}",
                          tuple({**skeleton, "COEF": "fp32", "W": part, "BIAS": part if bias else None}.items()),
                          (("WITH_BIAS", bias), ("UPCAST", False), *align), _dots(a, g))
        yield Variant("linear_norm_gram:_linear_gram_norm_kernel", f"{a}/{g}",
                      tuple({**skeleton, "SQ": "fp32"}.items()), (("UPCAST", False), *align), _dots(a, g))
        yield Variant("linear_norm_direct:_linear_direct_norm_kernel", f"{a}/{g}",
                      tuple({**skeleton, "SQ": "fp32"}.items()), (("UPCAST", False), *align), _dots(a, g))


def _token_sum_variants() -> Iterator[Variant]:
    for x in ONE:
        for write, norm in ((True, False), (False, True), (True, True)):
            yield Variant("linear_token_sum:_token_sum_kernel", f"{x} sum={write:d} norm={norm:d}",
                          (("X", x), ("X_PTRS", "i64"), ("SUM", "fp32" if write else None), ("SQ", "fp32")),
                          (("WRITE_SUM", write), ("WITH_NORM", norm)))


def _embedding_variants() -> Iterator[Variant]:
    for g in ONE:
        # (SCALED, STORE_ROWS): the norm's partials, per-sample rows, clipped rows.
        for scaled, store in ((False, False), (False, True), (True, True)):
            out = g if store else "fp32"
            yield Variant("embedding_segment_sum:_segment_sum_kernel", f"{g} scaled={scaled:d} rows={store:d}",
                          (("G", g), ("POS", "i64"), ("OFFSETS", "i64"), ("DEST", "i64"),
                           ("COEF", "fp32" if scaled else "i64"), ("OUT", out)),
                          (("SCALED", scaled), ("STORE_ROWS", store)))
    yield Variant("embedding_segment_sum:_per_sample_total_kernel", "fp32",
                  (("SEG_SQ", "fp32"), ("SAMPLE_OFFSETS", "i64"), ("OUT", "fp32")), (), blocks=(("BS", 256),))


def _experts_variants() -> Iterator[Variant]:
    """experts_segments.py: norms, per-sample gradients and clipped sums of (E, p, q) weights and
    their biases. Factors of one dtype (a half beside fp32 is widened to fp32 by the launchers);
    stores in that dtype or in fp32 (an fp32 weight beside half factors)."""
    for x in ONE:
        outs = [x] if x == "fp32" else [x, "fp32"]
        operands = (("G", x), ("A", x), ("ORDER", "i32"))
        segments = (*operands, ("KEYS", "i32"), ("OFFSETS", "i32"))
        flags = (("UPCAST", False), ("A_ALIGN", 1), ("G_ALIGN", 1))
        yield Variant("experts_segments:_experts_segment_kernel", f"{x} norm",
                      (*segments, ("W", "fp32"), ("SQ", "fp32")), (("STORE", False), *flags), _dots(x, x))
        for out in outs:
            yield Variant("experts_segments:_experts_segment_kernel", f"{x} grad={out}",
                          (*segments, ("W", out), ("SQ", "fp32")), (("STORE", True), *flags), _dots(x, x))
            yield Variant("experts_segments:_experts_clipped_sum_kernel", f"{x} out={out}",
                          (*operands, ("COEF", "fp32"), ("RUNS", "i32"), ("RUN_OFFSETS", "i32"), ("W", out)),
                          flags, _dots(x, x))
        # A bias's (SCALED, STORE): the norm's partials, per-sample rows, clipped rows.
        for scaled, store in ((False, False), (False, True), (True, True)):
            for out in (outs if store else ["fp32"]):
                yield Variant("experts_segments:_experts_rows_kernel",
                              f"{x} scaled={scaled:d} rows={out if store else 0}",
                              (("X", x), ("ORDER", "i32"), ("KEYS", "i32"), ("OFFSETS", "i32"), ("COEF", "fp32"),
                               ("OUT", out), ("SQ", "fp32")), (("SCALED", scaled), ("STORE", store)))


def _norm_layer_variants() -> Iterator[Variant]:
    from dpgrad.kernels.norm_layer_grad_sample import MAX_D, blocks

    # (X, G): one dtype, or autocast's (a LayerNorm run in fp32 after a bf16 layer).
    pairs = [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32"),
             ("fp32", "bf16"), ("fp32", "fp16")]
    sizes = sorted({blocks(1 << k) for k in range(MAX_D.bit_length())})
    for (x, g), (weight, bias) in itertools.product(pairs, ((True, True), (True, False), (False, True))):
        for BD, BT, warps in sizes:
            yield Variant("norm_layer_grad_sample:_norm_layer_grad_sample_kernel",
                          f"{x}/{g} weight={weight:d} bias={bias:d} BD={BD}",
                          (("X", x), ("G", g), ("X_PTRS", "i64"), ("G_PTRS", "i64"), ("GW", "fp32"), ("GB", "fp32")),
                          (("WITH_WEIGHT", weight), ("WITH_BIAS", bias)), blocks=(("BD", BD), ("BT", BT)),
                          num_warps=warps)


def _group_norm_variants() -> Iterator[Variant]:
    from dpgrad.kernels.group_norm_grad_sample import MAX_GROUP_CHANNELS, blocks

    # (X, G): one dtype, or autocast's (GroupNorm runs in fp32 after a half convolution).
    pairs = [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32")]
    sizes = sorted({blocks(1 << k) for k in range(MAX_GROUP_CHANNELS.bit_length())})
    for (x, g), (weight, bias) in itertools.product(pairs, ((True, True), (True, False), (False, True))):
        for BC, BS, warps in sizes:
            yield Variant("group_norm_grad_sample:_group_norm_grad_sample_kernel",
                          f"{x}/{g} weight={weight:d} bias={bias:d} BC={BC}",
                          (("X", x), ("G", g), ("X_PTRS", "i64"), ("G_PTRS", "i64"), ("GW", "fp32"), ("GB", "fp32")),
                          (("WITH_WEIGHT", weight), ("WITH_BIAS", bias)), blocks=(("BC", BC), ("BS", BS)),
                          num_warps=warps)


def variants() -> List[Variant]:
    """Every (kernel, variant) the launchers of ``dpgrad.kernels`` make."""
    # dict: a variant two launchers make alike (an fp32 layer's split and unsplit sums) once.
    plain = list(dict.fromkeys([*_linear_variants(), *_token_sum_variants(), *_embedding_variants(),
                                *_experts_variants(), *_norm_layer_variants(), *_group_norm_variants()]))
    # And each as a launch on aligned, contiguous tensors compiles it (the common case on a GPU),
    # the skeleton's tables of offsets aligned to 16 bytes too (``triton_common.relative``).
    return plain + [dataclasses.replace(v, label=v.label + " aligned", aligned=True, flags=_aligned(v))
                    for v in plain if v.kernel != "embedding_segment_sum:_per_sample_total_kernel"]


def _aligned(variant: Variant) -> Tuple[Tuple[str, object], ...]:
    """A variant's flags on aligned tensors: each ``X_ALIGN`` the elements of 16 bytes of X."""
    from dpgrad.kernels.triton_common import ELEMENT_BYTES

    pointers = dict(variant.pointers)
    return tuple((k, 16 // ELEMENT_BYTES[pointers[k[:-6]]] if k.endswith("_ALIGN") else v) for k, v in variant.flags)


def table_problems() -> List[str]:
    """Where ``variants`` would miss a kernel or a flag: every ``*_kernel`` of the kernel
    modules must have variants, and each variant must set exactly its kernel's constexprs
    other than block sizes (those of its configs), and give a type to each of its pointers."""
    import importlib
    import pkgutil

    import dpgrad.kernels

    found, problems = {}, []
    for module in sorted(m.name for m in pkgutil.iter_modules(dpgrad.kernels.__path__)):
        name = f"dpgrad.kernels.{module}"
        for attr, obj in vars(importlib.import_module(name)).items():
            fn = jit_function(obj)
            if attr.endswith("_kernel") and hasattr(fn, "params") and fn.__module__ == name:
                found[f"{module}:{attr}"] = obj
    by_kernel: Dict[str, List[Variant]] = {}
    for variant in variants():
        by_kernel.setdefault(variant.kernel, []).append(variant)
    for name in sorted(set(found) - set(by_kernel)):
        problems.append(f"{name} has no variants: add its launches to kernel_variants' table")
    for name, vs in sorted(by_kernel.items()):
        if name not in found:
            problems.append(f"{name}: variants of a kernel that does not exist")
            continue
        kernel = found[name]
        if hasattr(kernel, "configs"):
            from dpgrad.kernels.triton_common import PRUNE_RULES, config_name

            names = {config_name({**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages})
                     for c in kernel.configs}
            for rule, _ in PRUNE_RULES.get(jit_function(kernel).__name__, ()):
                for family, kept in getattr(rule, "kept", {}).items():
                    for unknown in sorted(kept - names):
                        problems.append(f"{name}: its prune rule keeps {unknown!r} for {family}, "
                                        "not one of its configs")
        params = jit_function(kernel).params
        blocks = set(kernel.configs[0].kwargs) if hasattr(kernel, "configs") else set()
        constexprs = {p.name for p in params if p.is_constexpr} - blocks
        for v in vs:
            flags = set(dict(v.flags)) | set(dict(v.blocks))
            if flags != constexprs:
                problems.append(f"{name} [{v.label}]: sets constexprs {sorted(flags)}, the kernel has "
                                f"{sorted(constexprs)}")
                break
    return problems


def kernel_object(name: str):
    import importlib

    module, attr = name.split(":")
    return getattr(importlib.import_module(f"dpgrad.kernels.{module}"), attr)


def jit_function(kernel):
    """The ``triton.JITFunction`` of a kernel (autotuned or not)."""
    return kernel.fn if hasattr(kernel, "configs") else kernel
