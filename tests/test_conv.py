"""Convolutions (``nn.Conv1d/2d/3d``) and GroupNorm: the samplers against float64 per-sample
gradients over a grid of convolution settings (strides, paddings and padding modes, dilations,
groups, kernel sizes, 1D/2D/3D), every norm algorithm the backend offers, autocast's mixed
operands; models of convolutions, GroupNorm and a convolution used twice through both wrappers,
both modes, flat, per-layer and per-block clipping, accumulation and ``make_private``; BatchNorm
refused. The Makefile runs this module on both backends."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import dpgrad
from dpgrad.kernels import backend, conv_unfold
from dpgrad.kernels.reference import outer_sum_inner
from dpgrad.samplers import conv as conv_samplers
from dpgrad.samplers.norms import norm_layer_grad_sample
from dpgrad.tuning.candidates import applicable, shape_of
from mixed_net import clipped_from_norms
from per_sample_reference import BACKEND_PASS, assert_norms_close, assert_tensor_close, per_sample_grads
from test_clipping_groups import check

# (class, keyword arguments, spatial input shape)
CONVS = {
    "1d": (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3), (9,)),
    "1d-same-circular-even": (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=4, padding="same",
                                              padding_mode="circular"), (9,)),
    "1d-stride-dilation-groups": (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2,
                                                  dilation=2, padding=1, groups=2), (11,)),
    "1d-depthwise-same": (nn.Conv1d, dict(in_channels=4, out_channels=4, kernel_size=5, padding="same",
                                          groups=4), (8,)),
    "2d": (nn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=3, padding=1), (6, 7)),
    "2d-stride": (nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1), (7, 8)),
    "2d-rect-dilation-groups-reflect": (nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=(2, 3),
                                                        dilation=(1, 2), groups=2, padding="same",
                                                        padding_mode="reflect"), (7, 8)),
    "2d-depthwise-replicate-nobias": (nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=3, groups=4,
                                                      bias=False, padding=2, padding_mode="replicate"), (5, 6)),
    "2d-pointwise": (nn.Conv2d, dict(in_channels=6, out_channels=3, kernel_size=1), (4, 5)),
    "2d-patches": (nn.Conv2d, dict(in_channels=3, out_channels=8, kernel_size=4, stride=4), (8, 12)),
    "2d-valid-stride-rect": (nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=(3, 1), stride=(1, 2),
                                             padding="valid"), (6, 7)),
    "3d": (nn.Conv3d, dict(in_channels=2, out_channels=4, kernel_size=(2, 3, 2), stride=(1, 2, 1),
                           padding=(1, 0, 1)), (4, 5, 4)),
    "3d-same-circular-groups": (nn.Conv3d, dict(in_channels=4, out_channels=4, kernel_size=3, padding="same",
                                                padding_mode="circular", groups=2), (3, 4, 3)),
}


def layer_reference(layer: nn.Module, x: torch.Tensor, G: torch.Tensor) -> dict:
    """{name: (B, *param.shape)} float64 per-sample gradients of ``<layer(x_b), G_b>``."""
    layer64 = copy.deepcopy(layer).double()
    params = {n: p.detach() for n, p in layer64.named_parameters()}

    def f(p, xb, gb):
        return (functional_call(layer64, p, (xb[None],)) * gb[None]).sum()

    return vmap(grad(f), in_dims=(None, 0, 0))(params, x.double(), G.double())


def conv_case(name: str, B: int, seed: int = 0, dtype=torch.float32):
    cls, kwargs, spatial = CONVS[name]
    torch.manual_seed(seed)
    layer = cls(**kwargs).to(dtype)
    x = torch.randn(B, kwargs["in_channels"], *spatial, dtype=dtype)
    G = torch.randn_like(layer(x))
    return layer, x, G


@pytest.mark.parametrize("name", list(CONVS))
def test_conv_samplers_match_float64(name):
    """Per-sample gradients, every applicable norm candidate, the norm sampler, the clipped sum
    and the factors (their self inner product is the squared norm) against torch.func in
    float64, from fp32 inputs."""
    layer, x, G = conv_case(name, B=3)
    ref = layer_reference(layer, x, G)
    params = dict(layer.named_parameters())
    grads = conv_samplers.conv_grad_sample(layer, [x], G)
    for n, p in params.items():
        assert_tensor_close(grads[p], ref[n], f"{name} {n} per-sample gradient")
    want = {n: g.flatten(1).norm(dim=1) for n, g in ref.items()}
    geom = conv_samplers.geometry(layer)
    # The eager norms' unfolded input (im2col's transposed view in 2-D) is the copy's values.
    assert torch.equal(conv_unfold.unfold(x, geom, rows_contiguous=False), conv_unfold.unfold(x, geom)), name
    inputs = (x, G, geom)
    candidates = applicable("conv_norm", shape_of("conv_norm", inputs), (x, G))
    assert {c.backend for c in candidates} == {backend.ops_for(x, G).NAME} | (
        {"eager"} if backend.requested() == "auto" else set())
    assert {c.algorithm for c in candidates} >= {"direct", "gram"}
    for cand in candidates:
        assert_norms_close(cand.run(*inputs).sqrt(), want["weight"], f"{name} weight norm by {cand.name}")
    norms = conv_samplers.conv_norm_sample(layer, [x], G)
    for n, p in params.items():
        assert_norms_close(norms[p], want[n], f"{name} {n} norm")
    coef = torch.tensor([0.3, 1.0, 0.0])
    sums = conv_samplers.conv_clipped_sum(layer, [x], G, coef)
    for n, p in params.items():
        expected = torch.einsum("b,b...->...", coef.double(), ref[n])
        assert_tensor_close(sums[p], expected, f"{name} clipped {n}", (ref[n].abs().sum(0)).max().item())
    factors = conv_samplers.conv_factors(layer, [x], G)
    for n, p in params.items():
        left, right = factors[p]
        assert_norms_close(outer_sum_inner(left, right, left, right).sqrt(), want[n], f"{name} {n} factors")


@pytest.mark.parametrize("B", [0, 1])
def test_conv_samplers_empty_and_single_batches(B):
    layer, x, G = conv_case("2d-stride", B=B)
    ref = layer_reference(layer, x, G) if B else {n: torch.zeros(0, *p.shape, dtype=torch.float64)
                                                   for n, p in layer.named_parameters()}
    for n, p in layer.named_parameters():
        assert conv_samplers.conv_grad_sample(layer, [x], G)[p].shape == (B, *p.shape)
        assert_norms_close(conv_samplers.conv_norm_sample(layer, [x], G)[p], ref[n].flatten(1).norm(dim=1), n)
        assert_tensor_close(conv_samplers.conv_clipped_sum(layer, [x], G, torch.ones(B))[p], ref[n].sum(0), n)


@pytest.mark.parametrize("inputs", ["bf16", "autocast"])
def test_conv_half_precision_is_the_rounded_computation(inputs):
    """bf16 operands, and autocast's fp32 input beside bf16 backprops (the forward convolved the
    input rounded to bf16): norms and clipped sums equal float64 of the rounded operands."""
    layer, x, G = conv_case("2d-rect-dilation-groups-reflect", B=4)
    G = G.bfloat16()
    if inputs == "bf16":
        x = x.bfloat16()
    ref = layer_reference(layer, x.bfloat16(), G)
    for cand in applicable("conv_norm", shape_of("conv_norm", (x, G, conv_samplers.geometry(layer))), (x, G)):
        got = cand.run(x, G, conv_samplers.geometry(layer)).sqrt()
        assert_norms_close(got, ref["weight"].flatten(1).norm(dim=1), f"weight norm by {cand.name}")
    coef = torch.tensor([0.5, 1.0, 0.25, 0.0])
    sums = conv_samplers.conv_clipped_sum(layer, [x], G, coef)
    expected = torch.einsum("b,b...->...", coef.double(), ref["weight"])
    assert_tensor_close(sums[layer.weight], expected, "clipped weight", ref["weight"].abs().sum(0).max().item())


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_per_sample_gradients(affine):
    torch.manual_seed(1)
    layer = nn.GroupNorm(3, 6, affine=affine, eps=1e-3)
    x = torch.randn(4, 6, 5, 3) * 3 + 1
    G = torch.randn_like(x)
    if not affine:
        assert norm_layer_grad_sample(layer, [x], G) == {}
        return
    ref = layer_reference(layer, x, G)
    got = norm_layer_grad_sample(layer, [x], G)
    for n, p in layer.named_parameters():
        assert_tensor_close(got[p], ref[n], f"GroupNorm {n}")


class SmallCNN(nn.Module):
    """Convolutions of several settings, GroupNorm, a convolution called twice, a Linear head."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 8)
        self.block = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, padding_mode="circular")
        self.norm2 = nn.GroupNorm(2, 8)
        self.shared = nn.Conv2d(8, 8, 1, bias=False)  # applied twice
        self.depthwise = nn.Conv2d(8, 8, 3, padding="same", groups=8)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        h = torch.relu(self.norm1(self.stem(x)))
        h = torch.tanh(self.norm2(self.block(h)))
        h = self.shared(torch.tanh(self.shared(h)))
        h = self.depthwise(h)
        return self.head(h.mean(dim=(2, 3)))


