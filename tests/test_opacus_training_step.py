"""Whole DP-SGD steps with Opacus's optimizer: single backward, double backward and Opacus.

At noise 0 a step with Opacus's ``DPOptimizerFastGradientClipping`` must move the parameters
the same way whichever backward produced ``p.grad``: dpgrad's single backward, dpgrad's
double backward, or Opacus's own protocol (where Opacus is right: no padding tokens). Also
the combinations of Opacus's and dpgrad's loss wrappers and modules.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("opacus")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from opacus.grad_sample import (  # noqa: E402
    GradSampleModuleFastGradientClipping as OpacusGradSampleModuleFastGradientClipping,
)
from opacus.optimizers import DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import (  # noqa: E402
    DPLossFastGradientClipping as OpacusDPLossFastGradientClipping,
)

import dpgrad  # noqa: E402
import dpgrad.opacus  # noqa: E402
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig  # noqa: E402

pytestmark = pytest.mark.opacus

CONFIGS = {
    "gpt2-like": TinyTransformerConfig(vocab_size=31, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=24),
    "llama-like": TinyTransformerConfig(vocab_size=31, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=24,
                                        norm="rms", bias=False, mlp="swiglu"),
}
C = 0.5  # below every per-sample norm of these models: each sample is clipped by its own factor


def _batches(cfg, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    # No padding token: Opacus's embedding sampler would count it.
    return [torch.randint(1, cfg.vocab_size, (b, cfg.max_seq_len), generator=g) for b in sizes]


def _wrapper(kind, model, loss_reduction):
    if kind == "opacus":
        return OpacusGradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction=loss_reduction)
    return dpgrad.GradSampleModuleFastGradientClipping(
        model, max_grad_norm=C, loss_reduction=loss_reduction, single_backward=kind == "single"
    )


def _step(kind, loss_cls, model, batches, loss_reduction, optimizer_cls=DPOptimizerFastGradientClipping,
          expected_batch_size=None):
    """Forward and backward every micro-batch, then one optimizer step; returns the update and
    the per-sample norms of every micro-batch."""
    wrapped = _wrapper(kind, model, loss_reduction)
    optimizer = optimizer_cls(
        # SGD: Adam would blow the rounding noise of gradients that are zero in exact
        # arithmetic (the attention key bias) up to full-size steps.
        torch.optim.SGD(wrapped.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=expected_batch_size or sum(b.shape[0] for b in batches),
        loss_reduction=loss_reduction,
    )
    criterion = loss_cls(wrapped, optimizer, nn.CrossEntropyLoss(reduction=loss_reduction), loss_reduction)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    norms = []
    for ids in batches:
        logits = wrapped(ids[:, :-1].contiguous())  # Opacus's embedding sampler needs contiguous ids
        V = logits.shape[-1]
        loss = criterion(logits.reshape(-1, V), ids[:, 1:].reshape(-1), shape=logits.shape[:2])
        loss.backward()
        norms.append(wrapped.get_norm_sample().detach().clone())
    optimizer.step()
    return [p.detach() - s for p, s in zip(model.parameters(), start)], norms


def _assert_same(updates_a, updates_b, names, what):
    for name, a, b in zip(names, updates_a, updates_b):
        assert b.abs().max() > 0, f"{what}: {name} did not move"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_single_double_and_opacus_make_the_same_step(config, loss_reduction):
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    names = [n for n, _ in model.named_parameters()]
    batches = _batches(cfg, [5])
    results = {
        kind: _step(kind, loss_cls, copy.deepcopy(model), batches, loss_reduction)
        for kind, loss_cls in [
            ("opacus", OpacusDPLossFastGradientClipping),
            ("double", dpgrad.DPLossFastGradientClipping),
            ("single", dpgrad.DPLossFastGradientClipping),
        ]
    }
    assert (results["opacus"][1][0] > C).all(), "every sample should be clipped"
    for kind in ("double", "single"):
        torch.testing.assert_close(results[kind][1][0], results["opacus"][1][0], rtol=1e-5, atol=0)
        _assert_same(results[kind][0], results["opacus"][0], names, kind)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_accumulated_micro_batches_make_one_step(loss_reduction):
    """Micro-batches of 3, 4 and 2 samples, each clipped on its own, then one step of dpgrad's
    optimizer: the same update in both modes, and the same as one batch of all 9 samples
    (clipping is per sample, so splitting the batch changes nothing). Three batches accumulated
    are three iterations for the accountant and the mean (Opacus's rule): under "mean" the step
    divides by expected_batch_size = 3 times 3. Opacus's own optimizer, which counts one, is
    refused before a second batch reaches p.grad."""
    cfg = CONFIGS["gpt2-like"]
    torch.manual_seed(1)
    model = TinyTransformer(cfg)
    names = [n for n, _ in model.named_parameters()]
    micro = _batches(cfg, [3, 4, 2], seed=1)
    whole = [torch.cat(micro)]
    ours = dpgrad.opacus.DPOptimizerFastGradientClipping
    single, single_norms = _step("single", dpgrad.DPLossFastGradientClipping, copy.deepcopy(model), micro,
                                 loss_reduction, ours, expected_batch_size=3)
    double, double_norms = _step("double", dpgrad.DPLossFastGradientClipping, copy.deepcopy(model), micro,
                                 loss_reduction, ours, expected_batch_size=3)
    with pytest.raises(ValueError, match="counts one batch per step"):
        _step("single", dpgrad.DPLossFastGradientClipping, copy.deepcopy(model), micro, loss_reduction)
    at_once, at_once_norms = _step("single", dpgrad.DPLossFastGradientClipping, copy.deepcopy(model), whole,
                                   loss_reduction)
    torch.testing.assert_close(torch.cat(single_norms), at_once_norms[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.cat(double_norms), at_once_norms[0], rtol=1e-5, atol=0)
    _assert_same(single, at_once, names, "single, accumulated")
    _assert_same(double, at_once, names, "double, accumulated")


@pytest.mark.parametrize("kind, config, loss_reduction", [("double", "gpt2-like", "mean"),
                                                           ("opacus", "llama-like", "sum")])
def test_either_loss_wrapper_drives_either_double_backward_module(kind, config, loss_reduction):
    """Opacus's own DPLossFastGradientClipping drives dpgrad's double-backward wrapper
    (drop-in), and dpgrad's runs Opacus's protocol on Opacus's wrapper: the same step."""
    cfg = CONFIGS[config]
    torch.manual_seed(2)
    model = TinyTransformer(cfg)
    names = [n for n, _ in model.named_parameters()]
    batches = _batches(cfg, [4], seed=2)
    theirs, _ = _step(kind, OpacusDPLossFastGradientClipping, copy.deepcopy(model), batches, loss_reduction)
    ours, _ = _step(kind, dpgrad.DPLossFastGradientClipping, copy.deepcopy(model), batches, loss_reduction)
    _assert_same(ours, theirs, names, f"dpgrad's loss wrapper on the {kind} module")


def test_single_backward_refuses_opacus_loss_wrapper():
    """Opacus's loss wrapper starts with a plain backward, which would leave unclipped
    gradients: the single-backward wrapper refuses it and says what to use instead."""
    cfg = CONFIGS["gpt2-like"]
    with pytest.raises(RuntimeError, match="single_backward=True.*dpgrad.DPLossFastGradientClipping"):
        _step("single", OpacusDPLossFastGradientClipping, TinyTransformer(cfg), _batches(cfg, [4]), "mean")
