"""The README and the guides in docs/: every Python example in them runs (Sybil; a page's
examples share one namespace, invisible setup blocks give them a model and data), and the
guides build into a site with mkdocs in strict mode (a broken link or reference fails)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sybil = pytest.importorskip("sybil")
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PARSER = sybil.Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


def _examples(path: Path) -> list:
    return list(PARSER.parse(path))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_runs(page, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # what an example writes lands here
    monkeypatch.setenv("DPGRAD_BACKEND", "eager")
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
