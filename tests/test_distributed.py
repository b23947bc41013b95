"""DistributedDataParallel with 2 processes on gloo (CPU), against one process on the global batch.

- ``p.grad`` after clipped backward, in both modes and with dpgrad's wrapper inside or around
  DDP, is DDP's average of the ranks' clipped sums: the one-process clipped sum / world size;
  so for a net of convolutions and GroupNorm clipped from their norms, and for a
  mixture-of-experts model (router and 3-D experts).
- The norm pass makes DDP reduce nothing: DDP reduces the clipped gradients, where with
  Opacus's protocol (a plain first pass) it reduces the unclipped ones instead.
- ``dpgrad.opacus.make_private`` on the DDP model with its distributed optimizer takes the
  one-process step, noise included: the noise is drawn once, on rank 0.
- A model sharded by FSDP2 is refused by GradSampleModule, untouched, with the alternatives
  named (tests/test_fsdp.py: the ghost-clipping wrapper takes it).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

import dpgrad
import distributed_worker as W
from dpgrad.tools.ranks import spawn
from per_sample_reference import assert_norms_close, assert_tensor_close

# Its session-scoped fixture runs once: under pytest-xdist the module's tests share a worker.
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed"),
              pytest.mark.xdist_group("test_distributed")]
WORLD = 2
MODES = {"single": True, "double": False}
ORDERS = ["dpgrad(ddp)", "ddp(dpgrad)"]
OPACUS = importlib.util.find_spec("opacus") is not None


@pytest.fixture(scope="session")  # once per worker, however its tests interleave
def ranks():
    jobs = [("clipped_gradients", dict(single=s, order=o)) for s in MODES.values() for o in ORDERS]
    jobs += [("clipped_gradients", dict(single=True, order=o, per_block=True)) for o in ORDERS]
    jobs += [("all_reduce_calls", dict(protocol=p)) for p in ("dpgrad", "opacus")]
    jobs += [("conv_clipped_gradients", dict(single=s)) for s in MODES.values()]
    if importlib.util.find_spec("transformers") is not None:
        jobs += [("moe_clipped_gradients", dict(single=s)) for s in MODES.values()]
    jobs += [("fsdp_refused", {})]
    jobs += [("mixing_refused", dict(order=o, where=w)) for o in ORDERS for w in ("model", "loss")]
    if OPACUS:
        jobs += [("privacy_engine_step", dict(single=s, noise=n)) for s in MODES.values() for n in (0.0, 1.0)]
        jobs += [("privacy_engine_step", dict(single=s, noise=1.0, wrap=False)) for s in MODES.values()]
        jobs += [("adaptive_steps", dict(single=s, public=p)) for s in MODES.values() for p in (False, True)]
    return jobs, spawn(WORLD, jobs, "distributed_worker")


def _result(ranks, name, **kwargs):
    jobs, results = ranks
    i = jobs.index((name, kwargs))
    return [results[r][i] for r in range(WORLD)]


def _one_process_clipped(single: bool):
    net = W.model()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=W.C, single_backward=single)
    W.lm_step(wrapped, dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss()), W.global_ids())
    return net, wrapped.per_sample_gradient_norms


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_are_the_one_process_clipped_sum_averaged(ranks, mode, order):
    net, norms = _one_process_clipped(MODES[mode])
    ids = torch.arange(W.GLOBAL_BATCH)
    assert (norms > W.C).all(), "every sample should be clipped"
    for rank, got in enumerate(_result(ranks, "clipped_gradients", single=MODES[mode], order=order)):
        assert_norms_close(torch.from_numpy(got["norms"]), norms[W.share(ids, rank, WORLD)].double(), f"rank {rank}")
        for n, p in net.named_parameters():
            assert_tensor_close(torch.from_numpy(got["grads"][n]), p.grad.double() / WORLD, f"rank {rank} {n}")


def _ranks_match_one_process(ranks, scenario: str, single: bool, net, wrapped, C: float) -> None:
    """Every sample clipped in the one-process step; each rank's norms are those of its samples,
    and its p.grad the one-process clipped sum / world size."""
    norms = wrapped.per_sample_gradient_norms
    assert (norms > C).all(), "every sample should be clipped"
    ids = torch.arange(W.GLOBAL_BATCH)
    for rank, got in enumerate(_result(ranks, scenario, single=single)):
        assert_norms_close(torch.from_numpy(got["norms"]), norms[W.share(ids, rank, WORLD)].double(), f"rank {rank}")
        for n, p in net.named_parameters():
            assert_tensor_close(torch.from_numpy(got["grads"][n]), p.grad.double() / WORLD, f"rank {rank} {n}")


@pytest.mark.parametrize("mode", list(MODES))
def test_convolutions_are_the_one_process_clipped_sum_averaged(ranks, mode):
    """Convolutions and GroupNorm clipped from their norms under DDP: each rank's norms are the
    one-process norms of its samples, and p.grad the one-process clipped sum / world size."""
    from mixed_net import clipped_from_norms

    net = W.conv_model()
    with clipped_from_norms():
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=W.CONV_C, single_backward=MODES[mode])
        x, y = W.global_images()
        dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss())(wrapped(x), y).backward()
    _ranks_match_one_process(ranks, "conv_clipped_gradients", MODES[mode], net, wrapped, W.CONV_C)


@pytest.mark.parametrize("mode", list(MODES))
def test_moe_gradients_are_the_one_process_clipped_sum_averaged(ranks, mode):
    """A mixture-of-experts model (router and 3-D experts trained, clipped from their norms)
    inside DDP: each rank's norms are the one-process norms of its samples, and p.grad the
    one-process clipped sum / world size."""
    pytest.importorskip("transformers")
    from mixed_net import clipped_from_norms

    net = W.moe_model()
    with clipped_from_norms():
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=W.C, single_backward=MODES[mode])
        W.lm_step(wrapped, dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss()), W.global_ids())
    _ranks_match_one_process(ranks, "moe_clipped_gradients", MODES[mode], net, wrapped, W.C)


@pytest.mark.parametrize("order", ORDERS)
def test_group_clipped_gradients_are_the_one_process_sums_averaged(ranks, order):
    """Per-block clipping (each group clipped in its last layer's hook): DDP reduces the
    clipped sums, which are the one-process ones over the global batch / world size."""
    from dpgrad.clipping.groups import per_block

    net = W.model()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        net, clipping="groups", clipping_groups=per_block, max_grad_norm=[W.C] * W.GROUPS, single_backward=True)
    W.lm_step(wrapped, dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss()), W.global_ids())
    norms = wrapped.per_sample_group_norms
    assert norms.shape == (W.GROUPS, W.GLOBAL_BATCH) and (norms > W.C).all(), "every group of every sample clipped"
    ids = torch.arange(W.GLOBAL_BATCH)
    for rank, got in enumerate(_result(ranks, "clipped_gradients", single=True, order=order, per_block=True)):
        for g in range(W.GROUPS):
            assert_norms_close(torch.from_numpy(got["norms"][g]), norms[g, W.share(ids, rank, WORLD)].double(),
                               f"rank {rank} group {g}")
        for n, p in net.named_parameters():
            assert_tensor_close(torch.from_numpy(got["grads"][n]), p.grad.double() / WORLD, f"rank {rank} {n}")


def test_norm_pass_reduces_nothing(ranks):
    """DDP reduces the clipped gradients only. Opacus's protocol, whose first pass computes
    the weight gradients, has DDP reduce those (unclipped) instead, and the clipped ones of
    the second pass, with no forward pass between, not at all."""
    ours = _result(ranks, "all_reduce_calls", protocol="dpgrad")
    opacus = _result(ranks, "all_reduce_calls", protocol="opacus")
    assert ours[0] and set(ours[0]) == {"clipped"} and ours[1] == ours[0]
    assert opacus[0] and set(opacus[0]) == {"norms"}


@pytest.mark.skipif(not OPACUS, reason="needs opacus")
@pytest.mark.parametrize("noise", [0.0, 1.0])
@pytest.mark.parametrize("mode", list(MODES))
def test_privacy_engine_step_is_the_one_process_step(ranks, mode, noise):
    import dpgrad.opacus
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    net = W.model()
    data = TensorDataset(W.global_ids())
    wrapped, optimizer, criterion, loader = dpgrad.opacus.make_private(
        PrivacyEngine(), module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=len(data)), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=noise, max_grad_norm=W.C, poisson_sampling=False, single_backward=MODES[mode],
        noise_generator=torch.Generator().manual_seed(7),  # rank 0's generator: its noise is the only one
    )
    # In one process and under DDP make_private gives dpgrad's batched optimizers, which draw
    # their noise in one call per dtype: the same draws from the same generator (rank 0's).
    assert type(optimizer) is dpgrad.opacus.DPOptimizerFastGradientClipping
    (batch,) = next(iter(loader))
    optimizer.zero_grad()
    W.lm_step(wrapped, criterion, batch)
    optimizer.step()
    start = dict(W.model().named_parameters())
    runs = [_result(ranks, "privacy_engine_step", single=MODES[mode], noise=noise)]
    if noise:  # the model left unwrapped (wrap_model=False), called itself: the same step
        runs.append(_result(ranks, "privacy_engine_step", single=MODES[mode], noise=noise, wrap=False))
    for rank, params in ((rank, params) for run in runs for rank, params in enumerate(run)):
        for n, p in net.named_parameters():
            update = (p - start[n]).detach().double()
            assert update.abs().max() > 0, n
            assert_tensor_close(torch.from_numpy(params[n]).double() - start[n].detach().double(), update,
                                f"rank {rank} {n}")


@pytest.mark.skipif(not OPACUS, reason="needs opacus")
@pytest.mark.parametrize("public", [False, True], ids=["drawn", "public"])
@pytest.mark.parametrize("mode", list(MODES))
def test_adaptive_clipping_is_the_one_process_run(ranks, mode, public):
    """Adaptive clipping under DDP: the ranks' counts summed, the count's noise drawn once (rank
    0), so every rank has the one-process bounds, step by step, and its parameters."""
    ref = W.adaptive_steps(0, 1, single=MODES[mode], public=public, sharded=False)
    assert len(set(ref["bounds"].tolist())) == len(ref["bounds"])  # the bound moved every step
    for rank, got in enumerate(_result(ranks, "adaptive_steps", single=MODES[mode], public=public)):
        np.testing.assert_allclose(got["bounds"], ref["bounds"], rtol=1e-6, err_msg=f"rank {rank} bounds")
        for n, want in ref.items():
            if n != "bounds":
                assert_tensor_close(torch.from_numpy(got[n]).double(), torch.from_numpy(want).double(),
                                    f"rank {rank} {n}")


def test_fsdp_is_refused_before_any_change(ranks):
    for message in _result(ranks, "fsdp_refused"):
        assert "sharded by FSDP" in message and "DistributedDataParallel" in message, message
        assert message.endswith("(untouched: True)"), message


@pytest.mark.parametrize("where, words", [("model", "samples are mixed inside the model"),
                                          ("loss", "the per-sample losses are in another order than the batch")])
@pytest.mark.parametrize("order", ORDERS)
def test_samples_mixed_are_refused_on_every_rank(ranks, order, where, words):
    """The independence check (dpgrad.checks.independence) on each rank's own batch, before DDP
    reduces anything."""
    for message in _result(ranks, "mixing_refused", order=order, where=where):
        assert words in message and "(grads untouched: True)" in message, message


def test_ranks_see_the_callers_environment_as_it_is_at_each_call(ranks, monkeypatch):
    """dpgrad.tools.ranks forks the ranks from a server process started at the first call (the
    ``ranks`` fixture's): a variable set after that call reaches the ranks of the next, each a
    new process; one removed is gone."""
    name = "DPGRAD_RANKS_TEST_VARIABLE"
    monkeypatch.setenv(name, "first")
    first = spawn(2, [("environment", dict(name=name))], "distributed_worker")
    monkeypatch.delenv(name)
    second = spawn(1, [("environment", dict(name=name))], "distributed_worker")
    assert [r[0]["value"] for r in first] == ["first", "first"] and second[0][0]["value"] is None
    pids = {r[0]["pid"] for r in first + second}
    assert len(pids) == 3 and os.getpid() not in pids
