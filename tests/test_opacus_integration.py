"""dpgrad with a real Opacus PrivacyEngine: ``dpgrad.opacus.make_private`` and
``dpgrad.opacus.register_with_opacus``, end to end on a small synthetic task."""

from __future__ import annotations

import copy
import warnings

import pytest

pytest.importorskip("opacus")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from opacus.data_loader import DPDataLoader  # noqa: E402
from opacus.grad_sample import GradSampleModule as OpacusGradSampleModule  # noqa: E402
from opacus.grad_sample import (  # noqa: E402
    GradSampleModuleFastGradientClipping as OpacusGradSampleModuleFastGradientClipping,
)
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import (  # noqa: E402
    DPLossFastGradientClipping as OpacusDPLossFastGradientClipping,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dpgrad  # noqa: E402
import dpgrad.opacus  # noqa: E402

pytestmark = pytest.mark.opacus

V, T, D, C, N, BATCH = 20, 6, 8, 3, 64, 8


class TinyTextClassifier(nn.Module):
    """Embedding -> Linear over tokens -> LayerNorm -> mean over tokens -> Linear head."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.embedding = nn.Embedding(V, D, padding_idx=padding_idx)
        self.proj = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.norm(torch.tanh(self.proj(self.embedding(ids))))  # [B, T, D]
        return self.head(h.mean(dim=1))  # [B, C]


def _dataset(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (N, T), generator=g)
    labels = torch.randint(0, C, (N,), generator=g)
    return TensorDataset(ids, labels)


def _model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TinyTextClassifier(**kwargs)


def _train(model, optimizer, criterion, loader, steps):
    taken = 0
    for ids, labels in loader:
        optimizer.zero_grad()
        loss = criterion(model(ids), labels)
        loss.backward()
        optimizer.step()
        taken += 1
        if taken == steps:
            break
    return taken


# ---------------------------------------------------------------------- make_private
# grad_sample_mode, and single_backward under "ghost".
MODES = {"ghost": ("ghost", False), "ghost-single": ("ghost", True), "hooks": ("hooks", False)}


def _make_private(engine, model, mode, **kwargs):
    grad_sample_mode, single = MODES[mode]
    extra = dict(single_backward=True) if single else {}
    return dpgrad.opacus.make_private(
        engine,
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=kwargs.pop("lr", 0.1)),
        criterion=nn.CrossEntropyLoss(),
        grad_sample_mode=grad_sample_mode,
        **extra,
        **kwargs,
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_make_private_trains_and_accounts(mode):
    torch.manual_seed(0)  # Poisson sampling draws from the global generator
    engine = PrivacyEngine(accountant="rdp")
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    out = _make_private(engine, model, mode, data_loader=DataLoader(_dataset(), batch_size=BATCH),
                        noise_multiplier=1.0, max_grad_norm=1.0)
    if mode.startswith("ghost"):
        module, optimizer, criterion, loader = out
        assert type(module) is dpgrad.GradSampleModuleFastGradientClipping
        assert module.single_backward == (mode == "ghost-single")
        # Opacus's optimizer, its per-parameter loops batched.
        assert type(optimizer) is dpgrad.opacus.DPOptimizerFastGradientClipping
        assert isinstance(optimizer, DPOptimizerFastGradientClipping)
        assert isinstance(criterion, dpgrad.DPLossFastGradientClipping)
        assert module.max_grad_norm == 1.0
    else:
        module, optimizer, loader = out
        assert type(module) is dpgrad.GradSampleModule
        assert isinstance(optimizer, DPOptimizer)
        assert not isinstance(optimizer, DPOptimizerFastGradientClipping)
        criterion = nn.CrossEntropyLoss()
    assert isinstance(loader, DPDataLoader)
    assert not module.grad_accumulation_allowed  # Poisson sampling forbids it

    steps = _train(module, optimizer, criterion, loader, steps=3)

    assert steps == 3
    assert sum(n for _, _, n in engine.accountant.history) == steps
    eps = engine.get_epsilon(delta=1e-5)
    assert 0 < eps < float("inf")
    after = list(module.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.isfinite(p).all() for p in after)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_step_matches_opacus_ghost_clipping(mode):
    """No noise, no Poisson sampling: dpgrad's update equals Opacus's own ghost clipping."""
    max_grad_norm = 0.05  # small enough that every sample is clipped, by its own factor
    dataset = _dataset()
    reference_model = _model()
    model = copy.deepcopy(reference_model)

    def loader():
        return DataLoader(dataset, batch_size=BATCH, shuffle=False)

    theirs = PrivacyEngine(accountant="rdp").make_private(
        module=reference_model,
        optimizer=torch.optim.SGD(reference_model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader(),
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        poisson_sampling=False,
        grad_sample_mode="ghost",
    )
    assert type(theirs[0]) is OpacusGradSampleModuleFastGradientClipping
    ours = _make_private(PrivacyEngine(accountant="rdp"), model, mode, lr=1.0, data_loader=loader(),
                         noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False)
    if mode == "hooks":
        ours = (ours[0], ours[1], nn.CrossEntropyLoss(), ours[2])

    for module, optimizer, criterion, data in (theirs, ours):
        start = [p.detach().clone() for p in module.parameters()]
        assert _train(module, optimizer, criterion, data, steps=1) == 1
        module.update = [p.detach() - s for p, s in zip(module.parameters(), start)]

    if mode.startswith("ghost"):
        norms = ours[0].per_sample_gradient_norms
        assert (norms > max_grad_norm).all(), "the test should exercise clipping"
    for name, (u_ours, u_theirs) in zip(
        [n for n, _ in model.named_parameters()], zip(ours[0].update, theirs[0].update)
    ):
        assert u_theirs.abs().max() > 0, name
        torch.testing.assert_close(u_ours, u_theirs, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


BUDGET = (4.0, 1e-3, 2)  # target_epsilon, target_delta, epochs


def _opacus_noise_for_the_budget(accountant):
    """Opacus's own make_private_with_epsilon for BUDGET on the model and loader below: its noise
    multiplier."""
    target_epsilon, target_delta, epochs = BUDGET
    torch.manual_seed(0)
    model = _model()
    return PrivacyEngine(accountant=accountant).make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(_dataset(), batch_size=BATCH), target_epsilon=target_epsilon,
        target_delta=target_delta, epochs=epochs, max_grad_norm=1.0, grad_sample_mode="ghost")[1].noise_multiplier


# Each accountant and each mode once: the accountant's search and the mode's wrapper meet only
# in the steps counted, which the two cases count in both modes.
@pytest.mark.parametrize("mode, accountant", [("ghost", "rdp"), ("ghost-single", "prv")])
def test_make_private_with_epsilon_reaches_the_budget(mode, accountant):
    """The noise multiplier is Opacus's own for the budget (its make_private_with_epsilon on the
    same model and loader), and epochs * len(loader) steps spend the budget to within the
    tolerance of the search, from below."""
    target_epsilon, target_delta, epochs = BUDGET
    theirs_noise = _opacus_noise_for_the_budget(accountant)

    torch.manual_seed(0)
    engine = PrivacyEngine(accountant=accountant)
    model = _model()
    grad_sample_mode, single = MODES[mode]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module, optimizer, criterion, loader = dpgrad.opacus.make_private_with_epsilon(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(_dataset(), batch_size=BATCH),
            target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, max_grad_norm=1.0,
            grad_sample_mode=grad_sample_mode, single_backward=single)
    # RDP's warning about its orders is about PRV's inner bound under PRV: left out there only.
    if accountant == "prv":
        assert not [w for w in seen if "largest alpha" in str(w.message)]
    assert type(module) is dpgrad.GradSampleModuleFastGradientClipping and module.single_backward == single
    assert optimizer.noise_multiplier == theirs_noise > 0

    steps = sum(_train(module, optimizer, criterion, loader, steps=len(loader)) for _ in range(epochs))
    assert steps == epochs * len(loader)
    spent = engine.get_epsilon(target_delta)
    assert target_epsilon - 0.05 <= spent <= target_epsilon * 1.001, spent


def test_make_private_with_epsilon_checks_the_budget():
    # The RDP accountant: the checks come before the noise's search, which PRV makes slower
    # (the search under PRV is the test above's).
    def call(engine=None, **kwargs):
        settings = dict(target_epsilon=2.0, target_delta=1e-3, epochs=1) | kwargs
        model = _model()
        return dpgrad.opacus.make_private_with_epsilon(
            engine or PrivacyEngine(accountant="rdp"), module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=BATCH), max_grad_norm=1.0, **settings)

    for bad in (dict(epochs=0), dict(epochs=1.5), dict(target_epsilon=0.0), dict(target_delta=1.0)):
        with pytest.raises(ValueError, match="epochs|budget"):
            call(**bad)
    with pytest.warns(UserWarning, match=r"at least 1/N for N=64 samples.*N\^-1.1 = 0.01"):
        call(target_delta=1 / 64)
    engine = PrivacyEngine(accountant="rdp")
    engine.accountant.history.append((1.0, 0.1, 3))
    with pytest.warns(UserWarning, match="budget already spent"):
        call(engine)


def test_make_private_default_criterion_follows_loss_reduction():
    model = _model()
    _, _, criterion, _ = dpgrad.opacus.make_private(
        PrivacyEngine(accountant="rdp"),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=BATCH),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        loss_reduction="sum",
    )
    assert isinstance(criterion.criterion, nn.CrossEntropyLoss)
    assert criterion.loss_reduction == criterion.criterion.reduction == "sum"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clipping="per_layer"), "clipping='per_layer' takes one max_grad_norm per trainable parameter of the optimizer"),
        (dict(clipping="median"), "clipping='median' is not supported"),
        (dict(max_grad_norm=[1.0, 1.0]), "one max_grad_norm"),
        (dict(grad_sample_mode="ew"), "not supported"),
        (dict(grad_sample_mode="hooks", single_backward=True), "needs grad_sample_mode='ghost'"),
        (dict(grad_sample_mode="ghost_fsdp"), "for a model sharded by FSDP2"),
        (dict(max_grad_norm=-1.0), "max_grad_norm must be a finite positive number"),
        (dict(max_grad_norm=float("nan")), "max_grad_norm must be a finite positive number"),
        (dict(max_grad_norm=float("inf"), grad_sample_mode="hooks"), "max_grad_norm must be a finite positive"),
        (dict(max_grad_norm=0), "max_grad_norm must be a finite positive number"),
    ],
)
def test_make_private_refuses_what_it_does_not_support(kwargs, match):
    model = _model()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=BATCH),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dpgrad.opacus.make_private(PrivacyEngine(accountant="rdp"), **args)
    assert not any(m._forward_hooks for m in model.modules())  # refused before the model was touched


def test_make_private_refuses_foreign_optimizer_parameters():
    model = _model()
    with pytest.raises(ValueError, match="not a parameter of the module"):
        dpgrad.opacus.make_private(
            PrivacyEngine(accountant="rdp"),
            module=model,
            optimizer=torch.optim.SGD(_model(seed=1).parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


# ---------------------------------------------------------------------- register_with_opacus
def _reference_per_sample_grads(model, ids, labels):
    """Per-sample gradients of each sample's own loss, by a loop over samples."""
    grads = {name: [] for name, _ in model.named_parameters()}
    for i in range(len(ids)):
        model.zero_grad()
        nn.functional.cross_entropy(model(ids[i : i + 1]), labels[i : i + 1]).backward()
        for name, p in model.named_parameters():
            grads[name].append(p.grad.detach().clone())
    return {name: torch.stack(g) for name, g in grads.items()}