class Sequence1d3d(nn.Module):
    """A Conv1d over a sequence beside a Conv3d over a volume."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(2, 4, 3, stride=2, padding=1, padding_mode="reflect")
        self.conv3 = nn.Conv3d(1, 3, (2, 2, 3), dilation=(1, 2, 1))
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        seq = self.conv1(x.flatten(1, 2)[:, :, :6].reshape(x.shape[0], 2, -1))
        vol = self.conv3(x.unsqueeze(1))
        return self.head(torch.cat([seq.mean(2), vol.mean(dim=(2, 3, 4))], dim=1))


def cnn_batch(B: int, seed: int, shape=(3, 8, 8), classes: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, *shape, generator=g), torch.randint(0, classes, (B,), generator=g)


MODELS = {"cnn": (SmallCNN, (3, 8, 8), 5), "1d3d": (Sequence1d3d, (4, 5, 6), 3)}


def loss_of(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("mode", ["single", "double"])
def test_cnn_flat_clipping_matches_float64(mode, model_name):
    """Ghost clipping of every convolution (norms and clipped sums, no per-sample gradient), a
    convolution used twice exact through its factors, two accumulated batches."""
    cls, shape, classes = MODELS[model_name]
    torch.manual_seed(0)
    model = cls()
    batches = [cnn_batch(5, 1, shape, classes), cnn_batch(3, 2, shape, classes)]
    refs = [per_sample_grads(model, x, y, loss_of) for x, y in batches]
    C = float(torch.stack([g.flatten(1).square().sum(1) for g in refs[0].values()]).sum(0).sqrt().median())
    with clipped_from_norms():
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="sum",
                                                              max_grad_norm=C, single_backward=mode == "single")
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, type("O", (), {"loss_reduction": "sum"})(),
                                                      nn.CrossEntropyLoss(reduction="sum"), "sum")
        expected, scale = {}, {}
        for (x, y), ref in zip(batches, refs):
            criterion(wrapped(x), y).backward()
            norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
            assert_norms_close(wrapped.per_sample_gradient_norms, norms, f"{model_name} norms ({mode})")
            coef = (C / (norms + 1e-6)).clamp(max=1.0)
            for n, g in ref.items():
                expected[n] = expected.get(n, 0) + torch.einsum("b,b...->...", coef, g)
                scale[n] = scale.get(n, 0.0) + (coef[:, None] * g.flatten(1).abs()).sum(0).max().item()
    for n, p in wrapped._module.named_parameters():
        assert_tensor_close(p.grad, expected[n], f"{model_name} clipped {n}.grad ({mode})", scale[n])


@pytest.mark.parametrize("spec", ["per_layer", "per_block"])
@pytest.mark.parametrize("mode", ["single", "double"])
def test_cnn_per_layer_and_per_block_clipping(mode, spec):
    torch.manual_seed(3)
    model = SmallCNN()
    batches = [cnn_batch(6, 4), cnn_batch(2, 5)]
    groups = None if spec == "per_layer" else (lambda name: "stem" if name.startswith(("stem", "norm1")) else "rest")
    with clipped_from_norms():
        check(model, batches, mode, "per_layer" if spec == "per_layer" else "groups", groups)


def test_cnn_per_sample_gradients_in_grad_sample_module():
    """``dpgrad.GradSampleModule``: ``p.grad_sample`` of every parameter, the convolution used
    twice summed over its uses."""
    torch.manual_seed(4)
    model = SmallCNN()
    x, y = cnn_batch(4, 6)
    ref = per_sample_grads(model, x, y, loss_of)
    wrapped = dpgrad.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    F.cross_entropy(wrapped(x), y, reduction="sum").backward()
    for n, p in wrapped._module.named_parameters():
        assert_tensor_close(p.grad_sample, ref[n], f"{n}.grad_sample")


@pytest.mark.skipif(BACKEND_PASS, reason="the wrappers' own paths are the same on both backends")
def test_cnn_small_gradients_are_clipped_from_per_sample_gradients():
    """Without forcing ghost clipping, the small convolutions of this model are clipped from
    their per-sample gradients (``ConvGradSampleGroup``): the same step."""
    torch.manual_seed(5)
    model = SmallCNN()
    x, y = cnn_batch(5, 7)
    ref = per_sample_grads(model, x, y, loss_of)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    C = float(norms.median())
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="sum",
                                                          max_grad_norm=C, single_backward=True)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, type("O", (), {"loss_reduction": "sum"})(),
                                                  nn.CrossEntropyLoss(reduction="sum"), "sum")
    criterion(wrapped(x), y).backward()
    assert_norms_close(wrapped.per_sample_gradient_norms, norms)
    coef = (C / (norms + 1e-6)).clamp(max=1.0)
    for n, p in wrapped._module.named_parameters():
        expected = torch.einsum("b,b...->...", coef, ref[n])
        assert_tensor_close(p.grad, expected, n, (coef[:, None] * ref[n].flatten(1).abs()).sum(0).max().item())


@pytest.mark.parametrize("layer", [nn.BatchNorm2d(8), nn.BatchNorm2d(8, track_running_stats=False)],
                         ids=["running-stats", "batch-stats-only"])
def test_batch_norm_is_refused_naming_group_norm(layer):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), layer, nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 6, 6))
    for cls in (dpgrad.GradSampleModule, dpgrad.GradSampleModuleFastGradientClipping):
        with pytest.raises(NotImplementedError, match=r"'1'.*BatchNorm2d.*GroupNorm"):
            cls(copy.deepcopy(model), strict=True)


def test_opacus_make_private_trains_a_cnn():
    """``make_private`` on a CNN with GroupNorm: the gradient one noiseless step takes is the
    float64 clipped sum of the Poisson batch's samples over the expected batch size."""
    opacus = pytest.importorskip("opacus")
    from torch.utils.data import DataLoader, TensorDataset

    import dpgrad.opacus

    torch.manual_seed(6)
    model = SmallCNN()
    x, y = cnn_batch(16, 8)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    reference_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = opacus.PrivacyEngine()
    with clipped_from_norms():
        wrapped, optimizer, criterion, loader = dpgrad.opacus.make_private(
            engine, module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=0.5,
            single_backward=True)
        xb, yb = next(iter(loader))
        if xb.shape[0] == 0:
            pytest.skip("an empty Poisson batch")
        optimizer.zero_grad()
        criterion(wrapped(xb), yb).backward()
        optimizer.step()
    ref = per_sample_grads(reference_model, xb, yb, loss_of)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    coef = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    for n, p in wrapped._module.named_parameters():
        step = torch.einsum("b,b...->...", coef, ref[n]) / 8  # the expected batch size
        assert_tensor_close(p.grad, step, n, (coef[:, None] * ref[n].flatten(1).abs()).sum(0).max().item() / 8)


