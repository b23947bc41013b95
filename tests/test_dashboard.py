"""Benchmark results: files, flat records, README tables, and the HTML dashboard in Chromium.

The dashboard test renders two machines' results (one with every chart's data, one CPU run
without peak memory) and opens the page in headless Chromium: every chart must have drawn
its bars (or said why it has none), the screenshot must show them, and the console must hold
no error. Chromium is a system package (Debian's ``chromium``; ``.ci/run`` installs it, and
then sets DPGRAD_REQUIRE_CHROMIUM so that the test cannot skip): elsewhere the test is
skipped, saying so, where Chromium is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import timed_bench_run
from dpgrad.tools import cli, dashboard, results, results_tables
from dpgrad.tools import dashboard_charts as charts
from dpgrad.tools import dashboard_colours as colour_check
from dpgrad.tools import dashboard_tables as units

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
COMMITTED = sorted((REPO / "benchmarks" / "results").glob("*.json"))


def _machine(device, gpu=None):
    return {"device": device, "gpu": gpu, "cpu": "test cpu", "threads": 2, "torch": "2.13.0", "cuda": "12.8" if gpu else None,
            "triton": "3.9.0", "opacus": "1.6.0", "transformers": None, "peft": None, "python": "3.11.7",
            "dpgrad": "0.1.0", "commit": "abc1234", "date": "2026-11-22T00:00:00+00:00"}


def _row(benchmark, shape, provider, status="ok", **metrics):
    return {"benchmark": benchmark, "shape": shape, "provider": provider, "status": status,
            "metrics": {name: results.metric(name, value) for name, value in metrics.items()}}


def sample_docs():
    """Input for the renderer: a GPU-like machine with kernels and DP steps (peak memory
    included) and a CPU run without memory figures. Made up for the test, not measurements."""
    kshape = dict(kernel="linear_norm", layer="gpt2.lm_head", d=768, p=50257, T=1024, B=4, dtype="bfloat16")
    kernels = [
        _row("linear_norm", kshape, "dpgrad-direct", time=2.0, speedup_over_opacus=3.0, time_over_gemm=1.2,
             time_over_cublas_gram=0.67, time_over_read=25.0, roofline_fraction=0.42),
        _row("linear_norm", kshape, "dpgrad-gram", time=4.0, speedup_over_opacus=1.5, time_over_gemm=2.4),
        _row("linear_norm", kshape, "opacus", time=6.0),
        _row("linear_norm", kshape, "gemm", time=1.7),
        _row("linear_norm", kshape, "cublas-gram", time=3.0),
        _row("roofline", dict(kernel="roofline", layer="gemm 8192^3", T=None, B=None, dtype="bfloat16",
                              flops=2 * 8192**3, bytes=3 * 2 * 8192**2), "cublas-gemm", time=1.5, tensor_flops=733.0),
        _row("roofline", dict(kernel="roofline", layer="copy 1024 MiB", T=None, B=None, dtype="bfloat16", flops=0,
                              bytes=2**31), "copy", time=0.5, bandwidth=4295.0),
        _row("embedding_norm", dict(kernel="embedding_norm", layer="gpt2.wte", V=50257, d=768, T=1024, B=4,
                                    dtype="bfloat16"), "dpgrad", time=0.2, speedup_over_opacus=5.0),
    ]
    dshape = dict(model="hf-gpt2", batch=8, seq_len=1024, dtype="bf16")
    steps = [
        _row("dp_step", dshape, "non-private", step_time=100.0, throughput=81920.0, throughput_over_non_private=1.0,
             peak_memory=10 * 2**30),
        _row("dp_step", dshape, "opacus-ghost", "refused: Parameter tying is not supported with Ghost Clipping"),
        _row("dp_step", dshape, "dpgrad-single", step_time=120.0, throughput=68266.7, throughput_over_non_private=0.83,
             peak_memory=10.5 * 2**30, peak_memory_over_non_private=1.05),
    ]
    cpu_steps = [
        _row("dp_step", dict(model="tiny", batch=8, seq_len=64, dtype="fp32"), p, step_time=t,
             throughput_over_non_private=14.0 / t)
        for p, t in (("non-private", 14.0), ("opacus-ghost", 34.0), ("dpgrad-single", 26.0))
    ]
    gpu, cpu = _machine("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), _machine("cpu: test cpu x 2 threads")
    return [
        {"schema": results.SCHEMA, "suite": "kernels", "machine": gpu, "settings": {}, "results": kernels},
        {"schema": results.SCHEMA, "suite": "dp_step", "machine": gpu, "settings": {}, "results": steps},
        {"schema": results.SCHEMA, "suite": "dp_step", "machine": cpu, "settings": {}, "results": cpu_steps},
    ]


def _write(tmp_path, docs):
    paths = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"{doc['suite']}_{i}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------- files and records
def test_flat_records_are_objects_not_strings(tmp_path):
    docs = results.load(_write(tmp_path, sample_docs()))
    records = results.flat_records(docs)
    assert len(records) == sum(len(r["metrics"]) for d in docs for r in d["results"])
    for rec in records:
        assert set(rec) == {"benchmark", "shape", "provider", "metric", "machine"}
        assert isinstance(rec["shape"], dict) and isinstance(rec["machine"], dict)
        assert set(rec["metric"]) == {"name", "unit", "p20", "p50", "p80"}
        assert rec["metric"]["unit"] == results.UNITS[rec["metric"]["name"]]
    speedups = [r for r in records if r["metric"]["name"] == "speedup_over_opacus"]
    assert {r["shape"]["layer"] for r in speedups} == {"gpt2.lm_head", "gpt2.wte"}
    # A provider that did not run has no metrics, hence no records.
    assert not [r for r in records if r["provider"] == "opacus-ghost" and r["shape"].get("model") == "hf-gpt2"]


def test_quantiles_and_machine():
    assert results.quantiles([5, 1, 4, 2, 3]) == {"p20": 1.8, "p50": 3.0, "p80": 4.2}
    assert results.quantiles([2.0], scale=1e3) == {"p20": 2000.0, "p50": 2000.0, "p80": 2000.0}
    m = results.machine_info()
    assert {"device", "gpu", "torch", "triton", "cuda", "opacus", "dpgrad", "commit", "date"} <= set(m)
    assert results.device_slug({"gpu": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100-80gb-hbm3"


@pytest.mark.parametrize("took, rounds", [([5, 1, 1, 9], 3), ([1, 2, 4, 8, 16, 32], 6), ([3, 3, 3], 2)])
def test_warm_up_runs_until_two_rounds_agree_or_its_limit(monkeypatch, took, rounds):
    """The benchmarks' warm-up, on a clock that each round moves by its time: it stops at the
    second of two rounds within 10% of each other, after at least two, or at its limit."""
    now, ran = [0.0], []

    def run():
        ran.append(took[len(ran)])
        now[0] += ran[-1]

    monkeypatch.setattr(results.time, "perf_counter", lambda: now[0])
    assert results.warm_up(run, max_rounds=6) == rounds == len(ran)


def test_commit_of_an_installed_copy_named_by_the_environment(monkeypatch):
    """An installed copy knows no commit of its own ("unknown" in its results); one measured
    against the checkout (gpu_session.sh compare) is named by DPGRAD_COMMIT."""
    monkeypatch.delenv("DPGRAD_COMMIT", raising=False)
    own = results.git_commit()
    monkeypatch.setenv("DPGRAD_COMMIT", "f66cec7")
    assert results.git_commit() == "f66cec7" and results.machine_info()["commit"] == "f66cec7"
    monkeypatch.setenv("DPGRAD_COMMIT", " ")
    assert results.git_commit() == own


def test_load_refuses_other_files(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(ValueError, match="not a dpgrad results file"):
        results.load([other])


def _bad(doc: dict, path: str, value) -> dict:
    """``doc`` with the item at ``path`` ("results.0.metrics", dotted) replaced, or deleted for ``...``."""
    doc = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    target = doc
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is ...:
        del target[last]
    else:
        target[int(last) if isinstance(target, list) else last] = value
    return doc


@pytest.mark.parametrize("path, value, message", [
    ("machine", ..., "a 'machine' that is not an object with the strings device, date, commit, torch"),
    ("machine.date", 20261124, "a 'machine' that is not an object"),
    ("suite", "dp-step", "suite 'dp-step', not one of dp_step"),
    ("results", {"rows": []}, "'results' that is not a list"),
    ("results.0", "row", "results[0] that is not an object"),
    ("results.0.provider", None, "results[0].provider that is not a string"),
    ("results.0.shape", {"model": "hf-gpt2"}, "results[0].shape without model, batch, seq_len, dtype"),
    ("results.0.shape.batch", [8], "results[0].shape with a value that is not a string or a number"),
    ("results.0.metrics", [], "results[0].metrics that is not an object"),
    ("results.0.metrics.step_time.p50", "100", "results[0].metrics.step_time without numbers p20, p50 and p80"),
    ("results.0.metrics.step_time", 100.0, "results[0].metrics.step_time without numbers"),
    ("results.0.flags", "noisy", "results[0].flags that is not a list of strings"),
    ("results.0.metrics.step_time.repeats", [100.0, "101"], "results[0].metrics.step_time.repeats that is not a list"),
])
def test_a_results_file_with_missing_or_ill_typed_fields_is_refused(tmp_path, capsys, path, value, message):
    doc = sample_docs()[1]  # dp_step on the GPU machine
    (bad,) = _write(tmp_path, [_bad(doc, path, value)])
    with pytest.raises(ValueError, match=re.escape(message)):
        results.load([bad])
    with pytest.raises(SystemExit) as exc:
        cli.main(["dashboard", str(bad), "-o", str(tmp_path / "page.html")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "write it again with the benchmarks" in err
    assert not (tmp_path / "page.html").exists()


def test_unwritable_outputs_are_refused_before_anything_is_written(tmp_path, capsys):
    paths = [str(p) for p in _write(tmp_path, sample_docs())]
    (tmp_path / "file").write_text("")
    for args, message in (
            (["-o", str(tmp_path)], "cannot write there (it is a directory)"),
            (["-o", str(tmp_path / "file" / "page.html")], "cannot make its directory"),
            (["--records", str(tmp_path / "none" / "r.json")], "its directory"),
            (["-o", str(tmp_path / "page.html"), "--summary", paths[0]], "not an autotune report's JSON (no 'model'")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["dashboard", *paths, *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "page.html").exists()


def test_cli_writes_page_records_and_tables(tmp_path, capsys):
    paths = [str(p) for p in _write(tmp_path, sample_docs())]
    out, rec = tmp_path / "report.html", tmp_path / "records.json"
    assert cli.main(["dashboard", *paths, "-o", str(out), "--records", str(rec), "--markdown"]) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert json.loads(rec.read_text()) == results.flat_records(results.load(paths))
    table = capsys.readouterr().out
    assert "| hf-gpt2 | 8 | 1024 | bf16 | 100.0 ms | refused | 120.0 ms | - | 0.83 | 1.05 |" in table
    assert ("| linear_norm | gpt2.lm_head | 1024 | 4 | 2.000 ms | 6.000 ms | 1.700 ms | 3.000 ms | 3.00 | 1.18 "
            "| 0.67 | 25.00 | 42% |") in table
    assert "Roofline measured in this run: 733 TFLOP/s (a large GEMM), 4295 GB/s (a large copy)." in table
    with pytest.raises(SystemExit):
        cli.main(["dashboard", *paths])  # nothing asked for


def test_results_page_tables_match_the_committed_results():
    """docs/results.md's results block is what the committed results files give, to the digit."""
    assert COMMITTED, "benchmarks/results holds no results file"
    page = (REPO / "docs" / "results.md").read_text()
    assert results_tables.readme_with_results(page, results.load(COMMITTED)) == page, (
        "docs/results.md's results differ from benchmarks/results: run "
        "`dpgrad dashboard benchmarks/results/*.json --update-readme docs/results.md`"
    )