def _padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (BATCH, T), generator=g)
    ids[:, T // 2 :] = 0  # every sample ends in padding
    ids[0, 1] = 0
    labels = torch.randint(0, C, (BATCH,), generator=g)
    return ids, labels


def _opacus_grad_samples(model, ids, labels):
    gsm = OpacusGradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    nn.functional.cross_entropy(gsm(ids), labels).backward()
    return {name: p.grad_sample for name, p in gsm._module.named_parameters()}


def test_register_with_opacus_swaps_and_restores_samplers():
    opacus_grad = dict(OpacusGradSampleModule.GRAD_SAMPLERS)
    opacus_norm = dict(OpacusGradSampleModuleFastGradientClipping.NORM_SAMPLERS)

    registration = dpgrad.opacus.register_with_opacus()
    try:
        assert registration.active
        for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm):
            # One dict serves both Opacus wrappers.
            assert OpacusGradSampleModule.GRAD_SAMPLERS[cls] is dpgrad.GRAD_SAMPLERS[cls]
            assert OpacusGradSampleModuleFastGradientClipping.GRAD_SAMPLERS[cls] is dpgrad.GRAD_SAMPLERS[cls]
            assert registration.replaced[("GRAD_SAMPLERS", cls)] is opacus_grad[cls]
        for cls in (nn.Linear, nn.Embedding):
            assert OpacusGradSampleModuleFastGradientClipping.NORM_SAMPLERS[cls] is dpgrad.NORM_SAMPLERS[cls]
            assert registration.replaced[("NORM_SAMPLERS", cls)] is opacus_norm[cls]
        assert nn.Conv2d not in {cls for _, cls in registration.replaced}  # others untouched
    finally:
        registration.unregister()
    registration.unregister()  # idempotent

    assert not registration.active
    assert OpacusGradSampleModule.GRAD_SAMPLERS == opacus_grad
    assert all(OpacusGradSampleModule.GRAD_SAMPLERS[c] is f for c, f in opacus_grad.items())
    assert OpacusGradSampleModuleFastGradientClipping.NORM_SAMPLERS == opacus_norm