class BatchCentred(nn.Module):
    """Convolutions with a batch statistic between them (a BatchNorm in all but name)."""

    def __init__(self, frozen_batch_norm: bool):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4).requires_grad_(False) if frozen_batch_norm else None
        self.b = nn.Conv2d(4, 4, 3, stride=2)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        h = self.a(x)
        h = self.bn(h) if self.bn is not None else h - h.mean(0, keepdim=True)
        return self.head(self.b(h).mean(dim=(2, 3)))


@pytest.mark.parametrize("mix", ["batch-mean", "frozen-batch-norm-in-training"])
@pytest.mark.parametrize("mode", ["single", "double", "hooks"])
def test_convolutions_whose_samples_mix_are_refused(mode, mix):
    """The guarantee's second half for convolutions: a batch statistic between them (a frozen
    BatchNorm still normalises by the batch in training mode) is refused before p.grad."""
    torch.manual_seed(7)
    model = BatchCentred(mix != "batch-mean")
    x, y = cnn_batch(4, 9)
    if mode == "hooks":
        wrapped = dpgrad.GradSampleModule(model)
    else:
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0,
                                                              single_backward=mode == "single")
    with pytest.raises(dpgrad.SampleMixingError, match="samples are mixed inside the model"):
        out = wrapped(x)
        if mode == "hooks":
            loss = F.cross_entropy(out, y, reduction="sum")
        else:
            loss = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(reduction="sum"), "sum")(out, y)
        loss.backward()
    assert all(p.grad is None for p in model.parameters())


