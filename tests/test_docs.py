"""The README, CONTRIBUTING.md and the guides in docs/: every Python example in them runs (Sybil; a page's
examples share one namespace, invisible setup blocks give them a model and data), and the
guides build into a site with mkdocs in strict mode (a broken link or reference fails)."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sybil = pytest.importorskip("sybil")
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PARSER = sybil.Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


def _examples(path: Path) -> list:
    return list(PARSER.parse(path))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_runs(page, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # what an example writes lands here
    monkeypatch.setenv("DPGRAD_BACKEND", "eager")
    if not torch.cuda.is_available():
        # On a CPU an example's torch.compile traces the step and breaks its graph as on a GPU
        # (Dynamo) but runs the pieces eagerly, leaving out Inductor's C++ build, most of a minute
        # on a fresh machine; test_graphs.py and test_guarantee.py compile such steps with
        # Inductor and compare them with the eager ones.
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    examples = _examples(page)
    for example in examples:
        example.evaluate()


def test_the_pages_have_examples_and_no_unrun_python():
    """Every fenced Python block is an example Sybil runs (none in another spelling it skips)."""
    counted = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = text.count("```python")
        counted += fences
        assert fences + text.count("invisible-code-block: python") == len(_examples(page)), page
        assert "```py\n" not in text and "```Python" not in text, page
    assert counted >= 8


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed")
def test_the_guides_build_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (site / "index.html").exists() and (site / "vision" / "index.html").exists()
    shutil.rmtree(site)


# ------------------------------------------------------------------ how the pages render and read
# Python-Markdown (mkdocs) starts a list or a table only at the start of a block: one written
# right under a paragraph line renders as running text. Code wider than the page is cut off.
GUIDES = [p for p in sorted((ROOT / "docs").glob("*.md"))
          if p.name != "results.md" and "changelog" not in p.name.lower()]  # measurements belong there
LIST_ITEM = re.compile(r"^( *)(?:[-*+]|\d+[.)]) +\S")
TABLE_ROW = re.compile(r"^ *\|")
FENCE = re.compile(r"^ *(```|~~~)")
CODE_COLUMNS = 100
# A commit: a word of 7 to 40 hex digits with letters and digits both (not 2026, not "deadbeef").
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?:-dirty)?(?![\w])")
TIMING = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|µs|us|ns|s|sec|seconds?|min|minutes?)(?![\w/])")


def _lines(page: Path):
    """(line number, line, where) for each line: where is "code" inside a fenced block, "hidden"
    inside an HTML comment (the invisible setup blocks), "text" elsewhere."""
    where, fence = "text", None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if where == "code":
            yield number, line, "code"
            if FENCE.match(line) and line.strip().startswith(fence):
                where = "text"
            continue
        if where == "hidden":
            yield number, line, "hidden"
            if "-->" in line:
                where = "text"
            continue
        if FENCE.match(line):
            fence = FENCE.match(line).group(1)
            yield number, line, "fence"
            where = "code"
            continue
        if line.lstrip().startswith("<!--") and "-->" not in line:
            where = "hidden"
            yield number, line, "hidden"
            continue
        yield number, line, "text"


def _prose(page: Path) -> list[tuple[int, str]]:
    """The lines a reader reads as prose: outside code blocks and comments; in the README, outside
    its results section (the headline figures, checked against docs/results.md)."""
    out, in_results = [], False
    for number, line, where in _lines(page):
        if page.name == "README.md" and line.startswith("## "):
            in_results = line.startswith("## Results")
        if where == "text" and not in_results:
            out.append((number, line))
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def _render_problems(page: Path) -> list[str]:
    problems = []
    block_start = None  # the first line of the current block of text (None after a blank line)
    previous, reported = "", False  # reported: this block's list or table is reported already
    for number, line, where in _lines(page):
        name = f"{_name(page)}:{number}"
        if where == "code" and len(line) > CODE_COLUMNS:
            problems.append(f"{name}: a code line of {len(line)} columns (at most {CODE_COLUMNS})")
        if where != "text":
            block_start = None if where == "fence" else block_start
            previous = "" if where == "fence" else previous
            continue
        if not line.strip():
            block_start, previous, reported = None, "", False
            continue
        item = LIST_ITEM.match(line)
        if item and 0 < len(item.group(1)) < 4:
            problems.append(f"{name}: a list item indented by {len(item.group(1))} spaces (a nested list "
                            f"needs 4): {line.strip()[:50]!r}")
        elif item and block_start is not None and not LIST_ITEM.match(block_start) \
                and not block_start.startswith("#") and not reported:
            reported = True
            problems.append(f"{name}: a list without a blank line before it renders as running text: "
                            f"{line.strip()[:50]!r}")
        if TABLE_ROW.match(line) and block_start is not None and not TABLE_ROW.match(block_start) \
                and not block_start.startswith("#") and not TABLE_ROW.match(previous) and not reported:
            reported = True
            problems.append(f"{name}: a table without a blank line before it renders as running text")
        if block_start is None or (block_start.startswith("#") and not line.startswith("#")):
            block_start = line
        previous = line
    return problems


def test_broken_lists_and_wide_code_are_found(tmp_path):
    """The check itself: a list right under a paragraph line, a table likewise, a nested list
    indented by 2 spaces and a code line of 101 columns are each reported; good pages are not."""
    page = tmp_path / "probe.md"
    bad = ("# T\n\nSome options:\n- `a`: one\n- `b`: two\n\nA table:\n| a | b |\n|---|---|\n\n"
           "- item\n  - nested\n\n```python\n" + "x = 1  # " + "y" * 92 + "\n```\n")
    good = ("# T\n\nSome options:\n\n- `a`: one,\n  wrapped\n- `b`: two\n\n| a | b |\n|---|---|\n\n"
            "<!-- invisible-code-block: python\n- not a list\n-->\n\n```python\n# - not a list\nx = 1\n```\n")
    page.write_text(bad)
    found = _render_problems(page)
    assert [p.split(": ", 1)[1][:20] for p in found] == [
        "a list without a bla", "a table without a bl", "a list item indented", "a code line of 101 c"], found
    page.write_text(good)
    assert _render_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_list_and_table_renders_and_code_fits(page):
    """Every list and table starts a block of its own (a blank line before it), nested lists are
    indented by 4 spaces, and code lines fit in 100 columns."""
    problems = _render_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [ROOT / "README.md", *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_guides_have_no_commits_or_timings(page):
    """Measurements, with the commits they were taken at, are on the results page; a guide says
    what to do and how it works. (In the README, its results section is exempt.)"""
    problems = []
    for number, line in _prose(page):
        for pattern, what in ((COMMIT, "a commit"), (TIMING, "a timing")):
            problems += [f"{_name(page)}:{number}: {what}: {m.group(0)!r}" for m in pattern.finditer(line)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in GUIDES if p.name != "api.md"], ids=lambda p: p.name)
def test_guides_show_an_example_early(page):
    """A guide opens with what you will do and an example: at most 200 words before its first
    code block (about a screen)."""
    words = 0
    for _, line, where in _lines(page):
        if where == "fence":
            break
        if where == "text" and not line.startswith("#"):
            words += len(line.split())
    else:
        pytest.fail(f"{page.name} has no code block")
    assert words <= 200, f"{page.name}: {words} words before the first example"


# ------------------------------------------------------------------ the defaults table
def _defaults_table() -> dict:
    """What docs/supported.md's "Defaults" table says: {setting: [wrappers, make_private, DPTrainer]}."""
    text = (ROOT / "docs" / "supported.md").read_text(encoding="utf-8")
    section = text.split("## Defaults\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_the_defaults_table_is_the_code():
    import dataclasses
    import inspect

    opacus = pytest.importorskip("opacus")
    import dpgrad
    import dpgrad.opacus
    from dpgrad.hf.privacy import PrivacyArguments
    from dpgrad.opacus.budget import default_delta

    def literal(value) -> str:  # as the docs write it
        return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"

    def default(function, name):
        value = inspect.signature(function).parameters[name].default
        return "given" if value is inspect.Parameter.empty else literal(value)

    trainer = {f.name: literal(f.default) for f in dataclasses.fields(PrivacyArguments)}
    wrapper = dpgrad.GradSampleModuleFastGradientClipping.__init__
    engine = dpgrad.opacus.make_private
    table = _defaults_table()
    for setting in ("single_backward", "clipping", "max_grad_norm", "check_independence"):
        cells = table[f"`{setting}`"]
        assert cells[0] == default(wrapper, setting), setting
        assert cells[1] == default(engine, setting), setting
        if setting == "clipping":  # DPTrainer clips flat, with no option
            assert cells[2] == literal("flat") and setting not in trainer
        else:
            assert cells[2] == trainer[setting], setting
    for setting in ("max_grad_norm", "target_delta"):  # make_private_with_epsilon: no default
        assert default(dpgrad.opacus.make_private_with_epsilon, setting) == "given"
    assert table["clipping mode"][0].endswith(f"(`use_ghost_clipping={default(wrapper, 'use_ghost_clipping')[1:-1]}`)")
    assert table["clipping mode"][1] == f"ghost (`grad_sample_mode={default(engine, 'grad_sample_mode')[1:-1]}`)"
    engine_accountant = inspect.signature(opacus.PrivacyEngine).parameters["accountant"].default
    assert table["accountant"][1] == f"the `PrivacyEngine`'s ({literal(engine_accountant)})"
    assert table["accountant"][2] == trainer["accountant"]
    assert table["`target_delta`"][2] == "N^-1.1" and trainer["target_delta"] == "`None`"
    assert default_delta(1000) == pytest.approx(1000 ** -1.1)
