"""The autotune report: one DP-SGD step of a model, and what the autotuner chose per layer.

``run_report`` builds a preset model (dpgrad/tools/presets.py), wraps it in
``GradSampleModuleFastGradientClipping`` (ghost clipping), runs one two-pass DP step on a
synthetic batch while the tuner records its decision for every layer (timing Opacus's own
sampler on the same inputs), then tuned steps, warmed up, whose median time is ``step_ms``. The result
is a JSON-ready dict; ``format_table`` and ``format_markdown`` render it.
"""

from __future__ import annotations

import datetime
import os
import sys
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, TextIO

import torch
import torch.nn as nn

from dpgrad.kernels import backend

from dpgrad.samplers import registry
from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.tools.models import dp_sgd_step, synthetic_batch
from dpgrad.tools.presets import DTYPES, build_model
from dpgrad.tools.results import git_commit, warm_up
from dpgrad.tuning import get_tuner, store, tune_mode
from dpgrad.tuning.tuner import ENV_VAR as TUNE_ENV_VAR
from dpgrad.tuning.progress import TUNING_PROGRESS, progress_bar

SCHEMA = 1
NO_CHOICE = "dpgrad sampler (no kernel choice)"
FUNCTORCH = "torch.func (no kernel choice)"
CPU_NOTICE = ("{why}: the eager fallback is in use (dpgrad's Triton kernels run on CUDA tensors), "
              "so the choices and times below are those of the eager PyTorch kernels.")


@dataclass
class ReportSettings:
    """What to run: a model name (preset or hf:<type>), batch shape, dtype name, device."""

    model: str = "tiny"
    batch_size: int = 8
    seq_len: int = 128
    dtype: str = "fp32"
    device: str = "cpu"
    opacus: bool = True  # time Opacus's eager sampler on each layer's inputs
    hf_config: Dict[str, object] = field(default_factory=dict)  # config overrides for hf: models
    retune: bool = False  # measure every shape again, replacing its stored entry


class Progress:
    """The report's progress bar (tqdm) on ``stream`` (stderr), a step per layer decided; off
    where the stream is not a terminal (``DPGRAD_PROGRESS=1`` shows it anyway), so logs keep
    the report alone."""

    def __init__(self, total: int, stream: Optional[TextIO] = None):
        self.bar = progress_bar("autotune", total, " layers", stream, leave=False, dynamic_ncols=True)

    def update(self, label: str, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label[:60], refresh=False)
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def _tuning_on_unless_set():
    """DPGRAD_TUNE=on for the run unless the user set it; the environment is left as found."""
    if TUNE_ENV_VAR in os.environ:
        yield
        return
    os.environ[TUNE_ENV_VAR] = "on"
    try:
        yield
    finally:
        os.environ.pop(TUNE_ENV_VAR, None)


def trainable_layers(model: nn.Module) -> List[tuple]:
    """(qualified name, module) for every module with trainable parameters of its own."""
    return [(name, m) for name, m in model.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))]


def _layer_shape(layer: nn.Module) -> str:
    if isinstance(layer, nn.Linear):
        return f"{layer.in_features}x{layer.out_features}"
    if isinstance(layer, nn.Embedding):
        return f"{layer.num_embeddings}x{layer.embedding_dim}"
    param = next(p for p in layer.parameters(recurse=False) if p.requires_grad)
    return "x".join(map(str, param.shape))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backend_in_use(device: torch.device, dtype: torch.dtype) -> str:
    try:
        name = backend.ops_for(torch.empty(1, device=device, dtype=dtype)).NAME
    except Exception as exc:  # e.g. DPGRAD_BACKEND=triton on CPU tensors without the interpreter
        return f"none ({exc})"
    return f"{name} (Triton interpreter)" if name == "triton" and device.type != "cuda" else name