def test_readme_headline_figures_are_the_committed_gpu_results():
    """Each figure of the README's headline table is in the committed GPU results table of the
    same device and commit (docs/results.md, generated from benchmarks/results)."""
    readme = (REPO / "README.md").read_text()
    headline = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    device, commit = re.search(r"on one (NVIDIA [^(]+?) \(.*?commit (\w+)", headline, re.S).groups()
    page = (REPO / "docs" / "results.md").read_text()
    section = next(part for part in page.split("\ndp_step on ")[1:]
                   if part.startswith(device.strip()) and f"commit {commit}" in part.split("\n", 1)[0])
    table = section.split("\n\n", 2)[1]
    rows = [line for line in headline.splitlines() if line.startswith("| ") and " ms |" in line]
    assert len(rows) >= 3
    for line in rows:
        for figure in re.findall(r"\d+\.\d+ ms", line):
            assert figure in table, (figure, line)


# ---------------------------------------------------------------------------- the page's parts
# CIEDE2000 test pairs published with the formula's implementation notes (Sharma, Wu and Dalal
# 2005, Table 1): Lab, Lab, difference.
SHARMA = [((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
          ((50.0, 3.1571, -77.2803), (50.0, 0.0, -82.7485), 2.8615),
          ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),
          ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
          ((50.0, 2.5, 0.0), (61.0, -5.0, 29.0), 22.8977),
          ((50.0, 2.5, 0.0), (56.0, -27.0, -3.0), 31.9030),
          ((50.0, 2.5, 0.0), (58.0, 24.0, 15.0), 19.4535)]


@pytest.mark.parametrize("lab1, lab2, expected", SHARMA)
def test_colour_difference_is_ciede2000(lab1, lab2, expected):
    assert colour_check.ciede2000(lab1, lab2) == pytest.approx(expected, abs=5e-5)
    assert colour_check.ciede2000(lab2, lab1) == pytest.approx(expected, abs=5e-5)


def test_the_contrast_check_refuses_pairs_a_colour_blind_reader_cannot_tell_apart():
    """matplotlib's default red and green differ by 72 to normal vision and by under 5 to a
    deuteranope; its orange and green by under 2 to a protanope: both refused, named with the
    view. The dashboard's palette passes, white stays white under the simulations, and a
    colour too close to the white page is refused."""
    assert colour_check.difference("#d62728", "#2ca02c") > 70
    bad = colour_check.pair_problems({"a": "#d62728", "b": "#2ca02c", "c": "#ff7f0e"})
    assert any("a (#d62728) and b (#2ca02c)" in p and "(deuteranopia)" in p for p in bad), bad
    assert any("b (#2ca02c) and c (#ff7f0e)" in p and "(protanopia)" in p for p in bad), bad
    assert not any("(normal)" in p for p in bad), bad
    assert colour_check.pair_problems(dict(enumerate(colour_check.PALETTE))) == []
    for view in colour_check.VIEWS:
        assert colour_check.lab("#ffffff", view) == pytest.approx((100.0, 0.0, 0.0), abs=0.05)
    assert colour_check.pair_problems({"pale grey": "#dddddd"}) != []


def test_colours_are_one_per_series_and_differ_within_each_chart():
    charts_ = [["a", "b", "c"], ["c", "d"], ["e", "f", "g", "h", "i", "j", "k", "l", "m", "n"]]
    colour_of = colour_check.assign(charts_)
    for chart in charts_:
        assert len({colour_of[s] for s in chart}) == len(chart)
    assert colour_of["e"] == colour_check.PALETTE[0]  # the busiest chart chooses first


def test_units_fit_the_values():
    assert units.byte_unit([12e6, 30e6]) == ("MiB", 2**20)  # a CPU run's steps
    assert units.byte_unit([10 * 2**30, 512]) == ("GiB", 2**30)
    assert units.byte_unit([900]) == ("B", 1)
    assert units.human_bytes(1.18e8) == "113 MiB" and units.human_bytes(1064960) == "1.02 MiB"
    assert units.human_bytes(0) == "0 B"
    assert units.human_ms(0.315) == "315 µs" and units.human_ms(1.2918) == "1.29 ms"
    assert units.human_ms(2500) == "2.50 s"
    assert units.human(1.18e8, "bytes") == "113 MiB" and units.human(396, "ops") == "396"


def test_a_ratios_whisker_is_the_widest_its_two_rows_spreads_allow():
    """throughput / non-private = base time / own time: from base p20 / own p80 to base p80 / own p20."""
    base, own = results.metric("step_time", 100.0, 90.0, 120.0), results.metric("step_time", 125.0, 110.0, 150.0)
    low, high = charts.interval(100.0 / 125.0, base, own)
    assert (low, high) == (pytest.approx(90.0 / 150.0), pytest.approx(120.0 / 110.0))
    assert charts.interval(0.5, None, own) == (pytest.approx(0.5 * 125 / 150), pytest.approx(0.5 * 125 / 110))
    assert charts.interval(1.0, base, results.metric("step_time", 1.0, 0.0, 2.0)) == (None, None)


def test_without_plotly_the_page_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    paths = [str(p) for p in _write(tmp_path, sample_docs())]
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly raises ImportError
    out = tmp_path / "new" / "index.html"
    with pytest.raises(SystemExit) as exc:
        cli.main(["dashboard", *paths, "-o", str(out), "--records", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and 'pip install "dpgrad[dashboard]"' in err and "plotly" in err, err
    assert not out.parent.exists() and not (tmp_path / "r.json").exists()
    with pytest.raises(ImportError, match=re.escape('pip install "dpgrad[dashboard]"')):
        dashboard.render(results.load(paths))
    assert cli.main(["dashboard", *paths, "--markdown"]) == 0  # the tables need no plotly


# ---------------------------------------------------------------------------- the page in a browser
class _Page(HTMLParser):
    """What a test reads back from the page as Chromium left it: every element's id, the table
    of contents' links, the charts (their attributes, whether plotly drew them, their bar labels
    and axis titles) and the first cell of each row of the autotune table."""

    def __init__(self):
        super().__init__()
        self.ids, self.toc, self.figures, self.body, self.autotune = set(), [], {}, {}, []
        self._in, self._figure, self._text = [], None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        cls = (attrs.get("class") or "").split()
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "body":
            self.body = attrs
        if tag == "nav" and attrs.get("id") == "toc":
            self._in.append("toc")
        if tag == "a" and "toc" in self._in:
            self.toc.append(attrs["href"])
        if tag == "table" and attrs.get("id") == "autotune-layers":
            self._in.append("autotune")
        if tag == "tr" and "autotune" in self._in:
            self._text = "autotune-row"
        if tag == "td" and self._text == "autotune-row":
            self._text = "autotune-cell"
        if tag == "figure" and "chart" in cls:
            self._figure = {"attrs": attrs, "plotly": False, "traces": 0, "labels": [], "axes": []}
            self.figures[attrs["id"]] = self._figure
        if self._figure is not None:
            self._figure["plotly"] |= "js-plotly-plot" in cls
            self._figure["traces"] += tag == "g" and {"trace", "bars"} <= set(cls)
            if tag == "text" and "bartext" in cls:
                self._figure["labels"].append(attrs.get("data-unformatted", ""))
            if tag == "text" and "xtitle" in cls:
                self._text = "axis"

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None
        if tag in ("nav", "table") and self._in:
            self._in.pop()
        if tag == "text" and self._text == "axis":
            self._text = None

    def handle_data(self, data):
        if self._text == "axis":
            self._figure["axes"].append(data)
        if self._text == "autotune-cell":
            self.autotune.append(data)
            self._text = None


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _run_chromium(tmp_path, page: Path, *mode):
    chromium = _chromium()
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
            "--window-size=1400,2600", "--virtual-time-budget=10000", *mode, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=180)


def _opened(tmp_path, page: Path, *mode) -> _Page:
    """The page as Chromium drew it, with no console error (``mode``: more of Chromium's flags
    for the same run, such as a screenshot's)."""
    dom = _run_chromium(tmp_path, page, "--dump-dom", *mode)
    assert dom.returncode == 0, dom.stderr[-2000:]
    errors = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line and ("Uncaught" in line or "rror" in line)]
    assert not errors, errors
    parsed = _Page()
    parsed.feed(dom.stdout)
    drawn = [f for f in parsed.figures.values() if "data-marks" in f["attrs"]]
    assert any(f"dashboard: {len(drawn)} charts drawn" in line for line in dom.stderr.splitlines()), dom.stderr[-2000:]
    return parsed


def _hex(rgb: str) -> str:
    return "#" + "".join(f"{int(v):02X}" for v in re.findall(r"\d+", rgb)[:3])


needs_chromium = pytest.mark.skipif(_chromium() is None and not os.environ.get("DPGRAD_REQUIRE_CHROMIUM"),
                                    reason="needs Chromium (Debian: apt-get install chromium)")


@needs_chromium
def test_dashboard_draws_every_chart_in_chromium(tmp_path):
    docs = results.load(_write(tmp_path, sample_docs()))
    page = tmp_path / "report.html"
    page.write_text(dashboard.render(docs))
    shot = tmp_path / "shot.png"  # the screenshot taken by the same run, once the page is drawn
    parsed = _opened(tmp_path, page, f"--screenshot={shot}")
    figures = parsed.figures
    assert len(figures) == 8  # four charts for each of the two machines
    assert parsed.body.get("data-charts") == "5"  # drawn by plotly: all but the CPU run's empty three
    empty = [name for name, f in figures.items() if "data-empty" in f["attrs"]]
    assert empty == ["speedup-1", "roofline-1", "memory-1"], empty
    assert not any(figures[name]["plotly"] for name in empty)
    drawn = {name: int(f["attrs"]["data-marks"]) for name, f in figures.items() if "data-marks" in f["attrs"]}
    # Kernels: 2 + 1 bars, and the one row with a roofline fraction; DP steps over non-private:
    # dpgrad-single (Opacus refused), and the CPU run's two; memory: non-private and dpgrad-single.
    assert drawn == {"speedup-0": 3, "roofline-0": 1, "throughput-0": 1, "memory-0": 2, "throughput-1": 2}
    for name in drawn:
        f = figures[name]
        assert f["plotly"] and f["traces"] == 2 * len(json.loads(f["attrs"]["data-colours"])), name
    assert figures["memory-0"]["axes"] == ["peak memory (GiB)"]  # 10 GiB steps
    assert "10.5 GiB" in figures["memory-0"]["labels"]

    assert shot.exists()
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    for name, f in figures.items():
        x, y, w, h = (int(v) for v in f["attrs"]["data-rect"].split(","))
        assert w > 0 and h > 0, name
        if y + h > image.height:
            continue  # below the window
        colours = image.crop((x, y, x + w, y + h)).getcolors(maxcolors=1 << 16) or []
        coloured = sum(n for n, (r, g, b) in colours if max(r, g, b) - min(r, g, b) > 60)
        if name in drawn:
            assert coloured > 100, f"{name}: no bars on the screenshot"
        else:
            assert len(colours) > 2, f"{name}: blank"  # the note's text


def _spread(name, p50, p20, p80):
    return results.metric(name, p50, p20, p80)


def rich_docs():
    """sample_docs, and on the CPU machine: a DP-step run with peak memory of a few MiB, a
    flagged row of each kind (faster than non-private; a wide spread), one that failed; FSDP2
    memory; an audit. Times with spreads, so whiskers have length."""
    docs = sample_docs()
    cpu = _machine("cpu: test cpu x 2 threads")
    shape = dict(model="tiny", batch=8, seq_len=64, dtype="fp32")
    steps = []
    for provider, (p20, p50, p80), peak in (("non-private", (13.0, 14.0, 15.0), 12e6),
                                            ("opacus-ghost", (33.0, 34.0, 36.0), 14e6),
                                            ("dpgrad-single", (25.0, 26.0, 28.0), 25e6),
                                            ("dpgrad-double", (11.0, 12.0, 13.0), 30e6),  # faster: impossible
                                            ("dpgrad-single-per-block", (10.0, 20.0, 40.0), 16e6)):  # noisy
        row = _row("dp_step", shape, provider, peak_memory=peak, throughput_over_non_private=14.0 / p50)
        row["metrics"]["step_time"] = _spread("step_time", p50, p20, p80)
        steps.append(row)
    steps.append(_row("dp_step", shape, "torch-func", "error: vmap cannot trace this model"))
    docs[2]["results"] = steps
    fshape = dict(model="tiny", world=2, batch=4, seq_len=64, dtype="fp32")
    fsdp = [_row("fsdp_memory", fshape, "ddp-non-private", peak_memory=118e6, state_memory=84e6),
            _row("fsdp_memory", fshape, "ddp-dpgrad-single", peak_memory=140e6, state_memory=84e6),
            _row("fsdp_memory", fshape, "fsdp2-non-private", peak_memory=82e6, state_memory=42e6,
                 peak_memory_over_ddp=82 / 118, state_memory_over_ddp=0.5),
            _row("fsdp_memory", fshape, "fsdp2-dpgrad-single", peak_memory=97e6, state_memory=42e6,
                 peak_memory_over_ddp=97 / 140, state_memory_over_ddp=0.5)]
    ashape = dict(noise_multiplier=1.0, canaries=1000, steps=100, sample_rate=0.1)
    audit = []
    for provider in ("dpgrad-single", "idealised"):
        row = _row("audit", ashape, provider, accountant_epsilon=7.9)
        row["metrics"]["epsilon_one_run"] = _spread("epsilon_one_run", 1.6, 1.5, 1.9)
        row["metrics"]["epsilon_fdp"] = _spread("epsilon_fdp", 2.2, 2.1, 2.7)
        audit.append(row)
    return docs + [{"schema": results.SCHEMA, "suite": suite, "machine": cpu, "settings": {}, "results": rows}
                   for suite, rows in (("fsdp_memory", fsdp), ("audit", audit))]


AUTOTUNE = {"model": {"name": "tiny", "parameters": 560640, "trainable_layers": 3}, "device": "cpu-test",
            "backend": "eager", "notice": None, "date": "2026-11-27T22:07:27+00:00", "commit": "4552cdc",
            "rows": [{"name": "tok", "type": "Embedding", "shape": "512x128", "kind": "embedding_norm",
                      "choice": "eager-sort", "chosen_ms": 0.48, "opacus_ms": 4.41, "speedup": 9.19,
                      "source": "measured", "rounds": 3, "extra_bytes": 1064960},
                     {"name": "blocks.0.qkv", "type": "Linear", "shape": "128x384", "kind": "linear_norm",
                      "choice": "eager-direct", "chosen_ms": 1.29, "opacus_ms": 1.76, "speedup": 1.36,
                      "source": "measured", "rounds": 3, "extra_bytes": 3670016},
                     {"name": "blocks.0.ln1", "type": "LayerNorm", "shape": "128", "kind": None,
                      "choice": "dpgrad sampler (no kernel choice)", "chosen_ms": None, "opacus_ms": None,
                      "speedup": None, "source": None}]}


@needs_chromium
def test_the_page_marks_flags_draws_spreads_and_units_and_its_colours_can_be_told_apart(tmp_path, capsys):
    """The full page through the CLI, in Chromium: a contents list linking every section and
    chart; the run summary and the autotune report's every layer; every chart drawn by plotly
    with p20-p80 whiskers on its timing-derived bars; flagged rows drawn, hatched and labelled,
    with a note saying how many and why, and the failed row listed; memory in MiB for MiB-sized
    figures; the FSDP2 charts where there are FSDP2 results; and every two colours of a chart
    (as drawn) far enough apart in normal vision, deuteranopia and protanopia."""
    paths = [str(p) for p in _write(tmp_path, rich_docs())]
    (tmp_path / "autotune.json").write_text(json.dumps(AUTOTUNE))
    page = tmp_path / "out" / "index.html"
    assert cli.main(["dashboard", *paths, "-o", str(page), "--summary", str(tmp_path / "autotune.json")]) == 0
    capsys.readouterr()
    parsed = _opened(tmp_path, page)
    figures = parsed.figures

    sections = {"summary", "autotune", "machine-0", "machine-1", "raw-figures", "machine-info"}
    targets = {href.lstrip("#") for href in parsed.toc}
    assert targets <= parsed.ids, targets - parsed.ids  # every link goes somewhere
    assert sections | set(figures) <= targets, (sections | set(figures)) - targets
    assert "fsdp-memory-1" in figures and "fsdp-ratio-1" in figures and "fsdp-memory-0" not in figures
    assert parsed.autotune == [row["name"] for row in AUTOTUNE["rows"]]
    text = page.read_text()
    assert "tiny on cpu-test (eager backend), 3 trainable layers" in text  # the run summary

    for name, f in figures.items():
        attrs = f["attrs"]
        if "data-empty" in attrs:
            continue
        assert f["plotly"] and int(attrs["data-marks"]) == int(attrs["data-bars"]) > 0, name
        assert attrs["data-errorbars"] == attrs["data-spread"], name  # a whisker on each bar with a spread
        if attrs["data-timing"] == "1" and name.endswith("-1"):  # the CPU run: every time has a spread
            assert attrs["data-spread"] == attrs["data-bars"], name
        used = json.loads(attrs["data-colours"])
        drawn = {series: _hex(rgb) for series, rgb in json.loads(attrs["data-drawn-colours"]).items()}
        assert drawn == {series: colour.upper() for series, colour in used.items()}, name
        assert colour_check.pair_problems(drawn) == [], name
    assert int(figures["audit-1"]["attrs"]["data-errorbars"]) == 5  # spreads over seeds too

    throughput = figures["throughput-1"]
    assert throughput["attrs"]["data-hatched"] == "2"  # both flagged rows drawn, hatched
    assert sum("⚠ impossible" in label for label in throughput["labels"]) == 1
    assert sum("⚠ noisy: p20-p80 150% of median" in label for label in throughput["labels"]) == 1
    assert "2 of 4 bars flagged, drawn faded and hatched" in text and "1 impossible: faster than" in text
    assert "1 row not drawn</b>: error: vmap cannot trace this model" in text
    memory = figures["memory-1"]
    assert memory["axes"] == ["peak memory (MiB)"] and "11.4 MiB" in memory["labels"]  # 12e6 bytes
    assert memory["attrs"]["data-hatched"] == "0"  # bytes do not depend on timing: not flagged
    assert figures["fsdp-memory-1"]["axes"] == ["bytes per rank (MiB)"] and figures["fsdp-memory-1"]["traces"] == 8


@needs_chromium
def test_each_series_has_one_colour_in_every_chart(tmp_path):
    """On the dashboard of the committed results, drawn by Chromium: a provider (or an audit's
    series) has the same colour in every chart, two series of one chart never share one, and
    every chart's colours (as drawn) can be told apart."""
    page = tmp_path / "results.html"
    page.write_text(dashboard.render(results.load(COMMITTED)))
    parsed = _opened(tmp_path, page)
    colour_of: dict = {}
    for name, f in parsed.figures.items():
        if "data-drawn-colours" not in f["attrs"]:
            continue
        drawn = {series: _hex(rgb) for series, rgb in json.loads(f["attrs"]["data-drawn-colours"]).items()}
        for series, colour in drawn.items():
            assert colour_of.setdefault(series, colour) == colour, (series, name, colour, colour_of[series])
        assert len(set(drawn.values())) == len(drawn), (name, drawn)
        assert colour_check.pair_problems(drawn) == [], name
    assert len(colour_of) >= 8, colour_of


# ---------------------------------------------------------------------------- the suites' writer
@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    """A timed run of part of the quick suites through benchmarks/run_suites.py, as ``make
    report`` runs them (pytest-benchmark in a subprocess; tests/timed_bench_run.py): bench_kernels'
    embedding norms at T=32, and bench_dp_step's smallest case, non-private and dpgrad's single
    backward, each case repeated three times. test_run_suites.py reads its display."""
    run = timed_bench_run.timed_run(tmp_path_factory)
    assert run.proc.returncode == 0, (run.log.read_text() if run.log.exists() else "")[-3000:] + run.proc.stderr[-3000:]
    return run


@pytest.mark.xdist_group(timed_bench_run.GROUP)
def test_quick_suite_writes_results_files(timed_run):
    """A timed run of part of the quick suite writes a results file with every metric and the
    ratios to the same run's baselines."""
    (path,) = timed_run.results.glob("kernels_*.json")
    (doc,) = results.load([path])
    assert doc["machine"]["commit"] and doc["settings"]["quick"] is True
    providers = {r["provider"]: r for r in doc["results"]}
    assert set(providers) == {"dpgrad", "dpgrad-eager-sort", "opacus"}
    if not torch.cuda.is_available():  # there dpgrad's own row runs the eager kernel: recorded, not run twice
        assert "eager kernels already" in providers.pop("dpgrad-eager-sort")["status"]
    for r in providers.values():
        time = r["metrics"]["time"]
        assert r["status"] == "ok" and time["unit"] == "ms" and 0 < time["p20"] <= time["p50"] <= time["p80"]
    speedup = providers["dpgrad"]["metrics"]["speedup_over_opacus"]["p50"]
    assert speedup == pytest.approx(providers["opacus"]["metrics"]["time"]["p50"] / providers["dpgrad"]["metrics"]["time"]["p50"])
    assert re.fullmatch(r"kernels_(cpu|[a-z0-9-]+)\.json", path.name)


@pytest.mark.xdist_group(timed_bench_run.GROUP)
def test_repeated_cases_give_the_median_repeat_and_each_repeat(timed_run):
    """A timed run of the DP-step suite with each case repeated three times writes one row per
    provider: every metric lists its three repeats, its p50 is their median (between the p20
    and p80 of all its rounds), and a ratio is taken within each repeat."""
    (doc,) = results.load(timed_run.results.glob("dp_step_*.json"))
    rows = {r["provider"]: r for r in doc["results"]}
    assert set(rows) == {"non-private", "dpgrad-single"} and all(r["status"] == "ok" for r in rows.values())
    base, single = rows["non-private"]["metrics"], rows["dpgrad-single"]["metrics"]
    for m in (base, single):
        time = m["step_time"]
        assert len(time["repeats"]) == 3 and time["p50"] == statistics.median(time["repeats"])
        assert 0 < time["p20"] <= time["p50"] <= time["p80"]
        assert len(m["peak_memory"]["repeats"]) == 3
    ratios = [b / s for b, s in zip(base["step_time"]["repeats"], single["step_time"]["repeats"])]
    assert single["throughput_over_non_private"]["repeats"] == pytest.approx(ratios)
    assert single["throughput_over_non_private"]["p50"] == pytest.approx(statistics.median(ratios))
    table = results_tables.markdown([doc])
    if not rows["dpgrad-single"]["flags"]:
        spread = f"({min(ratios):.2f}-{max(ratios):.2f})"
        assert f"{statistics.median(ratios):.2f} {spread}" in table


def test_parts_of_one_run_merge_into_one_file_and_other_runs_are_refused(tmp_path, capsys):
    """A suite run case by case (one call each) is written as one file: every row once, the
    tables of the parts together; parts of another commit or machine, another suite, or a case
    in two parts are refused and nothing is written."""
    _, gpu_steps, _ = sample_docs()
    other = dict(model="hf-gpt2", batch=64, seq_len=128, dtype="bf16")
    second = dict(gpu_steps, machine=dict(gpu_steps["machine"], date="2026-11-22T00:05:00+00:00"),
                  settings={"dtype": ["fp32"]},
                  results=[_row("dp_step", other, p, step_time=t, throughput_over_non_private=50.0 / t)
                           for p, t in (("non-private", 50.0), ("dpgrad-single", 55.0))])
    parts = _write(tmp_path, [dict(gpu_steps, settings={"dtype": ["bf16"]}), second])
    merge = __import__("merge_results")
    out = tmp_path / "out" / "dp_step_merged.json"
    assert merge.main([str(out), *map(str, parts)]) == 0
    (doc,) = results.load([out])
    loaded = results.load(parts)
    assert doc["results"] == [row for part in loaded for row in part["results"]]
    assert doc["machine"]["date"] == gpu_steps["machine"]["date"]
    assert doc["machine"]["dates"] == [gpu_steps["machine"]["date"], second["machine"]["date"]]
    assert doc["settings"]["dtype"] == ["bf16", "fp32"]
    table = results_tables.markdown([doc])
    rows = [line.split(" | ")[:4] for line in table.splitlines() if line.startswith("| hf-gpt2")]
    assert rows == [["| hf-gpt2", "8", "1024", "bf16"], ["| hf-gpt2", "64", "128", "bf16"]]
    refused = {
        "commit": dict(second, machine=dict(second["machine"], commit="def5678")),
        "device": dict(second, machine=dict(second["machine"], device="NVIDIA H200")),
        "suite": sample_docs()[0],
        "also in": dict(second, results=gpu_steps["results"][:1]),
    }
    for message, doc in refused.items():
        sub = tmp_path / message.replace(" ", "_")
        sub.mkdir()
        bad = tmp_path / "refused.json"
        assert merge.main([str(bad), str(parts[0]), str(_write(sub, [doc])[0])]) == 1
        assert message in capsys.readouterr().err and not bad.exists()
    assert merge.main([str(out)]) == 2


def test_implausible_and_noisy_rows_are_flagged_and_drawn_marked():
    """A DP step faster than its non-private baseline (a cold or disturbed baseline), or a time
    whose p20-p80 spans more than half its median, is flagged in the results; the README's
    tables show the flag instead of the figure, and the dashboard draws the figure marked."""
    dshape = dict(model="hf-gpt2", batch=8, seq_len=1024, dtype="bf16")
    rows = [
        _row("dp_step", dshape, "non-private", step_time=100.0, throughput_over_non_private=1.0),
        _row("dp_step", dshape, "dpgrad-single", step_time=90.0, throughput_over_non_private=100.0 / 90.0),
        _row("dp_step", dshape, "dpgrad-double", throughput_over_non_private=0.5),
    ]
    rows[2]["metrics"]["step_time"] = results.metric("step_time", 200.0, 120.0, 260.0)
    results.flag_rows(rows)
    assert rows[0]["flags"] == [] and rows[1]["flags"] == [results.IMPOSSIBLE]
    assert rows[2]["flags"] == ["wide spread: p20 to p80 of its time is 70% of the median"]

    host = [_row("host_overhead", dict(model="m", batch=8, seq_len=64, dtype="fp32"), p, step_time=t,
                 step_time_over_non_private=r) for p, t, r in (("non-private", 20.0, 1.0), ("dpgrad-single", 18.0, 0.9))]
    results.flag_rows(host)
    assert host[1]["flags"] == [results.IMPOSSIBLE]
    noisy_base = [_row("dp_step", dshape, "non-private"), _row("dp_step", dshape, "dpgrad-single", step_time=120.0,
                                                                throughput_over_non_private=0.8)]
    noisy_base[0]["metrics"]["step_time"] = results.metric("step_time", 100.0, 50.0, 160.0)
    results.flag_rows(noisy_base)
    assert noisy_base[1]["flags"] == ["its non-private baseline is flagged"]

    docs = [{"schema": results.SCHEMA, "suite": "dp_step", "machine": _machine("cpu: test cpu x 2 threads"),
             "settings": {}, "results": rows},
            {"schema": results.SCHEMA, "suite": "host_overhead", "machine": _machine("cpu: test cpu x 2 threads"),
             "settings": {}, "results": host}]
    table = results_tables.markdown(docs)
    assert "| - | flagged | - |" in table and "1.11" not in table and "| flagged |" in table.split("host_overhead")[1]
    assert "flagged: dpgrad-single (model=hf-gpt2, batch=8, seq_len=1024, dtype=bf16): impossible" in table
    throughput = charts.dp_step_charts(docs[:1], 0)[0]
    assert [(b.series, b.value, b.flags) for b in throughput.bars] == [
        ("dpgrad-single", 100.0 / 90.0, [results.IMPOSSIBLE]), ("dpgrad-double", 0.5, rows[2]["flags"])]
    notes = charts.notes(throughput)
    assert "2 of 2 bars flagged" in notes and "1 impossible: faster than the non-private step" in notes
    assert "1 wide spread (p20 to p80 of its time over 50% of the median)" in notes
    page = dashboard.render(docs)
    assert "impossible: faster than the non-private step" in page and "⚠ dpgrad-single (model=m" in page


def test_summary_names_the_machine_choices_ratios_and_page():
    docs = sample_docs()
    results.flag_rows(docs[1]["results"])
    report = {"model": {"name": "tiny", "trainable_layers": 3}, "device": "cpu-test", "backend": "eager",
              "rows": [{"choice": "eager-bmm", "speedup": 2.0}, {"choice": "eager-bmm", "speedup": 3.0},
                       {"choice": "eager-sort", "speedup": None}]}
    text = results_tables.summary(docs, report, "build/dashboard/index.html")
    assert text.startswith("summary\n") and max(len(line) for line in text.splitlines()) <= 120
    words = " ".join(text.split())
    assert "tiny on cpu-test (eager backend), 3 trainable layers: eager-bmm x2, eager-sort x1" in words
    assert "median speedup over Opacus's samplers 2.50x" in words
    assert "(NVIDIA H100 80GB HBM3): hf-gpt2 B=8 T=1024 bf16 0.83" in words  # a case's dtype: one of several
    assert text.rstrip().endswith("dashboard: build/dashboard/index.html")


def test_fsdp_memory_table_shows_bytes_and_ratios_to_ddp_even_when_timing_is_flagged():
    """Memory does not depend on timing: a row flagged for its time still shows its bytes
    and its ratios to DDP, in the README's table and the dashboard."""
    shape = dict(model="tiny", world=2, batch=4, seq_len=64, dtype="fp32")
    rows = [_row("fsdp_memory", shape, "ddp-dpgrad-single", peak_memory=140e6, state_memory=84e6),
            _row("fsdp_memory", shape, "fsdp2-dpgrad-single", peak_memory=88e6, state_memory=42e6,
                 peak_memory_over_ddp=88 / 140, state_memory_over_ddp=0.5)]
    rows[1]["metrics"]["step_time"] = results.metric("step_time", 300.0, 100.0, 500.0)
    results.flag_rows(rows)
    assert rows[1]["flags"] and not rows[0]["flags"]
    doc = {"schema": results.SCHEMA, "suite": "fsdp_memory", "machine": _machine("cpu: test cpu x 2 threads"),
           "settings": {}, "results": rows}
    table = results_tables.markdown([doc])
    assert "| tiny | 2 | fsdp2-dpgrad-single | 88.0 MB | 42.0 MB | 0.63 | 0.50 |" in table, table
    assert "| tiny | 2 | ddp-dpgrad-single | 140.0 MB | 84.0 MB | - | - |" in table, table
    per_rank, ratios = charts.fsdp_charts([doc], 0)
    assert per_rank.unit == "MiB" and not any(b.flags for b in per_rank.bars + ratios.bars)
    assert [(b.group, round(b.value, 1)) for b in per_rank.bars if b.series == "fsdp2-dpgrad-single"] == [
        ("tiny | 2 ranks | peak", round(88e6 / 2**20, 1)), ("tiny | 2 ranks | state", round(42e6 / 2**20, 1))]
    assert [(b.group, b.value) for b in ratios.bars] == [("tiny | 2 ranks | peak / DDP", 88 / 140),
                                                        ("tiny | 2 ranks | state / DDP", 0.5)]


def _bench_conftest():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "conftest.py"
    spec = importlib.util.spec_from_file_location("dpgrad_bench_conftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_kernel_rows_get_their_fraction_of_the_roofline_measured_in_the_same_run():
    """bench_kernels' derived figures: the roofline rows give 1000 TFLOP/s and 2000 GB/s; a
    Llama-1B q_proj at B=8, T=1024 in bf16 needs the symmetric Gram form's B*T^2*(d+p) = 3.4e10
    flops (fewer than the direct form's 6.9e10): 34.4 us at that peak, more than reading its
    6.7e7 bytes once takes (33.6 us). A kernel taking 68.7 us is at half the roofline."""
    bench = _bench_conftest()
    B, T, d, p = 8, 1024, 2048, 2048
    shape = dict(kernel="linear_norm", layer="llama1b.attn.q_proj", d=d, p=p, T=T, B=B, dtype="bfloat16")
    limit = B * T * T * (d + p) / 1e15
    read = 2 * B * T * (d + p) / 2e12
    rows = [
        _row("roofline", dict(kernel="roofline", layer="gemm", T=None, B=None, dtype="bfloat16", flops=2e12,
                              bytes=0), "cublas-gemm", time=2.0),
        _row("roofline", dict(kernel="roofline", layer="copy", T=None, B=None, dtype="bfloat16", flops=0,
                              bytes=2e9), "copy", time=1.0),
        _row("linear_norm", shape, "dpgrad-gram", time=2 * limit * 1e3),
        _row("linear_norm", shape, "cublas-gram", time=4 * limit * 1e3),
        _row("linear_norm", shape, "gemm", time=limit * 1e3),
    ]
    bench._derive_kernels(rows)
    gemm_peak, copy_peak, gram, cublas, _ = (r["metrics"] for r in rows)
    assert gemm_peak["tensor_flops"]["p50"] == pytest.approx(1000)
    assert copy_peak["bandwidth"]["p50"] == pytest.approx(2000)
    assert limit > read
    assert gram["roofline_fraction"]["p50"] == pytest.approx(0.5)
    assert gram["time_over_cublas_gram"]["p50"] == pytest.approx(0.5)
    assert gram["time_over_gemm"]["p50"] == pytest.approx(2.0)
    assert gram["time_over_read"]["p50"] == pytest.approx(2 * limit / read)
    assert cublas["roofline_fraction"]["p50"] == pytest.approx(0.25)
    assert "time_over_cublas_gram" not in cublas  # dpgrad's rows only
    # A clipped sum's work: the GEMM's flops, its inputs read and its output written.
    flops, moved = bench.kernel_work(dict(shape, kernel="linear_clipped_sum"))
    assert flops == 2 * B * T * d * p and moved == 2 * (B * T * (d + p) + p * d)
    # Past T = 2dp / (d + p) = 2048 the direct form's flops are the fewer.
    flops, _ = bench.kernel_work(dict(shape, T=8192, B=1))
    assert flops == 2 * 8192 * d * p
