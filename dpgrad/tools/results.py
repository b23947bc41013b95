"""Benchmark results: the JSON files the suites write and flat records for dashboards (their
tables for the docs and the end-of-run summary: ``dpgrad.tools.results_tables``).

A results file (``benchmarks/results/<suite>_<device>.json``) holds one run of one suite::

    {"schema": "dpgrad-bench/1", "suite": "dp_step" | "kernels" | "host_overhead",
     "machine": {"device", "gpu", "cpu", "torch", "triton", "cuda", "opacus", "python",
                 "dpgrad", "commit", "date", ...},
     "settings": {...},
     "results": [{"benchmark": "dp_step", "shape": {"model": ..., "batch": ..., ...},
                  "provider": "dpgrad-single", "status": "ok" | why it did not run,
                  "metrics": {"step_time": {"unit": "ms", "p20": .., "p50": .., "p80": ..}, ...}}]}

A case run several times in one run (``DPGRAD_BENCH_REPEATS``, the DP-step suite's providers
in turn each time) is one row whose metrics also list ``repeats``: each repeat's median (a
ratio: each repeat's ratio to the same repeat's baseline). Its p50 is then the median of the
repeats; a time's p20 and p80 are those of all its rounds together.

``flat_records`` turns files into one record per (result, metric) with the shape, the metric
and the machine as objects, so dashboard tools ingest them without parsing strings.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from dpgrad.version import __version__

SCHEMA = "dpgrad-bench/1"
# Metric name -> unit. Times are medians (and p20, p80) of synchronised runs, except
# host_time: the time to issue a step, not waiting for the device to finish it.
UNITS = {
    # audit: epsilons over the seeds of a case.
    "accountant_epsilon": "epsilon",
    "epsilon_one_run": "epsilon",
    "epsilon_fdp": "epsilon",
    "step_time": "ms",
    "capture_time": "ms",
    "time": "ms",
    "throughput": "tokens/s",
    "image_throughput": "images/s",
    "peak_memory": "bytes",
    "throughput_over_non_private": "ratio",
    "peak_memory_over_non_private": "ratio",
    "speedup_over_opacus": "ratio",
    "time_over_gemm": "ratio",
    # kernels: against cuBLAS's Gram pair, one read of the inputs, the roofline of the same run.
    "time_over_cublas_gram": "ratio",
    "time_over_read": "ratio",
    "roofline_fraction": "ratio",
    "tensor_flops": "TFLOP/s",
    "bandwidth": "GB/s",
    # host_overhead: per step, counted once (the counts are deterministic).
    "ops": "ops",
    "syncs": "count",
    "cuda_syncs": "count",
    "launches": "count",
    "hooked_layers": "count",
    "host_time": "ms",
    "extra_ops_per_layer": "ops",
    "extra_syncs": "count",
    "host_time_per_layer": "ms",
    "step_time_over_non_private": "ratio",
    # The first step's extra cost of the independence probe (check on against off).
    "first_step_probe_ops": "ops",
    "first_step_probe_syncs": "count",
    "first_step_probe_time": "ms",
    # fsdp_memory: per rank.
    "state_memory": "bytes",
    "peak_memory_over_ddp": "ratio",
    "state_memory_over_ddp": "ratio",
}


# A row whose time spreads wider than this (p80 - p20 over the median) is flagged.
WIDE_SPREAD = 0.5
# Figures that do not depend on timing: shown whatever a row's flags.
COUNTS = ("ops", "syncs", "cuda_syncs", "launches", "hooked_layers", "extra_ops_per_layer", "extra_syncs",
          "first_step_probe_ops", "first_step_probe_syncs", "peak_memory", "state_memory", "peak_memory_over_ddp", "state_memory_over_ddp")
IMPOSSIBLE = "impossible: faster than the non-private step of the same run, which does less work"


def flag_rows(rows: List[dict]) -> None:
    """Give each row ``flags``: why its timings are not to be shown as figures (a wide spread
    of its time; a DP step faster than the non-private step of the same case). Their ratios
    are left in the file and shown as flagged, not as figures."""
    for r in rows:
        flags = []
        if r.get("status") == "ok":
            metrics = r["metrics"]
            t = metrics.get("step_time") or metrics.get("time")
            if t and t["p50"] > 0 and (t["p80"] - t["p20"]) / t["p50"] > WIDE_SPREAD:
                flags.append(f"wide spread: p20 to p80 of its time is {(t['p80'] - t['p20']) / t['p50']:.0%} "
                             "of the median")
            if not r["provider"].startswith("non-private"):
                faster = metrics.get("throughput_over_non_private", {}).get("p50", 0) > 1 or \
                    metrics.get("step_time_over_non_private", {}).get("p50", 1) < 1
                if faster:
                    flags.append(IMPOSSIBLE)
        r["flags"] = flags
    for case in by_case(rows).values():  # a ratio to a flagged baseline is no figure either
        for name, r in case.items():
            base = baseline(case, name)
            if base is not None and base is not r and base["flags"] and r.get("status") == "ok":
                r["flags"].append("its non-private baseline is flagged")


def baseline(case: Dict[str, dict], provider: str) -> Optional[dict]:
    """The row a provider's ratios are to in a case of the DP step: the non-private step, or for
    a step captured in a CUDA graph ("-graph") or compiled ("-compile"), the non-private step
    run likewise."""
    for how in ("-graph", "-compile"):
        if provider.endswith(how):
            return case.get("non-private" + how)
    return case.get("non-private")


def warm_up(run, min_rounds: int = 2, max_rounds: int = 10, tolerance: float = 0.1) -> int:
    """Run ``run`` (a synchronised step) until two rounds in a row take times within
    ``tolerance`` of each other, at least ``min_rounds`` and at most ``max_rounds`` times:
    first steps pay for allocation, compilation and caches. Returns the rounds run."""
    last = None
    for rounds in range(1, max_rounds + 1):
        start = time.perf_counter()
        run()
        took = time.perf_counter() - start
        if rounds >= min_rounds and last is not None and abs(took - last) <= tolerance * max(took, last):
            return rounds
        last = took
    return max_rounds


def peak_allocated(run) -> int:
    """The most bytes ``run`` had allocated on the CPU at once beyond what was live when it
    started, from torch.profiler's record of every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def quick_mode() -> bool:
    """Whether the benchmark suites run at their small sizes: ``DPGRAD_BENCH_QUICK=1``, or no CUDA."""
    import os

    return os.environ.get("DPGRAD_BENCH_QUICK", "") == "1" or not torch.cuda.is_available()


