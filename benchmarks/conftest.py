"""Reports dpgrad / Opacus time ratios of the benchmarks and keeps them under results/."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch

from dpgrad.report import git_commit

RESULTS = Path(__file__).parent / "results"


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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled or not session.benchmarks:
        return
    medians = {}
    for bench in session.benchmarks:
        info = bench.extra_info
        if "wrapper" in info:
            medians[(info["seq_len"], info["wrapper"])] = (bench.stats.median, info)
    rows = []
    for (seq_len, wrapper), (median, info) in sorted(medians.items()):
        if wrapper != "dpgrad" or (seq_len, "opacus") not in medians:
            continue
        opacus_median = medians[(seq_len, "opacus")][0]
        rows.append(
            {
                "benchmark": "ghost_clipping_step",
                "model": "TinyTransformer (dpgrad.models, default config)",
                "batch": info["batch"],
                "seq_len": seq_len,
                "opacus_median_s": opacus_median,
                "dpgrad_median_s": median,
                "ratio_dpgrad_over_opacus": median / opacus_median,
            }
        )
    if not rows:
        return
    terminalreporter.section("dpgrad / Opacus")
    for r in rows:
        terminalreporter.write_line(
            f"T={r['seq_len']:>4}: opacus {r['opacus_median_s'] * 1e3:8.1f} ms  dpgrad "
            f"{r['dpgrad_median_s'] * 1e3:8.1f} ms  ratio {r['ratio_dpgrad_over_opacus']:.3f}"
        )
    import opacus

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "commit": git_commit() or "unknown",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "opacus": opacus.__version__},
        "results": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    path = RESULTS / f"ghost_step_{kind}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    terminalreporter.write_line(f"written {path}")
