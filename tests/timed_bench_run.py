"""One timed run of part of the benchmark suites in quick mode, as ``make report`` runs them:
``benchmarks/run_suites.py`` (its display on stderr, pytest's output in a log) with
pytest-benchmark timing, the results files written to a directory of the run's own.

Its cases: bench_kernels' embedding norms at T=32 (dpgrad's, its eager kernel's, Opacus's)
and bench_dp_step's smallest case, non-private and dpgrad's single backward, each repeated
three times. test_run_suites.py reads its display and log; test_dashboard.py its results
files. It runs once per process: the tests that read it carry ``pytest.mark.xdist_group(GROUP)``
so that pytest-xdist gives them one worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = "timed_bench_run"
SELECTION = "(test_embedding_norm and T32) or (tiny-8-64-fp32 and not hf and (non-private or single) and not per)"
REPEATS = 3


@dataclass
class TimedRun:
    proc: subprocess.CompletedProcess
    log: Path  # pytest's output
    results: Path  # the results files


_done: dict = {}


def own_session_env() -> dict:
    """This environment without pytest-xdist's worker variables: a pytest run in a subprocess
    is a session of its own (pytest-benchmark turns itself off in an xdist worker)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}


def timed_run(tmp_path_factory) -> TimedRun:
    """The run (made on the first call of this process, in a directory of ``tmp_path_factory``)."""
    if "run" not in _done:
        where = tmp_path_factory.mktemp("timed_bench_run")
        env = {**own_session_env(), "DPGRAD_RESULTS_DIR": str(where / "results"), "DPGRAD_BENCH_QUICK": "1",
               # Three repeats of each dp_step case, three timed steps each (ten in a report).
               "DPGRAD_BENCH_REPEATS": str(REPEATS), "DPGRAD_BENCH_ROUNDS": "3"}
        env.pop("DPGRAD_PROGRESS", None)
        log = where / "bench.log"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "run_suites.py"), "--log", str(log), "-q", "-p",
             "no:cacheprovider", "--benchmark-enable", "--benchmark-min-rounds=1", "-k", SELECTION],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        _done["run"] = TimedRun(proc, log, where / "results")
    return _done["run"]
