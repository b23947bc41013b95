"""The sweep of Hugging Face architectures: every causal-LM, seq2seq and sequence-classification
architecture of transformers' auto mappings, built tiny from its default config (random weights,
tests/hf_zoo_configs.py), trained one clipped step by dpgrad in four runs (full fine-tuning and
LoRA, single and double backward) and compared with float64 per-sample gradients.

    python tests/hf_zoo.py [--only gpt2,t5] [--tasks causal-lm,seq2seq,seq-cls] [--jobs N] [--write]

Each run is "exact" (norms and ``p.grad`` within the tolerances of tests/test_hf_models.py's
``check``; a run refused with the advice to start at another batch size is run again as it
says, after a first step on the batch's first B-1 rows, and marked so), "refused" (dpgrad
raised, naming a layer or parameter), "error" (any other exception:
a torch or transformers error surfacing through dpgrad, a bug) or "mismatch" (ran, and differs
from the reference). An architecture that fails to build, or whose plain forward pass fails
without dpgrad, is "not built". ``--write`` stores tests/data/hf_zoo.json and regenerates the
regions of docs/supported.md and README.md it feeds (tests/test_hf_zoo.py checks both).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf_zoo.json"
if __name__ == "__main__":  # as tests/conftest.py sets up a test session
    os.environ.setdefault("DPGRAD_TUNE", "off")
    os.environ.setdefault("DPGRAD_TUNE_DIR", tempfile.mkdtemp(prefix="dpgrad-zoo-tune-"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import dpgrad  # noqa: E402
from hf_zoo_configs import (TASKS, B, Case, NotBuilt, build, eager_experts, entries, first_line,  # noqa: E402
                            make_case, modal_inputs, unreached, with_lora)
from per_sample_reference import RTOL, norm_error_ratio, tensor_error_ratio, total_norm  # noqa: E402
from test_hf_models import clipped_step, reference, weighted_autograd  # noqa: E402

RUNS = ("full/single", "full/double", "lora/single", "lora/double")  # {full fine-tuning, LoRA} x backward
STATUSES = ("exact", "refused", "mismatch", "error")  # better to worse; "not built" apart
DPGRAD_DIR = Path(dpgrad.__file__).resolve().parent
NAMED = re.compile(r"\b(?:layers?|parameters?|submodules?|modules?)\b[^.;]{0,60}?['\[]")
# A refusal whose advice is to start at another batch size (a size of the batch's also another of an input's).
ANOTHER_SIZE = re.compile(r"(?i)run a first step at (?:a|another) batch size")


# ------------------------------------------------------------------ judging a run
def classify(exc: BaseException) -> Dict[str, str]:
    """{"status": "refused" or "error", "message": its first line, "where": the innermost frame,
    "via": the innermost frame in dpgrad}. A refusal is raised by dpgrad itself (the innermost
    frame is under dpgrad/) with a message naming a layer or parameter; an assertion is not one."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(DPGRAD_DIR)]
    inner = frames[-1] if frames else None
    refused = (bool(ours) and inner is ours[-1] and not isinstance(exc, AssertionError)
               and bool(NAMED.search(str(exc))))
    out = {"status": "refused" if refused else "error", "message": first_line(exc)}
    lines = str(exc).strip().splitlines()
    if lines and not NAMED.search(lines[0]):  # what it names is further down: keep its first line
        named = next((line.strip() for line in lines[1:] if NAMED.search(line)), None)
        if named:
            out["detail"] = named[:300]
    if inner is not None:
        out["where"] = f"{_short(inner.filename)}:{inner.lineno}"
    if ours and ours[-1] is not inner:
        out["via"] = f"{_short(ours[-1].filename)}:{ours[-1].lineno}"
    return out


def _short(filename: str) -> str:
    path = Path(filename).resolve()
    for base in (ROOT, *(Path(p) for p in sys.path if p.endswith("site-packages"))):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return path.name


