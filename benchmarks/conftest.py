"""Collects the suites' measurements into results files (``dpgrad.tools.results``) and summarises them.

Each benchmark test asks for the ``bench`` fixture and says what it measures (``suite``,
``benchmark``, ``shape``, ``provider``); it times with pytest-benchmark (whose rounds give
the p20/p50/p80 of ``step_time`` or ``time``) or hands in metrics of its own (GPU kernel
times from ``triton.testing.do_bench``, peak memory, operation counts, host time), or says
why the provider did not run (``bench.skip(reason)``: Opacus refusing tied weights, out of
memory). At the end of a run with timing enabled, each suite's rows get their ratios to the
same run's baselines (a case run several times, ``DPGRAD_BENCH_REPEATS``, is one row: the
median of its repeats, each repeat listed, ratios taken within each repeat), and flags where their timings cannot be trusted as figures (a wide
spread, a DP step faster than the non-private one: ``results.flag_rows``), and go to
``<suite>_<device>.json`` in ``$DPGRAD_RESULTS_DIR`` (default
benchmarks/results). Runs with ``--benchmark-disable`` (the test suite's quick pass:
collection and one round) write nothing.

``DPGRAD_BENCH_QUICK=1`` picks the small sizes; they are the default without CUDA.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from dpgrad.tools import results, results_tables

if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # Under pytest-xdist (-n) the workers share the cores: one thread each, as tests/conftest.py
    # gives the test suite's workers, not each a thread per core.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
RESULTS = Path(os.environ.get("DPGRAD_RESULTS_DIR") or Path(__file__).parent / "results")
QUICK = results.quick_mode()
ROWS_KEY = pytest.StashKey[list]()
# dp_step's image classifiers (benchmarks/bench_dp_step.py): their rows count images, not tokens.
VISION_MODELS = ("wrn-", "vit-")
MACHINE_KEY = pytest.StashKey[dict]()


@dataclass
class BenchRow:
    """What one benchmark test measured (filled in by the test) and its outcome."""

    benchmark_fixture: object
    suite: str = ""
    benchmark: str = ""
    shape: Dict[str, object] = field(default_factory=dict)
    provider: str = ""
    status: str = "ok"
    metrics: Dict[str, dict] = field(default_factory=dict)
    time_metric: str = "time"

    def end_untimed(self) -> None:
        """An untimed run's case ends here, its timing fixture called with nothing to time
        (pytest-benchmark warns of a fixture that was not called)."""
        self.benchmark_fixture.pedantic(lambda: None)

    def describe(self, suite: str, benchmark: str, shape: Dict[str, object], provider: str,
                 time_metric: str = "time") -> None:
        self.suite, self.benchmark, self.shape, self.provider = suite, benchmark, shape, provider
        self.time_metric = time_metric
        self.benchmark_fixture.group = f"{benchmark} " + ", ".join(f"{k}={v}" for k, v in shape.items())
        self.benchmark_fixture.extra_info.update(suite=suite, shape=shape, provider=provider)

    def skip(self, reason: str) -> None:
        """Record that the provider did not run here, and why; skips the test."""
        self.status = reason
        pytest.skip(f"{self.provider}: {reason}")

    def rounds(self) -> List[float]:
        """pytest-benchmark's timed rounds (seconds); none when timing is disabled."""
        stats = getattr(self.benchmark_fixture, "stats", None)
        return list(getattr(getattr(stats, "stats", None), "data", None) or [])

    def to_result(self) -> Optional[dict]:
        if self.status == "ok":
            data = self.rounds()
            if self.time_metric not in self.metrics:
                if not data:
                    return None  # timing disabled: nothing measured
                self.metrics[self.time_metric] = results.metric(self.time_metric, 0) | results.quantiles(data, 1e3)
        return {"benchmark": self.benchmark, "shape": self.shape, "provider": self.provider,
                "status": self.status, "metrics": self.metrics}


def _merged(rows: List[BenchRow]) -> Optional[dict]:
    """One result from the repeats of one case and provider (``results.repeated``): a time's
    p20, p50 and p80 from all their rounds together, every metric's median repeat with the
    ``repeats``; a provider that did not run in some repeat is recorded with the first reason."""
    if len(rows) == 1:
        return rows[0].to_result()
    missed = [row for row in rows if row.status != "ok"]
    if missed:
        return missed[0].to_result()
    done = [row.to_result() for row in rows]
    if any(result is None for result in done):
        return None
    merged = done[0]
    for name in merged["metrics"]:
        values = [result["metrics"][name]["p50"] for result in done]
        merged["metrics"][name] = results.repeated(name, values)
    time_metric = rows[0].time_metric
    pooled = [x for row in rows for x in row.rounds()]
    if pooled:
        merged["metrics"][time_metric].update(results.quantiles(pooled, 1e3))
        merged["metrics"][time_metric]["p50"] = statistics.median(merged["metrics"][time_metric]["repeats"])
    return merged


