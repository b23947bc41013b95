"""The tests of ``make test``'s second pass, on the Triton kernels (``DPGRAD_BACKEND=triton``,
Triton's interpreter on a CPU): the fewest tests of the Makefile's BACKEND_TESTS that still
reach every kernel and every dispatch path to one that the whole of those modules reaches.

The first pass (every test, eager backend, and the kernels' own tests against their eager
twins under the interpreter) runs everything else; the second adds what only a whole model on
the Triton kernels shows: each kernel launched by the samplers, through the tuner's choice,
checked against the same float64 or eager reference as on the eager backend. Running every
model-level test again would run the same kernel paths many times over.

The list is ``tests/triton_pass.txt`` (test ids); ``tests/conftest.py`` marks those tests
``kernel_paths`` and the Makefile runs ``-m kernel_paths``. To choose it afresh (after adding
a kernel, a dispatch path or a test that reaches one), measure the whole of BACKEND_TESTS on
the Triton kernels with a coverage context per test, then select::

    DPGRAD_BACKEND=triton python -m pytest -n 2 --dist loadgroup --cov=dpgrad --cov-branch \\
        --cov-context=test --cov-report= tests/<each module of BACKEND_TESTS>
    python tests/triton_pass.py .coverage --write

The selection is greedy: the test reaching most of the branches (arcs) not yet reached, in
``kernels/``, ``dpgrad/samplers/`` and ``dpgrad/tuning/``, until every one is.
"""

from __future__ import annotations

import argparse
import collections
import re
import sqlite3
import sys
from pathlib import Path

LIST = Path(__file__).with_name("triton_pass.txt")
# The code that chooses and runs a kernel: the kernels and their launchers, the samplers that
# call them, the tuner that picks one.
DISPATCH = ("/kernels/", "/dpgrad/samplers/", "/dpgrad/tuning/")
HEADER = """\
# The tests of `make test`'s second pass (DPGRAD_BACKEND=triton, the Triton interpreter on a
# CPU), chosen by tests/triton_pass.py from a coverage run of the whole of BACKEND_TESTS: they
# reach every branch of kernels/, dpgrad/samplers/ and dpgrad/tuning/ that the whole reaches.
"""


def test_id(context: str) -> str:
    """A coverage context of pytest-cov ("<node id>|run") as a node id, without pytest-xdist's
    "@<group>" suffix."""
    return re.sub(r"@[\w.-]+$", "", context.rsplit("|", 1)[0])


def select(data_file: str) -> list:
    db = sqlite3.connect(data_file)
    files = {i: path for i, path in db.execute("select id, path from file") if any(d in path for d in DISPATCH)}
    contexts = dict(db.execute("select id, context from context"))
    reached = collections.defaultdict(set)
    for file_id, context_id, start, end in db.execute("select file_id, context_id, fromno, tono from arc"):
        if file_id in files and contexts[context_id]:
            reached[test_id(contexts[context_id])].add((file_id, start, end))
    left = set().union(*reached.values())
    chosen = []
    while left:
        best = max(sorted(reached), key=lambda t: len(reached[t] & left))
        chosen.append(best)
        left -= reached[best]
    return chosen


def listed(path: Path = LIST) -> list:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_file", help="coverage data of the whole of BACKEND_TESTS, a context per test")
    parser.add_argument("--write", action="store_true", help=f"write the list to {LIST}")
    args = parser.parse_args(argv)
    chosen = select(args.data_file)
    text = HEADER + "".join(f"{t}\n" for t in sorted(chosen))
    if args.write:
        LIST.write_text(text)
    print(text, end="")
    print(f"{len(chosen)} tests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
