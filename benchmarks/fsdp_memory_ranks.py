"""What each rank of bench_fsdp_memory.py runs: DP steps of one model under
DistributedDataParallel or FSDP2, and the memory they take on that rank.

Providers ``<parallel>-<step>``: parallel "ddp" (``DistributedDataParallel``, the whole model
on every rank) or "fsdp2" (``fully_shard`` on each block, then the root); step
"non-private", "dpgrad-single" or "dpgrad-double" (dpgrad's ghost clipping in one or two
backward passes, around the DDP model or on the sharded one). Every step is Adam's, without
noise: the DP optimizer's noise takes one more gradient-sized buffer in every DP row alike.
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch
import torch.nn as nn

import dpgrad
from dpgrad.tools import results
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig, synthetic_batch

CFG = TinyTransformerConfig(vocab_size=4096, max_seq_len=64, d_model=256, n_heads=4, n_layers=4, d_ff=1024)
# An untimed run (make test's) checks that each step runs and is recorded, on a smaller model.
QUICK_CFG = TinyTransformerConfig(vocab_size=512, max_seq_len=64, d_model=64, n_heads=4, n_layers=2, d_ff=256)
BATCH_PER_RANK, SEQ_LEN = 4, 64
TIMED_STEPS = 3


def config(quick: bool) -> TinyTransformerConfig:
    """The model of a run: ``QUICK_CFG`` for an untimed one, ``CFG`` for a timed one."""
    return QUICK_CFG if quick else CFG


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (its shard of a DTensor)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _state(net: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    params = list(net.parameters())
    optimizer_state = [v for s in optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(optimizer_state)}


def dp_step_memory(rank: int, world: int, provider: str, timed_steps: int = TIMED_STEPS, quick: bool = False) -> dict:
    """Peak bytes of a step on this rank (parameters, gradients and optimizer state live when
    it starts, plus the most it allocates at once), the state alone, and the times (s) of
    ``timed_steps`` steps; of ``QUICK_CFG``'s model where ``quick``."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    parallel, step_kind = provider.split("-", 1)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    cfg = config(quick)
    torch.manual_seed(0)
    net = TinyTransformer(cfg)
    if parallel == "fsdp2":
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        model = net
    else:
        model = DDP(net)
    ids = synthetic_batch(cfg, BATCH_PER_RANK, SEQ_LEN, torch.Generator().manual_seed(rank))
    if step_kind == "non-private":
        criterion = None
    else:
        model = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0,
                                                            single_backward=step_kind == "dpgrad-single")
        criterion = dpgrad.DPLossFastGradientClipping(model, None, nn.CrossEntropyLoss(ignore_index=cfg.padding_idx))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        flat, targets = logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)
        if criterion is None:
            nn.functional.cross_entropy(flat, targets, ignore_index=cfg.padding_idx).backward()
        else:
            criterion(flat, targets, shape=logits.shape[:2]).backward()
        optimizer.step()

    step()  # the optimizer's state, FSDP's lazy initialisation, dpgrad's first-use tuning
    times: List[float] = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    state = _state(net, optimizer)
    peak = sum(state.values()) + results.peak_allocated(step)
    return {"peak": peak, "state": sum(state.values()), "parts": state, "times": times}


SCENARIOS = {"dp_step_memory": dp_step_memory}
