"""The dashboard's charts: what each draws from the results files (bars, their p20-p80
whiskers, their flags, the rows that did not run) and the plotly figure that draws it.

Every chart is horizontal grouped bars: a group per case (a layer shape, a model and T), a
bar per series (a provider). A timing-derived bar carries a whisker from p20 to p80; a ratio
a / b, whose file records one figure, gets the interval the two rows' times allow:
``ratio * (a.p20 / a.p50) * (b.p50 / b.p80)`` to ``ratio * (a.p80 / a.p50) * (b.p50 / b.p20)``.
A flagged row's timing figures are drawn faded and hatched, with the flag in their label;
figures that do not depend on timing (``results.COUNTS``: bytes, counts) are drawn plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from dpgrad.tools.dashboard_tables import byte_unit, esc, figure, not_run_list, shape_text
from dpgrad.tools.results import COUNTS, IMPOSSIBLE, SHAPE_KEYS, WIDE_SPREAD, baseline, by_case

FLAGGED_OPACITY = 0.55
RATIO_SPREAD = ("Whiskers: p20 to p80. A ratio a / b is recorded as one figure; its whisker runs from "
                "ratio x (a's p20 / a's p50) x (b's p50 / b's p80) to ratio x (a's p80 / a's p50) x "
                "(b's p50 / b's p20), the widest the two rows' spreads of time allow.")


@dataclass
class Bar:
    group: str
    series: str
    value: float  # in the chart's unit
    low: Optional[float] = None  # the whisker's ends, in the chart's unit; None: no spread recorded
    high: Optional[float] = None
    flags: Sequence[str] = ()
    detail: str = ""  # the row's shape, for the hover


@dataclass
class Chart:
    id: str
    title: str
    axis: str  # the value axis' title, with its unit
    unit: str  # after each value: "x", "%", "MiB"
    empty: str  # why nothing is drawn, when nothing is
    bars: List[Bar] = field(default_factory=list)
    ref: Optional[float] = None  # a dashed line (1x, 100%)
    spread: str = ""  # how the whiskers were derived
    timing: bool = False  # timing-derived bars: whiskers expected
    not_run: List[dict] = field(default_factory=list)

    def series(self) -> List[str]:
        return list(dict.fromkeys(b.series for b in self.bars))


def rows_of(docs: List[dict], suite: str) -> List[dict]:
    return [r for d in docs if d["suite"] == suite for r in d["results"]]


def interval(value: float, over: Optional[dict], under: Optional[dict]) -> Tuple[Optional[float], Optional[float]]:
    """The whisker of ``value`` = (a time ``over``) / (a time ``under``), either side None for a
    constant; (None, None) where a time it needs is missing or not positive."""
    low = high = value
    for m, upper in ((over, True), (under, False)):
        if m is None:
            continue
        if not all(m.get(q, 0) > 0 for q in ("p20", "p50", "p80")):
            return None, None
        if upper:
            low, high = low * m["p20"] / m["p50"], high * m["p80"] / m["p50"]
        else:
            low, high = low * m["p50"] / m["p80"], high * m["p50"] / m["p20"]
    return low, high


def _flags(row: dict, metric: str) -> List[str]:
    return [] if metric in COUNTS else list(row.get("flags") or [])


def short_flag(flag: str) -> str:
    """A flag in a few words, for a bar's label."""
    if flag.startswith("wide spread"):
        return "noisy: p20-p80 " + flag.split(" is ", 1)[-1].replace(" of the median", "").strip() + " of median"
    if flag == IMPOSSIBLE:
        return "impossible"
    if flag == "its non-private baseline is flagged":
        return "baseline flagged"
    return flag


def _reason(flag: str) -> str:
    if flag.startswith("wide spread"):
        return f"wide spread (p20 to p80 of its time over {WIDE_SPREAD:.0%} of the median)"
    return flag


def _kernel_group(r: dict) -> str:
    s = r["shape"]
    return f"{s['kernel']} | {s['layer']} | T={s['T']} B={s['B']}"