def compare(case: Case, model: nn.Module, norms: torch.Tensor, ref: dict, own: dict, C: float, skip: set) -> Dict:
    """The clipped step against the float64 reference, as tests/test_hf_models.py's ``check``:
    per-sample norms within RTOL, or 4x the error plain autograd's per-sample gradients make in the
    model's precision (``own``) where that is larger; each trainable ``p.grad`` within RTOL of
    ``sum_b c_b g_b``, element-wise, with the absolute floor at the gradient's scale or 4x the
    error plain autograd makes in the model's precision (per sample, ``own``, or on the whole
    batch as the non-private step runs it), whichever is larger. ``skip``: parameters plain
    autograd leaves without a gradient (None or zero expected). {"status", "rel_error", "what"}."""
    ref_norms = total_norm(ref)
    if norms is None or norms.shape != ref_norms.shape or norms.dtype != torch.float32:
        return {"status": "mismatch", "what": f"per-sample norms {None if norms is None else tuple(norms.shape)}"}
    own_norm_error = (total_norm(own) - ref_norms).abs()
    worst = (norm_error_ratio(norms, ref_norms, floor=4 * own_norm_error), "per-sample norms")
    if not torch.isfinite(norms).all():
        worst = (float("inf"), "per-sample norms")
    coef = (C / (norms.double() + 1e-6)).clamp(max=1.0)
    batched = weighted_autograd(case, coef)
    params = dict(model.named_parameters())
    for n, g in ref.items():
        got = params[n].grad
        if got is None:
            if n not in skip:
                return {"status": "mismatch", "what": f"{n}: no gradient"}
            continue
        if got.dtype != params[n].dtype:
            return {"status": "mismatch", "what": f"{n}.grad is {got.dtype}"}
        g = g.double()  # a layer may cast itself back in its forward (Switch Transformers' router to fp32)
        expected = torch.einsum("b,b...->...", coef, g)
        scale = (coef[:, None] * g.flatten(1).abs()).sum(0).max().item() if g.numel() else 0.0
        autograd_error = max((torch.einsum("b,b...->...", coef, own[n].double()) - expected).abs().max().item(),
                             (batched[n].double() - expected).abs().max().item()) if g.numel() else 0.0
        ratio = tensor_error_ratio(got, expected, RTOL, max(scale, 4 * autograd_error / RTOL))
        worst = max(worst, (ratio if ratio == ratio else float("inf"), f"{n}.grad"))
    frozen = [n for n, p in params.items() if n not in ref and p.grad is not None]
    if frozen:
        return {"status": "mismatch", "what": f"frozen {frozen[0]} got a gradient"}
    out = {"rel_error": float(f"{worst[0] * RTOL:.3g}"), "what": worst[1]}
    if worst[1] == "per-sample norms" and worst[0] > 1:  # how far plain fp32 autograd is, for the reader
        out["autograd_rel_error"] = float(f"{norm_error_ratio(total_norm(own), ref_norms) * RTOL:.3g}")
    return {"status": "exact" if worst[0] <= 1 else "mismatch", **out}


def run_variant(case: Case) -> Dict[bool, Dict]:
    """The two runs (single backward, double) of one model: {single: outcome}."""
    step = "plain backward"
    try:
        skip = unreached(case)
        step = "float64 reference"
        ref = reference(eager_experts(case))  # float64, one sample at a time
        step = "plain per-sample autograd"
        own = reference(case, dtype=None)  # plain autograd in the model's precision
        norms = total_norm(ref)
        step = "float64 reference"
        if not (torch.isfinite(norms).all() and norms.median() > 0):
            raise NotBuilt(f"per-sample norms {[float(f'{n:.3g}') for n in norms]}")
    except Exception as exc:  # noqa: BLE001
        why = str(exc) if isinstance(exc, NotBuilt) else first_line(exc)
        reason = {"status": "not built", "message": f"{step}: {why}"}
        return {True: reason, False: reason}
    C = float(norms.median())
    out = {}
    for single in (True, False):
        first = None
        try:
            try:
                model, norms = clipped_step(case, single, "mean", C)
            except Exception as exc:  # noqa: BLE001 - every exception is classified
                if classify(exc)["status"] != "refused" or not ANOTHER_SIZE.search(str(exc)):
                    raise
                first = {"first_step": B - 1, "refused_at_first": first_line(exc)}  # do as it says
                model, norms = clipped_step(case, single, "mean", C, first=slice(0, B - 1))
        except Exception as exc:  # noqa: BLE001 - every exception is classified
            out[single] = {**classify(exc), **(first or {})}
            continue
        out[single] = {**compare(case, model, norms, ref, own, C, skip), **(first or {})}
    return out


