"""Poisson batches of a fixed physical size: ``dpgrad.batches`` and
``dpgrad.opacus.make_private(physical_batch_size=...)``.

A padded (and, where larger, split) Poisson batch must give exactly the step of the unpadded
one: the same clipped sum, the same noise, the same update, the same expected batch size and
the same accounting, in both modes, with and without splitting.
"""

from __future__ import annotations

import pytest

pytest.importorskip("opacus")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dpgrad  # noqa: E402
import dpgrad.opacus  # noqa: E402
from dpgrad.batches import FixedShapeBatches, PaddedBatchSampler  # noqa: E402
from per_sample_reference import BACKEND_PASS  # noqa: E402

pytestmark = pytest.mark.opacus

V, T, D, C, N, BATCH = 20, 5, 6, 3, 48, 8
STEPS = 4


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.embedding(ids))).mean(dim=1))


def _dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, V, (N, T), generator=g), torch.randint(0, C, (N,), generator=g))


def test_the_sampler_splits_and_pads_each_logical_batch():
    plan = []
    sampler = PaddedBatchSampler([[5, 1, 2, 9, 4, 7, 3], [], [8, 6]], 3, plan)
    assert list(sampler) == [[5, 1, 2], [9, 4, 7], [3, 3, 3], [0, 0, 0], [8, 6, 8]]
    assert plan == [(3, False), (3, False), (1, True), (0, True), (2, True)]


def _run(single: bool, physical, loss_reduction="mean"):
    """STEPS logical steps of make_private; the parameters, the last step's gradients, the
    sampled samples of each logical step, the accountant's history and the optimizer."""
    torch.manual_seed(0)  # the Poisson sampler draws from the global generator
    model = Classifier()
    engine = PrivacyEngine(accountant="rdp")
    extra = {} if physical is None else dict(physical_batch_size=physical)
    model, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(_dataset(), batch_size=BATCH), criterion=nn.CrossEntropyLoss(reduction=loss_reduction),
        noise_multiplier=1.0, max_grad_norm=0.5, loss_reduction=loss_reduction, single_backward=single,
        noise_generator=torch.Generator().manual_seed(7), **extra)
    sampled, stepped, count = [], 0, 0
    for ids, labels in loader:
        if physical is not None:
            assert ids.shape[0] == physical
        loss = criterion(model(ids), labels)
        loss.backward()
        optimizer.step()
        count += ids.shape[0] if physical is None else loader.samples
        if not optimizer._is_last_step_skipped:
            stepped += 1
            sampled.append(count)
            count = 0
            if stepped == STEPS:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                break
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, grads, sampled, engine.accountant.history, optimizer


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("physical", [3, 16], ids=["split", "padded"])
# The Triton pass takes single backward only: its norms and clipped sums both run on the
# kernels (double backward's kernels are the same norms; its sums come from autograd).
@pytest.mark.parametrize("single", [True] if BACKEND_PASS else [True, False], ids=lambda s: "single" if s else "double")
def test_a_padded_step_is_the_unpadded_step(single, physical, loss_reduction):
    ref_params, ref_grads, ref_sampled, ref_history, ref_optimizer = _run(single, None, loss_reduction)
    params, grads, sampled, history, optimizer = _run(single, physical, loss_reduction)
    assert sampled == ref_sampled and sum(sampled) > 0  # the same Poisson batches
    if physical == 3:
        assert max(sampled) > 3, "no logical batch was split"
    assert history == ref_history  # the accountant counted the same steps
    assert optimizer.expected_batch_size == ref_optimizer.expected_batch_size
    for n in ref_params:
        # The last step's p.grad is (clipped sum + noise) / expected batch size: the same noise.
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=n)


class _Optimizer:
    """What FixedShapeBatches tells the optimizer, recorded."""

    def __init__(self):
        self.signals = []

    def signal_skip_step(self, do_skip):
        self.signals.append(do_skip)


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_an_empty_poisson_batch_is_all_padding_and_adds_nothing(single):
    """An empty logical batch is one physical batch of padding: every loss weight is zero, so
    the clipped gradient is exactly zero (the optimizer then adds its noise alone)."""
    dataset = _dataset()
    loader = DataLoader(dataset, batch_sampler=[[], [4, 2]])
    optimizer = _Optimizer()
    batches = FixedShapeBatches(loader, 4, optimizer)
    torch.manual_seed(0)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(Classifier(), max_grad_norm=0.5, single_backward=single)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), batches=batches)
    seen = []
    for ids, labels in batches:
        wrapped.zero_grad(set_to_none=True)
        loss = criterion(wrapped(ids), labels)
        loss.backward()
        seen.append((ids.shape[0], batches.samples, wrapped.per_sample_gradient_norms.clone()))
        if batches.samples == 0:
            assert all(p.grad is None or not p.grad.any() for p in wrapped.parameters())
            assert loss.item() == 0.0
        else:
            assert all(p.grad is not None and p.grad.any() for p in wrapped.parameters())
    assert [(b, s) for b, s, _ in seen] == [(4, 0), (4, 2)]
    assert not seen[0][2].any() and not seen[1][2][2:].any() and seen[1][2][:2].all()  # padding's norms: 0
    assert optimizer.signals == [False, False]


def test_the_loss_reported_is_the_mean_over_the_sampled_samples():
    dataset = _dataset()
    batches = FixedShapeBatches(DataLoader(dataset, batch_sampler=[[4, 2, 9]]), 5, _Optimizer())
    torch.manual_seed(0)
    model = Classifier()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=0.5)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), batches=batches)
    ((ids, labels),) = list(batches)
    loss = criterion(wrapped(ids), labels)
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model(ids[:3]), labels[:3])
    torch.testing.assert_close(loss.detach(), expected)
    with pytest.raises(ValueError, match=r"\(3,\) losses for a physical batch of 5 samples"):
        criterion(wrapped(ids[:3]), labels[:3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(physical_batch_size=0), "physical_batch_size must be a positive integer, not 0"),
    (dict(physical_batch_size="8"), "physical_batch_size must be a positive integer"),
    (dict(physical_batch_size=4, grad_sample_mode="hooks"), "needs poisson_sampling=True and grad_sample_mode='ghost'"),
    (dict(physical_batch_size=4, poisson_sampling=False), "needs poisson_sampling=True"),
])
def test_make_private_refuses_what_it_cannot_pad(kwargs, match):
    model = Classifier()
    with pytest.raises(ValueError, match=match):
        dpgrad.opacus.make_private(PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   data_loader=DataLoader(_dataset(), batch_size=BATCH), noise_multiplier=1.0,
                                   max_grad_norm=1.0, **kwargs)