def _timed(config) -> bool:
    """Whether pytest-benchmark times this run (pytest-benchmark's own test of its options)."""
    return not (config.getoption("benchmark_disable", False) and not config.getoption("benchmark_enable", False))


def pytest_configure(config):
    config.stash[ROWS_KEY] = []
    # Before any results file is written: the commit must not read as dirty because of them.
    # An untimed run writes none, and does not import what the machine's description names.
    if _timed(config):
        config.stash[MACHINE_KEY] = results.machine_info()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """In quick mode, before each test, what is alive (the imports' objects, hundreds of
    thousands: torch's, transformers', Opacus's; the suites' built models) is moved out of the
    garbage collector's reach once collected: each collection during the test (the suites' own
    ``gc.collect()`` before every provider, and Python's) then looks at what the test made
    only, in milliseconds instead of half a second. What is alive stays alive; what the test
    drops is collected as before."""
    if QUICK:
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's exit frees them as usual (nanobind reports what it does not)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``'s first pass, beside the tests),
    the cases that share what a suite builds run on one worker: a suite's cases of one model
    (``name``), or all of a suite's cases where they name no model. This hook sees every
    collected item: only the suites' own are grouped."""
    here = Path(__file__).parent
    untimed = not _timed(config)
    kept, dropped = [], []
    for item in items:
        if item.path.parent == here:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            if untimed and not _untimed_takes(item.module, params):
                dropped.append(item)
                continue
            name = params.get("name")
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}-{name}" if name else item.path.stem))
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _untimed_takes(module, params: dict) -> bool:
    """Whether an untimed run (``--benchmark-disable``: ``make test``'s pass, which checks that
    each case runs and is recorded) takes a suite's case: all of them, unless the suite names
    the ones it takes in ``UNTIMED`` (dicts of parameters; a case is taken where one of them is
    a subset of its own), leaving out cases that run the same code on other figures (another
    noise multiplier, a longer sequence). Timed runs take every case."""
    wanted = getattr(module, "UNTIMED", None)
    return wanted is None or any(all(params.get(k) == v for k, v in w.items()) for w in wanted)


@pytest.fixture
def bench(benchmark, request):
    row = BenchRow(benchmark)
    yield row
    if row.suite:
        request.config.stash[ROWS_KEY].append(row)
        # pytest-benchmark's own JSON (--benchmark-json) carries them too.
        benchmark.extra_info.update(status=row.status, metrics=row.metrics)


def _derive_dp_step(rows: List[dict]) -> None:
    """Throughput, and ratios to the non-private step and to Opacus ghost of the same case."""
    for case in results.by_case(rows).values():
        opacus = case.get("opacus-ghost")
        for r in case.values():
            m = r["metrics"]
            if r["status"] != "ok":
                continue
            base = results.baseline(case, r["provider"])
            t = m["step_time"]
            # A vision model's seq_len is its image side: its throughput is in images.
            vision = str(r["shape"]["model"]).startswith(VISION_MODELS)
            name = "image_throughput" if vision else "throughput"
            tokens = r["shape"]["batch"] * (1 if vision else r["shape"]["seq_len"])
            m[name] = results.metric(name, tokens / t["p50"] * 1e3, tokens / t["p80"] * 1e3, tokens / t["p20"] * 1e3)
            if "repeats" in t:
                m[name]["repeats"] = [tokens / x * 1e3 for x in t["repeats"]]
            if base is not None and base["status"] == "ok":
                m["throughput_over_non_private"] = results.derived(
                    "throughput_over_non_private", lambda b, x: b / x, base["metrics"]["step_time"], t)
                peak, base_peak = m.get("peak_memory"), base["metrics"].get("peak_memory")
                if peak and base_peak:
                    m["peak_memory_over_non_private"] = results.derived(
                        "peak_memory_over_non_private", lambda x, b: x / b, peak, base_peak)
            if opacus is not None and opacus["status"] == "ok":
                m["speedup_over_opacus"] = results.derived("speedup_over_opacus", lambda o, x: o / x,
                                                           opacus["metrics"]["step_time"], t)


