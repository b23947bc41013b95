"""Adaptive clipping (``dpgrad.clipping.adaptive``), a drop-in for Opacus 1.6's: against Opacus's own
classes on the same batches, the count's noise drawn alike (the global generator seeded alike
before each step), step by step: the bound, the adjusted noise multiplier and the parameters
(without gradient noise; with it, from generators of their own, the bounds); both modes; the
expected batch size instead of the drawn one, against the rule written out in float64; no host
sync added to a step; the accountant's noise multiplier unchanged; refusals."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import dpgrad
import dpgrad.opacus
from per_sample_reference import assert_tensor_close

opacus = pytest.importorskip("opacus")
from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping as OpacusAdaptiveEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dispatch_counts import DispatchCounts  # noqa: E402

B, STEPS = 24, 6
ADAPTIVE = dict(target_unclipped_quantile=0.3, min_clipbound=0.05, max_clipbound=100.0, clipbound_learning_rate=0.5)


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n: int = B * STEPS):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


@pytest.fixture(autouse=True)
def _opacus_per_sample_losses(monkeypatch):
    """Opacus 1.6's DPLossFastGradientAdaptiveClipping.__call__ calls the criterion without
    setting its reduction to "none" (its base class does), so with a mean- or sum-reduced
    criterion its losses are one scalar and its step is ``(sum_b c_b) * mean gradient``: no
    sample is clipped (``test_opacus_1_6_adaptive_loss_clips_no_sample`` shows it). Compared here
    with that call fixed as its base class has it."""
    from opacus.utils.adaptive_clipping import adaptive_clipping_utils as module
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping as Base

    original = module.DPLossFastGradientAdaptiveClipping.__call__

    def per_sample(self, *args, **kwargs):
        plain = Base.__call__(self, *args, **kwargs)  # the criterion with reduction "none"
        return module.DPTensorFastGradientAdaptiveClipping(
            self.module, self.optimizer, plain.loss_per_sample, self.loss_reduction, self.target_unclipped_quantile,
            self.min_clipbound, self.max_clipbound, self.clipbound_learning_rate, self.initial_noise_multiplier)

    monkeypatch.setattr(module.DPLossFastGradientAdaptiveClipping, "__call__", per_sample)
    yield original


def test_opacus_1_6_adaptive_loss_clips_no_sample(_opacus_per_sample_losses):
    """What the fix above is for: Opacus 1.6's own call, on its own wrapper and engine, leaves
    p.grad = (sum_b c_b) * (mean gradient) instead of sum_b c_b g_b (float64 reference)."""
    from opacus.utils.adaptive_clipping import adaptive_clipping_utils as module
    from per_sample_reference import per_sample_grads

    module.DPLossFastGradientAdaptiveClipping.__call__ = _opacus_per_sample_losses  # Opacus's own, for this test
    model = net()
    x, y = next(iter(DataLoader(data(), batch_size=B)))
    ref = per_sample_grads(net(), x, y, lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"))
    wrapped, optimizer, criterion, _ = OpacusAdaptiveEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data(), batch_size=B), noise_multiplier=0.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode="ghost", **ADAPTIVE)
    torch.manual_seed(100)
    criterion(wrapped(x), y).backward()
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    coef = (float(wrapped.max_grad_norm) / norms).clamp(max=1.0)
    assert (coef < 1).any()
    for (n, g), p in zip(ref.items(), model.parameters()):
        assert_tensor_close(p.grad, coef.sum() * g.mean(0), f"Opacus's {n}.grad")
        assert not torch.allclose(p.grad.double(), torch.einsum("b,b...->...", coef, g), rtol=1e-3)


def train(kind: str, noise: float, single: bool = True, generator_seed=None, poisson: bool = False, **extra):
    """STEPS steps; returns the bounds, the adjusted noise multipliers and the parameters after
    each step, and the engine."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(data(), batch_size=B)
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    common = dict(module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=loader,
                  noise_multiplier=noise, max_grad_norm=1.0, poisson_sampling=poisson, grad_sample_mode="ghost",
                  noise_generator=generator, **ADAPTIVE, **extra)
    if kind == "opacus":
        engine = OpacusAdaptiveEngine(accountant="rdp")
        module, optimizer, criterion, loader = engine.make_private(**common)
    else:
        engine = dpgrad.opacus.PrivacyEngineAdaptiveClipping(accountant="rdp")
        module, optimizer, criterion, loader = engine.make_private(**common, single_backward=single)
    bounds, sigmas, params = [], [], []
    for step, (x, y) in enumerate(loader):
        torch.manual_seed(100 + step)  # the count's noise, drawn alike
        optimizer.zero_grad()
        criterion(module(x), y).backward()
        optimizer.step()
        bounds.append(float(module.max_grad_norm))
        sigmas.append(float(optimizer._adjusted_noise_multiplier))
        params.append([p.detach().clone() for p in model.parameters()])
    return bounds, sigmas, params, engine, module, optimizer


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_exact_against_opacus_step_by_step_without_gradient_noise(single):
    ours = train("dpgrad", 0.0, single)
    theirs = train("opacus", 0.0)
    assert len(ours[0]) == STEPS and len(set(ours[0])) == STEPS  # the bound moved every step
    assert ours[0] == pytest.approx(theirs[0], rel=1e-6)
    assert ours[1] == theirs[1] == [0.0] * STEPS
    for step, (mine, opacus_params) in enumerate(zip(ours[2], theirs[2])):
        for a, b in zip(mine, opacus_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_bounds_and_noise_match_opacus_with_gradient_noise(single):
    """With noise (each from a generator of its own: the global one draws the count's noise
    alone), Opacus's model set to dpgrad's before each step: the same bound and adjusted noise
    multiplier at every step, the noise of the size they give, and the accountant counting the
    initial noise multiplier in both."""
    def engine_of(kind):
        model = net()
        common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                      criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data(), batch_size=B),
                      noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="ghost",
                      noise_generator=torch.Generator().manual_seed(7), **ADAPTIVE)
        if kind == "opacus":
            engine = OpacusAdaptiveEngine(accountant="rdp")
            return (model, engine) + tuple(engine.make_private(**common))
        engine = dpgrad.opacus.PrivacyEngineAdaptiveClipping(accountant="rdp")
        return (model, engine) + tuple(engine.make_private(**common, single_backward=single))

    ours, theirs = engine_of("dpgrad"), engine_of("opacus")
    want = (1.0 - (2 * B / 20) ** -2) ** -0.5
    differences = []
    for step, ((x, y), _) in enumerate(zip(ours[5], range(STEPS))):
        theirs[0].load_state_dict(ours[0].state_dict())
        before = [p.detach().clone() for p in ours[0].parameters()]
        for model, engine, module, optimizer, criterion, _ in (ours, theirs):
            torch.manual_seed(100 + step)  # the count's noise, drawn alike
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
        bound = float(ours[2].max_grad_norm)
        assert bound == pytest.approx(theirs[2].max_grad_norm, rel=1e-6), step
        assert ours[3]._adjusted_noise_multiplier == pytest.approx(theirs[3]._adjusted_noise_multiplier) == \
            pytest.approx(want)
        # The update's departure from the noise-free clipped step is the noise: std sigma * C / B.
        differences.append(torch.cat([((a - p0) - (b - p0)).flatten() for a, b, p0 in
                                      zip(ours[0].parameters(), theirs[0].parameters(), before)]) / (want * bound))
    spread = torch.cat(differences).std().item() * B / 2 ** 0.5  # two independent noises
    assert spread == pytest.approx(1.0, rel=0.1)
    assert ours[1].get_epsilon(1e-5) == pytest.approx(theirs[1].get_epsilon(1e-5))
    assert [h[0] for h in ours[1].accountant.history] == [1.0]


