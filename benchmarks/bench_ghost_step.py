"""One ghost-clipping DP-SGD step of the built-in transformer: Opacus against dpgrad.

Both runs use the same weights, batch, and Opacus's own DPLossFastGradientClipping and
DPOptimizerFastGradientClipping; only the wrapper class differs. The conftest prints the
ratio dpgrad / Opacus and writes it to benchmarks/results/.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dpgrad import GradSampleModuleFastGradientClipping
from dpgrad.models import TinyTransformer, TinyTransformerConfig, synthetic_batch

opacus = pytest.importorskip("opacus")
from opacus.grad_sample import GradSampleModuleFastGradientClipping as OpacusFGC  # noqa: E402
from opacus.optimizers import DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping  # noqa: E402

BATCH = 8
SEQ_LENS = [64, 256]
WRAPPERS = {"opacus": OpacusFGC, "dpgrad": GradSampleModuleFastGradientClipping}


class SequenceLoss(torch.nn.Module):
    """Token cross-entropy with Opacus's `shape=` convention for per-sequence losses."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits, targets):
        return torch.nn.functional.cross_entropy(logits, targets, reduction=self.reduction)


def make_step(wrapper_name: str, seq_len: int):
    torch.manual_seed(0)
    cfg = TinyTransformerConfig(max_seq_len=max(SEQ_LENS))
    model = WRAPPERS[wrapper_name](copy.deepcopy(TinyTransformer(cfg)), max_grad_norm=1.0, loss_reduction="mean")
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.01),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
        loss_reduction="mean",
    )
    criterion = DPLossFastGradientClipping(model, optimizer, SequenceLoss(), loss_reduction="mean")
    ids = synthetic_batch(cfg, BATCH, seq_len, generator=torch.Generator().manual_seed(1))
    # Opacus's embedding norm sampler needs contiguous ids (it calls .view on them).
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step():
        optimizer.zero_grad()
        logits = model(inputs)
        loss = criterion(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), shape=logits.shape[:2])
        loss.backward()
        optimizer.step()

    return step


@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_ghost_clipping_step(benchmark, wrapper, seq_len):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    step = make_step(wrapper, seq_len)
    step()  # warm-up
    benchmark.group = f"ghost step, TinyTransformer, B={BATCH}, T={seq_len}, cpu"
    benchmark.extra_info.update(wrapper=wrapper, seq_len=seq_len, batch=BATCH)
    benchmark.pedantic(step, rounds=15, iterations=1, warmup_rounds=1)
