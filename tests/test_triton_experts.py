"""The Triton kernels of mixture-of-experts weights (kernels/experts_segments.py) against a
float64 loop over the pairs and against the eager reference (kernels/reference_experts.py).

Pair s adds ``left[s] ⊗ right[s]`` (a bias: ``left[s]``) to the gradient of its expert's
matrix and belongs to ``sample[s]``. The oracle builds every sample's gradient of every expert
pair by pair in float64 from the same rounded operands the kernels read, and the tolerance of
each result is what fp32 accumulation over its own pairs can lose (tests/precision_bounds.py,
DESIGN.md's precision contract). Without a GPU this runs under Triton's interpreter on CPU
tensors (tests/conftest.py); buffers the kernels must fill are poisoned with NaN first.
Also: Qwen3-MoE's experts trained through the Triton backend (DPGRAD_BACKEND=triton).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dpgrad.kernels import backend  # noqa: E402
from dpgrad.kernels import reference as R  # noqa: E402
from dpgrad.kernels import triton_common  # noqa: E402
from dpgrad.kernels import triton_ops as K  # noqa: E402
from precision_bounds import UNIT, gamma, reduction_depth, within  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32, BF16, FP64 = torch.float32, torch.bfloat16, torch.float64

# (S pairs, E experts, B samples, p, q): the last expert and sample 1 get no pair (where B > 1);
# p and q cross tiles of the interpreter's 32 without filling them; the second has segments
# longer than one step of K; no pairs at all; a batch of one.
SHAPES = [(40, 4, 3, 37, 45), (90, 2, 2, 18, 40), (0, 3, 2, 8, 8), (9, 2, 1, 16, 12)]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(triton_common, "POISON", True)


def pairs(S, E, B, p, q, dtype, seed, bias=False, right_dtype=None):
    """Random factors in ``dtype`` and routing; the last expert and sample 1 (B > 1) get none."""
    g = torch.Generator().manual_seed(seed)
    left = torch.randn(S, p, generator=g).to(dtype)
    right = None if bias else torch.randn(S, q, generator=g).to(right_dtype or dtype)
    expert = torch.randint(0, max(E - 1, 1), (S,), generator=g)
    sample = torch.randint(0, B, (S,), generator=g)
    if B > 1:
        sample[sample == 1] = 0
    move = (lambda t: t if t is None else t.to(DEVICE))
    return move(left), move(right), move(expert), move(sample)


class Oracle:
    """Per (sample, expert): the float64 gradient, the sum of its terms' magnitudes and the
    number of pairs, pair by pair (no sort, no segments: independent of both implementations)."""

    def __init__(self, left, right, expert, sample, E, B):
        shape = (B, E, left.shape[1]) + (() if right is None else (right.shape[1],))
        self.grad = torch.zeros(shape, dtype=FP64)
        self.mags = torch.zeros(shape, dtype=FP64)
        self.count = torch.zeros(B, E, dtype=torch.int64)
        for s in range(left.shape[0]):
            b, e = int(sample[s]), int(expert[s])
            l = left[s].double().cpu()
            term = l if right is None else torch.outer(l, right[s].double().cpu())
            self.grad[b, e] += term
            self.mags[b, e] += term.abs()
            self.count[b, e] += 1

    def _k(self, count):
        """gamma(n + 1) per (sample, expert), broadcast over the gradient's dims."""
        k = torch.tensor([gamma(int(n) + 1) for n in count.flatten()], dtype=FP64).view(count.shape)
        return k.view(*count.shape, *[1] * (self.grad.dim() - count.dim()))

    def sq_norms(self):
        """(B,) exact squared norms and the bound on fp32's error (each entry off by
        ``gamma(n + 1)`` of its magnitudes, its square by what that makes of it; then the sums)."""
        W, err = self.grad, self._k(self.count) * self.mags
        exact = W.flatten(1).square().sum(1)
        sq = (err * (2 * W.abs() + err)).flatten(1).sum(1)
        return exact, sq + gamma(reduction_depth(W[0].numel())) * (exact + sq)

    def grad_sample(self, out_dtype):
        mags = self._k(self.count) * self.mags
        return self.grad, mags + UNIT[out_dtype] * (self.grad.abs() + mags)

    def clipped_sum(self, coef, out_dtype):
        """(E, ...) exact clipped sum and its bound: fp32 over each expert's pairs (in runs of one
        coefficient, each scaled once and then added: gamma(n + 3) covers it), then the rounding."""
        c = coef.double().cpu().view(-1, *[1] * (self.grad.dim() - 1))
        exact = (c * self.grad).sum(0)
        n = self.count.sum(0)
        k = torch.tensor([gamma(int(m) + 3) for m in n], dtype=FP64).view(-1, *[1] * (exact.dim() - 1))
        mags = k * (c * self.mags).sum(0)
        return exact, mags + UNIT[out_dtype] * (exact.abs() + mags)


def _check(got, exact, bound, want_dtype, want_shape, what):
    assert got.dtype == want_dtype and tuple(got.shape) == tuple(want_shape), (what, got.dtype, got.shape)
    assert within(got, exact, bound) <= 1, f"{what}: error {within(got, exact, bound):.3g} of the bound"