# The per-sample-gradient algorithm is torch's convolution backward: an eager candidate, which a
# forced Triton backend (the second pass) leaves out.
@pytest.mark.parametrize("algorithm", ["direct", "gram"] + ([] if BACKEND_PASS else ["grad-sample"]))
def test_the_tuned_algorithm_serves_the_group_and_the_report(algorithm, monkeypatch, tmp_path):
    """Whichever candidate the autotuner times fastest serves the layer's norms, exactly, and
    keeps nothing for the clipped sum (a convolution backward), not even the per-sample
    gradients of the per-sample-gradient algorithm (B times the weight: the layers clipped
    from those are ConvGradSampleGroup's); the autotune report's recording sees the decision
    and times Opacus's sampler beside it."""
    pytest.importorskip("opacus")
    from dpgrad.tuning import timing, tuner as tuner_module

    monkeypatch.setenv("DPGRAD_TUNE", "on")
    monkeypatch.setenv("DPGRAD_TUNE_DIR", str(tmp_path))

    def timer(fn, device, name=""):
        fn()
        return 1.0 if name.endswith(algorithm) else 5.0

    tuner = tuner_module.Tuner(timer=timer)
    monkeypatch.setattr(tuner_module, "_TUNER", tuner)
    monkeypatch.setattr(timing, "PRUNE_FACTOR", float("inf"))  # every candidate timed
    layer, x, G = conv_case("2d-rect-dilation-groups-reflect", B=3)
    ref = layer_reference(layer, x, G)
    with tuner.recording(opacus=True) as rec:
        with clipped_from_norms():
            group = conv_samplers.ConvGroup([(layer, [x], G)])
            params, rows = group.norms()
    (recorded, decision, opacus_ms), = rec.layers
    assert recorded is layer and decision.kind == "conv_norm" and decision.choice.endswith(algorithm)
    assert decision.source == "measured" and isinstance(opacus_ms, float)
    assert group._grads is None
    for p, row in zip(params, rows):
        name = next(n for n, q in layer.named_parameters() if q is p)
        assert_norms_close(row, ref[name].flatten(1).norm(dim=1), f"{name} norm by {decision.choice}")
    coef = torch.tensor([1.0, 0.5, 0.25])
    from dpgrad.samplers.groups import Coefficients

    for p, s in group.clipped_sums(Coefficients(coef)):
        name = next(n for n, q in layer.named_parameters() if q is p)
        assert_tensor_close(s, torch.einsum("b,b...->...", coef.double(), ref[name]), f"clipped {name}",
                            ref[name].abs().sum(0).max().item())


