"""Every Triton kernel of ``dpgrad.kernels`` compiled for real GPU targets, no GPU needed.

    python -m dpgrad.tools.kernel_compile [--target sm_80 sm_90 ...] [--jobs N]
        [--cache tests/data/kernel_compiles.json] [--update] [--report]

Triton's compiler builds for a target without its GPU: ``triton.compile`` gives the PTX and,
through the ``ptxas`` its wheel ships, the cubin, whose resource usage (registers, stack,
shared memory) ``cuobjdump`` reads. Each kernel is compiled in every variant its launchers
pass (the table of ``kernel_variants``: the dtypes of its tensors, autocast's fp32-beside-half
pairs included, and its constexpr flags), with every config its autotuner may choose on the
target (the configs ``triton_common.pruned`` keeps; those it prunes are listed with the
reason), for each target. For each compile: whether it compiled, registers, stack (spilled
registers), shared memory against the target's per-block limit, whether its dots use the
tensor cores (wgmma, mma, tcgen05) and whether any uses TF32, and its asynchronous copies to
shared memory (``LDGSTS``: cp.async; ``UTMALDG``: TMA), read in the SASS, which the GEMM
skeleton's kernels must use on aligned tensors. Offsets inside a tile may be 32-bit: each
launcher checks from the sizes that they cannot overflow (``gemm_tiles.check_offsets``).

A results cache keyed by the kernels' source (and Triton's version, the target, the variant
and the config) spares the compiles whose answer is known: ``--update`` writes the new ones
into it. ``tests/test_kernel_compile.py`` checks what this finds, compiling only what the
cache does not hold.

Not a part of the library: it imports Triton's compiler internals (``triton.compiler``), and
runs in a process of its own without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dpgrad.tools.kernel_variants import Variant, jit_function, kernel_object, table_problems, variants

TARGETS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
# The most shared memory one block may use (bytes): A100, H100, B200.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
CACHE = Path(__file__).resolve().parents[2] / "tests" / "data" / "kernel_compiles.json"
TENSOR_CORES = re.compile(r"\b(wgmma|mma\.sync|tcgen05\.mma)")
ASYNC_LOADS = re.compile(r"\b(LDGSTS|UTMALDG)\b")

# The innermost (feature) stride of each tensor the kernels read: 1 for a contiguous tensor.
UNIT_STRIDES = ("s_ad", "s_gp", "s_gd", "s_xd", "s_n", "s_xs", "s_gs")


def launch_configs(variant: Variant, capability: int) -> List[Tuple[Dict[str, object], Optional[str]]]:
    """``(config, None)`` for each config the kernel may run with on ``capability`` for this
    variant, ``(config, reason)`` for each it is kept from (``triton_common.pruned``).
    A config: block sizes with ``num_warps`` and ``num_stages``."""
    from dpgrad.kernels import triton_common

    kernel = kernel_object(variant.kernel)
    if not hasattr(kernel, "configs"):  # launched with blocks of its own
        return [({**dict(variant.blocks), "num_warps": variant.num_warps, "num_stages": 3}, None)]
    configs = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in kernel.configs]
    # The skeleton's alignment flags, which its families read (``triton_common.skeleton_family``).
    pointers = {**dict(variant.pointers), **{k: v for k, v in variant.flags if k.endswith("_ALIGN")}}
    return [(c, triton_common.pruned(jit_function(kernel).__name__, c, capability, pointers)) for c in configs]


def source_hash(variant: Variant) -> str:
    """The kernel's source as Triton's own cache keys it: its function's and those of the
    functions and constants it uses (``JITFunction.cache_key``)."""
    return jit_function(kernel_object(variant.kernel)).cache_key[:16]


def key(variant: Variant, config: Dict[str, object], target: str, triton_version: str) -> str:
    blocks = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
    return f"{triton_version}|{target}|{variant.kernel}|{variant.label}|{blocks}|{source_hash(variant)}"


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_one(variant: Variant, config: Dict[str, object], target: str) -> Dict[str, object]:
    """Compile the variant with the config for the target: what came of it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(kernel_object(variant.kernel))
    pointers, flags = dict(variant.pointers), dict(variant.flags)
    blocks = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    signature, constexprs = {}, {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = flags[p.name] if p.name in flags else blocks[p.name]
        elif p.name in pointers:
            if pointers[p.name] is None:
                signature[p.name], constexprs[p.name] = "constexpr", None
            else:
                signature[p.name] = "*" + pointers[p.name]
        else:
            signature[p.name] = "fp32" if p.name == "eps" else "i32"
    attrs = {}
    if variant.aligned:
        # What Triton's launcher specialises on a launch with aligned, contiguous tensors.
        for i, p in enumerate(fn.params):
            if p.is_constexpr or signature[p.name] == "constexpr" or p.do_not_specialize:
                continue
            if p.name in UNIT_STRIDES:
                signature[p.name], constexprs[p.name] = "constexpr", 1
            elif signature[p.name] != "fp32":
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(flags) - set(constexprs)
    if missing:
        raise ValueError(f"{variant.kernel}: flags {sorted(missing)} are not the kernel's constexprs")
    # ptxas's own account of the spills (its log, which Triton prints when asked), from a
    # compile that Triton's cache cannot answer.
    log = io.StringIO()
    knobs = [(triton.knobs.nvidia, "dump_ptxas_log"), (triton.knobs.compilation, "always_compile")]
    saved = [getattr(group, name) for group, name in knobs]
    try:
        for group, name in knobs:
            setattr(group, name, True)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", TARGETS[target], 32),
                                      options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result
        return {"ok": False, "error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:200]}"}
    finally:
        for (group, name), value in zip(knobs, saved):
            setattr(group, name, value)
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log.getvalue()))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    return {
        "ok": True,
        "regs": int(found.get("REG", 0)),
        "stack": int(found.get("STACK", 0)),
        "spills": spills,
        "local": int(found.get("LOCAL", 0)),
        "shared": max(int(found.get("SHARED", 0)), int(getattr(compiled.metadata, "shared", 0) or 0)),
        "tensor_cores": bool(TENSOR_CORES.search(ptx)),
        "tf32": ".tf32" in ptx,
        # Asynchronous copies to shared memory: cp.async (Ampere on), TMA (Hopper on).
        "async_loads": len(ASYNC_LOADS.findall(sass)),
    }


