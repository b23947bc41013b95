"""A DP step's time against the non-private step's, their rounds interleaved step by step.

    python benchmarks/step_ratio.py --model hf-gpt2 --batch 4 --seq-len 128 \
        --provider dpgrad-single dpgrad-single-per-block [--rounds 10] [--json PATH]

The steps are ``bench_dp_step.py``'s (same weights and batch, fp32 on a CPU). After their
warm-up, each round runs the non-private step and then each provider's once, synchronised, so
that a machine whose speed drifts (a shared CPU, a GPU's clocks) slows all of a round alike;
each provider's ratio is the median over the rounds of its round's non-private time over its
own, beside the median times. ``bench_dp_step.py`` times a provider's rounds one after another,
which on a noisy machine moves its ratios from one repeat to the next by more than the
difference being measured. Not a test: a tool for a figure that holds from run to run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_dp_step  # noqa: E402


def interleaved(steps: dict, rounds: int) -> dict:
    """Each step's time per round (ms), the steps run in turn every round (``steps``: name ->
    callable, the non-private one first)."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf-gpt2", help="a model of bench_dp_step.py (default: hf-gpt2)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32", choices=["fp32", "bf16", "amp"])
    parser.add_argument("--provider", nargs="+", default=["dpgrad-single"], choices=bench_dp_step.PROVIDERS[1:])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: 2)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    names = ["non-private"] + args.provider
    steps = {name: bench_dp_step.make_step(name, args.model, args.batch, args.seq_len, args.dtype) for name in names}
    interleaved(steps, args.warmup)
    times = interleaved(steps, args.rounds)
    base = times["non-private"]
    rows = [{"provider": name, "median_ms": statistics.median(times[name]),
             "ratio": statistics.median(b / t for b, t in zip(base, times[name])),
             "ratios": [round(b / t, 3) for b, t in zip(base, times[name])], "times_ms": [round(t, 1) for t in times[name]]}
            for name in names]
    print(f"{args.model} B={args.batch} T={args.seq_len} {args.dtype}, {args.rounds} interleaved rounds")
    print(f"{'provider':28s} {'median ms':>10s} {'throughput / non-private':>25s}  per round")
    for r in rows:
        print(f"{r['provider']:28s} {r['median_ms']:10.1f} {r['ratio']:25.3f}  {r['ratios']}")
    if args.json:
        from dpgrad.tools import results

        args.json.write_text(json.dumps({"machine": results.machine_info(), "settings": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
