"""Summarises the DP-step benchmarks (bench_dp_step.py) and keeps them under results/.

Per case (model, batch, tokens, dtype): each provider's median step time, its ratio to the
non-private step of the same run (time, and throughput = non-private time / its time), its
ratio to Opacus's ghost clipping, tokens per second and, on a GPU, peak memory against the
non-private step's.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import platform
from pathlib import Path

import torch

from dpgrad.report import git_commit

RESULTS = Path(__file__).parent / "results"
BASELINE, OPACUS = "non-private", "opacus-ghost"


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} x {torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} x {torch.get_num_threads()} threads"


def _versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("opacus", "triton"):
        if importlib.util.find_spec(name) is not None:
            versions[name] = __import__(name).__version__
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
    return versions


def dp_step_rows(benchmarks) -> list:
    """One row per (case, provider) with its median and its ratios to the same run's baselines."""
    cases: dict = {}
    for bench in benchmarks:
        info = bench.extra_info
        if info.get("bench") != "dp_step":
            continue
        case = (info["model"], info["batch"], info["seq_len"], info["dtype"])
        cases.setdefault(case, {})[info["provider"]] = (bench.stats, info)
    rows = []
    for (model, batch, seq_len, dtype), providers in sorted(cases.items()):
        base = providers.get(BASELINE)
        opacus = providers.get(OPACUS)
        for provider, (stats, info) in providers.items():
            median = stats.median
            row = {
                "model": model, "batch": batch, "seq_len": seq_len, "dtype": dtype, "provider": provider,
                "median_s": median, "q1_s": stats.q1, "q3_s": stats.q3, "rounds": stats.rounds,
                "tokens_per_s": info["tokens"] / median,
                "peak_memory_bytes": info.get("peak_memory_bytes"),
            }
            if base is not None:
                row["time_over_non_private"] = median / base[0].median
                row["throughput_over_non_private"] = base[0].median / median
                peak, base_peak = info.get("peak_memory_bytes"), base[1].get("peak_memory_bytes")
                row["peak_memory_over_non_private"] = peak / base_peak if peak and base_peak else None
            if opacus is not None:
                row["time_over_opacus_ghost"] = median / opacus[0].median
            rows.append(row)
    return rows


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled or not session.benchmarks:
        return
    rows = dp_step_rows(session.benchmarks)
    if not rows:
        return
    terminalreporter.section("DP step: ratios to the non-private step and to Opacus ghost clipping")
    for r in rows:
        memory = r.get("peak_memory_over_non_private")
        terminalreporter.write_line(
            f"{r['model']:<10} B={r['batch']:>3} T={r['seq_len']:>5} {r['provider']:<14} "
            f"{r['median_s'] * 1e3:9.1f} ms  throughput/non-private {r.get('throughput_over_non_private', 0):5.2f}  "
            f"time/opacus {r.get('time_over_opacus_ghost', float('nan')):5.2f}"
            + (f"  memory/non-private {memory:5.2f}" if memory else "")
        )
    record = {
        "benchmark": "dp_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "commit": git_commit() or "unknown",
        "versions": _versions(),
        "settings": {
            "timer": "pytest-benchmark, wall clock of a synchronised step, median",
            "step": "forward, backward, optimizer step; DP: C = 1.0, noise 1.0, Opacus's "
                    "DPOptimizerFastGradientClipping",
        },
        "results": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"dp_step_{'cuda' if torch.cuda.is_available() else 'cpu'}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    terminalreporter.write_line(f"written {path}")