def test_register_with_opacus_fixes_embedding_padding_idx_under_opacus_wrapper():
    model = _model(padding_idx=0).double()
    ids, labels = _padded_batch()
    expected = _reference_per_sample_grads(copy.deepcopy(model), ids, labels)
    assert expected["embedding.weight"][:, 0].abs().max() == 0  # PyTorch: no grad for padding

    # Opacus's own sampler puts the padding positions' gradients into row 0; this is what
    # makes the check below meaningful.
    before = _opacus_grad_samples(model, ids, labels)
    assert before["embedding.weight"][:, 0].abs().max() > 0

    with dpgrad.opacus.register_with_opacus() as registration:
        assert registration.active
        got = _opacus_grad_samples(model, ids, labels)
    assert not registration.active

    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")

    # Ghost clipping in Opacus's own wrapper: the norms now come from dpgrad's norm samplers.
    with dpgrad.opacus.register_with_opacus():
        fgc = OpacusGradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=1.0)
        nn.functional.cross_entropy(fgc(ids), labels).backward()
        got_norms = fgc.get_norm_sample()
    expected_norms = torch.cat([g.flatten(1) for g in expected.values()], dim=1).norm(dim=1)
    torch.testing.assert_close(got_norms.double(), expected_norms, rtol=1e-10, atol=1e-12)

    after = _opacus_grad_samples(model, ids, labels)  # unregistered: Opacus's sampler again
    torch.testing.assert_close(after["embedding.weight"], before["embedding.weight"])


def test_make_private_reuses_a_matching_dpgrad_wrapper_only():
    def call(module, **kwargs):
        return dpgrad.opacus.make_private(
            PrivacyEngine(accountant="rdp"),
            module=module,
            optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            **kwargs,
        )

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(_model(), max_grad_norm=1.0)
    assert call(wrapped)[0] is wrapped
    with pytest.raises(ValueError, match="already a GradSampleModuleFastGradientClipping"):
        call(wrapped, grad_sample_mode="hooks")
    module, _, _ = call(_model(), grad_sample_mode="functorch")
    assert type(module) is dpgrad.GradSampleModule and module.force_functorch
