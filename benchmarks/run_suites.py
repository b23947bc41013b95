"""Run the benchmark suites with one progress line per suite instead of pytest's output.

    python benchmarks/run_suites.py [--log build/benchmarks.log] [pytest options...]

pytest runs ``benchmarks/`` in a child process whose whole output goes to the log (its
results files are written as usual, to ``$DPGRAD_RESULTS_DIR``). On a terminal each suite gets
a tqdm bar (done/total, elapsed, time left); elsewhere (CI, a pipe) one line per suite as it
ends. Then one line per outcome and where the log is; on a failure, the end of pytest's
report and the exit status of pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from dpgrad.tuning.progress import progress_bar, progress_wanted

HERE = Path(__file__).resolve().parent


class Suites:
    """The display: a bar per suite on a terminal, else a line per suite as it ends."""

    def __init__(self, out=sys.stderr):
        self.out, self.bars, self.totals = out, {}, {}
        self.counts, self.started, self.width = {}, {}, 0
        self.tty = progress_wanted(out)

    def collected(self, totals: dict) -> None:
        self.totals = totals
        self.counts = {suite: Counter() for suite in totals}
        self.width = max(map(len, totals), default=0)
        print(f"benchmarks: {sum(totals.values())} cases in {len(totals)} suite{'s' * (len(totals) != 1)}",
              file=self.out, flush=True)

    def start(self, suite: str) -> None:
        """A test of ``suite`` starts: the suites run one after another, so the one before ended."""
        if suite in self.started:
            return
        for other in list(self.bars):
            self._close(other)
        self.started[suite] = time.monotonic()
        if self.tty:
            self.bars[suite] = progress_bar(
                suite.ljust(self.width), self.totals.get(suite, 0), " cases", self.out, dynamic_ncols=True,
                bar_format="{desc} {bar:20} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")

    def ended(self, suite: str, outcome: str) -> None:
        self.start(suite)
        counts = self.counts.setdefault(suite, Counter())
        counts[outcome] += 1
        bar = self.bars.get(suite)
        if bar is not None:
            bar.set_postfix_str(self._outcomes(counts), refresh=False)
            bar.update(1)
        elif not self.tty and sum(counts.values()) == self.totals.get(suite, 0):
            self._line(suite)

    def _outcomes(self, counts: Counter) -> str:
        return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))

    def _line(self, suite: str) -> None:
        seconds = time.monotonic() - self.started[suite]
        print(f"{suite:<{self.width}}  {self._outcomes(self.counts[suite]):<28} {seconds:6.0f} s",
              file=self.out, flush=True)

    def _close(self, suite: str) -> None:
        bar = self.bars.pop(suite, None)
        if bar is not None:
            bar.close()

    def finish(self) -> Counter:
        for suite in list(self.bars):
            self._close(suite)
        if not self.tty:  # suites cut short (a failure stopping the run) still get their line
            for suite, counts in self.counts.items():
                if counts and sum(counts.values()) != self.totals.get(suite, 0):
                    self._line(suite)
        return sum(self.counts.values(), Counter())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="python benchmarks/run_suites.py [--log PATH] [pytest options...]")
    parser.add_argument("--log", default="build/benchmarks.log", help="pytest's output (default build/benchmarks.log)")
    args, pytest_args = parser.parse_known_args(argv)
    log = Path(args.log)
    try:
        log_file = open(log, "w", encoding="utf-8")
    except OSError as exc:
        parser.error(f"--log {log}: cannot write there ({exc.strerror or exc})")
    read, write = os.pipe()
    env = dict(os.environ, DPGRAD_PROGRESS_FD=str(write),
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "pytest", str(HERE), "-p", "suite_progress", *pytest_args]
    with log_file:
        child = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, pass_fds=(write,))
        os.close(write)
        suites = Suites()
        status = None
        try:
            with os.fdopen(read, encoding="utf-8") as messages:
                for line in messages:
                    message = json.loads(line)
                    if "collected" in message:
                        suites.collected(message["collected"])
                    elif "start" in message:
                        suites.start(message["start"])
                    elif "test" in message:
                        suites.ended(message["test"], message["outcome"])
                    elif "exit" in message:
                        status = message["exit"]
        finally:
            totals = suites.finish()
            code = child.wait()
    status = code if status is None else status
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(totals.items())) or "nothing ran"
    print(f"benchmarks: {summary}; pytest's output in {log}", file=sys.stderr)
    if code != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        print(f"benchmarks: pytest exited {code}; the whole output is in {log}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
