"""The dashboard's text: units chosen from the values, and its HTML sections without charts
(the run summary, the autotune report, host overhead, rows that did not run, every raw
figure and the machines). Everything here is escaped HTML, built from the results files
and the autotune report's JSON."""

from __future__ import annotations

import html
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from dpgrad.tools import results_tables
from dpgrad.tools.results import COUNTS

BYTE_UNITS = (("B", 1.0), ("KiB", 2.0 ** 10), ("MiB", 2.0 ** 20), ("GiB", 2.0 ** 30), ("TiB", 2.0 ** 40))
# Times are recorded in ms.
TIME_UNITS = (("ns", 1e-6), ("µs", 1e-3), ("ms", 1.0), ("s", 1e3))


def _unit(values: Iterable[float], units: Sequence[Tuple[str, float]]) -> Tuple[str, float]:
    """The largest of ``units`` (name, size) that the largest value is at least one of (the
    smallest unit for no values or zeros)."""
    top = max((abs(v) for v in values if v is not None), default=0.0)
    chosen = units[0]
    for unit in units:
        if top >= unit[1]:
            chosen = unit
    return chosen


def byte_unit(values: Iterable[float]) -> Tuple[str, float]:
    """(name, bytes) of the unit for a set of byte counts: 150e6 -> ("MiB", 2**20)."""
    return _unit(values, BYTE_UNITS)


def time_unit(values_ms: Iterable[float]) -> Tuple[str, float]:
    """(name, ms) of the unit for a set of times in ms: 0.3 -> ("µs", 1e-3)."""
    return _unit(values_ms, TIME_UNITS)


def figure(value: float) -> str:
    """Three significant figures, no exponent: 113, 11.3, 1.13, 0.113."""
    if value == 0:
        return "0"
    digits = max(0, 2 - int(f"{abs(value):e}".split("e")[1]))
    text = f"{value:.{digits}f}"
    return text if abs(value) < 1000 else f"{value:,.0f}"


def human_bytes(value: Optional[float]) -> str:
    """``113 MiB`` for 118e6 bytes; "-" for none."""
    if value is None:
        return "-"
    name, size = byte_unit([value])
    return f"{value:.0f} B" if name == "B" else f"{figure(value / size)} {name}"


def human_ms(value: Optional[float]) -> str:
    """A time recorded in ms in the unit that fits it: ``1.29 ms``, ``315 µs``; "-" for none."""
    if value is None:
        return "-"
    name, size = time_unit([value])
    return f"{figure(value / size)} {name}"


