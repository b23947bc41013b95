"""The results files as Markdown (``dpgrad.tools.results``): a table per suite and machine for
docs/results.md (``markdown``, ``readme_with_results``, between the results markers), and the
few lines that end ``make report`` (``summary``), with the check of the autotune report they
read (``report_problem``)."""

from __future__ import annotations

import statistics
import textwrap
from typing import Dict, Iterable, List, Optional

from dpgrad.tools.results import by_case, spread


def _cell(value: Optional[float], spec: str, suffix: str = "", scale: float = 1.0) -> str:
    """A table cell: ``value / scale`` formatted by ``spec`` with its unit, or "-" for none."""
    return "-" if value is None else format(value / scale, spec) + suffix


def _fmt_ms(m: Optional[dict]) -> str:
    return _cell(None if m is None else m["p50"], ".1f", " ms")


def markdown(docs: Iterable[dict]) -> str:
    """The README's results: a table of DP-step times and ratios per machine, the host
    overhead of the DP steps, the kernels' speedups over Opacus, and the memory per rank under
    FSDP2 against DDP, from the given results files."""
    out = []
    for doc in sorted(docs, key=lambda d: (d["suite"], d["machine"]["device"])):
        m = doc["machine"]
        out.append(f"{doc['suite']} on {m['device']}, {m['date'][:10]}, commit {m['commit']}, torch {m['torch']}"
                   + (f", Opacus {m['opacus']}" if m.get("opacus") else "")
                   + (f", Triton {m['triton']}" if m.get("triton") and m.get("gpu") else "") + ":")
        out.append("")
        out += _TABLES.get(doc["suite"], _kernels_table)(doc["results"])
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _p50(row: Optional[dict], name: str) -> Optional[float]:
    if not row or row.get("status") != "ok" or name not in row.get("metrics", {}):
        return None
    return row["metrics"][name]["p50"]


def _ratio(value: Optional[float], row: Optional[dict] = None) -> str:
    if value is not None and row and row.get("flags"):
        return "flagged"
    return _cell(value, ".2f")


def _flag_notes(results: List[dict]) -> List[str]:
    """A line per flagged row, under its table."""
    notes = []
    for r in results:
        if r.get("flags"):
            shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
            notes.append(f"flagged: {r['provider']} ({shape}): {'; '.join(r['flags'])}")
    return [""] + notes if notes else []


def _dp_step_table(results: List[dict]) -> List[str]:
    providers = list(dict.fromkeys(r["provider"] for r in results))
    lines = ["| model | B | T | dtype | " + " | ".join(providers)
             + " | single / Opacus ghost | single throughput / non-private | single peak memory / non-private |",
             "|---|---|---|---|" + "---|" * (len(providers) + 3)]
    for (model, batch, seq_len, dtype), rows in by_case(results, ("model", "batch", "seq_len", "dtype")).items():
        cells = []
        for p in providers:
            row = rows.get(p)
            # A provider that did not run: the reason's first word here ("refused", "error"),
            # the whole of it in the results file and the dashboard.
            cells.append(_fmt_ms(row["metrics"]["step_time"]) if _p50(row, "step_time")
                         else (row or {}).get("status", "-").split(":")[0])
        single = rows.get("dpgrad-single")
        single_ms, opacus_ms = _p50(single, "step_time"), _p50(rows.get("opacus-ghost"), "step_time")
        vs_opacus = single_ms / opacus_ms if single_ms and opacus_ms else None
        throughput = _ratio(_p50(single, 'throughput_over_non_private'), single)
        if throughput not in ("-", "flagged"):  # the repeats' lowest and highest, where repeated
            throughput += spread(single["metrics"]["throughput_over_non_private"])
        lines.append(f"| {model} | {batch} | {seq_len} | {dtype} | " + " | ".join(cells)
                     + f" | {_ratio(vs_opacus, single)} | {throughput}"
                     + f" | {_ratio(_p50(single, 'peak_memory_over_non_private'))} |")
    return lines + _flag_notes(results)