def kernel_charts(docs: List[dict], i: int) -> List[Chart]:
    """Speedup over Opacus and fraction of the roofline per layer shape (the kernels suite)."""
    speedup = Chart(f"speedup-{i}", "Speedup over Opacus per layer shape (Opacus time / dpgrad time, medians)",
                    "speedup over Opacus (x)", "x", "no kernel results for this machine", ref=1.0,
                    spread=RATIO_SPREAD, timing=True)
    roofline = Chart(f"roofline-{i}", "Fraction of the roofline per layer shape (the least time the work takes at "
                     "the GEMM FLOP/s and copy bytes/s measured in the same run, over the time, medians)",
                     "fraction of the roofline (%)", "%", "no roofline figures for this machine", ref=100.0,
                     spread="Whiskers: p20 to p80 of the row's time (the fraction is a fixed least time over it; "
                            "the roofline runs' own spread is left out).", timing=True)
    rows = [r for r in rows_of(docs, "kernels") if r["shape"].get("kernel") != "roofline"]
    for case in by_case(rows, SHAPE_KEYS["kernels"]).values():
        opacus = case.get("opacus-with-norm") or case.get("opacus")
        opacus_time = opacus["metrics"].get("time") if opacus and opacus["status"] == "ok" else None
        for provider, r in case.items():
            if r["status"] != "ok":
                continue
            time = r["metrics"].get("time")
            for chart, name, scale, over in ((speedup, "speedup_over_opacus", 1.0, opacus_time),
                                             (roofline, "roofline_fraction", 100.0, None)):
                m = r["metrics"].get(name)
                if m is None:
                    continue
                low, high = interval(m["p50"] * scale, over, time) if time else (None, None)
                if name == "speedup_over_opacus" and over is None:
                    low = high = None
                chart.bars.append(Bar(_kernel_group(r), provider, m["p50"] * scale, low, high, _flags(r, name),
                                      shape_text(r)))
    failed = [r for r in rows if r["status"] != "ok"]
    speedup.not_run = [r for r in failed if r["provider"].startswith("dpgrad")]
    roofline.not_run = failed
    return [speedup, roofline]


def _step_group(r: dict) -> str:
    s = r["shape"]
    return f"{s['model']} | B={s['batch']} T={s['seq_len']} {s['dtype']}"


def dp_step_charts(docs: List[dict], i: int) -> List[Chart]:
    """Throughput over the non-private step's, and peak memory, per model and T (dp_step)."""
    throughput = Chart(f"throughput-{i}", "Throughput of each DP step over the non-private step's, per model and T "
                       "(non-private time / DP time, medians)", "throughput / non-private (x)", "x",
                       "no DP-step results for this machine", ref=1.0, spread=RATIO_SPREAD, timing=True)
    memory = Chart(f"memory-{i}", "Peak memory per step", "peak memory", "B", "no peak-memory figures for this machine")
    rows = rows_of(docs, "dp_step")
    peaks = []
    for case in by_case(rows, SHAPE_KEYS["dp_step"]).values():
        for provider, r in case.items():
            if r["status"] != "ok":
                continue
            m = r["metrics"]
            ratio = m.get("throughput_over_non_private")
            if ratio is not None and not provider.startswith("non-private"):
                base = baseline(case, provider)
                base_time = base["metrics"].get("step_time") if base and base["status"] == "ok" else None
                low, high = interval(ratio["p50"], base_time, m.get("step_time")) if base_time else (None, None)
                throughput.bars.append(Bar(_step_group(r), provider, ratio["p50"], low, high,
                                           _flags(r, "throughput_over_non_private"), shape_text(r)))
            if "peak_memory" in m:
                peaks.append((r, m["peak_memory"]["p50"]))
    unit, size = byte_unit(v for _, v in peaks)
    memory.unit, memory.axis = unit, f"peak memory ({unit})"
    memory.bars = [Bar(_step_group(r), r["provider"], v / size, detail=shape_text(r)) for r, v in peaks]
    failed = [r for r in rows if r["status"] != "ok"]
    throughput.not_run = [r for r in failed if not r["provider"].startswith("non-private")]
    memory.not_run = failed
    return [throughput, memory]