@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S,E,B,p,q", SHAPES, ids=["empty-expert-and-sample", "long-segments", "no-pairs", "B1"])
def test_experts_kernels_against_a_float64_loop_and_the_reference(S, E, B, p, q, dtype, bias):
    left, right, expert, sample = pairs(S, E, B, p, q, dtype, seed=S + p + bias, bias=bias)
    oracle = Oracle(left, right, expert, sample, E, B)
    tail = (p,) if bias else (p, q)

    exact, bound = oracle.sq_norms()
    got = K.experts_sq_norms(left, right, expert, sample, E, B)
    _check(got, exact, bound, FP32, (B,), "squared norms")
    # The eager reference accumulates in fp32 too: both within the bound of the exact value.
    _check(got, R.experts_sq_norms(left, right, expert, sample, E, B), 2 * bound, FP32, (B,), "norms vs eager")
    if B > 1:
        assert got[1] == 0, "a sample that routes nothing has norm 0"

    coef = torch.rand(B, generator=torch.Generator().manual_seed(3)).clamp_min(0.05).to(DEVICE)
    if B > 2:
        coef[B - 1] = 1.0  # unclipped, as Opacus leaves some (sample 0 is clipped in every case)
    for out_dtype in dict.fromkeys([dtype, FP32]):
        exact, bound = oracle.clipped_sum(coef, out_dtype)
        got = K.experts_clipped_sum(left, right, expert, coef[sample], E, out_dtype)
        _check(got, exact, bound, out_dtype, (E, *tail), f"clipped sum in {out_dtype}")
        eager = R.experts_clipped_sum(left, right, expert, coef[sample], E, out_dtype)
        _check(got, eager, 2 * bound, out_dtype, (E, *tail), f"clipped sum vs eager in {out_dtype}")
        assert not got[E - 1].any(), "an expert without pairs has no gradient"

        exact, bound = oracle.grad_sample(out_dtype)
        got = K.experts_grad_sample(left, right, expert, sample, E, B, out_dtype)
        _check(got, exact, bound, out_dtype, (B, E, *tail), f"per-sample gradients in {out_dtype}")
        eager = R.experts_grad_sample(left, right, expert, sample, E, B, out_dtype)
        _check(got, eager, 2 * bound, out_dtype, (B, E, *tail), f"per-sample gradients vs eager in {out_dtype}")
        assert not got[:, E - 1].any() and (B == 1 or not got[1].any()), "zeros where nothing is routed"


def test_a_half_beside_fp32_is_multiplied_as_the_reference_does():
    """bf16 left beside fp32 right: widened to fp32 (the reference's products), not rounded."""
    E, B = 3, 2
    left, right, expert, sample = pairs(30, E, B, 20, 24, BF16, seed=5, right_dtype=FP32)
    oracle = Oracle(left, right, expert, sample, E, B)
    exact, bound = oracle.sq_norms()
    _check(K.experts_sq_norms(left, right, expert, sample, E, B), exact, bound, FP32, (B,), "mixed norms")
    exact, bound = oracle.grad_sample(FP32)
    _check(K.experts_grad_sample(left, right, expert, sample, E, B, FP32), exact, bound, FP32, exact.shape,
           "mixed per-sample gradients")


def test_float64_is_refused_naming_the_eager_backend():
    """The kernels accumulate in fp32; the backend keeps float64 on the eager path."""
    left, right, expert, sample = pairs(6, 2, 2, 4, 4, FP64, seed=1)
    with pytest.raises(TypeError, match="DPGRAD_BACKEND=eager"):
        K.experts_sq_norms(left, right, expert, sample, 2, 2)
    assert backend.ops_for(left, right) is R


# ------------------------------------------------------------------ through the wrappers
def _count_calls(monkeypatch):
    """The names of the experts' Triton kernels called, in order, from now on."""
    calls = []
    for name in ("experts_sq_norms", "experts_clipped_sum", "experts_grad_sample"):
        fn = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    return calls


def test_qwen3_moe_trains_on_the_triton_kernels(monkeypatch):
    """One clipped step (single backward, every layer from its norms) and the per-sample
    gradients of Qwen3-MoE with DPGRAD_BACKEND=triton: the experts' samplers reach the Triton
    kernels, and the results are test_moe.py's, against float64 per-sample gradients."""
    from mixed_net import clipped_from_norms
    from test_hf_models import check
    from test_moe import checked_grad_samples, qwen3_moe

    calls = _count_calls(monkeypatch)
    with clipped_from_norms():
        check(qwen3_moe(), single=True)
    assert {"experts_sq_norms", "experts_clipped_sum"} <= set(calls), calls
    calls.clear()
    assert checked_grad_samples(qwen3_moe(), lambda n: "experts" in n) == 2 * 2
    assert set(calls) == {"experts_grad_sample"}, calls


def test_lora_on_experts_trains_on_the_triton_kernels(monkeypatch):
    """peft's LoRA on Qwen3-MoE's experts (each adapter an experts weight r wide): the same
    kernels, with the results of test_moe.py's LoRA tests against float64."""
    from mixed_net import clipped_from_norms
    from test_hf_models import check
    from test_moe import checked_grad_samples, moe_lora

    calls = _count_calls(monkeypatch)
    with clipped_from_norms():
        check(moe_lora("qwen3_moe"), single=True)
    assert {"experts_sq_norms", "experts_clipped_sum"} <= set(calls), calls
    calls.clear()
    assert checked_grad_samples(moe_lora("qwen3_moe"), lambda n: "experts" in n) == 2 * 2 * 2
    assert set(calls) == {"experts_grad_sample"}, calls