def _kernels_table(results: List[dict]) -> List[str]:
    """dpgrad's fastest row per kernel and shape against Opacus, the GEMM, cuBLAS's Gram pair
    (Linear norms), one read of the inputs and the roofline measured in the same run."""
    lines = []
    peaks = {r["provider"]: r["metrics"] for r in results
             if r["shape"].get("kernel") == "roofline" and r.get("status") == "ok"}
    if peaks:
        flops = peaks.get("cublas-gemm", {}).get("tensor_flops", {}).get("p50")
        moved = peaks.get("copy", {}).get("bandwidth", {}).get("p50")
        def rate(v, unit):  # a CPU's TFLOP/s are below 1
            return _cell(v, ".0f" if v is not None and v >= 10 else ".3g", unit)

        lines += [f"Roofline measured in this run: {rate(flops, ' TFLOP/s')} (a large GEMM), "
                  f"{rate(moved, ' GB/s')} (a large copy).", ""]
    lines += ["| kernel | layer | T | B | dpgrad | Opacus | GEMM | cuBLAS Gram | speedup over Opacus | dpgrad / GEMM "
              "| dpgrad / cuBLAS Gram | dpgrad / one read | % of roofline |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kernel, layer, T, B), rows in by_case(results, ("kernel", "layer", "T", "B")).items():
        if kernel == "roofline":
            continue
        timed = [(t, row) for p, row in rows.items() if p.startswith("dpgrad")
                 for t in [_p50(row, "time")] if t is not None]
        best, fastest = min(timed, key=lambda x: x[0], default=(None, None))
        # Per-sample gradients against Opacus's with the norms its optimizer then takes.
        opacus_ms = _p50(rows.get("opacus-with-norm") or rows.get("opacus"), "time")
        gemm_ms, gram_ms = _p50(rows.get("gemm"), "time"), _p50(rows.get("cublas-gram"), "time")
        ms = [_cell(v, ".3f", " ms") for v in (best, opacus_ms, gemm_ms, gram_ms)]
        roofline = _p50(fastest, "roofline_fraction")
        lines.append(f"| {kernel} | {layer} | {T} | {B} | {' | '.join(ms)} | "
                     f"{_ratio(opacus_ms / best if best and opacus_ms else None)} | "
                     f"{_ratio(best / gemm_ms if best and gemm_ms else None)} | "
                     f"{_ratio(best / gram_ms if best and gram_ms else None)} | "
                     f"{_ratio(_p50(fastest, 'time_over_read'))} | {_cell(roofline, '.0%')} |")
    return lines


def _host_overhead_table(results: List[dict]) -> List[str]:
    lines = ["| model | provider | hooked layers | ops | extra ops / layer | syncs | extra syncs | host time "
             "| host time / layer | step time | step time / non-private |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(row, name, fmt):
        return _cell(_p50(row, name), fmt)

    cases = by_case(results, ("model", "batch", "seq_len", "dtype"))
    for row in (row for case in cases.values() for row in case.values()):
        model = row["shape"]["model"]
        if row.get("status") != "ok":
            # As in the DP-step table: the reason's first word; the whole of it in the file.
            lines.append(f"| {model} | {row['provider']} | {row['status'].split(':')[0]} |" + " - |" * 8)
            continue
        lines.append(
            f"| {model} | {row['provider']} | {num(row, 'hooked_layers', '.0f')} | {num(row, 'ops', '.0f')} "
            f"| {num(row, 'extra_ops_per_layer', '.1f')} | {num(row, 'syncs', '.0f')} "
            f"| {num(row, 'extra_syncs', '+.0f')} | {_fmt_ms(row['metrics'].get('host_time'))} "
            f"| {_cell(_p50(row, 'host_time_per_layer'), '.3f', ' ms')} | {_fmt_ms(row['metrics'].get('step_time'))} "
            f"| {_ratio(_p50(row, 'step_time_over_non_private'), row)} |")
    return lines + _flag_notes(results)


def _fsdp_memory_table(results: List[dict]) -> List[str]:
    lines = ["| model | ranks | provider | peak memory / rank | state / rank | peak / DDP | state / DDP |",
             "|---|---|---|---|---|---|---|"]

    def mb(row, name):
        return _cell(_p50(row, name), ".1f", " MB", scale=1e6)

    for row in results:
        if row.get("status") != "ok":
            lines.append(f"| {row['shape']['model']} | {row['shape']['world']} | {row['provider']} | "
                         f"{row['status'].split(':')[0]} | - | - | - |")
            continue
        lines.append(f"| {row['shape']['model']} | {row['shape']['world']} | {row['provider']} | "
                     f"{mb(row, 'peak_memory')} | {mb(row, 'state_memory')} | "
                     f"{_ratio(_p50(row, 'peak_memory_over_ddp'))} | {_ratio(_p50(row, 'state_memory_over_ddp'))} |")
    return lines


def _audit_table(results: List[dict]) -> List[str]:
    lines = ["| noise | canaries | steps | rate | provider | accountant epsilon | audited (one run) | audited (f-DP) "
             "| audited / accountant |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        s = row["shape"]
        head = f"| {s['noise_multiplier']} | {s['canaries']} | {s['steps']} | {s['sample_rate']} | {row['provider']} |"
        if row.get("status") != "ok":
            lines.append(f"{head} {row['status'].split(':')[0]} | - | - | - |")
            continue
        eps, one, fdp = (_p50(row, k) for k in ("accountant_epsilon", "epsilon_one_run", "epsilon_fdp"))
        best = max(one, fdp)
        lines.append(f"{head} {eps:.2f} | {one:.2f} | {fdp:.2f} | {_ratio(best / eps if eps else None)} |")
    return lines


_TABLES = {"dp_step": _dp_step_table, "kernels": _kernels_table, "host_overhead": _host_overhead_table,
           "fsdp_memory": _fsdp_memory_table, "audit": _audit_table}


README_START = "<!-- results: generated by `dpgrad dashboard benchmarks/results/*.json --update-readme docs/results.md` -->"
README_END = "<!-- results: end -->"


def readme_with_results(readme: str, docs: Iterable[dict]) -> str:
    """``readme`` with the text between the results markers replaced by ``markdown(docs)``."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no results block: put {README_START!r} and {README_END!r} "
                         "where the tables go")
    return readme[: start + len(README_START)] + "\n\n" + markdown(docs) + "\n" + readme[end:]


def report_problem(report) -> Optional[str]:
    """What ``summary`` would miss in an autotune report's JSON; None if nothing."""
    if not isinstance(report, dict):
        return "not an object"
    model = report.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("name"), str) or \
            not isinstance(model.get("trainable_layers"), int):
        return "no 'model' with a name and a count of trainable layers"
    if not all(isinstance(report.get(k), str) for k in ("device", "backend")):
        return "no 'device' and 'backend' strings"
    rows = report.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("choice"), str) and (
            r.get("speedup") is None or isinstance(r["speedup"], (int, float))) for r in rows):
        return "no 'rows' of objects with a 'choice' string and a numeric 'speedup'"
    return None


