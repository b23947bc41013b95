"""``dpgrad.opacus.DPOptimizerFastGradientClipping``: Opacus's DP optimizer for ghost clipping
with its per-parameter loops batched. Checked against Opacus's own optimizer (no noise: the
same update, step skipping included), and the noise by its statistics: independent N(0, s^2)
coordinates, fresh at every step, on every parameter."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("opacus")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from opacus.optimizers import DPOptimizerFastGradientClipping as OpacusOptimizer  # noqa: E402

from dpgrad.opacus import DPOptimizerFastGradientClipping, optimizers  # noqa: E402

BENCHMARKS = str(Path(__file__).parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
from dispatch_counts import DispatchCounts  # noqa: E402

pytestmark = pytest.mark.opacus

SHAPES = [(7, 5), (5,), (3, 4, 2), (), (11,)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _params(dtypes=(torch.float32,), device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g).to(device=device, dtype=dtypes[i % len(dtypes)]))
            for i, shape in enumerate(SHAPES)]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype) for p in params]


def _optimizer(cls, params, noise=0.0, reduction="mean", batch=4, **kwargs):
    return cls(torch.optim.SGD(params, lr=0.5), noise_multiplier=noise, max_grad_norm=1.5,
               expected_batch_size=batch, loss_reduction=reduction, **kwargs)


def _run(cls, steps, dtypes=(torch.float32,), reduction="mean", set_to_none=True, device="cpu"):
    """Parameters after ``steps``: per step, a list of clipped gradients and whether the step
    is skipped (a virtual step of a large batch)."""
    params = _params(dtypes, device)
    opt = _optimizer(cls, params, reduction=reduction)
    grads_seen = []
    for i, skip in enumerate(steps):
        for p, g in zip(params, _grads(params, seed=i)):
            p.grad = g.clone()
        opt.signal_skip_step(do_skip=skip)
        opt.step()
        grads_seen.append([None if p.grad is None else p.grad.clone() for p in params])
        opt.zero_grad(set_to_none=set_to_none)
    return [p.detach() for p in params], grads_seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("steps", [[False], [False, False], [True, False], [True, True, False, False]])
def test_without_noise_the_update_is_opacus(reduction, set_to_none, steps, device):
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    ours, ours_grads = _run(DPOptimizerFastGradientClipping, steps, dtypes, reduction, set_to_none, device)
    theirs, their_grads = _run(OpacusOptimizer, steps, dtypes, reduction, set_to_none, device)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for skipped, step_a, step_b in zip(steps, ours_grads, their_grads):
        for a, b in zip(step_a, step_b):
            if skipped:  # taken into the sum (Opacus leaves it in p.grad, where a later pass would add to it)
                assert a is None
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0)


# How the noise is added: drawn into one buffer for all parameters (a GPU's way, and a small
# model's), or on a CPU a slice at a time into a small buffer and added in place to the sums
# (a large model's; here from the first element, in slices of 97 values, whose bounds fall inside
# parameters).
NOISE_PATHS = ["one-buffer", "in-place"]


@pytest.fixture
def noise_path(request, monkeypatch):
    if request.param == "in-place":
        monkeypatch.setattr(optimizers, "IN_PLACE_NOISE_ELEMENTS", 1)
        monkeypatch.setattr(optimizers, "NOISE_SLICE", 97)
    return request.param


@pytest.mark.parametrize("noise_path", NOISE_PATHS, indirect=True)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_with_noise_the_update_is_the_noisy_sum_divided_without_a_pass_of_its_own(reduction, noise_path):
    """``p.grad = (sum + noise) / B`` under "mean": the noise is drawn divided and the sums are
    added times 1/B in the same operation, with no division of its own. With the same draws,
    two updates differ by the difference of their sums over B; under "sum", by the difference
    of the sums. One gradient is not contiguous (a transposed layout)."""
    params = _params((torch.float64,))
    batch = 4 if reduction == "mean" else 1
    updates = []
    for seed in (1, 2):
        opt = _optimizer(DPOptimizerFastGradientClipping, params, noise=1.0, reduction=reduction,
                         generator=torch.Generator().manual_seed(7))
        for p, g in zip(params, _grads(params, seed)):
            p.grad = g.t().contiguous().t() if g.dim() == 2 else g
        with DispatchCounts() as counts:
            assert opt.pre_step()
        assert not any("div" in name for name in counts.names), counts.names
        updates.append([p.grad.clone() for p in params])
        opt.zero_grad()
    for a, b, g1, g2 in zip(*updates, _grads(params, 1), _grads(params, 2)):
        torch.testing.assert_close(a - b, (g1 - g2) / batch, rtol=1e-12, atol=1e-12)


def test_a_skipped_step_keeps_its_sum_through_zero_grad_in_place():
    """The sum of a skipped step is the gradient tensor, taken out of p.grad: zero_grad's
    in-place zeroing must not reach it."""
    params = _params()
    opt = _optimizer(DPOptimizerFastGradientClipping, params, reduction="sum")
    first = _grads(params, seed=1)
    for p, g in zip(params, first):
        p.grad = g.clone()
    opt.signal_skip_step(do_skip=True)
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is None for p in params)
    for p, g in zip(params, first):
        torch.testing.assert_close(p.summed_grad, g, rtol=0, atol=0)


@pytest.mark.parametrize("noise_path", NOISE_PATHS, indirect=True)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_noise_is_independent_gaussian_on_every_coordinate(dtype, device, noise_path):
    torch.manual_seed(0)
    sizes = [(300, 200), (200,), (300, 200), (1,)]
    params = [nn.Parameter(torch.zeros(s, dtype=dtype, device=device)) for s in sizes]
    noise_multiplier, batch = 0.7, 8
    opt = _optimizer(DPOptimizerFastGradientClipping, params, noise=noise_multiplier, batch=batch)
    std = noise_multiplier * opt.max_grad_norm
    draws = []
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        draws.append([(p.grad.double() * batch) for p in params])  # "mean": p.grad = noise / B
        opt.zero_grad()
    for step in draws:
        flat = torch.cat([n.flatten() for n in step])
        n = flat.numel()
        assert abs(flat.mean().item()) < 5 * std / math.sqrt(n)
        # The sample standard deviation of n normals is within 5 of its own deviations.
        assert abs(flat.std().item() / std - 1) < 5 / math.sqrt(2 * n) + 0.01 * (dtype == torch.bfloat16)
        for piece in step[:3]:
            assert abs(piece.std().item() / std - 1) < 5 / math.sqrt(2 * piece.numel()) + 0.02
    # Two parameters of one shape, one parameter at two steps, and two slices of one
    # parameter (the in-place path's) draw independent noise.
    first = draws[0][0].flatten()
    for a, b in [(draws[0][0], draws[0][2]), (draws[0][0], draws[1][0]), (first[:97 * 300], first[97 * 300:97 * 600])]:
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(a.numel())


@pytest.mark.parametrize("noise_path", NOISE_PATHS, indirect=True)
def test_a_bound_on_the_device_scales_the_noise(noise_path):
    """Adaptive clipping's bound is a tensor (``_adjusted_noise_multiplier``): the noise's
    standard deviation is it times C over B, on both paths."""
    params = [nn.Parameter(torch.zeros(400, 300))]
    opt = _optimizer(DPOptimizerFastGradientClipping, params, noise=5.0, batch=2)
    opt._adjusted_noise_multiplier = torch.tensor(0.8)
    params[0].grad = torch.zeros_like(params[0])
    opt.step()
    n = params[0].numel()
    assert abs(params[0].grad.double().std().item() / (0.8 * 1.5 / 2) - 1) < 5 / math.sqrt(2 * n)


def test_a_parameter_without_gradient_gets_noise():
    params = _params()
    opt = _optimizer(DPOptimizerFastGradientClipping, params, noise=1.0, reduction="sum")
    for p, g in zip(params[1:], _grads(params[1:], seed=0)):
        p.grad = g
    opt.step()
    assert params[0].grad is not None and params[0].grad.shape == params[0].shape
    assert params[0].grad.abs().min() > 0
    quiet = _params()
    opt = _optimizer(DPOptimizerFastGradientClipping, quiet, noise=0.0, reduction="sum")
    opt.step()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in quiet)


def test_a_second_step_without_zero_grad_is_refused_like_opacus():
    for cls in (DPOptimizerFastGradientClipping, OpacusOptimizer):
        params = _params()
        opt = _optimizer(cls, params)
        for p, g in zip(params, _grads(params, seed=0)):
            p.grad = g
        opt.step()
        with pytest.raises(ValueError, match="zero_grad"):
            opt.step()


def test_secure_mode_draws_opacus_noise():
    """Secure mode runs Opacus's own noise code: the same generator gives the same update."""
    updates = []
    for cls in (DPOptimizerFastGradientClipping, OpacusOptimizer):
        params = _params()
        opt = _optimizer(cls, params, noise=1.0, generator=torch.Generator().manual_seed(5), secure_mode=True)
        for p, g in zip(params, _grads(params, seed=0)):
            p.grad = g
        opt.step()
        updates.append([p.grad.clone() for p in params])
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_step_dispatches_a_few_operations_and_a_view_per_parameter():
    """Opacus's noise and scaling cost about five operations per parameter (so hundreds of
    launches for a transformer); these a view per parameter and a fixed number of batched
    operations. (The wrapped optimizer's own step is the same for both, and left out.)"""
    params = [nn.Parameter(torch.zeros(3, 2)) for _ in range(40)]
    counts = {}
    for cls in (DPOptimizerFastGradientClipping, OpacusOptimizer):
        opt = _optimizer(cls, params, noise=1.0)
        for _ in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
            with DispatchCounts() as c:
                assert opt.pre_step()
            opt.zero_grad()
        counts[cls] = c
    ours, theirs = counts[DPOptimizerFastGradientClipping], counts[OpacusOptimizer]
    assert theirs.ops >= 4 * len(params)
    assert ours.ops <= len(params) + 12, ours.names
    assert ours.syncs == 0



