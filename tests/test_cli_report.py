"""`dpgrad autotune-report` on CPU: the table, the JSON and Markdown outputs, the presets.

One report of the tiny preset (B=2, T=16) with timing on is shared by most tests (module
fixture); timings are real but only their signs are asserted (DESIGN.md: performance is
measured in benchmarks/, never asserted in a test).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from dpgrad.tools import cli, report
from mixed_net import clipped_from_norms
from dpgrad.tools.models import TinyTransformer
from dpgrad.tools.presets import PRESETS, build_model
from dpgrad.tuning import CANDIDATES, get_tuner

# Its session-scoped fixture runs once: under pytest-xdist the module's tests share a worker.
pytestmark = pytest.mark.xdist_group("test_cli_report")

ARGS = ["autotune-report", "--model", "tiny", "--batch-size", "2", "--seq-len", "16"]
TINY_LAYERS = (["tok", "pos"]
               + [f"blocks.{i}.{n}" for i in range(2) for n in ("ln1", "qkv", "proj", "ln2", "up", "down")]
               + ["ln_f", "head"])
EAGER = {kind: {c.name for c in cands if c.backend == "eager"} for kind, cands in CANDIDATES.items()}


@contextlib.contextmanager
def _clean_env(tmp_path, **env):
    """A fresh store directory, the default backend, and ``env`` (None: unset)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DPGRAD_TUNE_DIR", str(tmp_path))
        mp.delenv("DPGRAD_BACKEND", raising=False)
        for key, value in env.items():
            mp.delenv(key, raising=False) if value is None else mp.setenv(key, value)
        get_tuner().forget()  # decisions of earlier tests in this process must not leak in
        yield


