"""Clipping bounds and coefficients: the checks of a bound the user gives, Opacus's per-sample
factors ``min(1, C / (norm + 1e-6))`` and automatic clipping's ``C / (norm + gamma)``, and the
batch loss from per-sample losses. Used by the wrappers, the loss wrapper and the clipping
groups; nothing here knows about hooks."""

from __future__ import annotations

import math
from typing import Optional

import torch

def clipping_bound(value, what: str = "max_grad_norm") -> float:
    """``value`` as a float if it is a finite positive number (a clipping bound), else raise
    ValueError: a negative bound would make the coefficients negative (gradient ascent), and a
    NaN or infinite one would put NaN in, or take the clipping out of, every gradient."""
    try:
        if isinstance(value, (bool, str)) or (isinstance(value, torch.Tensor) and value.numel() != 1):
            raise TypeError(value)
        bound = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a finite positive number (the clipping bound C), not {value!r}") from None
    if not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"{what} must be a finite positive number (the clipping bound C), not {bound}")
    return bound


def per_sample_bounds(bounds, max_grad_norm: float, loss_per_sample: torch.Tensor) -> torch.Tensor:
    """``bounds`` as a float32 tensor (B,) on the losses' device, checked on the host: one per
    loss, each finite and between 0 and ``max_grad_norm`` (no sample may move the gradient by
    more than the bound the noise is scaled to); else ValueError."""
    host = torch.as_tensor(bounds.detach().cpu() if isinstance(bounds, torch.Tensor) else bounds,
                           dtype=torch.float64)
    if host.shape != loss_per_sample.shape:
        raise ValueError(f"max_grad_norms of shape {tuple(host.shape)} for {tuple(loss_per_sample.shape)} "
                         "losses: give one bound per sample")
    if not bool(torch.isfinite(host).all()) or bool((host < 0).any()) or bool((host > max_grad_norm).any()):
        raise ValueError(f"per-sample bounds must lie between 0 and max_grad_norm={max_grad_norm}; "
                         f"got values from {host.min().item()} to {host.max().item()}")
    return host.to(torch.float32).to(loss_per_sample.device, non_blocking=True)


def clipping_coefficients(norms: torch.Tensor, max_grad_norm, gamma: Optional[float] = None,
                          scale: float = 1.0) -> torch.Tensor:
    """Opacus's per-sample clipping factors ``min(1, C / (norm + 1e-6))``, (B,); with ``gamma``,
    automatic clipping's ``C / (norm + gamma)`` (Bu et al. 2022: every sample's gradient scaled
    to just below C, ``C * norm / (norm + gamma)``). ``max_grad_norm`` a float or per-sample
    bounds (B,). ``scale``: the factors times ``scale`` (the batch size, for backprops of a
    mean loss), in the same operations."""
    eps = 1e-6 if gamma is None else gamma
    if isinstance(max_grad_norm, torch.Tensor):  # bounds on the device: one division
        coef = max_grad_norm / (norms + eps)
        coef = coef if gamma is not None else coef.clamp(max=1.0)
        return coef if scale == 1.0 else coef * scale
    # A number: the reciprocal times C * scale (what ``C / x`` dispatches), in place.
    coef = (norms + eps).reciprocal_().mul_(max_grad_norm * scale)
    return coef if gamma is not None else coef.clamp_(max=scale)


def automatic_gamma(value) -> float:
    """Automatic clipping's stability constant gamma, checked: a finite number > 0 (0 would
    divide a zero gradient by zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"automatic_gamma must be a finite number > 0 (0.01 in Bu et al. 2022), not {value!r}")
    return float(value)


def reduce_losses(loss_per_sample: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    """The batch's loss from per-sample losses (B,): their mean or their sum."""
    return loss_per_sample.mean(dim=0) if loss_reduction == "mean" else loss_per_sample.sum(dim=0)



__all__ = ["automatic_gamma", "clipping_bound", "clipping_coefficients", "per_sample_bounds", "reduce_losses"]
