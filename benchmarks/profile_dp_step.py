"""Where a DP step's time goes, host or device: a torch.profiler trace of a few steps.

    python benchmarks/profile_dp_step.py --model hf-gpt2 --batch 8 --seq-len 1024 \
        --provider non-private dpgrad-single [--dtype bf16] [--steps 3] [--top 15]

For each provider (the steps of ``bench_dp_step.py``, same weights and batch): host time per
step (the operations' own CPU time, less the time spent waiting for the device, which is
shown apart), device time per step (the sum of kernel times on CUDA: dpgrad's named regions,
``dpgrad.finish`` and the like, are not kernels and are left out of it), kernel launches per
step, the operations that cost the host most and, on a GPU, the kernels that cost the device
most, and each region's span on the device's timeline (from its first kernel's start to its
last's end: idle time included, so a span longer than its kernels' time means the device
waited for the host there); the host's time by region (dpgrad's hooks, norms, clipped sums,
withholding and noise, the optimizer's step: on a CPU, the step's time by region); and the
matrix products' GFLOP of one step (torch's flop counter) beside the non-private step's.
``--trace`` writes the timeline; ``--python`` profiles the Python functions instead. A
step whose host time exceeds its device time keeps the GPU waiting. Prints one table; with
``--json PATH`` also writes the figures, with the machine (device, versions, commit, date).
Not a test and not a benchmark suite: a tool for finding what to fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import bench_dp_step  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
# The named regions whose host time is listed (``host_regions``): dpgrad's and the optimizer's.
HOST_REGIONS = ("dpgrad.", "Optimizer.")


def profile_provider(provider: str, model: str, batch: int, seq_len: int, dtype: str, steps: int, top: int,
                     trace: Path = None) -> dict:
    step = bench_dp_step.make_step(provider, model, batch, seq_len, dtype)
    for _ in range(2):  # warm-up: compilation and the autotuner's first look at each shape
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if trace is not None:
        import gzip

        raw = trace.with_suffix(".tmp.json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            dst.write(src.read())
        raw.unlink()
    return {"provider": provider, "gflops_per_step": step_gflops(step),
            **summarise(prof.key_averages(), steps, top, torch.cuda.is_available())}


def step_gflops(step) -> float:
    """The floating-point operations of one step (GFLOP) that torch's flop counter sees: the
    matrix products (mm, bmm, addmm, baddbmm, convolutions, attention), not the elementwise
    work."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return counter.get_total_flops() / 1e9