def run_cli(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")  # once per worker, however its tests interleave
def tiny(tmp_path_factory):
    """One CLI run, DPGRAD_TUNE unset (so the report turns timing on), table + JSON + Markdown."""
    tmp = tmp_path_factory.mktemp("report")
    paths = {"json": tmp / "report.json", "markdown": tmp / "report.md"}
    with _clean_env(tmp / "store", DPGRAD_TUNE=None):
        code, out, err = run_cli(ARGS + ["--json", str(paths["json"]), "--markdown", str(paths["markdown"])])
        env_after = os.environ.get("DPGRAD_TUNE")
    return {"code": code, "out": out, "err": err, "env_after": env_after,
            "json": json.loads(paths["json"].read_text()), "markdown": paths["markdown"].read_text()}


def table_rows(out: str):
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_table_has_a_row_per_trainable_layer(tiny):
    assert tiny["code"] == 0
    rows = table_rows(tiny["out"])
    assert [r[0] for r in rows] == TINY_LAYERS
    types = {r["name"]: r["type"] for r in tiny["json"]["rows"]}
    assert types["tok"] == "Embedding" and types["blocks.0.up"] == "Linear" and types["ln_f"] == "LayerNorm"
    assert {r[1] for r in rows if r[0] == "blocks.1.up"} == {"128x512"}
    assert all(report.NO_CHOICE in " ".join(r) for r in rows if types[r[0]] == "LayerNorm")
    assert max(len(line) for line in tiny["out"].splitlines()) <= 120


def test_cpu_notice_and_header(tiny):
    out = tiny["out"]
    assert "CUDA is not available: the eager fallback is in use" in out
    assert "backend eager" in out and "DPGRAD_TUNE=on" in out
    assert f"torch {torch.__version__}" in out


def test_json_has_the_documented_keys_and_a_row_per_layer(tiny):
    data = tiny["json"]
    for key in ("schema", "device", "versions", "commit", "date", "model", "settings", "backend", "rows", "step_ms"):
        assert key in data, key
    assert data["schema"] == 1 and data["backend"] == "eager" and data["step_ms"] > 0
    assert data["settings"] == {"batch_size": 2, "seq_len": 16, "dtype": "fp32", "tune_mode": "on",
                                "device": "cpu", "opacus": True, "retune": False}
    assert data["model"]["name"] == "tiny" and data["model"]["trainable_layers"] == len(TINY_LAYERS)
    assert data["model"]["parameters"] == sum(p.numel() for p in TinyTransformer().parameters())
    assert [r["name"] for r in data["rows"]] == TINY_LAYERS
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", data["date"])


def test_chosen_candidates_are_eager_and_timed(tiny):
    tuned = [r for r in tiny["json"]["rows"] if r["kind"] is not None]
    assert {r["type"] for r in tuned} == {"Linear", "Embedding"} and len(tuned) == 11
    for row in tuned:
        assert row["choice"] in EAGER[row["kind"]], row
        assert row["chosen_ms"] > 0 and all(ms > 0 for ms in row["timings_ms"].values()), row
        assert row["extra_bytes"] is not None and row["extra_bytes"] >= 0
        if row["kind"] == "linear_norm":  # direct and Gram forms (T > 1): timed, or pruned by the cost model
            assert row["source"] == "measured" and row["choice"] in row["timings_ms"]
            assert set(row["timings_ms"]) | set(row["skipped"]) == {"eager-direct", "eager-gram"}


def test_speedup_over_opacus_is_positive_for_linear_and_embedding(tiny):
    for row in tiny["json"]["rows"]:
        if row["type"] in ("Linear", "Embedding"):
            assert row["opacus_ms"] > 0 and row["speedup"] > 0, row
            assert row["speedup"] == pytest.approx(row["opacus_ms"] / row["chosen_ms"])
        else:
            assert row["speedup"] is None


def test_markdown_is_a_table_with_a_row_per_layer(tiny):
    lines = [line for line in tiny["markdown"].splitlines() if line.startswith("|")]
    header, separator, *body = lines
    n = len(report.COLUMNS)
    assert re.fullmatch(r"\|(---\|){%d}" % n, separator)
    for line in [header] + body:
        assert len(re.findall(r"(?<!\\)\|", line)) == n + 1, line
    assert [line.split("|")[1].strip() for line in body] == TINY_LAYERS


def test_no_progress_without_a_terminal_and_the_environment_is_restored(tiny):
    """The report's progress bar is off where stderr is not a terminal (captured here): stderr
    holds the notices and nothing drawn."""
    assert "autotune" not in tiny["err"].replace("autotune report", "") and "\r" not in tiny["err"]
    assert tiny["env_after"] is None  # the report set DPGRAD_TUNE=on only while it ran


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_in_place_on_a_terminal(monkeypatch):
    monkeypatch.delenv("DPGRAD_PROGRESS", raising=False)
    stream = _Terminal()
    bar = report.Progress(4, stream)
    bar.update("head: eager-gram")
    bar.update("rest", 3)
    bar.close()
    text = stream.getvalue()
    assert "\r" in text and "4/4" in text and "rest" in text
    monkeypatch.setenv("DPGRAD_PROGRESS", "0")  # turned off on a terminal too
    quiet = _Terminal()
    report.Progress(4, quiet).update("head")
    assert quiet.getvalue() == ""


def test_the_tuner_shows_the_shapes_it_measures_on_a_terminal_and_closes_at_the_end_of_the_pass(
        tmp_path, monkeypatch):
    """DPGRAD_TUNE=on, a new shape: a bar on stderr naming the layer while it is measured, gone
    (closed) once the backward pass ends; none on the next step (nothing measured), none where
    stderr is not a terminal."""
    import dpgrad
    from dpgrad.tuning.progress import TUNING_PROGRESS

    monkeypatch.setenv("DPGRAD_TUNE", "on")
    monkeypatch.setenv("DPGRAD_TUNE_DIR", str(tmp_path))
    monkeypatch.delenv("DPGRAD_PROGRESS", raising=False)
    get_tuner().forget()

    def step(model):
        x = torch.randn(16, 10, 64)
        model(x).square().mean(dim=(1, 2)).sum().backward()

    for terminal in (False, True):
        stream = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        get_tuner().forget()
        monkeypatch.setenv("DPGRAD_TUNE_DIR", str(tmp_path / str(terminal)))
        model = dpgrad.GradSampleModuleFastGradientClipping(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)))
        step(model)
        assert TUNING_PROGRESS.bar is None  # closed with the pass
        drawn = stream.getvalue()
        if terminal:
            assert "dpgrad autotune" in drawn and "'0' (Linear)" in drawn, drawn
        else:
            assert drawn == ""
        before = stream.getvalue()
        step(model)
        assert stream.getvalue() == before


