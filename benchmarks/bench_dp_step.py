"""One training step of a transformer: non-private, Opacus ghost clipping, dpgrad double and
single backward, all in the same run on the same weights and batch.

A DP step is forward, the loss wrapper's backward, and Opacus's
``DPOptimizerFastGradientClipping`` step (noise 1.0, C = 1.0); the non-private step is
forward, the mean token loss's backward and the plain optimizer's step. Each language-model
sequence is one sample (``shape=`` of the loss wrappers). On a CPU the built-in
``TinyTransformer`` runs in fp32; on a CUDA GPU the ``gpt2-small`` preset (GPT-2 small
shapes, untied head) in bf16. The conftest writes medians, ratios to the non-private step
and to Opacus, tokens/s and (on a GPU) peak memory to benchmarks/results/dp_step_<cpu|cuda>.json.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn as nn

import dpgrad
from dpgrad.presets import DTYPES, build_model
from dpgrad.models import synthetic_batch

opacus = pytest.importorskip("opacus")
from opacus.grad_sample import GradSampleModuleFastGradientClipping as OpacusFGC  # noqa: E402
from opacus.optimizers import DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping as OpacusDPLoss  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (model preset, batch, tokens per sequence, dtype): about 8k tokens a step on the GPU.
CASES = (
    [("gpt2-small", 64, 128, "bf16"), ("gpt2-small", 8, 1024, "bf16")]
    if CUDA
    else [("tiny", 8, 64, "fp32"), ("tiny", 8, 256, "fp32")]
)
PROVIDERS = ["non-private", "opacus-ghost", "dpgrad-double", "dpgrad-single"]
ROUNDS = 15 if CUDA else 10

_models: Dict[Tuple[str, str], nn.Module] = {}


def _model(name: str, dtype: str) -> nn.Module:
    """One set of random weights per preset and dtype: every provider copies it."""
    if (name, dtype) not in _models:
        torch.manual_seed(0)
        _models[(name, dtype)] = build_model(name, DEVICE, DTYPES[dtype]).module
    return _models[(name, dtype)]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def make_step(provider: str, name: str, batch: int, seq_len: int, dtype: str) -> Callable[[], None]:
    model = copy.deepcopy(_model(name, dtype))
    vocab = model.cfg.vocab_size
    ids = synthetic_batch(model.cfg, batch, seq_len + 1, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    # Opacus's embedding norm sampler needs contiguous ids (it calls .view on them).
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    criterion = nn.CrossEntropyLoss(ignore_index=model.cfg.padding_idx)

    if provider == "non-private":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            criterion(model(inputs).reshape(-1, vocab), targets.reshape(-1)).backward()
            optimizer.step()

        return step

    if provider == "opacus-ghost":
        wrapped, loss_cls = OpacusFGC(model, max_grad_norm=1.0, loss_reduction="mean"), OpacusDPLoss
    else:
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(
            model, max_grad_norm=1.0, loss_reduction="mean", single_backward=provider == "dpgrad-single"
        )
        loss_cls = dpgrad.DPLossFastGradientClipping
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(wrapped.parameters(), lr=1e-3),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
        loss_reduction="mean",
    )
    dp_criterion = loss_cls(wrapped, optimizer, criterion, loss_reduction="mean")

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = wrapped(inputs)
        dp_criterion(logits.reshape(-1, vocab), targets.reshape(-1), shape=logits.shape[:2]).backward()
        optimizer.step()

    return step


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name, batch, seq_len, dtype", CASES)
def test_dp_step(benchmark, provider, name, batch, seq_len, dtype):
    step = make_step(provider, name, batch, seq_len, dtype)

    def synced_step():
        step()
        _sync()

    synced_step()  # warm-up (and, for dpgrad, the autotuner's first look at each shape)
    peak = None
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
        synced_step()
        peak = torch.cuda.max_memory_allocated()
    benchmark.group = f"DP step, {name}, B={batch}, T={seq_len}, {dtype}, {DEVICE.type}"
    benchmark.extra_info.update(
        bench="dp_step", provider=provider, model=name, batch=batch, seq_len=seq_len, dtype=dtype,
        tokens=batch * seq_len, peak_memory_bytes=peak,
    )
    benchmark.pedantic(synced_step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
