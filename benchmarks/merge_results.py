"""One results file from the parts of a suite's run taken in several calls.

    python benchmarks/merge_results.py OUTPUT.json PART.json [PART.json ...]

A suite too long for one call (on a lent GPU, ten minutes a command) runs case by case
(``pytest benchmarks/bench_dp_step.py -k "[hf-gpt2-64-128-"``), each part writing its own
``<suite>_<device>.json``; this writes them as one file (``dpgrad.tools.results.merge``). It
refuses parts of other suites, machines, commits or versions, and a case found in two parts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dpgrad.tools import results


def main(argv) -> int:
    if len(argv) < 2:
        print("usage: python benchmarks/merge_results.py OUTPUT.json PART.json [PART.json ...]", file=sys.stderr)
        return 2
    output, parts = Path(argv[0]), [Path(p) for p in argv[1:]]
    try:
        doc = results.merge(results.load(parts))
    except ValueError as exc:
        print(f"merge_results: {exc}", file=sys.stderr)
        return 1
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        print(f"merge_results: cannot write {output}: {exc}", file=sys.stderr)
        return 1
    print(f"written {output}: {len(doc['results'])} rows from {len(parts)} parts")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