@pytest.mark.skipif(BACKEND_PASS, reason="the eager candidates' memory, measured on the CPU")
@pytest.mark.parametrize("c_in, c_out, size, lean, sliced", [(4, 8, 32, "eager-grad-sample", False),
                                                             (64, 64, 4, "eager-unfold-gram", True)],
                         ids=["few-channels-many-positions", "many-channels-few-positions"])
def test_memory_short_norms_take_the_candidate_holding_least(c_in, c_out, size, lean, sliced, monkeypatch,
                                                             tmp_path):
    """When memory is short (``Tuner.short_of_memory``) a convolution's norms take, per layer
    shape, the candidate whose work holds the least memory per sample (the cost model's
    ``conv_norm_workspace``), in batch slices holding at most the layer's own input and
    backprops: the per-sample gradients for few channels over many positions, the Gram norm
    of the unfolded input for many channels over few, where the candidate timed fastest (here
    the direct norm) holds many times that. Exact either way; the same layer takes the timed
    choice again once memory is no longer short."""
    from dpgrad.tools.results import peak_allocated
    from dpgrad.tuning import timing, tuner as tuner_module

    monkeypatch.setenv("DPGRAD_TUNE", "on")
    monkeypatch.setenv("DPGRAD_TUNE_DIR", str(tmp_path))

    def timer(fn, device, name=""):
        fn()
        return 1.0 if name.endswith("direct") else 5.0

    tuner = tuner_module.Tuner(timer=timer)
    monkeypatch.setattr(tuner_module, "_TUNER", tuner)
    monkeypatch.setattr(timing, "PRUNE_FACTOR", float("inf"))  # every candidate timed
    torch.manual_seed(3)
    B = 64
    layer = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    x = torch.randn(B, c_in, size, size)
    G = torch.randn_like(layer(x))
    record = (x.numel() + G.numel()) * 4
    want = layer_reference(layer, x, G)["weight"].flatten(1).norm(dim=1)
    inputs = [(x, G, conv_samplers.geometry(layer))]

    def norms():
        (row,) = conv_samplers.ConvGroup([(layer, [x], G)]).norms()[1]
        return row

    assert tuner.select_group("conv_norm", inputs, [layer]).name == "eager-unfold-direct"
    assert_norms_close(norms(), want, "timed choice")
    timed_peak = peak_allocated(norms)
    with tuner.short_of_memory():
        cand, batch_slice = tuner.select_by_memory("conv_norm", inputs, [layer], record)
        assert cand.name == lean
        assert batch_slice == max(1, int(record // cand.workspace(shape_of("conv_norm", inputs[0]))))
        assert (batch_slice < B) == sliced
        assert_norms_close(norms(), want, f"{lean} in batch slices of {batch_slice}")
        short_peak = peak_allocated(norms)
    assert short_peak <= record < timed_peak / 2, (short_peak, record, timed_peak)
    assert not tuner.memory_is_short
    assert tuner.select_group("conv_norm", inputs, [layer]).name == "eager-unfold-direct"


@pytest.mark.parametrize("padding_mode", ["circular", "reflect", "replicate"])
def test_opacus_1_6_conv_sampler_ignores_the_padding_mode(padding_mode):
    """Opacus 1.6.0's convolution sampler unfolds with zero padding whatever the layer's
    padding mode: its per-sample gradients (hence the norms it clips by) are wrong for the
    other modes; dpgrad's are the float64 reference's."""
    pytest.importorskip("opacus")
    from opacus.grad_sample.conv import compute_conv_grad_sample

    torch.manual_seed(8)
    layer = nn.Conv2d(2, 3, 3, padding=1, padding_mode=padding_mode)
    x = torch.randn(2, 2, 5, 5)
    G = torch.randn_like(layer(x))
    ref = layer_reference(layer, x, G)["weight"]
    theirs = compute_conv_grad_sample(layer, [x], G)[layer.weight].double()
    assert ((theirs - ref).norm() / ref.norm()).item() > 0.1
    assert_tensor_close(conv_samplers.conv_grad_sample(layer, [x], G)[layer.weight], ref, padding_mode)


def test_opacus_1_6_ghost_clipping_of_a_circular_convolution_exceeds_the_bound():
    """Opacus 1.6's ghost clipping takes a convolution's norm from its (zero-padded) per-sample
    gradient, then scales the true gradient by that norm's coefficient: one sample's clipped
    gradient passes C. dpgrad's stays within C on the same samples."""
    pytest.importorskip("opacus")
    from opacus.grad_sample import GradSampleModuleFastGradientClipping as OpacusFGC
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping as OpacusLoss

    C = 0.01
    worst = {"opacus": 0.0, "dpgrad": 0.0}
    for seed in range(20):
        torch.manual_seed(seed)
        base = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular", bias=False), nn.Flatten(),
                             nn.Linear(75, 2, bias=False))
        base[2].requires_grad_(False)
        x, y = torch.randn(1, 2, 5, 5), torch.tensor([1])
        for who in worst:
            model = copy.deepcopy(base)
            if who == "opacus":
                wrapped = OpacusFGC(model, max_grad_norm=C, loss_reduction="sum")
                optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=0.0),
                                                            noise_multiplier=0.0, max_grad_norm=C,
                                                            expected_batch_size=1, loss_reduction="sum")
                criterion = OpacusLoss(wrapped, optimizer, nn.CrossEntropyLoss(reduction="sum"), "sum")
            else:
                wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction="sum")
                criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(reduction="sum"),
                                                              "sum")
            with clipped_from_norms():
                criterion(wrapped(x), y).backward()
            worst[who] = max(worst[who], model[0].weight.grad.norm().item() / C)
    assert worst["opacus"] > 1.1, worst
    assert worst["dpgrad"] <= 1 + 1e-5, worst
