"""Packaging and the command line: what a user meets first."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from dpgrad.tools import cli


def _run_elsewhere(code: str, tmp_path) -> str:
    """Run Python code outside the repo root, so only the installed package is importable."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout


def test_core_imports_neither_opacus_nor_a_top_level_kernels(tmp_path):
    out = _run_elsewhere(
        "import sys, importlib.util, dpgrad, dpgrad.kernels.reference;"
        "print('opacus' in sys.modules, importlib.util.find_spec('kernels') is None)",
        tmp_path,
    )
    assert out.split() == ["False", "True"]


# The demo and the example check their own wiring at their models' real sizes; the Triton pass
# of `make test` would spend minutes there in the interpreter (the kernels are tested at small
# shapes elsewhere, also through the wrappers), so these two stay on the eager kernels.
def test_demo_trains_and_reports_norms(capsys, monkeypatch):
    monkeypatch.setenv("DPGRAD_BACKEND", "eager")
    assert cli.main(["demo", "--steps", "3", "--batch-size", "4", "--seq-len", "16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("dpgrad demo: TinyTransformer")
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for r in rows:
        loss, lo, median, hi = map(float, r[1:5])
        assert loss > 0 and 0 < lo <= median <= hi


def test_unknown_command_is_a_usage_error(capsys):
    assert cli.main(["nonsense"]) == 2
    assert "usage: dpgrad" in capsys.readouterr().err


def test_privacy_engine_example_runs(monkeypatch, capsys):
    pytest.importorskip("opacus")
    monkeypatch.setenv("DPGRAD_BACKEND", "eager")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))
    import privacy_engine

    epsilon = privacy_engine.main(steps=2)
    assert 0 < epsilon < float("inf")
    assert "epsilon" in capsys.readouterr().out


def test_digits_example_learns(monkeypatch, capsys):
    """The CNN of examples/digits_cnn.py learns under DP: after 7 of its 40 epochs it is far
    above chance (0.1; the README states the full run's figure), at the epsilon Opacus's
    accountant gives for its noise, sample rate and steps."""
    pytest.importorskip("opacus")
    pytest.importorskip("sklearn")
    from opacus import PrivacyEngine
    from opacus.accountants import create_accountant

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))
    import digits_cnn

    epochs = 7
    accuracy, epsilon = digits_cnn.main(epochs=epochs, verbose=False)
    # 0.73 here, 0.63 to 0.75 over the seeds 0 to 6: at least 0.13 above the bound, as at 12
    # epochs (0.73 to 0.79) above 0.6.
    assert accuracy > 0.5, accuracy
    # Poisson batches of expected size 256: a sample rate of one over the batches an epoch
    # (Opacus's DPDataLoader), noise 2.0, delta 1e-5.
    batches = math.ceil(len(digits_cnn.digits()[1]) / 256)
    accountant = create_accountant(PrivacyEngine().accountant.mechanism())
    accountant.history = [(2.0, 1 / batches, epochs * batches)]
    assert epsilon == pytest.approx(accountant.get_epsilon(1e-5), abs=0.01)


@pytest.mark.parametrize("model", ["gpt2", "llama-lora"])
def test_finetune_example_learns(model, monkeypatch, capsys):
    """Hugging Face GPT-2 (tied, full fine-tuning) and LoRA Llama with PrivacyEngine and
    dpgrad's single backward: the loss goes down on the synthetic task."""
    pytest.importorskip("opacus")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    monkeypatch.setenv("DPGRAD_BACKEND", "eager")  # see the demo's test
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))
    import finetune_lm

    out = finetune_lm.main(model, size="tiny", steps=30)
    assert out["last_loss"] < out["first_loss"] - 0.05, out
    assert 0 < out["epsilon"] < float("inf")
    assert "trainable parameters" in capsys.readouterr().out


