"""benchmarks/run_suites.py, what `make report` runs its benchmark phase with: one line per
suite instead of pytest's output (which goes to a log), bars on a terminal only, and pytest's
failure and exit status passed on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args, progress=None):
    env = dict(os.environ, DPGRAD_BENCH_QUICK="1", DPGRAD_RESULTS_DIR=str(tmp_path / "results"))
    env.pop("DPGRAD_PROGRESS", None)
    if progress is not None:
        env["DPGRAD_PROGRESS"] = progress
    log = tmp_path / "bench.log"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_suites.py"), "--log", str(log),
                           "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, log


def test_one_line_per_suite_without_a_terminal_and_pytest_s_output_in_the_log(tmp_path):
    proc, log = _run(tmp_path, "-k", "hf-gpt2-2l-non-private or hf-gpt2-2l-dpgrad-single")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "benchmarks: 2 cases in 1 suite"
    assert lines[1].split()[:3] == ["bench_host_overhead", "2", "passed"] and lines[1].endswith(" s")
    assert lines[2] == f"benchmarks: 2 passed; pytest's output in {log}"
    assert len(lines) == 3 and proc.stdout == "" and "█" not in proc.stderr
    assert "2 passed" in log.read_text()


def test_bars_on_a_terminal(monkeypatch):
    """The display on a terminal (``DPGRAD_PROGRESS=1`` stands for one), fed the messages the
    child's plugin sends (the run above carries them through the pipe)."""
    import io

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run_suites import Suites
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("DPGRAD_PROGRESS", "1")

    class Terminal(io.StringIO):
        encoding = "utf-8"  # (tqdm draws its bars in ASCII on a stream without one)

    out = Terminal()
    suites = Suites(out)
    suites.collected({"bench_host_overhead": 1})
    suites.start("bench_host_overhead")
    suites.ended("bench_host_overhead", "passed")
    assert suites.finish() == {"passed": 1}
    text = out.getvalue().replace("\r", "\n")
    assert text.startswith("benchmarks: 1 cases in 1 suite\n")
    assert "bench_host_overhead                      0/1 [00:00<?]" in text
    assert "bench_host_overhead ████████████████████ 1/1 [" in text


def test_a_failing_run_shows_the_end_of_pytest_s_report_and_its_exit_status(tmp_path):
    proc, log = _run(tmp_path, "-k", "no_such_benchmark")
    assert proc.returncode == 5  # pytest's own status: nothing ran
    assert "benchmarks: nothing ran" in proc.stderr and "deselected" in proc.stderr
    assert proc.stderr.rstrip().endswith(f"benchmarks: pytest exited 5; the whole output is in {log}")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_suites.py"), "--log",
                           str(tmp_path / "no" / "such" / "x.log")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot write there" in proc.stderr
