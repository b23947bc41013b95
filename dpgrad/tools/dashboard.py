"""``dpgrad dashboard``: one self-contained HTML page from benchmark results files.

The charts are plotly figures, with plotly.js inlined once in the page: nothing is fetched,
so it opens offline (plotly: ``pip install "dpgrad[dashboard]"``). From the top: a table of
contents, the run summary (the lines ``--summary`` prints) and the autotune report's layer
table, then per machine:
- speedup over Opacus and fraction of the roofline per kernel and layer shape (kernels);
- throughput of each DP step over the non-private step's, and peak memory, per model and T
  (dp_step);
- memory per rank under FSDP2 and DDP, and their ratio (fsdp_memory), where there are such results;
- audited epsilons against the accountant's (audit), where there are such results;
- a table of each DP step's host overhead (host_overhead), where there are such results;
then a table of every raw figure and one of the machines.

Timing-derived bars carry p20-p80 whiskers; flagged rows are drawn faded and hatched, with
the flag in their label and a note under the chart; rows that did not run are listed under
it (``dpgrad.tools.dashboard_charts``). Colours: ``dpgrad.tools.dashboard_colours``.

Each chart's ``<figure class="chart">`` records ``data-colours`` (series -> colour); once
plotly has drawn it, the page sets ``data-marks`` (bars drawn), ``data-errorbars`` (whiskers
drawn), ``data-hatched`` (flagged bars drawn hatched) and ``data-drawn-colours`` (each
series' fill as drawn). A chart with nothing to draw
has ``data-empty`` (why) instead, and says it. When every chart is drawn the body gets
``data-charts`` and the console ``dashboard: N charts drawn``; a script error is a console error.
"""

from __future__ import annotations

import html
import json
from typing import List, Optional, Tuple

from dpgrad.tools import dashboard_charts as charts
from dpgrad.tools import dashboard_colours as colours
from dpgrad.tools import dashboard_tables as tables

TITLE = "dpgrad benchmarks"
INSTALL = 'pip install "dpgrad[dashboard]"'


def plotly_missing() -> Optional[str]:
    """Why the page cannot be drawn here (plotly not importable), or None."""
    try:
        import plotly.io  # noqa: F401
        import plotly.offline  # noqa: F401
    except ImportError as exc:
        return (f"the dashboard's charts need plotly, which is not installed here ({exc}): "
                f"run {INSTALL}")
    return None