_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kernel_work(shape: Dict[str, object]) -> Optional[Tuple[float, float]]:
    """(FLOPs, bytes) the physical limit of a kernels row's work takes: the fewest FLOPs of its
    cheapest form and one read of its inputs (and one write of its output). Per-sample Linear
    norms: the direct form's ``2*B*T*d*p`` (the weight-gradient GEMM's) or the Gram form's
    ``B*T^2*(d+p)`` (both Gram matrices, symmetric: half of ``2*B*T^2*(d+p)``), whichever is
    fewer. Per-sample gradients and clipped sums: the GEMM's FLOPs, and their output written.
    Embedding norms: reading the ids and G. Experts' norms and clipped sums: the weight-gradient
    GEMMs over the routed pairs, and reading the pairs' factors. None for a row of another kind."""
    kernel, e = shape.get("kernel"), _ELEMENT_BYTES.get(str(shape.get("dtype")), 4)
    if kernel == "roofline":
        return float(shape["flops"]), float(shape["bytes"])
    if kernel == "embedding_norm":
        return 0.0, float(8 * shape["B"] * shape["T"] + e * shape["B"] * shape["T"] * shape["d"])
    if kernel in ("experts_norm", "experts_clipped_sum"):  # the per-expert weight-gradient GEMMs over the pairs
        pairs, p, q = int(shape["B"]) * int(shape["T"]) * int(shape["k"]), int(shape["p"]), int(shape["q"])
        written = 4 * shape["B"] if kernel == "experts_norm" else e * int(shape["E"]) * p * q
        return 2.0 * pairs * p * q, float(e * pairs * (p + q) + written)
    if kernel not in ("linear_norm", "linear_grad_sample", "linear_clipped_sum"):
        return None
    B, T, d, p = (int(shape[k]) for k in ("B", "T", "d", "p"))
    read = e * B * T * (d + p)
    gemm = 2.0 * B * T * d * p
    if kernel == "linear_norm":
        return min(gemm, float(B * T * T * (d + p))), float(read)
    written = B * p * d if kernel == "linear_grad_sample" else p * d
    return gemm, float(read + e * written)


def _seconds(row: dict) -> float:
    return row["metrics"]["time"]["p50"] / 1e3


def _derive_kernels(rows: List[dict]) -> None:
    """Per kernel and shape: speedup over Opacus's sampler, time over the plain GEMM and (Linear
    norms) over cuBLAS's Gram pair; every row's fraction of the roofline measured in the same
    run (the ``roofline`` rows: a large GEMM's FLOP/s, a large copy's bytes/s), and dpgrad's
    time over one read of its inputs at the copy's bytes/s."""
    peak_flops = peak_bytes = None
    for r in rows:
        if r["shape"].get("kernel") == "roofline" and r["status"] == "ok":
            flops, moved = kernel_work(r["shape"])
            if flops:
                peak_flops = flops / _seconds(r)
                r["metrics"]["tensor_flops"] = results.metric("tensor_flops", peak_flops / 1e12)
            else:
                peak_bytes = moved / _seconds(r)
                r["metrics"]["bandwidth"] = results.metric("bandwidth", peak_bytes / 1e9)
    for case in results.by_case(rows).values():
        # Per-sample gradients against Opacus's with the norms its optimizer then takes, as
        # dpgrad's kernel fuses them.
        opacus = case.get("opacus-with-norm") or case.get("opacus")
        gemm = case.get("gemm") or case.get("gemm-per-expert")
        gram = case.get("cublas-gram")
        for name, r in case.items():
            if r["status"] != "ok" or r["shape"].get("kernel") == "roofline":
                continue
            t = r["metrics"]["time"]["p50"]
            work = kernel_work(r["shape"])
            if work is not None and peak_flops and peak_bytes:
                limit = max(work[0] / peak_flops, work[1] / peak_bytes)
                r["metrics"]["roofline_fraction"] = results.metric("roofline_fraction", limit / (t / 1e3))
            if not name.startswith("dpgrad"):
                continue
            if work is not None and peak_bytes:
                r["metrics"]["time_over_read"] = results.metric("time_over_read", t / 1e3 / (work[1] / peak_bytes))
            if opacus is not None and opacus["status"] == "ok":
                r["metrics"]["speedup_over_opacus"] = results.metric("speedup_over_opacus",
                                                                     opacus["metrics"]["time"]["p50"] / t)
            if gemm is not None and gemm["status"] == "ok":
                r["metrics"]["time_over_gemm"] = results.metric("time_over_gemm", t / gemm["metrics"]["time"]["p50"])
            if gram is not None and gram["status"] == "ok":
                r["metrics"]["time_over_cublas_gram"] = results.metric("time_over_cublas_gram",
                                                                       t / gram["metrics"]["time"]["p50"])


