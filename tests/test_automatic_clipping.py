"""Automatic clipping (Bu et al. 2022, "Automatic Clipping: Differentially Private Deep Learning
Made Easier and Stronger"; fastDP's default): each sample's gradient (of its group) scaled by
``c_b = C / (norm_b + gamma)`` instead of clipped by ``min(1, C / (norm_b + 1e-6))``.

Against the float64 per-sample reference: the clipped sum, flat and per layer and per group,
both modes, both loss reductions, accumulation, a batch of one, Opacus's loss wrapper (through
``get_clipping_coef``) and ``make_private``; every sample's contribution strictly below its
bound, so the noise and the accountant are those of clipping at C. The Makefile runs this
module on both backends."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import dpgrad
import dpgrad.opacus
from mixed_net import NetConfig, build, clipped_from_norms, make_batch, per_sample_loss
from per_sample_reference import assert_norms_close, assert_tensor_close, per_sample_grads

MODES = ["single", "double"]
LAYER_RULE = staticmethod(lambda name: name.split(".")[0])


@pytest.fixture(autouse=True)
def _ghost():
    with clipped_from_norms():
        yield


def median_norms(model, batch, group_of, G):
    """Each group's median per-sample norm on ``batch``: bounds that scale samples both ways."""
    ref = per_sample_grads(model, *batch, per_sample_loss)
    squares = torch.zeros(G, batch[0].shape[0], dtype=torch.float64)
    for n, g in ref.items():
        squares[group_of(n)] += g.flatten(1).square().sum(1)
    return [float(v) for v in squares.sqrt().median(dim=1).values]


def reference_step(model, batches, bounds, group_of, gamma):
    """The float64 automatically clipped sum of ``batches`` (accumulated), each group's
    contributions checked below its bound; returns {name: sum} and {name: scale}."""
    expected, scale = {}, {}
    for x, y in batches:
        ref = per_sample_grads(model, x, y, per_sample_loss)
        G = len(bounds)
        squares = torch.zeros(G, x.shape[0], dtype=torch.float64)
        for n, g in ref.items():
            squares[group_of(n)] += g.flatten(1).square().sum(1)
        norms = squares.sqrt()
        coef = torch.tensor(bounds, dtype=torch.float64)[:, None] / (norms + gamma)
        assert (coef * norms < torch.tensor(bounds, dtype=torch.float64)[:, None]).all()  # below each bound
        assert (coef > 1).any() and (coef < 1).any()  # samples scaled up and down, unlike clipping
        for n, g in ref.items():
            c = coef[group_of(n)]
            expected[n] = expected.get(n, 0) + torch.einsum("b,b...->...", c, g)
            scale[n] = scale.get(n, 0.0) + (c[:, None] * g.flatten(1).abs()).sum(0).max().item()
    return expected, scale


def assert_step(wrapped, expected, scale, what):
    for n, p in wrapped._module.named_parameters():
        assert_tensor_close(p.grad, torch.zeros_like(p, dtype=torch.float64) + expected[n], f"{n}.grad ({what})",
                            scale[n])


def criterion(wrapped, loss_reduction):
    return dpgrad.DPLossFastGradientClipping(wrapped, SimpleNamespace(loss_reduction=loss_reduction),
                                             nn.CrossEntropyLoss(reduction=loss_reduction), loss_reduction)


@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
@pytest.mark.parametrize("clipping", ["automatic", "automatic_per_layer", "automatic_groups"])
@pytest.mark.parametrize("mode", MODES)
def test_automatic_clipping_is_the_scaled_sum(mode, clipping, loss_reduction):
    cfg = NetConfig()
    model = build(cfg, seed=4)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    batches = [make_batch(cfg, B=5, T=3, seed=20), make_batch(cfg, B=3, T=3, seed=21)]  # accumulated
    gamma = 0.05
    if clipping == "automatic":
        G, group_of, groups = 1, (lambda n: 0), None
    elif clipping == "automatic_per_layer":
        G, group_of, groups = len(names), names.index, None
    else:
        labels = list(dict.fromkeys(n.split(".")[0] for n in names))
        G, group_of, groups = len(labels), (lambda n: labels.index(n.split(".")[0])), LAYER_RULE
    bounds = median_norms(model, batches[0], group_of, G)
    expected, scale = reference_step(model, batches, bounds, group_of, gamma)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        copy.deepcopy(model), loss_reduction=loss_reduction, single_backward=mode == "single", clipping=clipping,
        max_grad_norm=bounds[0] if clipping == "automatic" else bounds, clipping_groups=groups,
        automatic_gamma=gamma)
    assert wrapped.max_grad_norm == pytest.approx(sum(b * b for b in bounds) ** 0.5)
    loss_fn = criterion(wrapped, loss_reduction)
    for x, y in batches:
        loss_fn(wrapped(x), y).backward()
    # Either reduction leaves p.grad the clipped sum of the samples' own losses' gradients
    # (Opacus's protocol; the optimizer divides by the expected batch size).
    assert_step(wrapped, expected, scale, f"{clipping}, {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [1, 6])
def test_automatic_clipping_with_mean_reduction_and_a_batch_of_one(mode, B):
    """The mean reduction (p.grad the clipped sum, as Opacus's protocol leaves it), with the
    per-sample norms, and a batch of one, clipped from its plain gradient."""
    cfg = NetConfig()
    model = build(cfg, seed=5)
    x, y = make_batch(cfg, B=B, T=3, seed=22)
    ref = per_sample_grads(model, x, y, per_sample_loss)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    C = float(norms.median())
    coef = C / (norms + 0.01)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="mean",
                                                          single_backward=mode == "single", clipping="automatic",
                                                          max_grad_norm=C)
    criterion(wrapped, "mean")(wrapped(x), y).backward()
    assert_norms_close(wrapped.per_sample_gradient_norms, norms, "norms")
    for n, p in wrapped._module.named_parameters():
        want = torch.einsum("b,b...->...", coef, ref[n])
        assert_tensor_close(p.grad, want, f"{n}.grad", (coef[:, None] * ref[n].flatten(1).abs()).sum(0).max())