def summarise(events, steps: int, top: int, cuda: bool) -> dict:
    """The figures per step of a profile's ``key_averages()`` (``events``) over ``steps`` steps.

    On the device, a named region (``record_function``: ``dpgrad.finish`` and the like) is a
    span of the timeline, not work: its time overlaps its kernels' and includes the device's
    idle time within it, so it is kept out of the device time and the kernels, and listed
    apart (``regions``)."""
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    waiting_us = sum(e.self_cpu_time_total for e in events if e.key in SYNCS)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA] if cuda else []
    kernels = [e for e in on_device if not e.is_user_annotation]
    regions = [e for e in on_device if e.is_user_annotation]
    # Host time: each op's own CPU time, summed, less the time spent waiting for the device.
    host_us = sum(e.self_cpu_time_total for e in events) - waiting_us
    costly = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]

    def per_step(found):
        return [(e.key[:120], e.count // steps, round(e.self_device_time_total / 1e3 / steps, 3))
                for e in sorted(found, key=lambda e: e.self_device_time_total, reverse=True)[:top]]

    return {
        "host_ms_per_step": host_us / 1e3 / steps,
        "waiting_ms_per_step": waiting_us / 1e3 / steps,
        "device_ms_per_step": sum(e.self_device_time_total for e in kernels) / 1e3 / steps,
        "launches_per_step": launches / steps,
        "top_host": [(e.key, e.count // steps, round(e.self_cpu_time_total / 1e3 / steps, 3)) for e in costly],
        # The kernels that cost the device most: where a GPU-bound step's time goes.
        "top_device": per_step(kernels),
        # dpgrad's regions on the device's timeline: spans, idle time included.
        "regions": per_step(regions),
        # Where the host's time goes, by region: dpgrad's (forward and backward hooks, norms, clipped
        # sums, the finite check's withholding, the noise, the finish step holding them) and the
        # optimizer's, each the CPU time of everything inside it (regions nest). On a CPU, where
        # the host runs the kernels, this is the step's time by region.
        "host_regions": [(e.key, e.count // steps, round(e.cpu_time_total / 1e3 / steps, 3))
                         for e in sorted(events, key=lambda e: e.cpu_time_total, reverse=True)
                         if e.key.startswith(HOST_REGIONS) and e.device_type == torch.autograd.DeviceType.CPU],
    }


def python_profile(provider: str, model: str, batch: int, seq_len: int, dtype: str, steps: int, top: int) -> None:
    """The Python functions that cost the host most per step (cProfile), after warm-up."""
    import cProfile
    import pstats

    step = bench_dp_step.make_step(provider, model, batch, seq_len, dtype)
    for _ in range(2):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    print(f"\n{provider}: Python, {steps} steps, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf-gpt2-tiny", help="a model of bench_dp_step.py (default: hf-gpt2-tiny)")
    parser.add_argument("--batch", type=int, default=8, help="samples per step (default: 8)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default: 64)")
    parser.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32", choices=["fp32", "bf16", "amp"],
                        help="model dtype, or amp: fp32 weights under autocast to bf16 (default: bf16 on a GPU, fp32 "
                             "on a CPU)")
    parser.add_argument("--provider", nargs="+", default=["non-private", "dpgrad-single"],
                        choices=bench_dp_step.PROVIDERS, help="the steps to profile")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per provider (default: 3)")
    parser.add_argument("--top", type=int, default=12, help="costliest host operations listed (default: 12)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--python", action="store_true", help="profile the Python functions (cProfile) instead")
    parser.add_argument("--trace", type=Path, help="write each provider's trace (Chrome format, gzip) to PATH-provider.json.gz")
    args = parser.parse_args(argv)
    if args.python:
        for p in args.provider:
            python_profile(p, args.model, args.batch, args.seq_len, args.dtype, args.steps, args.top)
        return 0
    rows = [profile_provider(p, args.model, args.batch, args.seq_len, args.dtype, args.steps, args.top,
                             None if args.trace is None else Path(f"{args.trace}-{p}.json.gz"))
            for p in args.provider]
    print(f"{args.model} B={args.batch} T={args.seq_len} {args.dtype}")
    print(f"{'provider':24s} {'host ms/step':>12s} {'waiting':>8s} {'device ms/step':>14s} {'launches/step':>13s} "
          f"{'GFLOP/step':>10s} {'x non-private':>13s}")
    base = next((r["gflops_per_step"] for r in rows if r["provider"] == "non-private"), None)
    for r in rows:
        times = f"{r['gflops_per_step'] / base:13.3f}" if base else f"{'':13s}"
        print(f"{r['provider']:24s} {r['host_ms_per_step']:12.1f} {r['waiting_ms_per_step']:8.1f} "
              f"{r['device_ms_per_step']:14.1f} {r['launches_per_step']:13.0f} {r['gflops_per_step']:10.2f} {times}")
    for r in rows:
        print(f"\n{r['provider']}: costliest host operations (name, calls/step, ms/step)")
        for name, calls, ms in r["top_host"]:
            print(f"  {ms:8.3f}  {calls:6d}  {name}")
        if r["top_device"]:
            print(f"{r['provider']}: costliest kernels (name, launches/step, ms/step)")
            for name, calls, ms in r["top_device"]:
                print(f"  {ms:8.3f}  {calls:6d}  {name}")
        if r["host_regions"]:
            print(f"{r['provider']}: host time by region, regions nested (name, calls/step, ms/step)")
            for name, calls, ms in r["host_regions"]:
                print(f"  {ms:8.3f}  {calls:6d}  {name}")
        if r["regions"]:
            print(f"{r['provider']}: regions' spans on the device, idle time included (name, calls/step, ms/step)")
            for name, calls, ms in r["regions"]:
                print(f"  {ms:8.3f}  {calls:6d}  {name}")
    if args.json:
        from dpgrad.tools import results

        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"machine": results.machine_info(), "settings": settings, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