def git_commit() -> Optional[str]:
    """``git describe --always --dirty`` of this checkout; None for an installed copy or no git,
    unless ``DPGRAD_COMMIT`` names the commit it was installed from (``benchmarks/gpu_session.sh
    compare`` sets it for the commit it measures the checkout against)."""
    named = os.environ.get("DPGRAD_COMMIT", "").strip()
    if named:
        return named
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # an installed copy: the commit would be someone else's
        return None
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> Dict[str, object]:
    """The machine, the versions and the commit that produced a run."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    versions = {name: None for name in ("triton", "opacus", "transformers", "peft")}
    for name in versions:
        if importlib.util.find_spec(name) is not None:
            versions[name] = getattr(__import__(name), "__version__", None)

    return {
        "device": gpu or f"cpu: {_cpu_name()} x {torch.get_num_threads()} threads",
        "gpu": gpu,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if gpu else None,
        **versions,
        "python": platform.python_version(),
        "dpgrad": __version__,
        "commit": git_commit() or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def device_slug(machine: Dict[str, object]) -> str:
    """"cpu" or the GPU's name in lower case and dashes: the results file's suffix."""
    if not machine.get("gpu"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", str(machine["gpu"]).lower()).strip("-")


def quantiles(values: Sequence[float], scale: float = 1.0) -> Dict[str, float]:
    """p20, p50 and p80 of ``values`` (times ``scale``), by linear interpolation."""
    ordered = sorted(v * scale for v in values)
    if not ordered:
        raise ValueError("no values")

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p20": at(0.2), "p50": at(0.5), "p80": at(0.8)}


def metric(name: str, p50: float, p20: Optional[float] = None, p80: Optional[float] = None) -> Dict[str, object]:
    """A metric entry; p20 and p80 default to p50 for single figures (a ratio, a peak)."""
    return {"unit": UNITS[name], "p20": p50 if p20 is None else p20, "p50": p50, "p80": p50 if p80 is None else p80}


def repeated(name: str, values: Sequence[float]) -> Dict[str, object]:
    """A metric of a case run several times: the median of the repeats' ``values`` (in the
    order they ran), which the entry keeps as ``repeats``."""
    entry = metric(name, statistics.median(values))
    entry["repeats"] = list(values)
    return entry


def derived(name: str, fn, *entries: Dict[str, object]) -> Dict[str, object]:
    """The metric ``name`` = ``fn`` of the p50s of ``entries``; where every entry lists the
    same number of ``repeats``, ``fn`` of each repeat's values and their median."""
    runs = [e.get("repeats") for e in entries]
    if all(runs) and len({len(r) for r in runs}) == 1:
        return repeated(name, [fn(*values) for values in zip(*runs)])
    return metric(name, fn(*(e["p50"] for e in entries)))