def sweep_one(model_type: str, task: str, class_name: str) -> Dict:
    """The record of one architecture: its runs, overall status and reason, sizes, timings."""
    start = time.perf_counter()
    record = {"model_type": model_type, "task": task, "model_class": class_name}
    try:
        model, config = build(model_type, task, class_name)
        case = make_case(model, task, config)
        try:
            with torch.no_grad():
                logits = case.forward(model, slice(None))[0][0]
            if not torch.isfinite(logits).all():
                raise NotBuilt("the plain forward pass gives non-finite logits")
        except NotBuilt:
            raise
        except Exception as exc:  # noqa: BLE001
            modal = modal_inputs(type(model))
            raise NotBuilt(f"needs {modal[0]}: a text-only forward fails ({first_line(exc)})" if modal
                           else f"forward: {first_line(exc)}") from exc
    except NotBuilt as exc:
        return {**record, "status": "not built", "reason": str(exc), "runs": {},
                "seconds": round(time.perf_counter() - start, 1)}
    record["parameters"] = sum(p.numel() for p in model.parameters())
    runs = {}
    for variant in ("full", "lora"):
        try:
            variant_case = case if variant == "full" else Case(with_lora(model), case.forward, case.per_sample_loss)
        except Exception as exc:  # noqa: BLE001
            runs.update({f"{variant}/single": {"status": "not built", "message": f"peft: {first_line(exc)}"},
                         f"{variant}/double": {"status": "not built", "message": f"peft: {first_line(exc)}"}})
            continue
        outcome = run_variant(variant_case)
        runs.update({f"{variant}/single": outcome[True], f"{variant}/double": outcome[False]})
    record["runs"] = runs
    record.update(overall(runs))
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def overall(runs: Dict[str, Dict]) -> Dict[str, str]:
    """Exact where every run that was built is exact; else the worst run's status and reason."""
    built = [r for r in runs.values() if r["status"] != "not built"]
    if not built:
        return {"status": "not built", "reason": next(iter(runs.values()))["message"]}
    worst = max(built, key=lambda r: STATUSES.index(r["status"]))
    if worst["status"] == "exact":
        return {"status": "exact", "reason": ""}
    return {"status": worst["status"], "reason": reason_of(worst)}


def reason_of(run: Dict) -> str:
    if run["status"] == "mismatch":
        error, own = run.get("rel_error"), run.get("autograd_rel_error")
        plain = f" (plain fp32 autograd: {own:.2g})" if own is not None else ""
        return f"{run['what']}: relative error {error:.2g}{plain}" if error is not None else run["what"]
    return run["message"]


# ------------------------------------------------------------------ the pool
def _child(entry, conn) -> None:
    torch.set_num_threads(1)
    try:
        conn.send(sweep_one(*entry))
    except BaseException as exc:  # noqa: BLE001 - the parent records it
        conn.send(_lost(entry, f"sweep: {first_line(exc)}", 0.0))
    conn.close()


def _lost(entry, why: str, seconds: float) -> Dict:
    return {"model_type": entry[0], "task": entry[1], "model_class": entry[2], "status": "error",
            "reason": why, "runs": {}, "seconds": round(seconds, 1)}


def _rss_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return 0.0


