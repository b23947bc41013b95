"""The DP step on a CUDA GPU: the Triton kernels as compiled for the device, against float64.

The rest of the suite runs on CPU tensors (and the kernels under Triton's interpreter, which
checks their arithmetic, not how they compile and launch). Here Hugging Face GPT-2 (tied
embeddings), Llama with LoRA adapters and fully trained, Qwen3 and ViT (a patch convolution)
run on the GPU in both modes, fp32 and bf16 (GPT-2 and the Llamas also with fp32 weights under
autocast), and two WideResNets (convolutions, GroupNorm) in fp32, against a float64
reference on the same GPU; the backward path's host synchronisations are counted by CUDA's own
sync debug mode (none more than the non-private step), and a non-finite step is withheld on the
device. Skipped without CUDA.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

transformers = pytest.importorskip("transformers")

import dpgrad  # noqa: E402
from test_hf_models import CASES as HF_CASES, BF16_RTOL, MODES, check  # noqa: E402
from test_vision_models import MODELS as VISION_MODELS, clipped_step as vision_clipped_step, images  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dispatch_counts import cuda_syncs  # noqa: E402

CASES = {name: HF_CASES[name] for name in ("gpt2", "llama_lora", "vit")}
# Besides, every parameter trained: the RMSNorms on the norm-layer kernel, in bf16 from what
# autograd saved (their normalised inputs), and Qwen3's per-head ones on four-dimensional inputs.
STEP_CASES = [*CASES, "llama", "qwen3"]


@pytest.fixture(autouse=True)
def _no_tf32_convolutions(monkeypatch):
    """cuDNN runs fp32 convolutions in TF32 by default: the fp32 model's own forward would then
    be 1e-3 from float64, and no fp32 check of the convolutions could be tighter."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", STEP_CASES)
def test_dp_step_matches_float64_on_gpu(name, mode, dtype):
    case = HF_CASES[name]("cuda")
    if dtype == "bf16":
        case.model.to(torch.bfloat16)
        check(case, MODES[mode], rtol=BF16_RTOL)
    else:
        check(case, MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_lora"])
def test_fp32_weights_under_autocast_on_gpu(name, mode):
    """CUDA autocast (LayerNorm and RMSNorm in fp32, the projections in bf16 on the casts the
    hooks keep), against float64 within bf16's tolerance, in both modes."""
    check(HF_CASES[name]("cuda"), MODES[mode], rtol=BF16_RTOL, autocast=True)


@pytest.mark.parametrize("room", ["ample", "reset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["single", "double"])
def test_per_block_clipping_on_gpu(mode, dtype, room, monkeypatch):
    """GPT-2 clipped per block on the GPU, against float64, with the memory the device counts
    (``dpgrad.backward.group_flush``). "ample": the device's peak set well above what the step uses (a
    256 MiB tensor made and freed first), so complete blocks wait and are clipped together at
    the end of the pass, once, the layers of one shape in one launch each. "reset": the peak
    statistics reset before the step, so the mark is the step's own forward pass and loss."""
    from dpgrad.backward.group_flush import GroupFlush
    from test_clipping_groups import per_block_step

    flushes = []
    flush = GroupFlush.flush
    monkeypatch.setattr(GroupFlush, "flush", lambda self, records: flushes.append(len(records)) or flush(self, records))
    case = HF_CASES["gpt2"]("cuda")
    case.model.to(dtype)
    if room == "ample":
        torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # made and freed at once: the peak
    else:
        torch.cuda.reset_peak_memory_stats()
    wrapped = per_block_step(case, mode, 1e-5 if dtype == torch.float32 else BF16_RTOL, 3)
    if room == "ample":
        records = sum(1 for layer in wrapped._path.layer_names if any(p.requires_grad for p in layer.parameters()))
        assert flushes == [wrapped._path.records_peak] and wrapped._path.records_peak >= records, (
            f"clipped in {len(flushes)} flushes of {flushes} records (the pass kept at most "
            f"{wrapped._path.records_peak} at once, of {records} hooked layers)")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_no_host_sync_more_than_non_private(name, mode):
    """Forward, clipped backward and an SGD step: no synchronisation more than the same step
    without DP (the finite check of the norms is decided on the device)."""
    case = CASES[name]("cuda")
    args, shape = case.forward(case.model, slice(None))
    model = copy.deepcopy(case.model)
    plain_opt = torch.optim.SGD([p for p in case.model.parameters() if p.requires_grad], lr=1e-3)

    def plain():
        plain_opt.zero_grad(set_to_none=True)
        a, _ = case.forward(case.model, slice(None))
        nn.CrossEntropyLoss()(*a).backward()
        plain_opt.step()

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, single_backward=MODES[mode])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss(), "mean")

    def private():
        optimizer.zero_grad(set_to_none=True)
        a, s = case.forward(wrapped, slice(None))
        criterion(*a, shape=s).backward()
        optimizer.step()

    for step in (plain, private):
        step()
        step()  # warm: the autotuner's first look at each shape syncs
    assert cuda_syncs(private) <= cuda_syncs(plain)


@pytest.mark.parametrize("mode", list(MODES))
def test_non_finite_step_adds_nothing_and_the_next_forward_raises_on_gpu(mode):
    """On the device: a pass with a NaN loss hands zeros to p.grad, with no host wait; once
    its outcome has reached the host (the event), the next forward pass raises, once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).cuda()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, single_backward=MODES[mode])
    x, y = torch.randn(6, 8, device="cuda"), torch.randint(0, 4, (6,), device="cuda")
    losses = nn.functional.cross_entropy(wrapped(x), y, reduction="none")
    wrapped.clipped_backward(losses * torch.tensor([1, float("nan"), 1, 1, 1, 1], device="cuda"))
    torch.cuda.synchronize()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    with pytest.raises(FloatingPointError, match="added nothing to p.grad"):
        wrapped(x)
    wrapped.zero_grad(set_to_none=True)
    wrapped.clipped_backward(nn.functional.cross_entropy(wrapped(x), y, reduction="none"))
    wrapped.raise_if_not_finite()
    assert all(p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["single", "double"])
@pytest.mark.parametrize("name", list(VISION_MODELS))
def test_wide_resnet_clipped_step_matches_float64_on_gpu(name, mode):
    """Convolutions (their norms as the tuner chooses on the GPU, the clipped sums by cuDNN's
    convolution backward) and GroupNorm (its Triton kernel) of a WideResNet in fp32 on the GPU,
    every parameter's clipped gradient against float64 on the same GPU."""
    make, size, classes = VISION_MODELS[name]
    torch.manual_seed(0)
    model = make().cuda()
    x, y = images(3, size, classes, seed=1)
    vision_clipped_step(model, (x.cuda(), y.cuda()), mode)