# Test modules that reach no sampler through a wrapper: the Makefile's second pass (every
# sampler on the Triton kernels) leaves them out. Every other test module must be in it.
BACKEND_INDEPENDENT = {
    "test_triton_kernels.py",  # chooses its backend per test; runs on the interpreter in the first pass
    "test_kernels_gpu.py",  # the kernels on a GPU, each backend explicitly
    "test_kernel_compile.py",  # compiles the kernels for GPU targets in a process of its own
    "test_audit.py",  # audits through make_private, whose backends the second pass covers
    "test_reference_kernels.py",  # the eager reference alone
    "test_precision.py",  # holds each backend's kernels to the error bound, both in one pass
    "test_host_overhead.py",  # counts eager operations whatever the backend
    "test_graphs.py",  # what a graphed step does around the step, whose backends the second pass covers
    "test_training_loops.py",  # what loops do with p.grad and the step, the same whatever computes the sums
    "test_cli_report.py", "test_dashboard.py", "test_package.py", "test_tuning.py",
    "test_tuning_store.py",
    "test_run_suites.py",  # the benchmark runner's display and log
    # A sample of the sweep of Hugging Face architectures against the results stored from
    # eager runs; the model families it samples run on both backends in test_hf_models.
    "test_hf_zoo.py",
    "test_triton_experts.py",  # chooses its backend per test
    # Layers taken whole by torch.func, the same recomputation on every backend.
    "test_whole_layers.py",
    "test_install.py",  # builds, installs and imports the package
    # The Trainer's sampling, accounting and losses around the wrapper, whose backends the
    # modules of the second pass cover (it passes on the Triton interpreter too, in minutes).
    "test_hf_trainer.py",
    # The guides' examples and their site build: the wrappers they call run on both backends in
    # the modules of the second pass.
    "test_docs.py",
    # What these check does not depend on the backend that computes the norms and sums, which
    # the modules of the second pass take through the same wrappers: DDP's reduction and the
    # noise drawn on rank 0 (test_distributed); the adaptive bound's rule and automatic
    # clipping's coefficients, (B,) vectors (test_adaptive_clipping, test_automatic_clipping);
    # the splitting and zero-weight padding of Poisson batches (test_fixed_batches); the
    # guarantee's graph checks and independence probes, taken before any sampler runs, and a
    # batch of one, clipped from its plain gradient without one (test_guarantee,
    # test_independence, test_independence_probes).
    "test_distributed.py", "test_adaptive_clipping.py", "test_automatic_clipping.py", "test_fixed_batches.py",
    "test_guarantee.py", "test_independence.py", "test_independence_probes.py",
}


def _makefile_list(name: str) -> list:
    """The Makefile's ``name := ...`` (backslash-continued lines up to a blank line), split."""
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    return makefile.split(f"{name} :=", 1)[1].split("\n\n", 1)[0].replace("\\", " ").split()


def test_every_wrapper_test_module_runs_on_both_backends():
    root = Path(__file__).resolve().parent.parent
    listed = _makefile_list("BACKEND_TESTS")
    modules = {p.name for p in (root / "tests").glob("test_*.py")}
    assert set(listed) <= modules, f"BACKEND_TESTS names missing modules: {set(listed) - modules}"
    unplaced = modules - set(listed) - BACKEND_INDEPENDENT
    assert not unplaced, f"add {sorted(unplaced)} to the Makefile's BACKEND_TESTS (or to BACKEND_INDEPENDENT here)"
    assert not set(listed) & BACKEND_INDEPENDENT


def test_the_triton_pass_names_tests_of_its_modules():
    """tests/triton_pass.txt (the second pass's tests) names tests of BACKEND_TESTS's modules
    that exist (the pass itself stops on a listed test it does not collect)."""
    from triton_pass import listed

    root = Path(__file__).resolve().parent.parent
    modules = set(_makefile_list("BACKEND_TESTS"))
    tests = listed()
    assert tests
    for test in tests:
        path, name = test.split("::", 1)
        assert Path(path).name in modules, f"{test}: its module is not in the Makefile's BACKEND_TESTS"
        # (a test of a class: the class, whose tests may be inherited)
        defined = "class {}(" if "::" in name else "def {}("
        assert defined.format(name.split("[", 1)[0].split("::")[0]) in (root / path).read_text(), f"{test}: no such test"


def test_fast_tests_name_existing_modules():
    """``make test-fast``'s modules (the Makefile's FAST_TESTS) exist: a renamed module would
    leave the edit loop without its tests, and pytest exits 5 when it runs none."""
    root = Path(__file__).resolve().parent.parent
    listed = _makefile_list("FAST_TESTS")
    modules = {p.name for p in (root / "tests").glob("test_*.py")}
    assert listed and set(listed) <= modules, f"FAST_TESTS names missing modules: {set(listed) - modules}"


def _package_imports() -> dict:
    """{module: the package's modules it imports}, for every module of dpgrad (kernels/ as
    dpgrad.kernels), imports inside functions included. ``from P import name`` counts as an
    import of P.name where that is a module, else of P."""
    import ast

    root = Path(__file__).resolve().parents[1]
    files = {}
    for base, package in ((root / "dpgrad", "dpgrad"), (root / "kernels", "dpgrad.kernels")):
        for path in base.rglob("*.py"):
            parts = [package] + [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            files[".".join(parts)] = path
    graph = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in files and t != module)
    return graph