def run_pool(todo: List[Tuple[str, str, str]], jobs: int, timeout: float, report,
             max_memory_gb: float = 4.0) -> List[Dict]:
    """Each architecture in a process of its own (forked: the imports are done once), ``jobs``
    at a time; one past ``timeout`` seconds or ``max_memory_gb`` of memory is ended and
    recorded, as is one that dies."""
    ctx = mp.get_context("fork")
    pending, running, results = list(todo), {}, []
    while pending or running:
        while pending and len(running) < jobs:
            entry = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(entry, send), daemon=True)
            proc.start()
            send.close()
            running[recv] = (proc, entry, time.monotonic())
        ready = mp.connection.wait(list(running), timeout=1.0)
        for recv, (proc, entry, started) in list(running.items()):
            elapsed = time.monotonic() - started
            if recv in ready:
                try:
                    result = recv.recv()
                except EOFError:
                    proc.join()
                    result = _lost(entry, f"the process died (exit code {proc.exitcode})", elapsed)
            elif elapsed > timeout:
                proc.kill()
                result = _lost(entry, f"no result within --timeout={timeout:g}", elapsed)
            elif _rss_gb(proc.pid) > max_memory_gb:
                proc.kill()
                result = _lost(entry, f"took more than --max-memory={max_memory_gb:g} GB", elapsed)
            else:
                continue
            proc.join()
            recv.close()
            del running[recv]
            results.append(result)
            report(result)
    return results


# ------------------------------------------------------------------ the stored results and the docs
def versions() -> Dict[str, str]:
    import peft
    import transformers

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
            "dpgrad": dpgrad.__version__, "date": datetime.date.today().isoformat(), "commit": commit}


def load() -> Dict:
    return json.loads(DATA.read_text(encoding="utf-8"))


def store(results: List[Dict], merge: bool) -> Dict:
    """Write tests/data/hf_zoo.json; with ``merge``, over the stored records of other architectures."""
    records = {(r["model_type"], r["task"]): r for r in (load()["results"] if merge and DATA.exists() else [])}
    records.update({(r["model_type"], r["task"]): r for r in results})
    order = {e[:2]: i for i, e in enumerate(entries())}
    data = {**versions(), "results": sorted(records.values(), key=lambda r: order.get((r["model_type"], r["task"]),
                                                                                          len(order)))}
    rows = ",\n".join(f"  {json.dumps(r)}" for r in data["results"])  # one line per architecture
    head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in data.items() if k != "results")
    DATA.write_text(f"{{\n{head} \"results\": [\n{rows}\n ]\n}}\n", encoding="utf-8")
    return data


MARK = {"exact": "exact", "refused": "refused", "mismatch": "**mismatch**", "error": "**error**",
        "not built": "not built"}


def _counts(results: List[Dict]) -> Dict[str, Counter]:
    counts = defaultdict(Counter)
    for r in results:
        counts[r["task"]][r["status"]] += 1
    return counts


def summary_table(results: List[Dict]) -> List[str]:
    counts = _counts(results)
    cols = ["exact", "refused", "error", "mismatch", "not built"]
    lines = ["| task | architectures | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for task in [t for t in TASKS if t in counts]:
        c = counts[task]
        lines.append(f"| {task} | {sum(c.values())} | " + " | ".join(str(c[s]) for s in cols) + " |")
    return lines


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)\s", text, maxsplit=1)[0]


def cause(run: Dict) -> str:
    """What a failing run has in common with others of its kind: the first sentence of its
    message with names, lists and the layer's class elided; for a mismatch, what differs."""
    if run["status"] == "mismatch":
        what = run["what"]
        if what == "per-sample norms":
            own = run.get("autograd_rel_error") or 0
            return (f"per-sample norms off by more than {RTOL:g}" +
                    (", as plain fp32 autograd's are (the model's own rounding)"
                     if own >= run.get("rel_error", 1) / 2 else ""))
        if what.endswith(".grad"):
            return f"`p.grad` off by more than {RTOL:g} of its scale"
        if what.endswith(": no gradient"):
            return "no `p.grad` on a parameter plain autograd gives one"
        return re.sub(r"(?<=frozen )\S+", "…", what)
    text = re.sub(r"\[[^\]]*\]", "[…]", first_sentence(run["message"]))
    text = re.sub(r"'…'(?:, '…')+", "'…', …", re.sub(r"'[^'\s]*'", "'…'", text))
    return re.sub(r"\([A-Z]\w*(?:, [^)]*)?\)", "(…)", text)