def _work(item):
    variant, config, target = item
    return compile_one(variant, config, target)


def problems(variant: Variant, target: str, result: Dict[str, object]) -> List[str]:
    """What is wrong with one compile of a config the kernel may run with."""
    if not result["ok"]:
        return [f"does not compile: {result['error']}"]
    found = []
    if result["spills"] or result["local"]:
        found.append(f"spills: {result['regs']} registers, {result['spills']} bytes of spill stores and loads "
                     f"({result['stack']} bytes of stack)")
    if result["shared"] > MAX_SHARED[TARGETS[target]]:
        found.append(f"{result['shared']} bytes of shared memory, over {target}'s {MAX_SHARED[TARGETS[target]]}")
    if variant.dots == "tensor cores" and not result["tensor_cores"]:
        found.append("its dots on half operands use no tensor-core instruction")
    if variant.dots == "fp32" and (result["tf32"] or result["tensor_cores"]):
        found.append("its fp32 dots use the tensor cores (TF32), not fp32")
    # The GEMM skeleton's kernels (their alignment flags) on aligned tensors: the main loop's
    # operands come through asynchronous copies (cp.async, TMA), which the pipelining needs.
    skeleton = any(name.endswith("_ALIGN") for name, _ in variant.flags)
    if skeleton and variant.aligned and result.get("async_loads") == 0:
        found.append("its main loop loads without asynchronous copies (no LDGSTS or UTMALDG in the SASS)")
    return found


@dataclass
class Run:
    """What ``check`` found: every compile's result, what was pruned, and the problems."""

    results: Dict[str, Dict[str, object]] = field(default_factory=dict)  # key -> result
    pruned: List[Tuple[Variant, Dict[str, object], str, str]] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    compiled: int = 0


def check(targets: List[str], jobs: int, cache: Optional[Dict[str, Dict[str, object]]] = None,
          only: Optional[str] = None, progress=None) -> Run:
    """Compile (or take from ``cache``) every variant with every config it may run with on
    every target; ``only``: the kernels whose name holds it; ``progress(results)``: called
    every 200 compiles with what is known so far (to keep it)."""
    import triton

    cache = cache or {}
    run = Run()
    todo, keys, places = [], [], []
    for variant in variants():
        if only and only not in variant.kernel:
            continue
        for target in targets:
            for config, reason in launch_configs(variant, TARGETS[target]):
                if reason is not None:
                    run.pruned.append((variant, config, target, reason))
                    continue
                k = key(variant, config, target, triton.__version__)
                if k in cache:
                    run.results[k] = cache[k]
                else:
                    todo.append((variant, config, target))
                    keys.append(k)
                places.append((k, variant, config, target))
    if todo:
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            for i, result in enumerate(pool.map(_work, todo, chunksize=8)):
                run.results[keys[i]] = result
                if progress is not None and (i + 1) % 200 == 0:
                    progress(run.results)
        run.compiled = len(todo)
    for k, variant, config, target in places:
        for problem in problems(variant, target, run.results[k]):
            run.problems.append(f"{target} {variant.kernel} [{variant.label}] {config}: {problem}")
    return run