def test_an_unknown_command_is_named_with_the_commands_listed(capsys):
    assert cli.main(["bogus-command"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpgrad: unknown command 'bogus-command'; the commands are:\n")
    listed = [line.split()[0] for line in err.splitlines()[1:] if line.startswith("  ")]
    assert listed == list(cli.COMMANDS)
    assert cli.main(["autotune-reprot"]) == 2
    assert "(did you mean 'autotune-report'?)" in capsys.readouterr().err


def test_an_explicit_tune_mode_is_kept(tmp_path):
    """DPGRAD_TUNE=cached with an empty store: cost-model choices, the chosen one timed by the
    report (of Linear norms: layers this small would otherwise be clipped from their per-sample
    gradients)."""
    with _clean_env(tmp_path, DPGRAD_TUNE="cached"), clipped_from_norms():
        data = report.run_report(report.ReportSettings(batch_size=2, seq_len=8, opacus=False), io.StringIO())
        assert os.environ["DPGRAD_TUNE"] == "cached"
    assert data["settings"]["tune_mode"] == "cached"
    linear = [r for r in data["rows"] if r["kind"] == "linear_norm"]
    # Not tuned: only the chosen candidate is timed, by the report, for the speedup column.
    assert linear and all(r["source"] == "cost model" and r["timings_ms"] == {}
                          and r["chosen_timed_by"] == "report" for r in linear)
    assert all(r["chosen_ms"] > 0 and r["chosen_timed_by"] == "report" for r in linear)
    assert all(r["speedup"] is None and "no-opacus" in r["opacus_note"] for r in linear)
    assert re.search(r"eager-(direct|gram) ~\d", report.format_table(data, full=True))  # the untimed one


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt3"], "unknown model 'gpt3': choose one of tiny, gpt2-small"),
    (["--model", "tiny", "--seq-len", "300"], "takes 2 to 256 tokens"),
    (["--model", "tiny", "--hf-config", "n_layer=2"], "hf: models only"),
    (["--seq-len", "0"], "argument --seq-len: 0 is out of range: pass a value at least 2"),
    (["--seq-len", "1"], "argument --seq-len: 1 is out of range: pass a value at least 2"),
    (["--seq-len", "-5"], "argument --seq-len: -5 is out of range: pass a value at least 2"),
    (["--model", "hf:gpt2", "--seq-len", "0"], "argument --seq-len: 0 is out of range"),
    (["--seq-len", "x"], "argument --seq-len: 'x' is not an integer"),
    (["--batch-size", "0"], "argument --batch-size: 0 is out of range: pass a value at least 1"),
    (["--device", "nonsense"], "argument --device: 'nonsense' is not a torch device: pass cpu, cuda or cuda:N"),
    (["--device", "cpu:x"], "argument --device: 'cpu:x' is not a torch device"),
    (["--device", "meta"], "argument --device: 'meta': the report runs a model on cpu or cuda"),
    (["--model", "hf:gpt2", "--hf-config", "no_such_field=1"], "hf:gpt2 has no config field 'no_such_field'; its "
                                                               "size fields include n_embd"),
    (["--model", "hf:gpt2", "--hf-config", "n_layer=-2"], "config field n_layer=-2 of hf:gpt2: a size, pass a "
                                                          "positive integer"),
    (["--model", "hf:gpt2", "--hf-config", "n_embd=0"], "n_embd=0 of hf:gpt2: a size"),
    (["--model", "hf:gpt2", "--hf-config", "n_layer=two"], "n_layer='two' of hf:gpt2: a size"),
    (["--model", "hf:gpt2", "--hf-config", "layer_norm_epsilon=big"], "layer_norm_epsilon='big' of hf:gpt2: pass a "
                                                                      "finite number"),
    (["--model", "hf:gpt2", "--hf-config", "n_layer=1", "--hf-config", "n_embd=30", "--hf-config", "n_head=4"],
     "the model cannot be built with"),
    (["--json", "/"], "--json /: cannot write there (it is a directory); give a writable file path"),
    (["--markdown", "/no/such/dir/table.md"], "--markdown /no/such/dir/table.md: cannot write there (its directory "
                                              "/no/such/dir does not exist)"),
])
def test_bad_arguments_are_usage_errors_with_exit_code_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["autotune-report"] + args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_runs_the_report_and_help_lists_it(monkeypatch, capsys):
    monkeypatch.setattr(cli, "autotune_report", lambda argv: 0 if argv == [] else 1)
    assert cli.main([]) == 0
    assert cli.main(["--help"]) == 0
    assert "autotune-report" in capsys.readouterr().out