def test_the_expected_batch_size_replaces_the_drawn_one():
    """public_batch_size=True under Poisson sampling: the noise multiplier (and the count's
    noise and fraction, see the rule's test) use the expected batch size, the same every step;
    with the drawn size it changes with each batch."""
    _, public, *_ = train("dpgrad", 1.0, generator_seed=3, poisson=True, public_batch_size=True)
    _, drawn, *_ = train("dpgrad", 1.0, generator_seed=3, poisson=True)
    assert public == pytest.approx([(1.0 - (2 * B / 20) ** -2) ** -0.5] * len(public))
    assert len(set(drawn)) > 1


def test_the_update_rule_in_float64():
    """AdaptiveBound.update against the rule written out: count, noise, fraction, clamp."""
    from dpgrad.clipping.adaptive import AdaptiveBound

    rule = AdaptiveBound(0.3, 0.05, 10.0, 0.5, 1.0, expected_batch_size=None)
    norms = torch.tensor([0.1, 0.5, 0.9, 1.5, 2.0, 3.0] * 4)
    torch.manual_seed(5)
    bound, sigma = rule.update(norms, 1.0)
    torch.manual_seed(5)
    noise = torch.normal(mean=0.0, std=24 / 20, size=(1,)).double().item()
    want = 1.0 * math.exp(-0.5 * ((12 + noise) / 24 - 0.3))
    assert bound.shape == () and float(bound) == pytest.approx(min(max(want, 0.05), 10.0), rel=1e-6)
    assert sigma == pytest.approx((1.0 - (2 * 24 / 20) ** -2) ** -0.5)
    rule = AdaptiveBound(0.3, 0.05, 10.0, 0.5, 1.0, expected_batch_size=50)
    torch.manual_seed(5)
    bound, sigma = rule.update(norms, 1.0)
    torch.manual_seed(5)
    noise = torch.normal(mean=0.0, std=50 / 20, size=(1,)).double().item()
    assert float(bound) == pytest.approx(math.exp(-0.5 * ((12 + noise) / 50 - 0.3)), rel=1e-6)
    assert sigma == pytest.approx((1.0 - (2 * 50 / 20) ** -2) ** -0.5)


