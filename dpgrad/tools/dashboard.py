"""``dpgrad dashboard``: one self-contained HTML page from benchmark results files.

The page embeds the results as JSON and draws its charts with a few lines of its own
JavaScript into SVG: nothing is fetched, so it opens offline. Per machine:
- speedup over Opacus per kernel and layer shape (the kernels suite);
- throughput of each DP step over the non-private step's, per model and T (dp_step);
- peak memory per model, T and provider (dp_step; on a CPU the most a step allocates at once);
- a table of each DP step's host overhead against the non-private step's (host_overhead:
  operations dispatched and host waits per step, per hooked layer, host and step times),
  where the machine has such results;
then a table of every raw figure and one of the machines. Each chart, once drawn, carries
``data-marks`` (bars drawn) or ``data-empty`` (why there is nothing to draw); the page logs
``dashboard: N charts drawn`` to the console, and any script error as a console error.
"""

from __future__ import annotations

import html
import json
from typing import List

from dpgrad.tools.results import COUNTS

TITLE = "dpgrad benchmarks"

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; } h3 { font-size: 15px; }
figure.chart { margin: 12px 0 24px; padding: 8px; border: 1px solid #ddd; border-radius: 4px; }
figure.chart figcaption { font-weight: 600; margin-bottom: 6px; }
figure.chart .empty { color: #777; font-style: italic; padding: 12px; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
"""

# Draws every chart from DATA; no library, no network.
_SCRIPT = r"""
(function () {
  // One colour per series (a provider, an audit's estimate), the same in every chart of the
  // page, given in the order the series are first drawn; past the palette, hues a golden angle apart.
  const COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#332288",
                  "#117733", "#882255", "#999933", "#dd7788", "#44aa99", "#661100", "#e69f00", "#000000",
                  "#6699cc", "#aa4499", "#ddcc77", "#8c564b"];
  const SERIES = [];
  function colorOf(name) {
    let i = SERIES.indexOf(name);
    if (i < 0) { SERIES.push(name); i = SERIES.length - 1; }
    return i < COLORS.length ? COLORS[i] : "hsl(" + Math.round((i * 137.508) % 360) + ", 65%, 40%)";
  }
  const SVG = "http://www.w3.org/2000/svg";
  // A flagged row's timings are not figures: only its counts (and bytes) are shown.
  const COUNTS = new Set(JSON.parse(document.getElementById("counts").textContent));
  const flagged = row => Boolean(row.flags && row.flags.length);
  const p50 = (row, name) => (row.status === "ok" && row.metrics[name] && (!flagged(row) || COUNTS.has(name)))
    ? row.metrics[name].p50 : null;
  const shapeKey = (s, keys) => keys.map(k => s[k]).join(" | ");

  function el(tag, attrs, parent) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  // Horizontal grouped bars: groups [{label, bars: [{series, value}]}], a reference line at ref.
  function bars(figure, groups, series, unit, ref) {
    if (!groups.length) return 0;
    const longest = Math.max(...groups.map(g => g.label.length));
    const barH = 14, gap = 8, left = 12 + 6.5 * longest, width = 520, right = 80;
    const rows = groups.reduce((n, g) => n + g.bars.length, 0);
    const height = rows * barH + groups.length * gap + 40;
    const max = Math.max(ref || 0, ...groups.flatMap(g => g.bars.map(b => b.value))) * 1.05 || 1;
    const svg = el("svg", {width: left + width + right, height: height, role: "img"}, figure);
    let y = 10, marks = 0;
    for (const g of groups) {
      el("text", {x: 4, y: y + 11, "font-size": 12}, svg).textContent = g.label;
      for (const b of g.bars) {
        const w = Math.max(1, width * b.value / max);
        el("rect", {x: left, y: y, width: w, height: barH - 2,
                    fill: colorOf(b.series), "class": "bar", "data-series": b.series}, svg);
        el("text", {x: left + w + 4, y: y + 11, "font-size": 11}, svg).textContent =
          b.value.toFixed(b.value < 10 ? 2 : 0) + " " + unit;
        y += barH; marks += 1;
      }
      y += gap;
    }
    if (ref) {
      const x = left + width * ref / max;
      el("line", {x1: x, x2: x, y1: 4, y2: y, stroke: "#333", "stroke-dasharray": "4 3"}, svg);
      el("text", {x: x + 3, y: y + 14, "font-size": 11}, svg).textContent = ref + " " + unit;
    }
    const legend = document.createElement("div");
    legend.className = "legend";
    for (const s of series) {
      const item = document.createElement("span");
      item.innerHTML = '<i style="background:' + colorOf(s) + '"></i>';
      item.dataset.series = s;
      item.dataset.color = colorOf(s);
      item.appendChild(document.createTextNode(s));
      legend.appendChild(item);
    }
    figure.appendChild(legend);
    return marks;
  }

  function chart(section, id, caption, draw, emptyWhy) {
    const figure = document.createElement("figure");
    figure.className = "chart"; figure.id = id;
    const cap = document.createElement("figcaption");
    cap.textContent = caption;
    figure.appendChild(cap);
    section.appendChild(figure);
    const marks = draw(figure);
    if (marks > 0) { figure.dataset.marks = marks; }
    else {
      figure.dataset.empty = emptyWhy;
      const note = document.createElement("div");
      note.className = "empty"; note.textContent = emptyWhy;
      figure.appendChild(note);
    }
  }

  // Where each chart is on the page, for checks on a screenshot.
  function recordRects() {
    for (const figure of document.querySelectorAll("figure.chart")) {
      const box = figure.getBoundingClientRect();
      figure.dataset.rect = [box.left + window.scrollX, box.top + window.scrollY, box.width, box.height]
        .map(Math.round).join(",");
    }
  }

  function rowsOf(docs, suite) { return docs.filter(d => d.suite === suite).flatMap(d => d.results); }

  // A kernels metric per kernel, layer shape and provider (times scale).
  function kernelMetric(figure, docs, metric, scale, unit, ref) {
    const groups = [], series = [];
    for (const r of rowsOf(docs, "kernels")) {
      const v = p50(r, metric);
      if (v === null || r.shape.kernel === "roofline") continue;
      if (!series.includes(r.provider)) series.push(r.provider);
      const label = shapeKey(r.shape, ["kernel", "layer"]) + " | T=" + r.shape.T;
      let g = groups.find(g => g.label === label);
      if (!g) { g = {label: label, bars: []}; groups.push(g); }
      g.bars.push({series: r.provider, value: v * scale});
    }
    return bars(figure, groups, series, unit, ref);
  }

  function dpStep(figure, docs, metric, scale, unit, ref) {
    const groups = [], series = [];
    for (const r of rowsOf(docs, "dp_step")) {
      const v = p50(r, metric);
      if (v === null || (metric === "throughput_over_non_private" && r.provider === "non-private")) continue;
      if (!series.includes(r.provider)) series.push(r.provider);
      const label = r.shape.model + " | B=" + r.shape.batch + " T=" + r.shape.seq_len + " " + r.shape.dtype;
      let g = groups.find(g => g.label === label);
      if (!g) { g = {label: label, bars: []}; groups.push(g); }
      g.bars.push({series: r.provider, value: v * scale});
    }
    return bars(figure, groups, series, unit, ref);
  }

  // Audited epsilons (medians over seeds) beside the accountant's, per noise multiplier.
  function audits(figure, docs) {
    const groups = [], series = [];
    for (const r of rowsOf(docs, "audit")) {
      if (r.status !== "ok") continue;
      const label = "noise " + r.shape.noise_multiplier + " | " + r.shape.canaries + " canaries, " + r.shape.steps +
        " steps";
      let g = groups.find(g => g.label === label);
      if (!g) { g = {label: label, bars: []}; groups.push(g); }
      const pairs = [[r.provider + " one-run", "epsilon_one_run"], [r.provider + " f-DP", "epsilon_fdp"]];
      if (!g.bars.some(b => b.series === "accountant")) pairs.unshift(["accountant", "accountant_epsilon"]);
      for (const [name, metric] of pairs) {
        const v = p50(r, metric);
        if (v === null) continue;
        if (!series.includes(name)) series.push(name);
        g.bars.push({series: name, value: v});
      }
    }
    return bars(figure, groups, series, "eps", 0);
  }

  function cell(tr, text, tag) {
    const td = document.createElement(tag || "td");
    td.textContent = text;
    tr.appendChild(td);
  }

  // One row per model and provider: what the host is asked to do in a step, and the times.
  function hostOverhead(section, docs, i) {
    const rows = rowsOf(docs, "host_overhead");
    if (!rows.length) return 0;
    const title = document.createElement("h3");
    title.textContent = "Host overhead per DP step (counts of one step; times: medians; extra: over non-private)";
    section.appendChild(title);
    const table = document.createElement("table");
    table.id = "host-overhead-" + i;
    const head = document.createElement("tr");
    const columns = [["hooked_layers", "hooked layers", 0], ["ops", "ops", 0],
                     ["extra_ops_per_layer", "extra ops / layer", 1], ["syncs", "syncs", 0],
                     ["extra_syncs", "extra syncs", 0], ["first_step_probe_ops", "first step: probe ops", 0],
                     ["first_step_probe_syncs", "first step: probe syncs", 0],
                     ["first_step_probe_time", "first step: probe time (ms)", 1],
                     ["cuda_syncs", "CUDA syncs", 0], ["launches", "launches", 0],
                     ["host_time", "host time (ms)", 2], ["host_time_per_layer", "host time / layer (ms)", 3],
                     ["step_time", "step time (ms)", 2], ["step_time_over_non_private", "step time / non-private", 2]];
    for (const h of ["model", "B", "T", "dtype", "provider", ...columns.map(c => c[1])]) cell(head, h, "th");
    table.appendChild(head);
    for (const r of rows) {
      const tr = document.createElement("tr");
      for (const v of [r.shape.model, r.shape.batch, r.shape.seq_len, r.shape.dtype, r.provider]) cell(tr, String(v));
      if (r.status !== "ok") {
        cell(tr, r.status);
        tr.lastChild.colSpan = columns.length;
      } else {
        for (const [name, , digits] of columns) {
          const v = p50(r, name);
          cell(tr, v === null ? "-" : v.toFixed(digits));
        }
      }
      table.appendChild(tr);
    }
    section.appendChild(table);
    return rows.length;
  }

  function rawTable(section, docs) {
    const table = document.createElement("table");
    table.id = "raw";
    const head = document.createElement("tr");
    for (const h of ["suite", "benchmark", "shape", "provider", "status", "metric", "p20", "p50", "p80", "unit"]) cell(head, h, "th");
    table.appendChild(head);
    for (const d of docs) for (const r of d.results) {
      const metrics = Object.entries(r.metrics);
      const lines = metrics.length ? metrics : [[null, null]];
      for (const [name, m] of lines) {
        const tr = document.createElement("tr");
        const shape = Object.entries(r.shape).map(([k, v]) => k + "=" + v).join(", ");
        const status = flagged(r) ? r.status + " (flagged: " + r.flags.join("; ") + ")" : r.status;
        for (const v of [d.suite, r.benchmark, shape, r.provider, status, name || "",
                         m ? m.p20.toPrecision(4) : "", m ? m.p50.toPrecision(4) : "", m ? m.p80.toPrecision(4) : "",
                         m ? m.unit : ""]) cell(tr, v);
        table.appendChild(tr);
      }
    }
    section.appendChild(table);
  }

  function machines(section, docs) {
    const keys = Array.from(new Set(docs.flatMap(d => Object.keys(d.machine))));
    const table = document.createElement("table");
    table.id = "machines";
    const head = document.createElement("tr");
    cell(head, "file", "th");
    for (const k of keys) cell(head, k, "th");
    table.appendChild(head);
    for (const d of docs) {
      const tr = document.createElement("tr");
      cell(tr, d.path || d.suite);
      for (const k of keys) cell(tr, d.machine[k] === null || d.machine[k] === undefined ? "-" : String(d.machine[k]));
      table.appendChild(tr);
    }
    section.appendChild(table);
  }

  const docs = JSON.parse(document.getElementById("data").textContent);
  const root = document.getElementById("charts");
  const devices = Array.from(new Set(docs.map(d => d.machine.device)));
  let drawn = 0;
  for (const [i, device] of devices.entries()) {
    const mine = docs.filter(d => d.machine.device === device);
    const section = document.createElement("section");
    const h = document.createElement("h2");
    h.textContent = device;
    section.appendChild(h);
    const m = mine[0].machine;
    const about = document.createElement("p");
    about.textContent = "run " + m.date + ", commit " + m.commit + ", torch " + m.torch +
      (m.cuda ? ", CUDA " + m.cuda : "") + (m.triton ? ", Triton " + m.triton : "") +
      (m.opacus ? ", Opacus " + m.opacus : "");
    section.appendChild(about);
    root.appendChild(section);
    chart(section, "speedup-" + i, "Speedup over Opacus per layer shape (Opacus time / dpgrad time, medians)",
          f => kernelMetric(f, mine, "speedup_over_opacus", 1, "x", 1), "no kernel results for this machine");
    chart(section, "roofline-" + i, "Fraction of the roofline per layer shape (the least time the work takes " +
          "at the GEMM FLOP/s and copy bytes/s measured in the same run, over the time, medians)",
          f => kernelMetric(f, mine, "roofline_fraction", 100, "%", 100), "no roofline figures for this machine");
    chart(section, "throughput-" + i, "Throughput of each DP step over the non-private step's, per model and T",
          f => dpStep(f, mine, "throughput_over_non_private", 1, "x", 1), "no DP-step results for this machine");
    chart(section, "memory-" + i, "Peak memory per step (GiB)",
          f => dpStep(f, mine, "peak_memory", 1 / 2 ** 30, "GiB", 0),
          "no peak-memory figures for this machine");
    drawn += 4;
    if (rowsOf(mine, "audit").length) {
      chart(section, "audit-" + i, "Audited epsilon (one-run and f-DP bounds, 95%) against the accountant's, " +
            "dpgrad's training and the idealised Gaussian mechanism", f => audits(f, mine), "no audit results");
      drawn += 1;
    }
    hostOverhead(section, mine, i);
    const bad = mine.flatMap(d => d.results).filter(flagged);
    if (bad.length) {
      const list = document.createElement("ul");
      list.className = "flags";
      for (const r of bad) {
        const li = document.createElement("li");
        li.textContent = "flagged, not shown as figures: " + r.provider + " (" +
          Object.entries(r.shape).map(([k, v]) => k + "=" + v).join(", ") + "): " + r.flags.join("; ");
        list.appendChild(li);
      }
      section.appendChild(list);
    }
  }
  rawTable(document.getElementById("raw-figures"), docs);
  machines(document.getElementById("machine-info"), docs);
  recordRects();
  document.body.dataset.charts = drawn;
  console.log("dashboard: " + drawn + " charts drawn");
})();
"""


def render(docs: List[dict]) -> str:
    """The dashboard page for results files loaded by ``dpgrad.tools.results.load``."""
    # "</" would end the script element early; JSON allows the escaped form.
    data = json.dumps(docs).replace("</", "<\\/")
    sources = ", ".join(html.escape(d.get("path", d["suite"])) for d in docs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{TITLE}</title>
<style>{_STYLE}</style></head>
<body>
<h1>{TITLE}</h1>
<p>From {sources}. Medians of synchronised runs (host times: of the host issuing a step, not waiting for its
end); ratios are to the baselines of the same run.</p>
<div id="charts"></div>
<h2>Raw figures</h2><div id="raw-figures"></div>
<h2>Machines</h2><div id="machine-info"></div>
<script type="application/json" id="data">{data}</script>
<script type="application/json" id="counts">{json.dumps(list(COUNTS))}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