def _expected_parameters(cfg) -> int:
    d, f = cfg.d_model, cfg.d_ff
    norm = 2 * d if cfg.norm == "layer" else d  # LayerNorm: weight and bias; RMSNorm: weight

    def linear(i, o):
        return i * o + (o if cfg.bias else 0)

    mlp = linear(d, f) * (2 if cfg.mlp == "swiglu" else 1) + linear(f, d)
    block = 2 * norm + linear(d, 3 * d) + linear(d, d) + mlp
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return (cfg.vocab_size + cfg.max_seq_len) * d + cfg.n_layers * block + norm + head


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_to_their_documented_sizes(name):
    built = build_model(name, "meta")
    cfg = PRESETS[name]
    assert sum(p.numel() for p in built.module.parameters()) == _expected_parameters(cfg)
    assert (built.module.head.weight is built.module.tok.weight) == (name != "tiny")


def test_llama_1b_is_llama_3_2_1b():
    """Built through transformers' LlamaConfig: rotary positions (no position embedding), 8
    key/value heads, tied embeddings, and Llama 3.2 1B's published 1,235,814,400 parameters."""
    pytest.importorskip("transformers")
    built = build_model("llama-1b", "meta")
    module = built.module
    assert sum(p.numel() for p in module.parameters()) == 1_235_814_400
    attention = module.model.layers[0].self_attn
    assert attention.k_proj.out_features == 8 * 64 and attention.q_proj.out_features == 32 * 64
    assert module.lm_head.weight is module.model.embed_tokens.weight
    assert not any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == built.max_seq_len
                   for m in module.modules())  # rotary: no learned positions
    assert built.hf and built.max_seq_len == 131072 and built.vocab_size == 128256


