"""Mixture-of-experts weights stored as one (E, p, q) tensor per projection: per-sample norms,
clipped sums and per-sample gradients from per-pair factors (eager PyTorch).

A token routed to k experts makes k (token, expert) pairs. Pair s adds ``left[s] ⊗ right[s]``
to the gradient of its expert's (p, q) matrix (``right`` None: ``left[s]`` to a (p,) bias), and
belongs to ``sample[s]``. So sample b's gradient of expert e is the sum over its pairs routed to
e, and its squared norm is summed over the experts:

    ||g_b||^2 = sum_e || sum_{s in (b, e)} left[s] ⊗ right[s] ||^2

per expert either from the pairs' Gram matrices (``(L L^T) ⊙ (R R^T)`` over the pairs of one
sample, n_e^2 (p + q) flops) or from each sample's own (p, q) sum (n_e p q flops), whichever is
fewer. Shapes: left (S, p), right (S, q), expert and sample (S,) int64, S pairs; norms squared,
in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .reference_common import accumulation_dtype


def _by_expert(expert: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, List[int]]:
    """The pairs' order grouping them by expert (stable), and each expert's count."""
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts).tolist()
    return order, counts


def experts_sq_norms(left: torch.Tensor, right: Optional[torch.Tensor], expert: torch.Tensor, sample: torch.Tensor,
                     num_experts: int, batch: int) -> torch.Tensor:
    """(B,) squared norms of each sample's gradient of the (E, p, q) weight (or (E, p) bias)."""
    acc = accumulation_dtype(left)
    out = torch.zeros(batch, dtype=acc, device=left.device)
    if left.shape[0] == 0:
        return out
    if right is None:
        rows = torch.zeros(batch * num_experts, left.shape[1], dtype=acc, device=left.device)
        rows.index_add_(0, sample * num_experts + expert, left.to(acc))
        return out.index_add_(0, torch.arange(batch, device=left.device).repeat_interleave(num_experts),
                              rows.square().sum(1))
    order, counts = _by_expert(expert, num_experts)
    p, q = left.shape[1], right.shape[1]
    for L, R, s in zip(left[order].split(counts), right[order].split(counts), sample[order].split(counts)):
        n = L.shape[0]
        if n == 0:
            continue
        L, R = L.to(acc), R.to(acc)
        if n * (p + q) <= p * q:  # the pairs' Gram matrices, over pairs of one sample
            same = s[:, None] == s[None, :]
            M = (L @ L.T) * (R @ R.T) * same
            out.index_add_(0, s, M.sum(1))
        else:  # each sample's own (p, q) sum
            out += _per_sample(L, R, s, batch).square().sum((1, 2))
    return out


def _per_sample(L: torch.Tensor, R: torch.Tensor, s: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, p, q): sum over each sample's pairs of ``L[i] ⊗ R[i]``."""
    onehot = torch.zeros(L.shape[0], batch, dtype=L.dtype, device=L.device)
    onehot[torch.arange(L.shape[0], device=L.device), s] = 1
    return torch.einsum("nb,np,nq->bpq", onehot, L, R)


def experts_clipped_sum(left: torch.Tensor, right: Optional[torch.Tensor], expert: torch.Tensor,
                        pair_coef: torch.Tensor, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The clipped gradient, (E, p, q) (or (E, p)): ``sum_s coef[s] left[s] ⊗ right[s]`` into
    each pair's expert; ``pair_coef`` (S,) is the clipping coefficient of each pair's sample."""
    acc = accumulation_dtype(left)
    scaled = left.to(acc) * pair_coef.to(acc)[:, None]
    if right is None:
        out = torch.zeros(num_experts, left.shape[1], dtype=acc, device=left.device)
        return out.index_add_(0, expert, scaled).to(out_dtype)
    out = torch.zeros(num_experts, left.shape[1], right.shape[1], dtype=acc, device=left.device)
    order, counts = _by_expert(expert, num_experts)
    for e, (L, R) in enumerate(zip(scaled[order].split(counts), right[order].to(acc).split(counts))):
        if L.shape[0]:
            out[e] = L.T @ R
    return out.to(out_dtype)


def experts_grad_sample(left: torch.Tensor, right: Optional[torch.Tensor], expert: torch.Tensor, sample: torch.Tensor,
                        num_experts: int, batch: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-sample gradients, (B, E, p, q) (or (B, E, p))."""
    acc = accumulation_dtype(left)
    if right is None:
        out = torch.zeros(batch * num_experts, left.shape[1], dtype=acc, device=left.device)
        out.index_add_(0, sample * num_experts + expert, left.to(acc))
        return out.view(batch, num_experts, -1).to(out_dtype)
    out = torch.zeros(batch, num_experts, left.shape[1], right.shape[1], dtype=acc, device=left.device)
    order, counts = _by_expert(expert, num_experts)
    pieces = zip(left[order].split(counts), right[order].split(counts), sample[order].split(counts))
    for e, (L, R, s) in enumerate(pieces):
        if L.shape[0]:
            out[:, e] = _per_sample(L.to(acc), R.to(acc), s, batch)
    return out.to(out_dtype)
