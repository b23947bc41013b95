"""The sweep of Hugging Face architectures (tests/hf_zoo.py) on a sample of its families, run
live: each gives the statuses stored in tests/data/hf_zoo.json (so the stored results, and the
tables generated from them, follow the code), and no run is an error or a mismatch. An
architecture stored as failing is marked xfail(strict) on that second assertion, with the stored
reason: the test flips when the library is fixed (then rerun ``make zoo``).

Also: the doc regions are what the generator makes from the stored results, the shrinker's
models are tiny, and the judge itself tells a refusal from an error and a wrong gradient from a
right one.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import dpgrad

pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_zoo  # noqa: E402
from hf_zoo_configs import HIDDEN, LAYERS, MAX_PARAMETERS, entries  # noqa: E402

# The live runs are shared by this module's tests: one worker runs them all.
pytestmark = pytest.mark.xdist_group("hf_zoo")

# The families (a mixture of experts: qwen3_moe; a decoder as a classifier: llama), and roc_bert,
# whose classifier adds to a Linear's output in place. (Mistral's layers are Llama's.)
SAMPLE = [("gpt2", "causal-lm"), ("llama", "causal-lm"), ("qwen3", "causal-lm"),
          ("gemma", "causal-lm"), ("phi", "causal-lm"), ("opt", "causal-lm"), ("qwen3_moe", "causal-lm"),
          ("t5", "seq2seq"), ("bart", "seq2seq"), ("roberta", "seq-cls"), ("llama", "seq-cls"),
          ("roc_bert", "seq-cls")]
CLASSES = {e[:2]: e[2] for e in entries()}
STORED = {(r["model_type"], r["task"]): r for r in hf_zoo.load()["results"]}
_LIVE = {}


def live(model_type: str, task: str) -> dict:
    key = (model_type, task)
    if key not in _LIVE:
        with one_thread():
            _LIVE[key] = hf_zoo.sweep_one(model_type, task, CLASSES[key])
    return _LIVE[key]


@contextlib.contextmanager
def one_thread():
    """Tiny models: more threads only wait on each other (on a busy machine, for minutes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def stored(model_type: str, task: str) -> dict:
    assert (model_type, task) in STORED, f"{model_type} ({task}) is not in tests/data/hf_zoo.json: run `make zoo`"
    return STORED[(model_type, task)]


def outcomes(record: dict) -> dict:
    """What must not drift: each run's status, and the message of a refusal or an error (a
    mismatch's size depends on the machine's rounding, its status does not)."""
    return {run: (o["status"], o.get("message") if o["status"] in ("refused", "error") else None)
            for run, o in record["runs"].items()} | {"overall": (record["status"], None)}


def _ids(entry) -> str:
    return f"{entry[0]}-{entry[1]}"


@pytest.mark.parametrize("model_type,task", SAMPLE, ids=[_ids(e) for e in SAMPLE])
def test_a_live_run_gives_the_stored_result(model_type, task):
    got, want = live(model_type, task), stored(model_type, task)
    assert outcomes(got) == outcomes(want), (
        f"{model_type} ({task}) now gives {outcomes(got)}, tests/data/hf_zoo.json says {outcomes(want)}: "
        "rerun `make zoo` to store the results and regenerate the tables")


def _exact_or_refused() -> list:
    params = []
    for entry in SAMPLE:
        record = STORED.get(entry)
        marks = ()
        if record is not None and record["status"] in ("error", "mismatch"):
            marks = pytest.mark.xfail(strict=True, reason=f"{record['status']}: {record['reason']}")
        params.append(pytest.param(*entry, marks=marks, id=_ids(entry)))
    return params


@pytest.mark.parametrize("model_type,task", _exact_or_refused())
def test_every_run_is_exact_or_a_proper_refusal(model_type, task):
    record = live(model_type, task)
    assert record["status"] != "not built", record["reason"]
    assert len(record["runs"]) == 4
    bad = {run: hf_zoo.reason_of(o) for run, o in record["runs"].items() if o["status"] in ("error", "mismatch")}
    assert not bad, bad


@pytest.mark.parametrize("path", list(hf_zoo.REGIONS), ids=lambda p: p.name)
def test_the_doc_regions_are_generated_from_the_stored_results(path):
    name, _ = hf_zoo.REGIONS[path]
    text = path.read_text(encoding="utf-8")
    start, end = hf_zoo.region(text, name)
    assert text[start:end] == hf_zoo.generated(path, hf_zoo.load()), (
        f"the {name} region of {path.name} is not what tests/data/hf_zoo.json gives: regenerate it with "
        "`make zoo` (or python tests/hf_zoo.py --write), never by hand")


def test_the_stored_results_cover_every_architecture():
    """One record per architecture of the three mappings, each with its runs or its reason."""
    assert set(STORED) == set(CLASSES), sorted(set(STORED) ^ set(CLASSES))
    for record in STORED.values():
        assert record["status"] in (*hf_zoo.STATUSES, "not built"), record
        assert record["status"] == "exact" or record["reason"], record
        lost = record["status"] == "error" and not record["runs"]  # its process died or timed out
        assert record["status"] == "not built" or lost or set(record["runs"]) == set(hf_zoo.RUNS), record


@pytest.mark.parametrize("model_type,task", SAMPLE, ids=[_ids(e) for e in SAMPLE])
def test_the_shrinker_builds_tiny_models(model_type, task):
    model, config = hf_zoo.build(model_type, task, CLASSES[(model_type, task)])
    n = sum(p.numel() for p in model.parameters())
    assert n < 60_000, f"{model_type}: {n} parameters"
    text = config.get_text_config()
    assert getattr(text, "hidden_size", HIDDEN) <= 2 * HIDDEN and getattr(text, "num_hidden_layers", 0) <= LAYERS
    assert max(p.numel() for p in model.parameters()) <= 64 * 64


def test_the_stored_models_were_all_tiny():
    """Every architecture built within the bound, most of them far below it."""
    sizes = sorted((r["parameters"], k) for k, r in STORED.items() if "parameters" in r)
    assert len(sizes) > len(STORED) / 2 and sizes[-1][0] <= MAX_PARAMETERS, sizes[-1]
    assert sizes[len(sizes) // 2][0] < 20_000, sizes[len(sizes) // 2]


def test_a_refusal_names_what_it_refuses_and_an_error_does_not():
    """A refusal: raised in dpgrad, naming the layer. An error: raised elsewhere (torch), or in
    dpgrad without naming anything."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    with pytest.raises(NotImplementedError) as refused:
        dpgrad.GradSampleModuleFastGradientClipping(model)
    got = hf_zoo.classify(refused.value)
    assert got["status"] == "refused" and got["message"].startswith("NotImplementedError: layer '1'"), got
    assert got["where"].startswith("dpgrad/")
    with pytest.raises(RuntimeError) as raw:
        torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 5))
    assert hf_zoo.classify(raw.value)["status"] == "error"
    from dpgrad.clipping.coefficients import clipping_bound

    with pytest.raises(ValueError) as unnamed:
        clipping_bound(-1.0, "max_grad_norm")
    assert hf_zoo.classify(unnamed.value)["status"] == "error"


def test_the_judge_finds_a_wrong_gradient():
    """compare() passes dpgrad's clipped step of GPT-2 and fails it with one gradient entry
    moved by 1e-3 of the gradient's largest, or the norms by a relative 1e-4, naming what."""
    model, config = hf_zoo.build("gpt2", "causal-lm", "GPT2LMHeadModel")
    case = hf_zoo.make_case(model, "causal-lm", config)
    with one_thread():
        ref, own = hf_zoo.reference(case), hf_zoo.reference(case, dtype=None)
        C = float(hf_zoo.total_norm(ref).median())
        stepped, norms = hf_zoo.clipped_step(case, True, "mean", C)
    assert hf_zoo.compare(case, stepped, norms, ref, own, C, set())["status"] == "exact"
    grad = stepped.transformer.h[1].mlp.c_fc.weight.grad
    grad[0, 0] += 1e-3 * grad.abs().max()
    got = hf_zoo.compare(case, stepped, norms, ref, own, C, set())
    assert got["status"] == "mismatch" and got["what"] == "transformer.h.1.mlp.c_fc.weight.grad", got
    grad[0, 0] -= 1e-3 * grad.abs().max()
    got = hf_zoo.compare(case, stepped, norms * (1 + 1e-4), ref, own, C, set())
    assert got["status"] == "mismatch" and got["what"] == "per-sample norms", got