def summary(docs: List[dict], report: Optional[dict] = None, page: Optional[str] = None) -> str:
    """A few lines to end a run with: the machine, the autotune report's model and how often
    each algorithm was chosen, the headline ratios of the DP-step suite (dpgrad single over
    non-private, flagged ones said so) and where the dashboard is."""
    lines = ["summary"]
    machines = sorted({d["machine"]["device"] for d in docs})
    if report is not None:
        chosen: Dict[str, int] = {}
        for row in report["rows"]:
            chosen[row["choice"]] = chosen.get(row["choice"], 0) + 1
        counts = ", ".join(f"{name} x{n}" for name, n in sorted(chosen.items(), key=lambda kv: -kv[1]))
        speedups = sorted(r["speedup"] for r in report["rows"] if r.get("speedup"))
        median = f"; median speedup over Opacus's samplers {statistics.median(speedups):.2f}x" if speedups else ""
        lines.append(f"  autotune report: {report['model']['name']} on {report['device']} ({report['backend']} "
                     f"backend), {report['model']['trainable_layers']} trainable layers: {counts}{median}")
    lines.append(f"  benchmarks on: {'; '.join(machines) if machines else 'no results'}")
    for doc in docs:
        if doc["suite"] != "dp_step":
            continue
        ratios = []
        for case in by_case(doc["results"], ("model", "batch", "seq_len", "dtype")).items():
            (model, batch, seq_len, dtype), rows = case
            single = rows.get("dpgrad-single")
            value = _p50(single, "throughput_over_non_private")
            if value is not None:
                ratios.append(f"{model} B={batch} T={seq_len} {dtype} {_ratio(value, single)}")
        if ratios:
            lines.append(f"  dpgrad single throughput / non-private ({doc['machine']['device']}): " + ", ".join(ratios))
    if page:
        lines.append(f"  dashboard: {page}")
    return "\n".join(textwrap.fill(line, 120, subsequent_indent="    ", break_on_hyphens=False)
                     for line in lines) + "\n"