def fsdp_charts(docs: List[dict], i: int) -> List[Chart]:
    """Memory per rank under FSDP2 and DDP, and FSDP2's over DDP's (fsdp_memory); none
    without such results."""
    rows = rows_of(docs, "fsdp_memory")
    if not rows:
        return []
    per_rank = Chart(f"fsdp-memory-{i}", "Memory per rank under FSDP2 and DDP (largest over the ranks: peak of a "
                     "step; state: parameters, gradients and optimizer state)", "bytes per rank", "B",
                     "no FSDP2 memory figures for this machine")
    ratios = Chart(f"fsdp-ratio-{i}", "FSDP2's memory per rank over DDP's, same step and ranks",
                   "FSDP2 / DDP (x)", "x", "no FSDP2 rows with a DDP row to compare", ref=1.0)
    figures = []
    for r in rows:
        if r["status"] != "ok":
            continue
        s = r["shape"]
        for what, label in (("peak_memory", "peak"), ("state_memory", "state")):
            group = f"{s['model']} | {s['world']} ranks | {label}"
            if what in r["metrics"]:
                figures.append((group, r, r["metrics"][what]["p50"]))
            over = r["metrics"].get(f"{what}_over_ddp")
            if over is not None:
                ratios.bars.append(Bar(f"{group} / DDP", r["provider"], over["p50"], detail=shape_text(r)))
    unit, size = byte_unit(v for _, _, v in figures)
    per_rank.unit, per_rank.axis = unit, f"bytes per rank ({unit})"
    per_rank.bars = [Bar(g, r["provider"], v / size, detail=shape_text(r)) for g, r, v in figures]
    per_rank.not_run = [r for r in rows if r["status"] != "ok"]
    ratios.not_run = [r for r in per_rank.not_run if r["provider"].startswith("fsdp2")]
    return [per_rank, ratios]


def audit_chart(docs: List[dict], i: int) -> Optional[Chart]:
    """Audited epsilons against the accountant's, per noise multiplier; None without audits."""
    rows = rows_of(docs, "audit")
    if not rows:
        return None
    chart = Chart(f"audit-{i}", "Audited epsilon (one-run and f-DP bounds, 95%) against the accountant's, dpgrad's "
                  "training and the idealised Gaussian mechanism", "epsilon", "", "no audit results",
                  spread="Whiskers: p20 to p80 of the audited epsilons over the seeds of a case.")
    seen = set()
    for r in rows:
        if r["status"] != "ok":
            continue
        s = r["shape"]
        group = f"noise {s['noise_multiplier']} | {s['canaries']} canaries, {s['steps']} steps"
        pairs = [(f"{r['provider']} one-run", "epsilon_one_run"), (f"{r['provider']} f-DP", "epsilon_fdp")]
        if group not in seen:
            pairs.insert(0, ("accountant", "accountant_epsilon"))
            seen.add(group)
        for series, name in pairs:
            m = r["metrics"].get(name)
            if m is not None:
                chart.bars.append(Bar(group, series, m["p50"], m["p20"], m["p80"], _flags(r, name), shape_text(r)))
    chart.not_run = [r for r in rows if r["status"] != "ok"]
    return chart


# ------------------------------------------------------------------------------ drawing
def _label(bar: Bar, unit: str) -> str:
    text = figure(bar.value) + ("" if unit in ("", "x", "%") else " ") + unit
    return text + "".join(f" ⚠ {short_flag(f)}" for f in bar.flags)


def _hover(bar: Bar, unit: str) -> str:
    lines = [f"<b>{esc(bar.series)}</b>", esc(bar.group), esc(_label(Bar(bar.group, bar.series, bar.value), unit))]
    if bar.low is not None and bar.high is not None:
        lines.append(f"p20-p80: {figure(bar.low)} to {figure(bar.high)} {esc(unit)}")
    lines += [f"⚠ flagged: {esc(f)}" for f in bar.flags]
    if bar.detail:
        lines.append(f"<span style='font-size:10px'>{esc(bar.detail)}</span>")
    return "<br>".join(lines)


def bar_height(chart: Chart) -> int:
    """Pixels: a band per group with room for each series' bar, the legend's rows above."""
    groups, n = len({b.group for b in chart.bars}), len(chart.series())
    legend_rows = 1 + sum(len(s) + 4 for s in chart.series()) // 120
    return 70 + 22 * legend_rows + groups * max(26, int(n * 11 / 0.75))