def test_the_package_has_no_import_cycles():
    graph = _package_imports()
    assert "dpgrad.tools.report" in graph["dpgrad.tools.cli"]  # the walk sees imports inside functions
    cycles, state, stack = [], {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, cycles


def test_nothing_in_the_library_imports_the_tools():
    """dpgrad.tools (CLI, report, results, dashboard, presets, demo model) uses the library;
    the library never imports it (dpgrad.__main__ is the command line's entry)."""
    graph = _package_imports()
    assert any(t.startswith("dpgrad.tools.") for t in graph["dpgrad.tools.cli"])
    library = {m: sorted(t for t in targets if t.startswith("dpgrad.tools"))
               for m, targets in graph.items() if not m.startswith("dpgrad.tools") and m != "dpgrad.__main__"}
    assert not {m: t for m, t in library.items() if t}


def test_no_class_in_the_library_is_a_diamond():
    """No class of dpgrad has two bases that share a base of their own (besides object): a
    wrapper holds its backward path rather than inheriting it from two sides."""
    import importlib
    import inspect
    import pkgutil

    import dpgrad

    # The command line's entry (it runs on import) and the Triton kernels (they need Triton) aside:
    # of dpgrad.kernels, the eager modules (reference and its reference_* modules).
    modules = [importlib.import_module(info.name)
               for info in pkgutil.walk_packages(dpgrad.__path__, "dpgrad.")
               if not info.name.endswith("__main__")
               and (not info.name.startswith("dpgrad.kernels.") or info.name.startswith("dpgrad.kernels.reference"))]
    classes = {cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
               if cls.__module__.startswith("dpgrad")}
    assert len(classes) > 20, sorted(c.__name__ for c in classes)
    diamonds = []
    for cls in classes:
        for i, first in enumerate(cls.__bases__):
            for second in cls.__bases__[i + 1:]:
                shared = set(first.__mro__) & set(second.__mro__) - {object}
                if shared:
                    diamonds.append(f"{cls.__qualname__}({first.__name__}, {second.__name__}) share "
                                    f"{sorted(c.__name__ for c in shared)}")
    assert not diamonds, diamonds


@pytest.mark.xdist_group("package_group_check")
def test_pytest_xdist_groups_hold(request):
    """make test runs pytest-xdist with --dist loadgroup: the tests of a module marked
    xdist_group share a worker, so its session fixtures (ranks spawned, a report) run once.
    xdist groups by the suffix it gives the node ids of grouped tests; a pytest that ignores
    the suffix (9.2 with xdist 3.8) spreads a group over the workers, each running the
    fixtures again."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a worker of pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@package_group_check"), (
        f"node id {request.node.nodeid!r} has no group suffix: this pytest and pytest-xdist lose "
        "the groups (see pyproject.toml's pin of pytest)")


def test_changelog_and_version_in_one_place():
    """CHANGELOG.md keeps Keep a Changelog's form, its newest release is dpgrad's version, and
    pyproject.toml reads the version from dpgrad/version.py instead of writing it again."""
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    from packaging.version import Version

    import dpgrad

    root = Path(__file__).resolve().parents[1]
    text = (root / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    assert "keepachangelog.com" in text and "semver.org" in text
    headings = re.findall(r"^## (.*)$", text, flags=re.M)
    assert headings, "no version headings"
    releases = []
    for heading in headings:
        if heading == "[Unreleased]":
            assert not releases, "[Unreleased] comes before every release"
            continue
        match = re.fullmatch(r"\[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}", heading)
        assert match, f"version heading {heading!r} is not '[X.Y.Z] - YYYY-MM-DD'"
        releases.append(Version(match.group(1)))
    assert releases == sorted(releases, reverse=True), "releases newest first"
    version = Version(dpgrad.__version__)
    if releases:
        # The newest release is the package's version, or older while a next one is in
        # development (a .dev or pre-release version); never newer.
        assert releases[0] <= version, f"CHANGELOG.md's {releases[0]} is newer than {version}"
        if not version.is_prerelease:
            assert releases[0] == version, f"CHANGELOG.md's newest release {releases[0]} is not {version}"
    kinds = set(re.findall(r"^### (.*)$", text, flags=re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds

    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dpgrad.version.__version__"}
    # setuptools reads the attribute without importing dpgrad only from a plain assignment.
    assert re.search(r'^__version__ = "[^"]+"$', (root / "dpgrad" / "version.py").read_text(), flags=re.M)


def test_no_module_over_500_lines_and_no_class_over_300():
    """The package stays in rooms a reader can take in: every module of dpgrad (kernels/
    included) at most 500 lines, every class and top-level function at most 300."""
    import ast

    root = Path(__file__).resolve().parents[1]
    too_long = []
    for path in sorted([*(root / "dpgrad").rglob("*.py"), *(root / "kernels").glob("*.py")]):
        text = path.read_text()
        name = path.relative_to(root)
        if len(text.splitlines()) > 500:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 300:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long


def test_the_earlier_module_paths_import_the_same_modules():
    """``import dpgrad.clipping_groups`` and the other module paths of earlier versions give the
    module at its new place, the same object, with its own name and spec."""
    import importlib

    from dpgrad._moved import MOVED

    for old, new in MOVED.items():
        module = importlib.import_module(new)
        assert importlib.import_module(old) is module, old
        assert module.__name__ == module.__spec__.name == new, (old, module.__spec__.name)
    from dpgrad.clipping_groups import per_block
    from dpgrad.registry import register_norm_sampler

    assert per_block is importlib.import_module("dpgrad.clipping.groups").per_block
    assert register_norm_sampler is importlib.import_module("dpgrad.samplers.registry").register_norm_sampler