def test_no_host_sync_is_added_to_a_step():
    """A step with adaptive clipping waits for the device as often as one with a fixed bound
    (the count, its noise and the bound stay tensors)."""
    counts = {}
    for kind in ("flat", "adaptive"):
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        kw = dict(module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(
            data(), batch_size=B), noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
            single_backward=True, check_independence=False)
        if kind == "adaptive":
            engine = dpgrad.opacus.PrivacyEngineAdaptiveClipping(accountant="rdp")
            module, optimizer, criterion, loader = engine.make_private(**kw, **ADAPTIVE)
        else:
            module, optimizer, criterion, loader = dpgrad.opacus.make_private(opacus.PrivacyEngine(), **kw)
        batches = iter(loader)

        def step():
            x, y = next(batches)
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()

        step(), step()  # warm-up
        with DispatchCounts() as c:
            step()
        counts[kind] = c.syncs
    assert counts["adaptive"] == counts["flat"], counts


def test_make_private_clipping_adaptive_with_a_plain_engine():
    """make_private(clipping="adaptive", target_unclipped_quantile=...) with Opacus's plain
    engine: the adaptive loss, as with the adaptive engine."""
    model = net()
    module, optimizer, criterion, loader = dpgrad.opacus.make_private(
        opacus.PrivacyEngine(accountant="rdp"), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data(), batch_size=B), noise_multiplier=0.0,
        max_grad_norm=1.0, poisson_sampling=False, clipping="adaptive", **ADAPTIVE)
    assert isinstance(criterion, dpgrad.DPLossFastGradientAdaptiveClipping)
    x, y = next(iter(loader))
    torch.manual_seed(100)
    criterion(module(x), y).backward()
    optimizer.step()
    assert float(module.max_grad_norm) != 1.0 and float(optimizer.max_grad_norm) == float(module.max_grad_norm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_unclipped_quantile=1.5), "target_unclipped_quantile must be"),
    (dict(min_clipbound=0.0), "min_clipbound must be"),
    (dict(min_clipbound=2.0, max_clipbound=1.0), "max_clipbound must be"),
    (dict(clipbound_learning_rate=float("nan")), "clipbound_learning_rate must be"),
    (dict(min_clipbound=2.0), r"initial max_grad_norm 1.0 is outside \[min_clipbound, max_clipbound\]"),
    (dict(noise_multiplier=3.0, batch=24), "needs a batch larger than 10 \\* noise_multiplier = 30"),
])
def test_refusals(kwargs, match):
    kwargs = dict(kwargs)
    noise = kwargs.pop("noise_multiplier", 0.0)
    batch = kwargs.pop("batch", None)
    settings = {**ADAPTIVE, **kwargs}
    model = net()
    engine = dpgrad.opacus.PrivacyEngineAdaptiveClipping(accountant="rdp")
    with pytest.raises(ValueError, match=match):
        module, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(data(), batch_size=batch or B), noise_multiplier=noise, max_grad_norm=1.0,
            poisson_sampling=False, **settings)
        x, y = next(iter(loader))
        criterion(module(x), y).backward()


def test_accumulating_a_second_backward_is_refused():
    """Each step's count is paid for once: a second backward before the optimizer steps is
    refused, p.grad left as the first made it."""
    model = net()
    engine = dpgrad.opacus.PrivacyEngineAdaptiveClipping(accountant="rdp")
    module, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data(), batch_size=B), noise_multiplier=0.0, max_grad_norm=1.0,
        poisson_sampling=False, **ADAPTIVE)
    x, y = next(iter(loader))
    criterion(module(x), y).backward()
    first = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="adaptive clipping counts the unclipped samples once per step"):
        criterion(module(x), y).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))