def render_docs(data: Dict) -> str:
    """The region of docs/supported.md: what was run, one row per built architecture with its
    runs and the causes of those not exact (labels, most frequent first, explained below it),
    then the architectures not built, grouped by reason."""
    results = data["results"]
    built = [r for r in results if r["status"] != "not built"]
    failing = [(r, run) for r in built for run in r["runs"].values() if run["status"] in STATUSES[1:]]
    by_cause = defaultdict(list)  # (status, cause) -> model types
    for r, run in failing:
        if r["model_type"] not in by_cause[run["status"], cause(run)]:
            by_cause[run["status"], cause(run)].append(r["model_type"])
    order = sorted(by_cause, key=lambda c: (-len(by_cause[c]), c))
    labels = {c: f"R{i + 1}" for i, c in enumerate(order)}
    lines = [f"transformers {data['transformers']}, torch {data['torch']}, peft {data['peft']}; "
             f"run on {data['date']}.", ""] + summary_table(results) + [
        "", "| architecture | task | model class | full single | full double | LoRA single | LoRA double | why |",
        "|---|---|---|---|---|---|---|---|"]
    for r in built:
        cells = [MARK[r["runs"][k]["status"]] + ("†" if "first_step" in r["runs"][k] else "") if k in r["runs"]
                 else "" for k in RUNS]
        why = sorted({labels[o["status"], cause(o)] for o in r["runs"].values() if o["status"] in STATUSES[1:]},
                     key=lambda label: int(label[1:]))
        lines.append(f"| `{r['model_type']}` | {r['task']} | `{r['model_class']}` | " + " | ".join(cells)
                     + f" | {', '.join(why)} |")
    after = sorted({run["first_step"] for r in built for run in r["runs"].values() if "first_step" in run})
    if after:
        lines += ["", f"† After a first step at {', '.join(map(str, after))} samples: at the sweep's {B}, the first "
                      "step is refused, saying to start at another batch size, because that size is also another "
                      "size of a layer's input and where its batch lies cannot be told; what the first step showed "
                      "is remembered."]
    if labels:
        lines += ["", "Why (the first sentence of each message, names elided; the full messages are in "
                      "`tests/data/hf_zoo.json`):", ""]
        lines += [f"- {labels[c]}, {c[0]}: {_escape(c[1])} ({', '.join(f'`{m}`' for m in by_cause[c])})"
                  for c in order]
    missing = defaultdict(list)
    for r in results:
        if r["status"] == "not built" and r["model_type"] not in missing[r["reason"]]:
            missing[r["reason"]].append(r["model_type"])
    if missing:
        lines += ["", "Not built (the model or its tiny config, not dpgrad):", ""]
        lines += [f"- {_escape(first_sentence(reason))}: {', '.join(f'`{m}`' for m in names)}"
                  for reason, names in sorted(missing.items())]
    return "\n".join(lines)


def _escape(text: str) -> str:
    return (text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*").replace("_", "\\_")
            .replace("[", "\\[").replace("]", "\\]"))


def render_readme(data: Dict) -> str:
    return "\n".join(summary_table(data["results"]) + [
        "", f"With transformers {data['transformers']} and peft {data['peft']}. Each architecture, its four "
            "runs and why\na run is not exact: [What is supported](docs/supported.md#models)."])


REGIONS = {ROOT / "docs" / "supported.md": ("zoo", render_docs), ROOT / "README.md": ("zoo-summary", render_readme)}