def run_report(settings: ReportSettings, progress_stream: Optional[TextIO] = None) -> dict:
    """Run one DP step of ``settings.model`` with the autotuner recording, and return the report.

    Raises ValueError for an unknown model, dtype or an out-of-range sequence length.
    """
    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype {settings.dtype!r}: use one of {', '.join(DTYPES)}")
    device = torch.device(settings.device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    # Seeded for repeatable weights and batches, without changing the caller's random state.
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        return _run(settings, device, DTYPES[settings.dtype], progress_stream)


def _run(settings: ReportSettings, device: torch.device, dtype: torch.dtype, progress_stream) -> dict:
    built = build_model(settings.model, device, dtype, seq_len=settings.seq_len, **settings.hf_config)
    layers = trainable_layers(built.module)
    names = {id(m): name for name, m in layers}
    model = GradSampleModuleFastGradientClipping(built.module, max_grad_norm=1.0, loss_reduction="mean",
                                                 use_ghost_clipping=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ids = synthetic_batch(built.batch_config(), settings.batch_size, settings.seq_len, generator=gen).to(device)

    tuner = get_tuner()
    progress = Progress(len(layers), progress_stream)

    def on_layer(layer, decision):
        progress.update(f"{names.get(id(layer), '?')}: {decision.choice} ({decision.source})")

    with _tuning_on_unless_set():
        mode = tune_mode()
        start = time.perf_counter()
        if settings.retune:
            tuner.forget()  # this process's decisions too
        tuner.retune, retune_before = settings.retune, tuner.retune
        try:
            with tuner.recording(settings.opacus, on_layer) as rec, TUNING_PROGRESS.hidden():
                dp_sgd_step(model, optimizer, built.per_sample_loss(model, ids), noise_multiplier=1.0)
                _sync(device)
        finally:
            tuner.retune = retune_before
        tuning_s = time.perf_counter() - start
        untuned = len(layers) - len({id(layer) for layer, _, _ in rec.layers})
        if untuned > 0:
            progress.update(f"{untuned} layer(s) without a kernel choice", untuned)
        progress.close()
        # The tuned step: every decision is now cached in the process. Warmed up until two
        # steps agree (a first step pays for allocation), then the median of three.
        def step():
            dp_sgd_step(model, optimizer, built.per_sample_loss(model, ids), noise_multiplier=1.0)
            _sync(device)

        warm_up(step, min_rounds=1, max_rounds=5)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        step_ms = sorted(times)[1]

    rows = _rows(layers, rec.layers, rec.chosen_ms)
    dev_name = store.device_name(device)
    notice = None
    if device.type != "cuda":
        why = "CUDA is not available" if not torch.cuda.is_available() else f"running on {device}"
        notice = CPU_NOTICE.format(why=why)
    return {
        "schema": SCHEMA,
        "device": dev_name,
        "versions": {**store.versions(), "python": sys.version.split()[0]},
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": settings.model, "parameters": sum(p.numel() for p in built.module.parameters()),
                  "trainable_layers": len(layers)},
        "settings": {"batch_size": settings.batch_size, "seq_len": settings.seq_len, "dtype": settings.dtype,
                     "tune_mode": mode, "device": str(device), "opacus": settings.opacus,
                     "retune": settings.retune},
        "backend": _backend_in_use(device, dtype),
        "notice": notice,
        "store": str(store.store_path(dev_name)),
        "rows": rows,
        "step_ms": step_ms,
        "tuning_s": tuning_s,
    }


def _rows(layers, recorded, chosen_ms: Dict[tuple, float]) -> List[dict]:
    """A row per trainable layer and kind of work. Speedups divide Opacus's time by the chosen
    candidate's, both taken in this run on the layer's inputs; ``timings_ms`` are the tuner's,
    of this run (source "measured") or of the process that stored them (``timings_from``)."""
    by_layer: Dict[int, list] = {}
    for layer, decision, opacus in recorded:
        by_layer.setdefault(id(layer), []).append((decision, opacus))
    rows = []
    for name, layer in layers:
        base = {"name": name, "type": type(layer).__name__, "shape": _layer_shape(layer),
                "parameters": sum(p.numel() for p in layer.parameters(recurse=False) if p.requires_grad)}
        if id(layer) not in by_layer:
            tuned_type = type(layer) in registry.NORM_SAMPLERS
            choice = ("no kernel choice made (weight frozen, or layer unused)" if tuned_type
                      else NO_CHOICE if type(layer) in registry.GRAD_SAMPLERS else FUNCTORCH)
            rows.append({**base, "B": None, "T": None, "kind": None, "choice": choice, "config": None,
                         "source": None, "timings_ms": {}, "skipped": {}, "estimates_ms": {}, "chosen_ms": None,
                         "chosen_timed_by": None, "opacus_ms": None, "opacus_note": None, "speedup": None,
                         "extra_bytes": None, "timings_from": None, "window_ms": {}, "rounds": 0, "stable": True})
            continue
        for decision, opacus in by_layer[id(layer)]:
            ms = chosen_ms.get((id(layer), decision.kind))
            measured = decision.source in ("measured", "measured again")
            timed_by = None if ms is None else "autotuner" if measured else "report"
            opacus_ms = opacus if isinstance(opacus, float) else None
            note = None if opacus_ms is not None else (opacus or "not timed (--no-opacus)")
            speedup = opacus_ms / ms if opacus_ms is not None and ms else None
            if speedup is None and note is None:
                note = "no time for the chosen candidate"
            rows.append({**base, "B": decision.shape.get("B"), "T": decision.shape.get("T"), "kind": decision.kind,
                         "choice": decision.choice, "config": decision.config, "source": decision.source,
                         "timings_ms": dict(decision.timings_ms), "skipped": dict(decision.skipped),
                         "window_ms": {k: list(v) for k, v in decision.window_ms.items()},
                         "rounds": decision.rounds, "stable": decision.stable,
                         "estimates_ms": dict(decision.estimates_ms), "chosen_ms": ms, "chosen_timed_by": timed_by,
                         "opacus_ms": opacus_ms, "opacus_note": note, "speedup": speedup,
                         "extra_bytes": decision.extra_bytes.get(decision.choice),
                         "timings_from": ("this run" if measured else
                                          f"store, {decision.stored_at or 'undated'}" if decision.source == "store"
                                          else None)})
    return rows


# ---------------------------------------------------------------------------- rendering
COLUMNS = ["layer", "type", "shape", "BxT", "kind", "choice", "config", "candidates (ms)", "Opacus ms",
           "speedup", "extra mem (est.)", "source"]


def _short_reason(reason: str) -> str:
    for prefix, short in (("pruned", "pruned"), ("wrong", "wrong"), ("failed", "failed")):
        if reason.startswith(prefix):
            return short
    return reason.split(":")[0][:20]


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"~{n:.0f} {unit}" if unit == "B" else f"~{n:.1f} {unit}"
        n /= 1024
    return "-"


def _candidates_cell(row: dict) -> str:
    parts = []
    stored = (row.get("timings_from") or "").startswith("store")
    for name in row["estimates_ms"]:
        if name == row["choice"] and row["chosen_ms"] is not None:
            parts.append(f"{name} {row['chosen_ms']:.3f}")  # timed in this run
        elif name in row["timings_ms"]:
            window = row.get("window_ms", {}).get(name)
            spread = f" ({window[0]:.3f}-{window[1]:.3f})" if window and window[1] > window[0] else ""
            parts.append(f"{name} {'stored ' if stored else ''}{row['timings_ms'][name]:.3f}{spread}")
        elif name in row["skipped"]:
            parts.append(f"{name} {_short_reason(row['skipped'][name])}")
        else:
            parts.append(f"{name} ~{row['estimates_ms'][name]:.3f}")
    return ", ".join(parts) or "-"


def _cells(row: dict) -> List[str]:
    if row["kind"] is None:
        return [row["name"], row["type"], row["shape"], "-", "-", row["choice"], "-", "-", "-", "-", "-", "-"]
    config = " ".join(f"{k}={v}" for k, v in row["config"].items()) if row["config"] else "-"
    opacus = f"{row['opacus_ms']:.3f}" if row["opacus_ms"] is not None else "-"
    speedup = f"{row['speedup']:.2f}x" if row["speedup"] is not None else f"n/a ({row['opacus_note']})"
    return [row["name"], row["type"], row["shape"], f"{row['B']}x{row['T']}", row["kind"], row["choice"], config,
            _candidates_cell(row), opacus, speedup, _bytes(row["extra_bytes"]), _source_cell(row)]


def _source_cell(row: dict) -> str:
    """The source, with the rounds of timing and whether the choice held over them."""
    if not row.get("rounds"):
        return row["source"]
    return f"{row['source']}, {row['rounds']} rounds" + ("" if row.get("stable", True) else ", unstable: not stored")


def _header_lines(report: dict) -> List[str]:
    s, v, m = report["settings"], report["versions"], report["model"]
    lines = [
        f"dpgrad autotune report: {m['name']} ({m['parameters'] / 1e6:.2f}M parameters, "
        f"{m['trainable_layers']} trainable layers), batch {s['batch_size']} x {s['seq_len']} tokens, {s['dtype']}",
        f"device {report['device']} ({s['device']}); torch {v['torch']}, triton {v['triton'] or 'not installed'}, "
        f"dpgrad {v['dpgrad']}; backend {report['backend']}",
        f"DPGRAD_TUNE={s['tune_mode']}; store {report['store']}",
    ]
    if report["notice"]:
        lines.append(report["notice"])
    return lines


FOOTER = ("candidates: ms measured in this run, 'stored' ms from the tune store (the JSON says when), the median "
          "over rounds of timing with its p20-p80 in brackets, or why not timed (pruned by the cost model, failed, "
          "wrong result); ~ marks a cost-model estimate. Candidates are timed in rounds, each once a round in a "
          "rotated order, until the choice holds (source: the rounds); a stored choice timed here at over twice "
          "another candidate's time is measured again. "
          "speedup = Opacus ms / chosen ms, both timed in this run on the same inputs. "
          "extra mem: cost-model estimate for the chosen candidate.")


# The compact table (the CLI's default): what was chosen and how it compares, within 120
# columns; the full one (``full=True``) adds every candidate's time, the config and memory.
COMPACT = ["layer", "shape", "kind", "choice", "ms", "Opacus ms", "speedup", "source"]
SHORT_KIND = {"linear_norm": "norm", "linear_grad_sample": "grad sample", "linear_clipped_sum": "clipped sum",
              "embedding_norm": "emb norm", "embedding_grad_sample": "emb grad sample", "conv_norm": "conv norm"}
SHORT_SOURCE = {"measured": "tuned", "measured again": "retuned", "store": "stored", "cost model": "cost model",
                "only candidate": "only one",
                "cost model (no candidate passed)": "none passed", "eager after a failure": "fallback"}
LAYER_WIDTH = 36


def _compact_cells(row: dict) -> List[str]:
    name = row["name"] if len(row["name"]) <= LAYER_WIDTH else "..." + row["name"][-(LAYER_WIDTH - 3):]
    if row["kind"] is None:
        return [name, row["shape"], "-", row["choice"][:38], "-", "-", "-", "-"]
    ms = f"{row['chosen_ms']:.3f}" if row["chosen_ms"] is not None else "-"
    opacus = f"{row['opacus_ms']:.3f}" if row["opacus_ms"] is not None else "-"
    speedup = f"{row['speedup']:.2f}x" if row["speedup"] is not None else "n/a"
    return [name, row["shape"], SHORT_KIND.get(row["kind"], row["kind"]), row["choice"], ms, opacus, speedup,
            SHORT_SOURCE.get(row["source"], row["source"])]


def format_table(report: dict, full: bool = False) -> str:
    """The report as aligned plain text (what the CLI prints): compact (within 120 columns:
    what was chosen, its time and Opacus's), or ``full`` (every candidate, config, memory)."""
    columns, cells = (COLUMNS, _cells) if full else (COMPACT, _compact_cells)
    table = [columns] + [cells(r) for r in report["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = _header_lines(report) + [""]
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += ["", f"one tuned DP step: {report['step_ms']:.1f} ms (the first, tuning step: "
                  f"{report['tuning_s']:.1f} s)", FOOTER if full else COMPACT_FOOTER]
    if not full:  # prose wrapped to the table's 120 columns
        lines = [wrapped for line in lines for wrapped in (textwrap.wrap(line, 120) if len(line) > 120 else [line])]
    return "\n".join(lines) + "\n"


COMPACT_FOOTER = ("ms: the chosen candidate's time in this run; speedup = Opacus ms / ms, on the same inputs. "
                  "source: tuned in this run, retuned (a stored choice found far off), stored (the tune store), "
                  "cost model, only one candidate, none passed, fallback (after a failure). --full: every "
                  "candidate's time with its spread, the rounds, the config, the memory.")


def format_markdown(report: dict) -> str:
    """The report as a Markdown paragraph and table."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["  \n".join(_header_lines(report)), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(c) for c in _cells(r)) + " |" for r in report["rows"]]
    lines += ["", f"One tuned DP step: {report['step_ms']:.1f} ms. {FOOTER}"]
    return "\n".join(lines) + "\n"
