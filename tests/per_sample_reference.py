"""Float64 per-sample gradients by torch.func: the oracle of the model-level tests.

Independent of dpgrad's code paths: ``vmap(grad(functional_call))`` over a float64 copy of
the model, one sample's own loss at a time, no hooks, no samplers. Under Opacus's convention
the per-sample gradient is the gradient of the sample's own loss for both loss reductions.
"""

from __future__ import annotations

import copy
import os
from typing import Callable, Dict

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

# Relative tolerance of fp32 results against the float64 reference (DESIGN.md). Never loosen.
RTOL = 1e-5
# The Makefile's second pass: every sampler on the Triton kernels (the interpreter on a CPU).
BACKEND_PASS = os.environ.get("DPGRAD_BACKEND") == "triton"


# Hypothesis's examples of the random-model tests (derandomized: the same draws at every run):
# their full number in the nightly profile, DPGRAD_HYPOTHESIS=nightly; a quarter of it in
# `make test`'s passes.
NIGHTLY = os.environ.get("DPGRAD_HYPOTHESIS") == "nightly"


def examples(n: int) -> int:
    """Hypothesis examples of a random-model test: its nightly number ``n`` under
    DPGRAD_HYPOTHESIS=nightly, a quarter of it otherwise (``make test``: the edit loop and CI)."""
    return n if NIGHTLY else max(1, n // 4)


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 deep copy of an unwrapped model (hooks would drag the wrapper along)."""
    for m in model.modules():
        assert not m._forward_hooks, "copy the model before wrapping it"
    return copy.deepcopy(model).double()


def per_sample_grads(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch_first: bool = True,
) -> Dict[str, torch.Tensor]:
    """``{name: (B, *param.shape)}`` float64 gradients of each sample's own loss.

    x: the model's input, batch on dim 0 (batch_first) or 1; y: targets, batch on dim 0;
    loss_fn(output, target) -> per-sample losses (B,), the model's output batch first.
    Tied parameters appear once (under their first name) with the sum over their uses.
    """
    model64 = float64_copy(model)
    names = [n for n, p in model64.named_parameters() if p.requires_grad]
    frozen = {n: p.detach() for n, p in model64.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach() for n, p in model64.named_parameters() if p.requires_grad}
    x64 = x.double() if x.is_floating_point() else x
    y64 = y.double() if y.is_floating_point() else y
    batch_dim = 0 if batch_first else 1
    B = x.shape[batch_dim]
    if B == 0:
        return {n: torch.zeros(0, *p.shape, dtype=torch.float64) for n, p in trainable.items()}

    def sample_loss(params, xb, yb):
        out = functional_call(model64, {**frozen, **params}, (xb.unsqueeze(batch_dim),))
        return loss_fn(out, yb.unsqueeze(0)).sum()

    try:
        grads = vmap(grad(sample_loss), in_dims=(None, batch_dim, 0))(trainable, x64, y64)
    except RuntimeError as exc:  # shapes that depend on the data (a mixture of experts' routing, counts read)
        if "dynamic shape" not in str(exc) and "storage" not in str(exc):
            raise
        rows = []
        for b in range(B):  # plain autograd, one sample at a time
            leaves = {n: p.clone().requires_grad_() for n, p in trainable.items()}
            got = torch.autograd.grad(sample_loss(leaves, x64.select(batch_dim, b), y64[b]), list(leaves.values()),
                                      allow_unused=True)
            rows.append({n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(leaves, got)})
        grads = {n: torch.stack([r[n] for r in rows]) for n in names}
    return {n: grads[n] for n in names}


def norms_of(grads: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per-parameter per-sample L2 norms, (B,) each."""
    return {n: g.flatten(1).norm(dim=1) for n, g in grads.items()}


def total_norm(grads: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample L2 norm over all the given parameters, (B,)."""
    return torch.stack([g.flatten(1).square().sum(dim=1) for g in grads.values()]).sum(dim=0).sqrt()


def norm_error_ratio(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, floor=None) -> float:
    """How much of the norm tolerance ``actual`` uses: <= 1 passes ``assert_norms_close``.
    ``floor``: per-sample absolute errors also allowed (the error plain autograd makes)."""
    err = (actual.double() - expected).abs()
    allowed = rtol * expected if floor is None else torch.maximum(rtol * expected, floor)
    return (err / (allowed + 1e-12)).max().item() if err.numel() else 0.0


def tensor_error_ratio(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL, scale=None) -> float:
    """How much of the tensor tolerance ``actual`` uses: <= 1 passes ``assert_tensor_close``."""
    if expected.numel() == 0:
        return 0.0
    if scale is None:
        scale = expected.abs().max().item()
    err = (actual.double() - expected).abs()
    return (err / (rtol * expected.abs() + rtol * scale + 1e-300)).max().item()


def assert_norms_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "norm", rtol: float = RTOL) -> None:
    """Every sample's norm within relative ``rtol`` of the float64 reference (zeros stay zero)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.double() - expected).abs()
    bad = err > rtol * expected + 1e-12
    assert not bad.any(), (
        f"{what}: relative error {(err / expected.clamp_min(1e-300)).max().item():.3g} > {rtol}; "
        f"actual {actual.tolist()} expected {expected.tolist()}"
    )


def assert_tensor_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", scale=None, rtol: float = RTOL
) -> None:
    """``rtol`` element-wise, with an absolute floor ``rtol`` * the tensor's magnitude."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double(), expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}"
    )
