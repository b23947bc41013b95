"""benchmarks/run_suites.py, what `make report` runs its benchmark phase with: one line per
suite instead of pytest's output (which goes to a log), bars on a terminal only, and pytest's
failure and exit status passed on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import timed_bench_run

ROOT = Path(__file__).resolve().parents[1]


def _suites_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_suites
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return run_suites


@pytest.mark.xdist_group(timed_bench_run.GROUP)
def test_one_line_per_suite_without_a_terminal_and_pytest_s_output_in_the_log(tmp_path_factory):
    """The run of tests/timed_bench_run.py, as `make report` makes it (timed, results files
    written): nine cases of two suites, bench_dp_step's six and bench_kernels' three (its
    eager-kernel row skipped on a CPU)."""
    run = timed_bench_run.timed_run(tmp_path_factory)
    proc, log = run.proc, run.log
    assert proc.returncode == 0, proc.stderr
    kernels = "3 passed" if torch.cuda.is_available() else "2 passed, 1 skipped"
    total = "9 passed" if torch.cuda.is_available() else "8 passed, 1 skipped"
    lines = proc.stderr.splitlines()
    assert lines[0] == "benchmarks: 9 cases in 2 suites"
    assert lines[1].split()[:-2] == ["bench_dp_step", "6", "passed"] and lines[1].endswith(" s")
    assert " ".join(lines[2].split()[:-2]) == f"bench_kernels {kernels}" and lines[2].endswith(" s")
    assert lines[3] == f"benchmarks: {total}; pytest's output in {log}"
    assert len(lines) == 4 and proc.stdout == "" and "█" not in proc.stderr
    assert total in log.read_text()


def test_bars_on_a_terminal(monkeypatch):
    """The display on a terminal (``DPGRAD_PROGRESS=1`` stands for one), fed the messages the
    child's plugin sends (the run above carries them through the pipe)."""
    import io

    Suites = _suites_module().Suites
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


def test_a_failing_run_shows_the_end_of_pytest_s_report_and_its_exit_status(tmp_path, capsys):
    env = dict(os.environ, DPGRAD_BENCH_QUICK="1", DPGRAD_RESULTS_DIR=str(tmp_path / "results"))
    env.pop("DPGRAD_PROGRESS", None)
    log = tmp_path / "bench.log"
    # Nothing selected: pytest's own status 5. Of the suites, bench_fsdp_memory's alone is
    # collected (the others import Opacus: seconds more, and the same report).
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_suites.py"), "--log", str(log),
                           "-q", "-p", "no:cacheprovider", "--ignore-glob=*/bench_[!f]*.py", "-k", "no_such_benchmark"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 5  # pytest's own status: nothing ran
    assert "benchmarks: nothing ran" in proc.stderr and "deselected" in proc.stderr
    assert proc.stderr.rstrip().endswith(f"benchmarks: pytest exited 5; the whole output is in {log}")
    # A log it cannot write: refused before pytest starts (the script's main, in this process).
    with pytest.raises(SystemExit) as exc:
        _suites_module().main(["--log", str(tmp_path / "no" / "such" / "x.log")])
    assert exc.value.code == 2 and "cannot write there" in capsys.readouterr().err