@pytest.mark.parametrize("name, published", [("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168)])
def test_gpt2_presets_are_gpt2_sized(name, published):
    """GPT-2's published parameter counts (with the head tied to the embedding)."""
    built = build_model(name, "meta")
    assert sum(p.numel() for p in built.module.parameters()) == published


def test_hf_model_report_names_hugging_face_layers(tmp_path):
    pytest.importorskip("transformers")
    overrides = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=128)
    with _clean_env(tmp_path, DPGRAD_TUNE="off"):
        data = report.run_report(report.ReportSettings(model="hf:llama", batch_size=2, seq_len=8, opacus=False,
                                                       hf_config=overrides), io.StringIO())
    rows = {r["name"]: r for r in data["rows"]}
    # Norms or per-sample gradients, as dpgrad clips layers of these sizes.
    assert rows["lm_head"]["kind"].startswith("linear_") and rows["model.embed_tokens"]["kind"].startswith("embedding_")
    assert rows["model.layers.0.mlp.gate_proj"]["shape"] == "32x64"
    assert rows["model.norm"]["choice"] == report.NO_CHOICE  # LlamaRMSNorm: dpgrad's own sampler


def test_python_dash_m_prints_json_on_stdout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DPGRAD_TUNE", "DPGRAD_BACKEND", "TRITON_INTERPRET")}
    env["DPGRAD_TUNE_DIR"] = str(tmp_path / "store")
    proc = subprocess.run(
        [sys.executable, "-m", "dpgrad", "autotune-report", "--model", "tiny", "--batch-size", "2", "--seq-len", "8",
         "--json", "-"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["name"] for r in data["rows"]] == TINY_LAYERS
    assert data["settings"]["tune_mode"] == "on" and data["settings"]["seq_len"] == 8
    # stderr is a pipe: the notice, and no progress bar
    assert proc.stderr.startswith("CUDA is not available") and "autotune:" not in proc.stderr


def test_a_doctored_store_does_not_change_the_displayed_speedup(monkeypatch, tmp_path):
    """Speedups divide Opacus's time by the chosen candidate's, both timed in this run: a
    store whose timings were scaled by 1/1.5 changes neither (it still decides the choice), and
    its figures are shown as stored, with their date; one scaled by 1/50 is far from what this
    run times, and its layers are timed again (the store corrected). Timings injected: the
    test is exact."""
    from dpgrad.tuning import Tuner, tuner as tuner_module

    ms = {"eager-direct": 2.0, "eager-gram": 1.0, "eager-sort": 0.8, "opacus": 3.0}

    def timer(fn, device, name=""):
        fn()
        return ms.get(name, 1.5)

    def speedups(data):
        return {(r["name"], r["kind"]): r["speedup"] for r in data["rows"] if r["kind"] is not None}

    def doctored(path, factor):
        doc = json.loads(path.read_text())
        for entry in doc["entries"].values():
            entry["timings_ms"] = {k: v * factor for k, v in entry["timings_ms"].items()}
        path.write_text(json.dumps(doc))

    settings = report.ReportSettings(batch_size=2, seq_len=8)
    with _clean_env(tmp_path, DPGRAD_TUNE="on"), clipped_from_norms():
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=timer))
        first = report.run_report(settings, io.StringIO())
        path = next(tmp_path.glob("*.json"))
        doctored(path, 1 / 1.5)
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=timer))  # a new process
        second = report.run_report(settings, io.StringIO())
        doctored(path, 1 / 50)
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=timer))
        third = report.run_report(settings, io.StringIO())
        stored = json.loads(path.read_text())["entries"].values()
    assert speedups(first) and speedups(second) == speedups(first) == speedups(third)
    assert {r["speedup"] for r in first["rows"] if r["kind"] == "linear_norm"} == {3.0}  # 3.0 / eager-gram's 1.0
    tuned = [r for r in second["rows"] if r["kind"] is not None and r["timings_ms"]]
    assert tuned and all(r["source"] == "store" and r["timings_from"].startswith("store, 20") for r in tuned)
    table = report.format_table(second, full=True)
    assert "eager-sort 0.800, eager-gram stored 0.667" in table, table  # the embeddings' row
    retimed = [r for r in third["rows"] if r["kind"] is not None and len(r["timings_ms"]) > 1]
    assert retimed and all(r["source"] == "measured again" for r in retimed)
    # Corrected (an entry with one candidate timed, the rest pruned, has no choice to correct).
    assert all(e["timings_ms"].get("eager-gram") in (None, 1.0) for e in stored if len(e["timings_ms"]) > 1)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "argument --steps: 0 is out of range: pass a value at least 1"),
    (["--seq-len", "300"], "argument --seq-len: 300 is out of range: pass a value from 2 to 256"),
    (["--max-grad-norm", "0"], "argument --max-grad-norm: 0 is out of range: pass a value above 0"),
    (["--noise-multiplier", "-1"], "argument --noise-multiplier: -1 is out of range: pass a value at least 0"),
])
def test_demo_refuses_out_of_range_values_the_same_way(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo"] + args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _option_helps(text: str) -> dict:
    """Each option of an argparse --help text and its help (empty when it has none)."""
    helps, current = {}, None
    for line in text.split("options:")[1].splitlines():
        m = re.match(r"\s{2}(-[-\w]+)(?:,\s+--[-\w]+)?(?:\s\S+)?(?:\s{2,}(.*))?$", line)
        if m:
            current = m.group(1)
            helps[current] = m.group(2) or ""
        elif current and line.strip() and not line.strip().startswith("-"):
            helps[current] += " " + line.strip()
    return helps


def test_every_option_has_a_help_text(capsys):
    for command in (["demo"], ["autotune-report"]):
        with pytest.raises(SystemExit):
            cli.main(command + ["--help"])
        helps = _option_helps(capsys.readouterr().out)
        assert len(helps) > 3 and all(helps.values()), (command, helps)


@pytest.mark.parametrize("script", ["privacy_engine.py", "finetune_lm.py", "fsdp_privacy_engine.py", "digits_cnn.py"])
def test_examples_help_is_whole(script, monkeypatch, capsys):
    """An example's --help: the description a whole sentence, every option with a help text.
    Run in this process as ``python examples/<script> --help`` runs it (its directory first on
    the path, argparse's 80 columns of a pipe): the help is printed, and the process would
    exit, before the example does anything."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", script)
    monkeypatch.syspath_prepend(os.path.dirname(path))
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(path, run_name="__main__")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description.rstrip().endswith("."), description
    helps = _option_helps(out)
    assert ("--steps" in helps or "--epochs" in helps) and all(helps.values()), helps


def test_retune_measures_the_model_again_and_replaces_its_entries(tmp_path, monkeypatch):
    """--retune: the stored choices of the model's shapes are measured again (the timings of
    this run decide) and replaced in the store; without it the store decides (its choice timed
    here as it was stored, not far off: eager-gram has become faster, by less than 2x)."""
    from dpgrad.tuning import Tuner, tuner as tuner_module

    def timer_of(ms):
        def timer(fn, device, name=""):
            fn()
            return ms.get(name, 1.0)
        return timer

    settings = report.ReportSettings(batch_size=2, seq_len=8, opacus=False)
    with _clean_env(tmp_path, DPGRAD_TUNE="on"), clipped_from_norms():
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=timer_of({"eager-sort": 1.0, "eager-gram": 9.0})))
        report.run_report(settings, io.StringIO())
        faster_gram = timer_of({"eager-sort": 1.0, "eager-gram": 0.8})
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=faster_gram))
        kept = report.run_report(settings, io.StringIO())
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=faster_gram))
        retuned = report.run_report(report.ReportSettings(batch_size=2, seq_len=8, opacus=False, retune=True),
                                    io.StringIO())
        monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=faster_gram))
        after = report.run_report(settings, io.StringIO())
    embedding = lambda data: {(r["choice"], r["source"]) for r in data["rows"] if r["kind"] == "embedding_norm"}  # noqa: E731,E501
    assert embedding(kept) == {("eager-sort", "store")}
    assert embedding(retuned) == {("eager-gram", "measured")} and retuned["settings"]["retune"]
    assert embedding(after) == {("eager-gram", "store")}
    assert get_tuner().retune is False


def test_the_default_table_fits_120_columns_and_full_has_every_candidate(tmp_path):
    """Hugging Face GPT-2's long layer names included; --full adds candidates, config, memory."""
    with _clean_env(tmp_path, DPGRAD_TUNE="on"):
        data = report.run_report(report.ReportSettings(model="hf:gpt2", batch_size=2, seq_len=8, opacus=False,
                                                       hf_config={"n_layer": 1, "n_embd": 32, "n_head": 2}),
                                 io.StringIO())
    compact, full = report.format_table(data), report.format_table(data, full=True)
    rows = [line for line in compact.splitlines() if line.startswith("transformer")]
    assert rows and max(len(line) for line in compact.splitlines()) <= 120
    assert "candidates (ms)" in full and "candidates (ms)" not in compact


def test_an_output_that_fails_after_the_run_exits_1_without_a_traceback(tmp_path, monkeypatch, capsys):
    """Writable when checked, gone when written (a full disk, a removed directory): the error
    is one line on stderr and the exit status 1."""
    target = tmp_path / "gone" / "report.json"
    target.parent.mkdir()
    real_run = report.run_report

    def run_then_remove(settings, *args, **kwargs):
        out = real_run(settings, *args, **kwargs)
        target.parent.rmdir()
        return out

    monkeypatch.setattr(report, "run_report", run_then_remove)
    with _clean_env(tmp_path):
        code = cli.main(["autotune-report", "--model", "tiny", "--batch-size", "2", "--seq-len", "8", "--no-opacus",
                         "--json", str(target)])
    err = capsys.readouterr().err
    assert code == 1 and f"dpgrad: cannot write the json report to {target}" in err and "Traceback" not in err