_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; } h3 { font-size: 15px; }
nav#toc { border: 1px solid #ddd; border-radius: 4px; padding: 4px 16px; background: #fafafa; }
nav#toc ul { margin: 4px 0; padding-left: 20px; } nav#toc li { margin: 1px 0; }
figure.chart { margin: 12px 0 24px; padding: 8px; border: 1px solid #ddd; border-radius: 4px; }
figure.chart figcaption { font-weight: 600; margin-bottom: 6px; }
figure.chart .empty, p.empty { color: #666; font-style: italic; padding: 12px; }
p.note { margin: 4px 8px; font-size: 12px; color: #444; }
p.note.flagged[data-flagged]:not([data-flagged="0"]) { color: #8a4b00; }
ul.not-run, ul.flags { font-size: 12px; color: #555; margin: 4px 8px; }
ul.not-run .who { color: #777; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
"""

# Counts what plotly drew in each chart; no drawing of its own.
_SCRIPT = r"""
window.addEventListener("error", function (e) { console.error("dashboard: " + e.message); });
window.dpgradCharts = {drawn: 0, loaded: false, done: false};
// Once every chart is drawn and the whole page is parsed (a chart can finish before the rest).
function dpgradDone() {
  const state = window.dpgradCharts;
  if (state.done || !state.loaded || state.drawn !== Number(document.body.dataset.chartsExpected)) return;
  state.done = true;
  for (const f of document.querySelectorAll("figure.chart")) {
    const box = f.getBoundingClientRect();
    f.dataset.rect = [box.left + window.scrollX, box.top + window.scrollY, box.width, box.height]
      .map(Math.round).join(",");
  }
  document.body.dataset.charts = window.dpgradCharts.drawn;
  console.log("dashboard: " + window.dpgradCharts.drawn + " charts drawn");
}
document.addEventListener("DOMContentLoaded", function () {
  window.dpgradCharts.loaded = true;
  dpgradDone();
});
window.dpgradDrawn = function (plotId) {
  const gd = document.getElementById(plotId);
  const figure = gd.closest("figure.chart");
  // Each series is two traces: its bars, then an unseen one holding their labels (meta "label").
  const traces = Array.from(gd.querySelectorAll(".barlayer .trace"));
  const bars = traces.filter(function (t, i) { return gd.data[i].meta !== "label"; });
  figure.dataset.marks = bars.reduce(function (n, t) { return n + t.querySelectorAll(".point").length; }, 0);
  figure.dataset.errorbars = gd.querySelectorAll("g.errorbar path.xerror").length;
  figure.dataset.traces = bars.length;
  figure.dataset.hatched = bars.reduce(function (n, t) {
    return n + t.querySelectorAll("path.pattern_filled").length;
  }, 0);
  const drawn = {};
  traces.forEach(function (trace, i) {
    if (gd.data[i].meta === "label") return;
    // A solid bar's fill; a hatched (flagged) bar's outline, drawn in the series' colour.
    for (const path of trace.querySelectorAll(".point path")) {
      const fill = path.style.fill, stroke = path.style.stroke;
      if (fill && fill.startsWith("rgb")) { drawn[gd.data[i].name] = fill; break; }
      if (stroke && stroke.startsWith("rgb")) drawn[gd.data[i].name] = stroke;
    }
  });
  figure.dataset.drawnColours = JSON.stringify(drawn);
  window.dpgradCharts.drawn += 1;
  dpgradDone();
};
"""


def _short(title: str) -> str:
    """A chart's title up to its first bracket, for the table of contents."""
    return title.split(" (", 1)[0]


def _chart_html(chart: "charts.Chart", colour_of: dict) -> Tuple[str, bool]:
    """A chart's <figure>; whether plotly draws it (not when empty)."""
    import plotly.io as pio

    used = {s: colour_of[s] for s in chart.series()}
    attrs = (f'class="chart" id="{chart.id}" data-colours="{html.escape(json.dumps(used))}" '
             f'data-bars="{len(chart.bars)}" data-spread="{sum(b.low is not None for b in chart.bars)}" '
             f'data-timing="{int(chart.timing)}" data-unit="{html.escape(chart.unit)}"')
    caption = f"<figcaption>{html.escape(chart.title)}</figcaption>"
    if not chart.bars:
        return (f'<figure {attrs} data-empty="{html.escape(chart.empty)}">\n{caption}\n'
                f'<div class="empty">{html.escape(chart.empty)}</div>\n{charts.notes(chart)}</figure>'), False
    plot = pio.to_html(charts.plotly_figure(chart, colour_of), full_html=False, include_plotlyjs=False,
                       div_id=f"plot-{chart.id}", default_width="100%",
                       default_height=f"{charts.bar_height(chart)}px",
                       config={"displaylogo": False, "responsive": True, "displayModeBar": False},
                       post_script="window.dpgradDrawn('{plot_id}');")
    clash = "".join(f'<p class="note clash">Colours hard to tell apart: {html.escape(p)}</p>'
                    for p in colours.pair_problems(used))  # only past the palette's thirteen series
    return f"<figure {attrs}>\n{caption}\n{plot}\n{charts.notes(chart)}{clash}</figure>", True


def _machine_parts(docs: List[dict]) -> List[Tuple[str, List[dict], list]]:
    """Per machine (device): its title, its results files and its charts in page order."""
    parts = []
    devices = list(dict.fromkeys(d["machine"]["device"] for d in docs))
    for i, device in enumerate(devices):
        mine = [d for d in docs if d["machine"]["device"] == device]
        found = charts.kernel_charts(mine, i) + charts.dp_step_charts(mine, i) + charts.fsdp_charts(mine, i)
        audit = charts.audit_chart(mine, i)
        parts.append((device, mine, found + ([audit] if audit else [])))
    return parts


def render(docs: List[dict], report: Optional[dict] = None) -> str:
    """The dashboard page for results files loaded by ``dpgrad.tools.results.load``, with an
    autotune report's JSON (``dpgrad autotune-report --json``) when given. Raises ImportError
    naming the install command where plotly is missing."""
    missing = plotly_missing()
    if missing:
        raise ImportError(missing)
    import plotly.offline

    parts = _machine_parts(docs)
    colour_of = colours.assign([c.series() for _, _, found in parts for c in found])
    toc = ['<li><a href="#summary">Run summary</a></li>', '<li><a href="#autotune">Autotune report</a></li>']
    body, expected = [], 0
    for i, (device, mine, found) in enumerate(parts):
        m = mine[0]["machine"]
        about = (f"run {m['date']}, commit {m['commit']}, torch {m['torch']}"
                 + "".join(f", {name} {m[key]}" for key, name in (("cuda", "CUDA"), ("triton", "Triton"),
                                                                   ("opacus", "Opacus")) if m.get(key)))
        body.append(f'<section id="machine-{i}"><h2>{html.escape(device)}</h2>\n<p>{html.escape(about)}</p>')
        links = []
        for chart in found:
            text, drawn = _chart_html(chart, colour_of)
            body.append(text)
            expected += drawn
            links.append(f'<li><a href="#{chart.id}">{html.escape(_short(chart.title))}</a></li>')
        host = charts.rows_of(mine, "host_overhead")
        if host:
            body.append(f'<h3 id="host-{i}">Host overhead per DP step (counts of one step; times: medians; extra: '
                        f'over non-private; ⚠: a flagged row\'s timing)</h3>')
            body.append(tables.host_overhead_table(host, f"host-overhead-{i}"))
            links.append(f'<li><a href="#host-{i}">Host overhead per DP step</a></li>')
        body.append("</section>")
        toc.append(f'<li><a href="#machine-{i}">{html.escape(device)}</a><ul>{"".join(links)}</ul></li>')
    toc += ['<li><a href="#raw-figures">Raw figures</a></li>', '<li><a href="#machine-info">Machines</a></li>']
    sources = ", ".join(html.escape(d.get("path", d["suite"])) for d in docs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{TITLE}</title>
<style>{_STYLE}</style>
<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>
<script>{_SCRIPT}</script></head>
<body data-charts-expected="{expected}">
<h1>{TITLE}</h1>
<p>From {sources}. Medians of synchronised runs (host times: of the host issuing a step, not waiting for its
end); ratios are to the baselines of the same run. Whiskers: p20 to p80. Hover a bar for its figures.</p>
<nav id="toc"><h2>Contents</h2><ul>{"".join(toc)}</ul></nav>
<section id="summary"><h2>Run summary</h2>{tables.summary_section(docs, report)}</section>
<section id="autotune"><h2>Autotune report</h2>{tables.autotune_section(report)}</section>
{chr(10).join(body)}
<section id="raw-figures"><h2>Raw figures</h2>{tables.raw_table(docs)}</section>
<section id="machine-info"><h2>Machines</h2>{tables.machines_table(docs)}</section>
</body></html>
"""