def human(value: Optional[float], unit: str) -> str:
    """A recorded value with its results-file unit, bytes and times in the unit that fits."""
    if value is None:
        return "-"
    if unit == "bytes":
        return human_bytes(value)
    if unit == "ms":
        return human_ms(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{value:.0f}"
    return f"{value:.4g}"


def esc(value) -> str:
    return html.escape(str(value))


def table(head: Sequence[str], rows: Iterable[Sequence[str]], table_id: str = "", cls: str = "") -> str:
    """An HTML table of already escaped cells."""
    attrs = (f' id="{table_id}"' if table_id else "") + (f' class="{cls}"' if cls else "")
    out = [f"<table{attrs}><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows]
    return "\n".join(out) + "</tbody></table>"


def shape_text(row: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in row["shape"].items())


def not_run_list(rows: List[dict], what: str = "not drawn") -> str:
    """Rows that did not run (status not "ok"), grouped by their status: a list under a chart."""
    by_status: Dict[str, List[dict]] = {}
    for r in rows:
        by_status.setdefault(r["status"], []).append(r)
    if not by_status:
        return ""
    items = []
    for status, group in by_status.items():
        who = "".join(f"<li>{esc(r['provider'])} ({esc(shape_text(r))})</li>" for r in group)
        items.append(f"<li><details><summary><b>{len(group)} {'row' if len(group) == 1 else 'rows'} {what}</b>: "
                     f"{esc(status)}</summary><ul class=\"who\">{who}</ul></details></li>")
    return f'<ul class="not-run" data-rows="{len(rows)}">' + "".join(items) + "</ul>"


# ------------------------------------------------------------------------------ sections
def summary_section(docs: List[dict], report: Optional[dict]) -> str:
    """What ``dpgrad dashboard --summary`` prints at the end of a run, as a list."""
    text = results_tables.summary(docs, report)
    items: List[str] = []
    for line in text.splitlines()[1:]:  # the first line is the word "summary"
        if line.startswith("    ") and items:
            items[-1] += " " + line.strip()  # a wrapped line goes on
        else:
            items.append(line.strip())
    return "<ul>" + "".join(f"<li>{esc(item)}</li>" for item in items) + "</ul>"


AUTOTUNE_HEAD = ["layer", "type", "shape", "kind", "choice", "ms", "Opacus ms", "speedup", "extra memory (est.)",
                 "source"]


def autotune_section(report: Optional[dict]) -> str:
    """The autotune report's layer table (as ``dpgrad autotune-report --json`` writes it)."""
    if report is None:
        return ('<p class="empty">No autotune report given: pass its JSON with '
                '<code>--summary build/autotune-report.json</code> (as <code>make report</code> does).</p>')
    model, settings = report["model"], report.get("settings") or {}
    about = (f"{model['name']}, {model['trainable_layers']} trainable layers"
             + (f", {model['parameters'] / 1e6:.2f}M parameters" if isinstance(model.get("parameters"), int) else "")
             + (f"; batch {settings['batch_size']} x {settings['seq_len']} tokens, {settings.get('dtype', '')}"
                if "batch_size" in settings and "seq_len" in settings else "")
             + f"; device {report['device']}, {report['backend']} backend"
             + (f"; run {report['date']}" if report.get("date") else "")
             + (f", commit {report['commit']}" if report.get("commit") else ""))
    lines = [f"<p>{esc(about)}</p>"]
    if report.get("notice"):
        lines.append(f'<p class="note">{esc(report["notice"])}</p>')
    rows = []
    for r in report["rows"]:
        speedup = r.get("speedup")
        rows.append([esc(r.get("name", "-")), esc(r.get("type", "-")), esc(r.get("shape", "-")),
                     esc(r.get("kind") or "-"), esc(r["choice"]), esc(human_ms(r.get("chosen_ms"))),
                     esc(human_ms(r.get("opacus_ms"))),
                     esc(f"{speedup:.2f}x" if speedup is not None else (r.get("opacus_note") or "-")),
                     esc(human_bytes(r.get("extra_bytes"))), esc(_source(r))])
    lines.append(table(AUTOTUNE_HEAD, rows, "autotune-layers"))
    if isinstance(report.get("step_ms"), (int, float)):
        lines.append(f"<p>One tuned DP step: {esc(human_ms(report['step_ms']))}. ms: the chosen candidate's time in "
                     "that run; speedup = Opacus ms / ms, on the same inputs.</p>")
    return "\n".join(lines)


def _source(row: dict) -> str:
    source = row.get("source") or "-"
    if row.get("rounds"):
        source += f", {row['rounds']} rounds" + ("" if row.get("stable", True) else ", unstable: not stored")
    return source


# Host overhead columns: metric, heading; times in the unit that fits.
HOST_COLUMNS = [("hooked_layers", "hooked layers"), ("ops", "ops"), ("extra_ops_per_layer", "extra ops / layer"),
                ("syncs", "syncs"), ("extra_syncs", "extra syncs"), ("first_step_probe_ops", "first step: probe ops"),
                ("first_step_probe_syncs", "first step: probe syncs"),
                ("first_step_probe_time", "first step: probe time"), ("cuda_syncs", "CUDA syncs"),
                ("launches", "launches"), ("host_time", "host time"), ("host_time_per_layer", "host time / layer"),
                ("step_time", "step time"), ("step_time_over_non_private", "step time / non-private")]


def host_overhead_table(rows: List[dict], table_id: str) -> str:
    """One row per model and provider: what the host is asked to do in a step, and the times
    (medians); a flagged row's timings shown with the flag."""
    body = []
    for r in rows:
        head = [esc(r["shape"].get(k, "-")) for k in ("model", "batch", "seq_len", "dtype")] + [esc(r["provider"])]
        if r["status"] != "ok":
            body.append(head + [esc(r["status"])] + [""] * (len(HOST_COLUMNS) - 1))
            continue
        cells = []
        for name, _ in HOST_COLUMNS:
            m = r["metrics"].get(name)
            if m is None:
                cells.append("-")
                continue
            text = f"{m['p50']:.2f}" if m["unit"] == "ratio" else human(m["p50"], m["unit"])
            if r.get("flags") and name not in COUNTS:
                text += " ⚠"
            cells.append(esc(text))
        body.append(head + cells)
    flagged = [r for r in rows if r.get("flags")]
    notes = "".join(f"<li>⚠ {esc(r['provider'])} ({esc(shape_text(r))}): {esc('; '.join(r['flags']))}</li>"
                    for r in flagged)
    return (table(["model", "B", "T", "dtype", "provider", *(h for _, h in HOST_COLUMNS)], body, table_id)
            + (f'<ul class="flags">{notes}</ul>' if notes else ""))


def raw_table(docs: List[dict]) -> str:
    """Every figure of every results file: p20, p50 and p80 in units that fit each value."""
    body = []
    for d in docs:
        for r in d["results"]:
            status = r["status"] + (f" (flagged: {'; '.join(r['flags'])})" if r.get("flags") else "")
            lines = list(r["metrics"].items()) or [(None, None)]
            for name, m in lines:
                quantiles = [human(m[q], m["unit"]) if m else "" for q in ("p20", "p50", "p80")]
                body.append([esc(v) for v in (d["suite"], r["benchmark"], shape_text(r), r["provider"], status,
                                              name or "", *quantiles, m["unit"] if m else "")])
    return table(["suite", "benchmark", "shape", "provider", "status", "metric", "p20", "p50", "p80", "unit"],
                 body, "raw")


def machines_table(docs: List[dict]) -> str:
    keys = list(dict.fromkeys(k for d in docs for k in d["machine"]))
    body = [[esc(d.get("path") or d["suite"])] + [esc("-" if d["machine"].get(k) is None else d["machine"][k])
                                                   for k in keys] for d in docs]
    return table(["file", *map(esc, keys)], body, "machines")