def _derive_host_overhead(rows: List[dict]) -> None:
    """What each dpgrad step adds to the non-private step of the same model: operations per
    hooked layer, host waits, host time per hooked layer, and the step time's ratio."""
    for case in results.by_case(rows).values():
        base = case.get("non-private")
        if base is None or base["status"] != "ok":
            continue
        b = base["metrics"]
        for name, r in case.items():
            m = r["metrics"]
            if not name.startswith("dpgrad") or r["status"] != "ok":
                continue
            layers = m["hooked_layers"]["p50"]
            m["extra_syncs"] = results.metric("extra_syncs", m["syncs"]["p50"] - b["syncs"]["p50"])
            if layers:
                m["extra_ops_per_layer"] = results.metric("extra_ops_per_layer",
                                                          (m["ops"]["p50"] - b["ops"]["p50"]) / layers)
                m["host_time_per_layer"] = results.metric(
                    "host_time_per_layer", (m["host_time"]["p50"] - b["host_time"]["p50"]) / layers)
            m["step_time_over_non_private"] = results.metric("step_time_over_non_private",
                                                             m["step_time"]["p50"] / b["step_time"]["p50"])


def _derive_fsdp_memory(rows: List[dict]) -> None:
    """Each FSDP2 row's memory over the DDP row of the same step and world size."""
    for case in results.by_case(rows).values():
        for name, r in case.items():
            ddp = case.get(name.replace("fsdp2-", "ddp-", 1))
            if not name.startswith("fsdp2-") or ddp is None or r["status"] != "ok" or ddp["status"] != "ok":
                continue
            for what in ("peak_memory", "state_memory"):
                r["metrics"][f"{what}_over_ddp"] = results.metric(
                    f"{what}_over_ddp", r["metrics"][what]["p50"] / ddp["metrics"][what]["p50"])


DERIVE = {"dp_step": _derive_dp_step, "kernels": _derive_kernels, "host_overhead": _derive_host_overhead,
          "fsdp_memory": _derive_fsdp_memory, "audit": lambda rows: None}  # audits: nothing to derive
# What a suite's results file says about how it measured, beside the timer.
SETTINGS = {"audit": {"timer": "none: epsilons, p20/p50/p80 over the seeds of a case (twenty; five with "
                               "DPGRAD_BENCH_QUICK=1; one when timing is disabled)"},
            "fsdp_memory": {
    "timer": "perf_counter around rank 0's steps (CPU, gloo)",
    "memory": "largest over the ranks: parameters, gradients and optimizer state live at a step's start plus "
              "the most the step allocates at once (torch.profiler, profile_memory); DDP's bucket buffers not "
              "counted",
}, "host_overhead": {
    "timer": "pytest-benchmark rounds of a synchronised step (step_time)",
    "counts": "one step after two warm-up steps: aten operations dispatched (TorchDispatchMode, views included) "
              "and those that wait for the device; on CUDA also the sync debug mode's reports and the profiler's "
              "kernel launches",
    "host_time": "perf_counter around a step started on an idle device, not waiting for its end",
}}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled:
        return
    by_suite: Dict[str, List[dict]] = {}
    settings: Dict[str, dict] = {}
    repeats: Dict[tuple, List[BenchRow]] = {}
    for row in config.stash[ROWS_KEY]:  # a case's repeats in the order they ran
        key = (row.suite, row.benchmark, json.dumps(row.shape, sort_keys=True), row.provider)
        repeats.setdefault(key, []).append(row)
    for (suite, *_), rows in repeats.items():
        result = _merged(rows)
        if result is not None:
            by_suite.setdefault(suite, []).append(result)
    for suite, rows in by_suite.items():
        DERIVE[suite](rows)
        results.flag_rows(rows)
        settings[suite] = {"quick": QUICK, "timer": "triton.testing.do_bench (GPU kernels), else pytest-benchmark "
                           "rounds of a synchronised call", "dtype": sorted({str(r["shape"].get("dtype")) for r in rows})}
        settings[suite].update(SETTINGS.get(suite, {}))
        path = results.write(RESULTS, suite, rows, settings[suite], config.stash[MACHINE_KEY])
        terminalreporter.write_line(f"written {path}")
        if suite in ("dp_step", "host_overhead"):
            terminalreporter.section({"dp_step": "DP step", "host_overhead": "Host overhead"}[suite])
            terminalreporter.write_line(results_tables.markdown([{"suite": suite, "machine": config.stash[MACHINE_KEY],
                                                             "results": rows}]))