def spread(entry: Optional[Dict[str, object]], fmt: str = ".2f") -> str:
    """`` (lowest-highest)`` of a repeated metric's repeats, else nothing."""
    runs = (entry or {}).get("repeats")
    if not runs or len(runs) < 2:
        return ""
    return f" ({format(min(runs), fmt)}-{format(max(runs), fmt)})"


def write(directory: Path, suite: str, results: List[dict], settings: Dict[str, object],
          machine: Optional[Dict[str, object]] = None) -> Path:
    """Write one suite's run to ``directory/<suite>_<device>.json``; returns the path.

    ``machine``: ``machine_info()`` taken when the run began (default: now). Taken after an
    earlier suite's file was written, the commit would read as dirty.
    """
    machine = machine or machine_info()
    doc = {"schema": SCHEMA, "suite": suite, "machine": machine, "settings": settings, "results": results}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{suite}_{device_slug(machine)}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


# What the tables and the dashboard read of each suite's shapes.
SHAPE_KEYS = {"dp_step": ("model", "batch", "seq_len", "dtype"), "host_overhead": ("model", "batch", "seq_len", "dtype"),
              "kernels": ("kernel", "layer", "T", "B"), "fsdp_memory": ("model", "world"),
              "audit": ("noise_multiplier", "canaries", "steps", "sample_rate")}
MACHINE_KEYS = ("device", "date", "commit", "torch")