def test_the_accountant_and_the_noise_for_a_budget_are_opacus_own():
    """``dpgrad.opacus.budget``'s RDP accountant (one step's RDP kept per sample rate and noise)
    gives Opacus's epsilon to the bit, over a history of several entries and again from what it
    kept, and so does its PRV accountant (whose domain it bounds); its noise for a budget is
    Opacus's ``get_noise_multiplier``'s, to the bit."""
    from opacus.accountants import PRVAccountant, RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    from dpgrad.opacus import budget

    history = [(1.3, 0.02, 40), (0.9, 0.05, 7), (1.3, 0.02, 3)]
    ours, theirs = budget.create_accountant("rdp"), RDPAccountant()
    assert isinstance(ours, RDPAccountant)
    for _ in range(2):  # the second time from the steps' RDP kept
        ours.history, theirs.history = list(history), list(history)
        for delta in (1e-5, 1e-3):
            assert ours.get_privacy_spent(delta=delta) == theirs.get_privacy_spent(delta=delta)
    ours.history, theirs.history = [], []
    assert ours.get_privacy_spent(delta=1e-5) == theirs.get_privacy_spent(delta=1e-5) == (0, 0)
    prv, opacus_prv = budget.create_accountant("prv"), PRVAccountant()
    assert isinstance(prv, PRVAccountant) and prv.mechanism() == "prv"
    prv.history, opacus_prv.history = list(history), list(history)
    assert prv.get_epsilon(delta=1e-5) == opacus_prv.get_epsilon(delta=1e-5)
    for epsilon, rate, steps in ((3.0, 0.01, 200), (0.5, 0.02, 50)):
        assert budget.noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=rate, steps=steps,
                                       mechanism="rdp") == get_noise_multiplier(
            target_epsilon=epsilon, target_delta=1e-5, sample_rate=rate, steps=steps, accountant="rdp")
