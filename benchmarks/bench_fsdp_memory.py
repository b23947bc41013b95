"""Memory per rank of a DP step under FSDP2 against DistributedDataParallel, on CPU (gloo).

DistributedDataParallel keeps the whole model, its gradients and its optimizer state on every
rank; FSDP2 keeps a shard of each. The question for dpgrad is whether its DP step keeps that:
ghost clipping's per-sample norms need no communication, and in single-backward mode the
clipped gradients are handed to FSDP's reduce-scatter one parameter group at a time.

Per (world size, provider; ``fsdp_memory_ranks``), the largest figure over the ranks:
- ``peak_memory``: bytes live when a step starts (parameters, gradients, Adam's state) plus the
  most the step allocates at once (torch.profiler's record of CPU allocations); DDP's bucket
  buffers (one more gradient-sized copy, made when DDP is built) are not counted;
- ``state_memory``: parameters, gradients and optimizer state alone;
- ``step_time``: rank 0's steps (CPU and gloo: a check that the step runs, not a figure for GPUs).
conftest derives, for each FSDP2 row, ``peak_memory_over_ddp`` and ``state_memory_over_ddp``
against the DDP row of the same step. Throughput on several GPUs is not measured here.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

import fsdp_memory_ranks as R
from dpgrad.tools import results
from dpgrad.tools.ranks import spawn

PROVIDERS = [f"{parallel}-{step}" for parallel in ("ddp", "fsdp2")
             for step in ("non-private", "dpgrad-single", "dpgrad-double")]
WORLDS = (2, 4)
# make test's untimed pass: the smallest world size only.
UNTIMED = [dict(world=WORLDS[0])]
_runs: Dict[int, list] = {}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")


def _run(world: int, timed: bool) -> list:
    """Every provider's results on each rank of one world size, [rank][provider] (an untimed
    run, make test's, times one step of each instead of ``TIMED_STEPS``, on the smaller model)."""
    if world not in _runs:
        steps = R.TIMED_STEPS if timed else 1
        jobs = [("dp_step_memory", dict(provider=p, timed_steps=steps, quick=not timed)) for p in PROVIDERS]
        _runs[world] = spawn(world, jobs, "fsdp_memory_ranks")
    return _runs[world]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_memory(bench, world, provider):
    cfg = R.config(quick=bench.benchmark_fixture.disabled)
    bench.describe("fsdp_memory", "fsdp_memory",
                   dict(model=f"tiny-{cfg.n_layers}l-d{cfg.d_model}", world=world, batch=R.BATCH_PER_RANK,
                        seq_len=R.SEQ_LEN, dtype="fp32"), provider, time_metric="step_time")
    ranks = [out[PROVIDERS.index(provider)] for out in _run(world, not bench.benchmark_fixture.disabled)]
    bench.metrics["peak_memory"] = results.metric("peak_memory", max(r["peak"] for r in ranks))
    bench.metrics["state_memory"] = results.metric("state_memory", max(r["state"] for r in ranks))
    bench.metrics["step_time"] = results.metric("step_time", 0) | results.quantiles(ranks[0]["times"], 1e3)
    bench.benchmark_fixture.extra_info.update(parts=[r["parts"] for r in ranks])
    # pytest-benchmark needs a call to time; the steps were timed on the ranks.
    bench.benchmark_fixture.pedantic(lambda: None, rounds=1, iterations=1)