def _problem(doc: dict) -> Optional[str]:
    """What in a results file (of the right schema) is missing or of the wrong type; None if nothing."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    suite = doc.get("suite")
    if suite not in SHAPE_KEYS:
        return f"suite {suite!r}, not one of {', '.join(SHAPE_KEYS)}"
    machine = doc.get("machine")
    if not isinstance(machine, dict) or not all(isinstance(machine.get(k), str) for k in MACHINE_KEYS):
        return f"a 'machine' that is not an object with the strings {', '.join(MACHINE_KEYS)}"
    rows = doc.get("results")
    if not isinstance(rows, list):
        return "'results' that is not a list"
    for i, row in enumerate(rows):
        where = f"results[{i}]"
        if not isinstance(row, dict):
            return f"{where} that is not an object"
        for key in ("benchmark", "provider", "status"):
            if not isinstance(row.get(key), str):
                return f"{where}.{key} that is not a string"
        shape = row.get("shape")
        if not isinstance(shape, dict) or any(k not in shape for k in SHAPE_KEYS[suite]):
            return f"{where}.shape without {', '.join(SHAPE_KEYS[suite])}"
        if any(not isinstance(v, (str, int, float, bool, type(None))) for v in shape.values()):
            return f"{where}.shape with a value that is not a string or a number"
        metrics = row.get("metrics", {})
        if not isinstance(metrics, dict):
            return f"{where}.metrics that is not an object"
        for name, m in metrics.items():
            if not isinstance(m, dict) or not all(number(m.get(q)) for q in ("p20", "p50", "p80")):
                return f"{where}.metrics.{name} without numbers p20, p50 and p80"
            runs = m.get("repeats", [])
            if not isinstance(runs, list) or not all(number(v) for v in runs):
                return f"{where}.metrics.{name}.repeats that is not a list of numbers"
        flags = row.get("flags", [])
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            return f"{where}.flags that is not a list of strings"
    return None


def load(paths: Iterable[Path]) -> List[dict]:
    """Read results files (flagging the rows of one written before rows were flagged); raises
    ValueError naming a file that is not one."""
    docs = []
    for path in paths:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a dpgrad results file (schema {SCHEMA!r}); write it with the benchmarks")
        problem = _problem(doc)
        if problem is not None:
            raise ValueError(f"{path}: a dpgrad results file with {problem}; write it again with the benchmarks")
        doc["path"] = str(path)
        if any("flags" not in row for row in doc["results"]):
            flag_rows(doc["results"])  # a file written before rows were flagged
        docs.append(doc)
    return docs


# What must agree between the parts of one suite's run taken in several calls.
SAME_RUN = ("device", "commit", "torch", "triton", "cuda")


def merge(docs: Sequence[dict]) -> dict:
    """One results document from the parts of one suite's run, each holding other cases (a
    suite run case by case, to fit each part in a time limit): the rows together, the first
    part's machine with the dates of all parts, the settings' dtypes together. Raises
    ValueError where the parts are of different suites, machines, commits or versions, or
    where a case is in two parts (its ratios were taken within one part)."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    for doc in docs[1:]:
        if doc["suite"] != first["suite"]:
            raise ValueError(f"{doc.get('path')}: suite {doc['suite']!r}, not {first['suite']!r}")
        for key in SAME_RUN:
            if doc["machine"].get(key) != first["machine"].get(key):
                raise ValueError(f"{doc.get('path')}: {key} {doc['machine'].get(key)!r}, not "
                                 f"{first['machine'].get(key)!r} as in {first.get('path')}")
    keys = SHAPE_KEYS[first["suite"]]
    seen: Dict[tuple, str] = {}
    for doc in docs:
        for case in by_case(doc["results"], keys):
            if case in seen and seen[case] != doc.get("path"):
                raise ValueError(f"{doc.get('path')}: case {dict(zip(keys, case))} is also in {seen[case]}")
            seen[case] = doc.get("path")
    machine = dict(first["machine"], date=min(doc["machine"]["date"] for doc in docs))
    dates = sorted(doc["machine"]["date"] for doc in docs)
    if len(set(dates)) > 1:
        machine["dates"] = dates
    settings = dict(first.get("settings", {}))
    dtypes = sorted({d for doc in docs for d in doc.get("settings", {}).get("dtype", [])})
    if dtypes:
        settings["dtype"] = dtypes
    return {"schema": SCHEMA, "suite": first["suite"], "machine": machine, "settings": settings,
            "results": [row for doc in docs for row in doc["results"]]}


def flat_records(docs: Iterable[dict]) -> List[dict]:
    """One record per result and metric: ``{"benchmark", "shape", "provider", "metric":
    {"name", "unit", "p20", "p50", "p80"}, "machine"}``. Results that did not run have no
    metrics and give no records."""
    records = []
    for doc in docs:
        for row in doc["results"]:
            for name, m in row.get("metrics", {}).items():
                records.append({
                    "benchmark": row["benchmark"],
                    "shape": row["shape"],
                    "provider": row["provider"],
                    "metric": {"name": name, **m},
                    "machine": doc["machine"],
                })
    return records


def by_case(rows: Iterable[dict], keys: Optional[Sequence[str]] = None) -> Dict[tuple, Dict[str, dict]]:
    """Rows grouped by shape (the values of ``keys``, default the whole shape), then provider."""
    cases: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        key = tuple(r["shape"][k] for k in keys) if keys else tuple(sorted(r["shape"].items()))
        cases.setdefault(key, {})[r["provider"]] = r
    return cases