def test_opacus_loss_wrapper_takes_the_automatic_coefficients():
    """Opacus's own DPLossFastGradientClipping (two passes, its coefficients from
    get_clipping_coef) gives the same step as dpgrad's."""
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping as OpacusLoss

    cfg = NetConfig()
    model = build(cfg, seed=6)
    x, y = make_batch(cfg, B=5, T=3, seed=23)
    steps = []
    for loss_class in (OpacusLoss, dpgrad.DPLossFastGradientClipping):
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="sum",
                                                              clipping="automatic", max_grad_norm=3.0)
        loss_class(wrapped, SimpleNamespace(loss_reduction="sum", zero_grad=wrapped.zero_grad),
                   nn.CrossEntropyLoss(reduction="sum"), "sum")(wrapped(x), y).backward()
        coef = wrapped.get_clipping_coef()
        assert torch.allclose(coef, 3.0 / (wrapped.per_sample_gradient_norms + 0.01))
        steps.append([p.grad.clone() for p in wrapped.parameters()])
    for a, b in zip(*steps):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clipping", ["automatic", "automatic_per_layer"])
@pytest.mark.parametrize("mode", MODES)
def test_make_private_automatic_clipping(mode, clipping):
    """make_private(clipping="automatic" | "automatic_per_layer"): the step is the scaled sum over
    the expected batch size (noise 0); the optimizer's noise is scaled to the bound (the total
    per layer)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    cfg = NetConfig()
    model = build(cfg, seed=7)
    start = copy.deepcopy(model)
    x, y = make_batch(cfg, B=6, T=3, seed=24)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    group_of = (lambda n: 0) if clipping == "automatic" else names.index
    bounds = median_norms(model, (x, y), group_of, 1 if clipping == "automatic" else len(names))
    expected, _ = reference_step(model, [(x, y)], bounds, group_of, 0.02)
    wrapped, optimizer, loss, _ = dpgrad.opacus.make_private(
        PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.0,
        max_grad_norm=bounds[0] if clipping == "automatic" else bounds, clipping=clipping, automatic_gamma=0.02,
        poisson_sampling=False, single_backward=mode == "single", criterion=nn.CrossEntropyLoss())
    assert optimizer.max_grad_norm == pytest.approx(sum(b * b for b in bounds) ** 0.5)
    optimizer.zero_grad()
    loss(wrapped(x), y).backward()
    optimizer.step()
    before = dict(start.named_parameters())
    for n, p in model.named_parameters():
        assert_tensor_close(p.detach(), before[n].detach().double() - expected[n] / 6, f"{n} after the step")


@pytest.mark.parametrize("kwargs, match", [
    (dict(clipping="automatic", automatic_gamma=0.0), "automatic_gamma must be a finite number > 0"),
    (dict(clipping="automatic", automatic_gamma=float("nan")), "automatic_gamma must be a finite number > 0"),
    (dict(clipping="flat", automatic_gamma=0.01), "automatic_gamma is for automatic clipping"),
    (dict(clipping="automatic", max_grad_norm=[1.0]), "flat clipping takes one max_grad_norm"),
    (dict(clipping="automatic_groups"), "clipping_groups needs clipping='groups'|needs clipping_groups"),
    (dict(clipping="auto"), "clipping='auto': use one of flat, per_layer, groups, automatic"),
])
def test_wrapper_refusals(kwargs, match):
    args = dict(max_grad_norm=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dpgrad.GradSampleModuleFastGradientClipping(nn.Linear(3, 2), **args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clipping="automatic", grad_sample_mode="hooks"), "needs grad_sample_mode='ghost'"),
    (dict(automatic_gamma=0.1), "automatic_gamma is for automatic clipping"),
    (dict(clipping="automatic", automatic_gamma=-1.0), "automatic_gamma must be a finite number > 0"),
    (dict(clipping="automatic_per_layer"), "one max_grad_norm per trainable parameter"),
])
def test_make_private_refusals(kwargs, match):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=match):
        dpgrad.opacus.make_private(
            PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=2), noise_multiplier=1.0,
            max_grad_norm=1.0, **kwargs)