def supported_targets() -> List[str]:
    """The targets the installed Triton compiles for (sm_100 needs a newer one than 3.6)."""
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return ["sm_80", "sm_90"] + (["sm_100"] if (major, minor) >= (3, 9) else [])


def load_cache(path: Path) -> Dict[str, Dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a kernel compile cache ({exc}); delete it to start a new one") from exc
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise SystemExit(f"{path}: not a kernel compile cache (no 'results' mapping); delete it to start a new one")
    return data["results"]


def save_cache(path: Path, results: Dict[str, Dict[str, object]]) -> None:
    """Keep only entries of the current kernels' sources: the rest can never be asked for again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"results": dict(sorted(results.items()))}, indent=0, sort_keys=True) + "\n")
    os.replace(tmp, path)


def report(run: Run) -> str:
    """A Markdown table: per kernel and target, configs compiled and pruned, registers."""
    rows: Dict[Tuple[str, str], Dict[str, object]] = {}
    for k, result in run.results.items():
        version, target, kernel = k.split("|")[:3]
        row = rows.setdefault((kernel, target), {"compiles": 0, "regs": [], "tc": False, "pruned": 0, "reasons": set()})
        row["compiles"] += 1
        if result.get("ok"):
            row["regs"].append(result["regs"])
            row["tc"] |= result["tensor_cores"]
    for variant, config, target, reason in run.pruned:
        row = rows.setdefault((variant.kernel, target), {"compiles": 0, "regs": [], "tc": False, "pruned": 0,
                                                         "reasons": set()})
        row["pruned"] += 1
        row["reasons"].add(reason.split(":")[0])  # the reason without its pointer to where it is shown
    lines = ["| kernel | target | compiles | registers | tensor cores | configs pruned (why) |",
             "|---|---|---|---|---|---|"]
    for (kernel, target), row in sorted(rows.items()):
        regs = f"{min(row['regs'])}-{max(row['regs'])}" if row["regs"] else "-"
        why = "; ".join(sorted(row["reasons"])) if row["reasons"] else ""
        lines.append(f"| `{kernel.split(':')[1]}` | {target} | {row['compiles']} | {regs} | "
                     f"{'yes' if row['tc'] else 'no'} | {row['pruned']}{' (' + why + ')' if why else ''} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs="+", choices=sorted(TARGETS), help="default: all the installed Triton takes")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once")
    parser.add_argument("--cache", type=Path, default=CACHE, help="the results cache (default: %(default)s)")
    parser.add_argument("--update", action="store_true", help="write what was compiled into the cache")
    parser.add_argument("--only", help="the kernels whose name holds this")
    parser.add_argument("--report", action="store_true", help="print the table of kernels and targets")
    parser.add_argument("--json", type=Path, help="write the problems and counts as JSON")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("run without TRITON_INTERPRET: the interpreter compiles nothing")
    import triton

    table = table_problems()
    for problem in table:
        print("table: " + problem)
    cache = load_cache(args.cache)

    def keep(results):  # a long run's compiles are not lost if it stops
        save_cache(args.cache, {**cache, **results})

    run = check(args.target or supported_targets(), args.jobs, cache, args.only, keep if args.update else None)
    print(f"triton {triton.__version__}: {len(run.results)} compiles ({run.compiled} new, the rest from the cache), "
          f"{len(run.pruned)} configs pruned, {len(run.problems)} problems")
    for problem in run.problems[:200]:
        print("  " + problem)
    if args.report:
        print(report(run))
    if args.update:
        # A whole run replaces this Triton's entries (dropping those of sources gone); a part adds.
        keep = {k: v for k, v in cache.items() if args.only or not k.startswith(triton.__version__ + "|")}
        keep.update(run.results)
        save_cache(args.cache, keep)
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "targets": args.target or supported_targets(),
                                         "compiles": len(run.results), "compiled": run.compiled,
                                         "pruned": len(run.pruned), "problems": run.problems, "table": table,
                                         "report": report(run)}, indent=1))
    return 1 if run.problems or table else 0


if __name__ == "__main__":
    sys.exit(main())