def plotly_figure(chart: Chart, colours: Dict[str, str]):
    """The plotly figure that draws ``chart`` in the page's ``colours`` (series -> colour)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for series in chart.series():
        bars = [b for b in chart.bars if b.series == series]
        flagged = [bool(b.flags) for b in bars]
        # No whisker (not a zero-length one) where no spread is known.
        plus = [None if b.high is None else max(0.0, b.high - b.value) for b in bars]
        minus = [None if b.low is None else max(0.0, b.value - b.low) for b in bars]
        spread = any(b.low is not None for b in bars)
        fig.add_trace(go.Bar(
            name=series, orientation="h", y=[b.group for b in bars], x=[b.value for b in bars], offsetgroup=series,
            marker=dict(color=colours[series], line=dict(color=colours[series], width=1),
                        opacity=[FLAGGED_OPACITY if f else 1.0 for f in flagged],
                        pattern=dict(shape=["/" if f else "" for f in flagged], fgcolor="#222222", size=6,
                                     solidity=0.3)),
            error_x=dict(type="data", symmetric=False, array=plus, arrayminus=minus, visible=spread,
                         color="#333333", thickness=1.2, width=3),
            customdata=[_hover(b, chart.unit) for b in bars], hovertemplate="%{customdata}<extra></extra>",
        ))
        # The labels: an unseen bar in the same slot reaching the whisker's end, its text just past it.
        fig.add_trace(go.Bar(
            name=series, orientation="h", y=[b.group for b in bars], offsetgroup=series, meta="label",
            x=[max(b.value, b.high if b.high is not None else b.value) for b in bars],
            marker=dict(color="rgba(0,0,0,0)", line=dict(width=0)), showlegend=False, hoverinfo="skip",
            text=[_label(b, chart.unit) for b in bars], textposition="outside", cliponaxis=False,
            textfont=dict(size=10, color="#222222"),
        ))
    fig.update_layout(
        barmode="group", bargap=0.25, bargroupgap=0.0, height=bar_height(chart), autosize=True,
        margin=dict(l=10, r=170, t=10, b=45), plot_bgcolor="#ffffff", paper_bgcolor="#ffffff",
        font=dict(family="system-ui, sans-serif", size=12, color="#222222"), hoverlabel=dict(align="left"),
        legend=dict(orientation="h", x=0, xanchor="left", y=1.0, yanchor="bottom", traceorder="normal",
                    font=dict(size=12)),
        xaxis=dict(title=dict(text=chart.axis), rangemode="tozero", gridcolor="#e6e6e6", zerolinecolor="#999999",
                   automargin=True),
        yaxis=dict(type="category", autorange="reversed", automargin=True, tickfont=dict(size=11)),
    )
    if chart.ref is not None:
        fig.add_vline(x=chart.ref, line=dict(color="#555555", dash="dash", width=1))
        top = max([chart.ref] + [max(b.value, b.high or 0.0) for b in chart.bars])
        fig.update_xaxes(range=[0, top * 1.06])  # the reference line inside the plot, not on its edge
    return fig


def notes(chart: Chart) -> str:
    """The lines under a chart: how its whiskers were derived, how many bars are flagged and
    why, and the rows that did not run."""
    out = []
    if chart.spread and any(b.low is not None for b in chart.bars):
        out.append(f'<p class="note spread">{esc(chart.spread)}</p>')
    flagged = [b for b in chart.bars if b.flags]
    if chart.bars:
        reasons: Dict[str, int] = {}
        for b in flagged:
            for f in b.flags:
                reasons[_reason(f)] = reasons.get(_reason(f), 0) + 1
        why = "; ".join(f"{n} {reason}" for reason, n in reasons.items())
        text = (f"{len(flagged)} of {len(chart.bars)} bars flagged, drawn faded and hatched with ⚠ in their labels: "
                f"{why}." if flagged else f"No bar flagged ({len(chart.bars)} drawn).")
        out.append(f'<p class="note flagged" data-flagged="{len(flagged)}">{esc(text)}</p>')
    out.append(not_run_list(chart.not_run, "not drawn"))
    return "\n".join(out)
