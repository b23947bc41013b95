"""What a DP step costs the host: operations dispatched, host-device waits, kernel launches,
and the time to issue the step against the time to run it.

dpgrad's per-layer work is small GEMMs and reductions; on a GPU, with a model of few layers
and a large batch, the kernels are fast and the question is whether the host keeps the GPU
fed. Each hooked layer adds operations the host must dispatch (and kernels it must launch),
and every operation that waits for the device (an ``item()``, a boolean mask, a
data-sized output, an index made from host data) stalls the queue. This suite measures that overhead per hooked layer,
against the non-private step of the same model, on two-layer Hugging Face models (two
layers keep the per-layer figures from drowning in per-layer kernel time):
- ``hf-gpt2-2l``: GPT-2, full fine-tuning, tied embeddings, no dropout;
- ``hf-llama-2l-lora16``: Llama with tied embeddings and PEFT LoRA adapters of rank 16 on
  every projection; only the adapters train.
Quick mode (the default without CUDA, ``DPGRAD_BENCH_QUICK=1`` otherwise) takes
bench_dp_step's two-layer "-tiny" widths, B=8, T=64, fp32; the full suite takes GPT-2 small's
and Llama-3.2-1B's widths with two layers, B=8, T=1024, bf16, on CUDA.

Providers: ``non-private``, ``dpgrad-double``, ``dpgrad-single`` (``dispatch_counts.make_step``).
All step with plain SGD: Opacus's DP optimizer is left out because its clipping check and
noise add the same few operations per parameter whatever computed the clipped gradients, so
they would add the same to every DP row and say nothing about the wrappers.

Per (model, provider), after two warm-up steps (dpgrad's first step tunes its kernels):
- ``ops``: aten operations dispatched in one step, views included (``DispatchCounts``);
- ``syncs``: those that make the host wait for the device (``waits_for_device``);
- ``cuda_syncs`` (CUDA): synchronisations ``torch.cuda.set_sync_debug_mode`` reports in a step;
- ``launches`` (CUDA): kernel launches in a step, from torch.profiler;
- ``hooked_layers`` (dpgrad): the layers the wrapper hooks;
- ``first_step_probe_ops``, ``first_step_probe_syncs``, ``first_step_probe_time`` (dpgrad):
  what the first step of a fresh wrapper dispatches, waits for and takes (the median of
  three fresh wrappers) beyond the same first step with ``check_independence=False``: the
  independence check (``dpgrad.checks.independence``: a backward pass per probe set from the model's
  outputs or the losses, ceil(log2 B) or one more; the forward probe's runs of the model and
  the criterion, one per set and a reference; one host read for each), which later steps of
  the same layout do not run;
- ``host_time``: the time for the host to issue a step, without waiting for its end (on a
  CPU, the step's time); ``step_time``: the time of a synchronised step.
conftest derives, for the dpgrad rows against the non-private row: ``extra_ops_per_layer``,
``extra_syncs``, ``host_time_per_layer`` and ``step_time_over_non_private``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import pytest
import torch

from dispatch_counts import MODELS, PROVIDERS, WARMUP_STEPS, build_model, count, cuda_syncs, make_step
from dpgrad.tools import results

CUDA = torch.cuda.is_available()
QUICK = results.quick_mode()
# Like bench_dp_step: the GPU when there is one (its name is the results file's), else the CPU.
DEVICE = torch.device("cuda" if CUDA else "cpu")
BATCH, SEQ_LEN, DTYPE = (8, 64, "fp32") if QUICK else (8, 1024, "bf16")
ROUNDS = 20 if QUICK else 15
# The profiler's names for a kernel launch: the runtime's, and the driver's (Triton launches
# through the driver).
LAUNCHES = {"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"}

_models: Dict[str, object] = {}


def _model(name: str):
    """One set of random weights per model: every provider copies it."""
    if name not in _models:
        _models[name] = build_model(name, QUICK, DEVICE, DTYPE)
    return _models[name]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def kernel_launches(run: Callable[[], None]) -> int:
    """Kernel launches during one ``run``, as the profiler records the host's launch calls."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync()
    return sum(1 for event in prof.events() if event.name in LAUNCHES)


def host_times(run: Callable[[], None], rounds: int) -> List[float]:
    """Seconds for the host to return from each ``run``: the device is idle when each starts
    (so no earlier step's work is waited for), and the run's own work is not waited for."""
    times = []
    for _ in range(rounds):
        _sync()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    _sync()
    return times


def first_step_time(provider: str, name: str, check_independence: bool, rounds: int = 3) -> float:
    """Seconds of a fresh wrapper's first (synchronised) step, the median of ``rounds``."""
    times = []
    for _ in range(rounds):
        step = make_step(provider, _model(name), BATCH, SEQ_LEN, DEVICE, check_independence=check_independence)
        _sync()
        start = time.perf_counter()
        step.run()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name", MODELS)
def test_host_overhead(bench, name, provider):
    bench.describe("host_overhead", "host_overhead", dict(model=name, batch=BATCH, seq_len=SEQ_LEN, dtype=DTYPE),
                   provider, time_metric="step_time")
    # Untimed runs (--benchmark-disable: make test's pass over the suites) take one round of
    # each timing, and no timed steps; conftest writes nothing for them.
    untimed = bench.benchmark_fixture.disabled
    try:
        step = make_step(provider, _model(name), BATCH, SEQ_LEN, DEVICE)
        for _ in range(WARMUP_STEPS):
            step.run()
            _sync()
    except NotImplementedError as err:
        bench.skip(f"refused: {err}".splitlines()[0][:200])
    except torch.cuda.OutOfMemoryError:
        bench.skip("out of memory")
    except RuntimeError as err:
        bench.skip(f"error: {err}".splitlines()[0][:200])

    counts = count(step.run)
    _sync()
    bench.metrics["ops"] = results.metric("ops", counts.ops)
    bench.metrics["syncs"] = results.metric("syncs", counts.syncs)
    bench.benchmark_fixture.extra_info.update(sync_ops=dict(counts.sync_names))
    if CUDA:
        bench.metrics["cuda_syncs"] = results.metric("cuda_syncs", cuda_syncs(step.run))
        bench.metrics["launches"] = results.metric("launches", kernel_launches(step.run))
    if step.wrapped is not None:
        bench.metrics["hooked_layers"] = results.metric("hooked_layers", step.hooked_layers)
        first = [count(make_step(provider, _model(name), BATCH, SEQ_LEN, DEVICE, check_independence=on).run)
                 for on in (True, False)]
        bench.metrics["first_step_probe_ops"] = results.metric("first_step_probe_ops", first[0].ops - first[1].ops)
        bench.metrics["first_step_probe_syncs"] = results.metric("first_step_probe_syncs",
                                                                 first[0].syncs - first[1].syncs)
        on, off = (first_step_time(provider, name, on, rounds=1 if untimed else 3) for on in (True, False))
        bench.metrics["first_step_probe_time"] = results.metric("first_step_probe_time", (on - off) * 1e3)

    bench.metrics["host_time"] = results.metric("host_time", 0) | results.quantiles(
        host_times(step.run, 1 if untimed else ROUNDS), 1e3)
    if untimed:
        bench.end_untimed()
        return

    def synced_step():
        step.run()
        _sync()

    results.warm_up(synced_step)  # until two steps in a row agree within 10%
    bench.benchmark_fixture.pedantic(synced_step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