def region(text: str, name: str) -> Tuple[int, int]:
    """(start, end) of the text between ``<!-- name:begin -->`` and ``<!-- name:end -->``."""
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    start = text.index(begin) + len(begin)
    return start, text.index(end, start)


def generated(path: Path, data: Dict) -> str:
    """What stands between the markers of ``path``'s region: the rendering, between blank lines
    (a table right under a comment line would not render as a table)."""
    name, render = REGIONS[path]
    return "\n" + render(data) + "\n\n"


def write_docs(data: Dict) -> None:
    for path, (name, _) in REGIONS.items():
        text = path.read_text(encoding="utf-8")
        start, end = region(text, name)
        path.write_text(text[:start] + generated(path, data) + text[end:], encoding="utf-8")


# ------------------------------------------------------------------ the command line
def print_summary(results: List[Dict]) -> None:
    print("\n" + "\n".join(summary_table(results)))
    groups = defaultdict(list)
    for r in results:
        for run, outcome in (r.get("runs") or {}).items():
            if outcome["status"] in ("refused", "error", "mismatch"):
                key = (outcome["status"], reason_of(outcome) if outcome["status"] == "mismatch"
                       else outcome["message"], outcome.get("where", ""), outcome.get("via", ""),
                       outcome.get("detail", ""))
                groups[key].append(f"{r['model_type']}[{r['task']}:{run}]")
        if r["status"] == "error" and not r.get("runs"):
            groups[("error", r["reason"], "", "", "")].append(f"{r['model_type']}[{r['task']}]")
    for (status, message, where, via, detail), names in sorted(groups.items()):
        at = f" at {where}" + (f" via {via}" if via else "") if where else ""
        detail = f"\n    ({detail})" if detail else ""
        print(f"\n{status}: {message}{at}{detail}\n    {', '.join(names)}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks: " + ", ".join(TASKS))
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)), help="processes at a time")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per architecture")
    parser.add_argument("--max-memory", type=float, default=4.0, help="GB per architecture")
    parser.add_argument("--write", action="store_true", help="store tests/data/hf_zoo.json and the doc regions")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    unknown = set(tasks) - set(TASKS)
    if unknown:
        parser.error(f"unknown task(s) {sorted(unknown)}: choose from {', '.join(TASKS)}")
    todo = entries(tasks)
    if args.only:
        only = set(args.only.split(","))
        missing = only - {e[0] for e in todo}
        if missing:
            parser.error(f"no architecture {sorted(missing)} for the tasks {', '.join(tasks)}")
        todo = [e for e in todo if e[0] in only]
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # transformers' and peft's notes on models built from configs
    from dpgrad.tuning.progress import progress_bar

    # One thread per process, set before any operation (forked processes must not inherit a thread
    # pool); one architecture run here first, so that each forked process starts with the modules
    # it shares with the others imported and initialised.
    torch.set_num_threads(1)
    sweep_one("gpt2", "causal-lm", "GPT2LMHeadModel")

    bar = progress_bar("hf zoo", total=len(todo), unit=" models")
    say = bar.write if bar is not None else print

    def report(r: Dict) -> None:
        say(f"{r['model_type']:<28} {r['task']:<9} {r['status']:<9} {r.get('seconds', 0):6.1f}s  {r['reason'][:90]}")
        if bar is not None:
            bar.update(1)

    start = time.monotonic()
    results = run_pool(todo, args.jobs, args.timeout, report, args.max_memory)
    if bar is not None:
        bar.close()
    print_summary(results)
    print(f"\n{len(results)} architectures in {(time.monotonic() - start) / 60:.1f} min, {args.jobs} at a time")
    if args.write:
        data = store(results, merge=bool(args.only) or len(tasks) < len(TASKS))
        write_docs(data)
        print(f"\nwrote {DATA.relative_to(ROOT)} and the regions of {', '.join(p.name for p in REGIONS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
