"""Eager-PyTorch versions of the embedding launchers (``dpgrad.kernels.reference`` re-exports
them): per-sample gradient norms by sorted segments or by a Gram form, per-sample gradients and
clipped sums. Shapes: ids (B, T) token ids, G (B, T, d) backprops; every output size is known
before the data is read (no host synchronisation on a GPU).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from .reference_common import accumulation_dtype
from .reference_linear import outer_sum_inner

# Above this many elements a (B, V, d) embedding grad sample gets a warning.
EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS = 1 << 28


def _embedding_positions(ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int]):
    """Flat (B*T,) token ids with padding positions moved to row ``num_embeddings`` (one past
    the table: an output row that is then dropped), and the backprop rows (B*T, d). No
    position is removed, so no output size depends on the data (no host synchronisation on a
    GPU)."""
    B = ids.shape[0]
    # Not reshape(B, -1): that is ambiguous for an empty batch.
    T = math.prod(ids.shape[1:])
    tok = ids.reshape(B * T).to(torch.int64)
    if padding_idx is not None:
        tok = tok.masked_fill(tok == padding_idx, num_embeddings)
    return tok, G.reshape(B * T, G.shape[-1])


def embedding_sq_norm(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """Squared per-sample embedding-gradient norms ``sum_v ||sum_{t: x_bt = v} g_bt||^2``.

    ids: (B, T) int, G: (B, T, d) -> (B,). The positions are sorted by (sample, token); equal
    pairs form segments whose rows are summed before squaring; positions holding
    ``padding_idx`` contribute nothing, as PyTorch gives that row no gradient. O(B*T*d), and
    every size is known before the data is read.
    """
    acc = accumulation_dtype(G)
    B = ids.shape[0]
    tok, rows = _embedding_positions(ids, G, num_embeddings, padding_idx)
    n = tok.numel()
    if n == 0:
        return torch.zeros(B, dtype=acc, device=G.device)
    # (sample, token) as one key; the sample of each position and its key's offset are made
    # once per shape.
    sample = _cached(("sample", B, n, G.device), lambda: torch.arange(n, device=G.device) // (n // B))
    offset = _cached(("offset", B, n, num_embeddings, G.device), lambda: sample * (num_embeddings + 1))
    key = offset + tok
    if padding_idx is not None:
        # Padding sorts into segments of its own, beyond every sample's: index B of the output.
        key = key.masked_fill(tok == num_embeddings, B * (num_embeddings + 1))
    sorted_key, order = torch.sort(key)
    starts = torch.ones(n, dtype=torch.int64, device=G.device)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    segment = torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)
    summed = torch.zeros(n, rows.shape[-1], dtype=acc, device=G.device).index_add_(0, segment, rows.to(acc))
    owner = torch.zeros(n, dtype=torch.int64, device=G.device).scatter_(
        0, segment, sample if padding_idx is None else key // (num_embeddings + 1))
    out = torch.zeros(B + 1, dtype=acc, device=G.device).index_add_(0, owner, summed.square().sum(1))
    return out[:B]


def embedding_sq_norm_gram(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """``embedding_sq_norm`` as ``sum_{t,s} [x_bt = x_bs] <g_bt, g_bs>``: (B,).

    O(B*T^2*d) flops and a (B, T, T) intermediate per batch slice: few operations for short
    sequences. Padding positions count as no token.
    """
    B = ids.shape[0]
    T = math.prod(ids.shape[1:])
    flat = ids.reshape(B, T)
    if padding_idx is not None:
        flat = flat.masked_fill(flat == padding_idx, -1)
    rows = G.reshape(B, T, G.shape[-1])
    return outer_sum_inner(flat, rows, flat, rows)


def embedding_grad_sample_warning(B: int, num_embeddings: int, d: int, element_size: int) -> str:
    """The warning for a large (B, V, d) per-sample embedding gradient."""
    gib = B * num_embeddings * d * element_size / 2**30
    return (
        f"materialising per-sample embedding gradients of shape ({B}, {num_embeddings}, {d}) "
        f"({gib:.1f} GiB); ghost clipping (GradSampleModuleFastGradientClipping) computes "
        "their norms without them"
    )


def embedding_grad_sample(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """Per-sample embedding gradients: (B, T) ids, (B, T, d) backprops -> (B, V, d).

    Inherently B*V*d memory; warns when that is large. The ``padding_idx`` row stays zero.
    """
    B, d = ids.shape[0], G.shape[-1]
    if B * num_embeddings * d > EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS:
        warnings.warn(embedding_grad_sample_warning(B, num_embeddings, d, G.element_size()), ResourceWarning, stacklevel=3)
    T = math.prod(ids.shape[1:])
    tok = ids if ids.dim() == 2 else ids.reshape(B, T)
    if padding_idx is not None:
        tok = tok.masked_fill(tok == padding_idx, num_embeddings)  # one spare row per sample
    rows = G if G.dim() == 3 else G.reshape(B, T, d)
    out = torch.zeros(B, num_embeddings + 1, d, dtype=G.dtype, device=G.device)
    # out[b, tok[b, t]] += rows[b, t]: sample b's rows by a (B, 1) index made once per B.
    rows_of = _cached(("rows", B, G.device), lambda: torch.arange(B, device=G.device).view(B, 1))
    out.index_put_((rows_of, tok), rows, accumulate=True)
    return out[:, :num_embeddings]


def embedding_clipped_sum(
    ids: torch.Tensor,
    G: torch.Tensor,
    coef: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Clipped gradient sum of an embedding: ``index_add`` of ``c_b * g_bt`` rows -> (V, d).

    ids: (B, T), G: (B, T, d), coef: (B,). Accumulated in fp32 (fp64 for fp64 inputs);
    returned in ``out_dtype`` (default G's dtype). ``padding_idx`` rows get nothing.
    """
    acc = accumulation_dtype(G)
    tok, rows = _embedding_positions(ids, G, num_embeddings, padding_idx)
    B, T, d = ids.shape[0], math.prod(ids.shape[1:]), G.shape[-1]
    # A spare row takes the padding positions.
    out = torch.zeros(num_embeddings + 1, d, dtype=acc, device=G.device)
    scaled = rows.to(acc).view(B, T, d) * coef.to(device=G.device, dtype=acc).view(B, 1, 1)
    out.index_add_(0, tok, scaled.view(-1, d))
    return out[:num_embeddings].to(out_dtype or G.dtype)


_CACHED: dict = {}


def _cached(key: tuple, make):
    """An index tensor that depends on shapes alone (``key``), made once: a position's sample,
    for instance, rather than an ``arange`` and a division at every call."""
    found = _CACHED.get(key)
    if found is None:
        if len(_CACHED) > 256:  # Poisson batch sizes: keep the cache small
            _CACHED.clear()
        found = _CACHED[key] = make()
    return found
