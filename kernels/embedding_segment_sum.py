"""Embedding norms, per-sample gradients and clipped sums by sorted segment sums, in Triton.

The positions of a batch are sorted by a key (``b * V + token`` per sample, or ``token`` for
the clipped sum across the batch), so equal keys form contiguous segments. One program owns
one segment and one d-tile: it sums the segment's backprop rows in fp32 (scaled by ``c_b``
for the clipped sum) and then either
- squares and sums them (the norm: ``sum_v ||sum_{t: x_bt = v} g_bt||^2``), writing one
  partial that a second kernel adds up per sample in a fixed order, or
- stores the row at its key (per-sample gradient row, or clipped-sum row).
Every (segment, tile) is written by exactly one program, so there are no atomics and the
results do not vary run to run. O(B*T*d) work; no T x T mask, no one-hot. Positions holding
``padding_idx`` get a key past every real one (PyTorch gives that row no gradient): their
segment comes last and lands in a spare row or sample that is dropped. No size depends on the
data: the grid has a program for every possible segment (one per position; the unused ones
find an empty range), so nothing waits for the device to say how many segments there are.

G is read through its strides (copied once only when ids of rank > 2 come with token axes
that no view can merge); offsets are int64. Token ids must lie in [0, V), which
``nn.Embedding``'s forward pass has already checked.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .reference import EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS, embedding_grad_sample_warning
from .triton_common import cdiv, check_dtypes, configs, empty, keep_only, launch, min_block, one_family, prune_for

CONFIGS = configs(
    [dict(BD=bd, BR=br) for bd in (64, 128, 256) for br in (4, 16)],
    interpret=dict(BD=32, BR=8),
    num_warps=(2, 4),
)
_ALL = [f"BD={bd} BR={br} w{w}" for bd in (64, 128, 256) for br in (4, 16) for w in (2, 4)]
keep_only("_segment_sum_kernel", one_family("G"), {
    "fp32": [n for n in _ALL if n not in ("BD=64 BR=16 w4", "BD=256 BR=16 w2")],
    "half": [n for n in _ALL if n != "BD=256 BR=16 w2"],
})
_MIN_BD = min_block(CONFIGS, "BD")


# Norm partials are laid out for the smallest tiles: clear what tuning leaves (reset_to_zero;
# for stored rows it only re-zeroes an output that starts at zero).
@triton.autotune(configs=CONFIGS, key=["d", "SCALED", "STORE_ROWS"], reset_to_zero=["OUT"],
                 prune_configs_by=prune_for("_segment_sum_kernel"))
@triton.jit(do_not_specialize=["T"])
def _segment_sum_kernel(
    G, POS, OFFSETS, DEST, COEF, OUT,
    T, d,
    s_gb, s_gt, s_gd,
    n_tiles_max,
    SCALED: tl.constexpr, STORE_ROWS: tl.constexpr,
    BD: tl.constexpr, BR: tl.constexpr,
):
    i_seg = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD).to(tl.int64)
    m_d = o_d < d
    start = tl.load(OFFSETS + i_seg)
    end = tl.load(OFFSETS + i_seg + 1)
    b_sum = tl.zeros((BD,), dtype=tl.float32)
    for r0 in range(start, end, BR):
        o_r = r0 + tl.arange(0, BR).to(tl.int64)
        m_r = o_r < end
        pos = tl.load(POS + o_r, mask=m_r, other=0)
        b = pos // T
        t = pos % T
        # [BR, BD]
        b_rows = tl.load(G + b[:, None] * s_gb + t[:, None] * s_gt + o_d[None, :] * s_gd,
                         mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        if SCALED:
            b_rows = b_rows * tl.load(COEF + b, mask=m_r, other=0.0)[:, None]
        b_sum += tl.sum(b_rows, axis=0)
    if STORE_ROWS:
        # A segment index past the last segment has an empty range and no row to write.
        dest = tl.load(DEST + i_seg)
        tl.store(OUT + dest * d + o_d, b_sum.to(OUT.dtype.element_ty), mask=m_d & (o_d * 0 + start < end))
    else:
        tl.store(OUT + i_seg * n_tiles_max + i_d, tl.sum(b_sum * b_sum))


@triton.jit
def _per_sample_total_kernel(SEG_SQ, SAMPLE_OFFSETS, OUT, BS: tl.constexpr):
    """OUT[b] = sum of SEG_SQ over sample b's segments, in a fixed order."""
    i_b = tl.program_id(0).to(tl.int64)
    start = tl.load(SAMPLE_OFFSETS + i_b)
    end = tl.load(SAMPLE_OFFSETS + i_b + 1)
    b_acc = tl.zeros((BS,), dtype=tl.float32)
    for s0 in range(start, end, BS):
        o_s = s0 + tl.arange(0, BS).to(tl.int64)
        b_acc += tl.load(SEG_SQ + o_s, mask=o_s < end, other=0.0)
    tl.store(OUT + i_b, tl.sum(b_acc))


class _Segments(NamedTuple):
    T: int
    pos: torch.Tensor  # (n,) flat positions b*T + t, sorted by key
    offsets: torch.Tensor  # (n + 1,) segment bounds in pos; past the last segment all equal n
    keys: torch.Tensor  # (n,) the key of each segment, ascending; past the last one the spare key
    spare: int  # the key of padding positions and of unused segments: one past every real key


def _segments(ids: torch.Tensor, num_embeddings: int, padding_idx: Optional[int], per_sample: bool) -> _Segments:
    B = ids.shape[0]
    T = math.prod(ids.shape[1:])
    n = B * T
    tok = ids.reshape(n).to(torch.int64)
    pos = torch.arange(n, dtype=torch.int64, device=ids.device)
    key = (pos // max(T, 1)) * num_embeddings + tok if per_sample else tok
    spare = B * num_embeddings if per_sample else num_embeddings
    if padding_idx is not None:
        key = key.masked_fill(tok == padding_idx, spare)
    # Stable, so the order of rows within a segment (the fp32 summation order) is fixed.
    key, order = torch.sort(key, stable=True)
    starts = torch.ones(n, dtype=torch.int64, device=ids.device)
    starts[1:] = key[1:] != key[:-1]
    segment = torch.cumsum(starts, 0) - 1
    offsets = torch.full((n + 1,), n, dtype=torch.int64, device=ids.device)
    offsets.scatter_reduce_(0, segment, pos, reduce="amin")
    keys = torch.full((n,), spare, dtype=torch.int64, device=ids.device).scatter_(0, segment, key)
    return _Segments(T, order, offsets, keys, spare)


def _launch(G: torch.Tensor, seg: _Segments, out: torch.Tensor, dest=None, coef=None, n_tiles_max: int = 0):
    d = G.shape[-1]
    G3 = G.reshape(G.shape[0], seg.T, d)
    n = seg.pos.numel()
    if n == 0 or d == 0:
        return
    launch(_segment_sum_kernel, lambda meta: (n, cdiv(d, meta["BD"])),
        G3, seg.pos, seg.offsets, seg.keys if dest is None else dest, seg.offsets if coef is None else coef, out,
        seg.T, d, *G3.stride(), n_tiles_max,
        SCALED=coef is not None, STORE_ROWS=dest is not None,
    )


def embedding_sq_norm(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """Squared per-sample embedding-gradient norms ``sum_v ||sum_{t: x_bt = v} g_bt||^2``;
    positions holding ``padding_idx`` add nothing.

    Args:
        ids: token ids, [B, T] (or [B, *]) int32/int64.
        G: backprops, [B, T, d] (or [B, *, d]), fp32/bf16/fp16, any strides.
        num_embeddings: V, the table's rows.
        padding_idx: the row that gets no gradient, or None.

    Returns:
        [B] fp32.
    """
    check_dtypes("embedding_sq_norm", G)
    B, d = ids.shape[0], G.shape[-1]
    seg = _segments(ids, num_embeddings, padding_idx, per_sample=True)
    n = seg.pos.numel()
    n_tiles_max = cdiv(d, _MIN_BD)
    # Tiles beyond the autotuned block count, and unused segments, stay zero.
    part = torch.zeros(n, n_tiles_max, dtype=torch.float32, device=G.device)
    _launch(G, seg, part, n_tiles_max=n_tiles_max)
    seg_sq = part.sum(dim=1)
    # Segments are sorted by sample (the spare key, past them all, belongs to sample B): the
    # segments of sample b are a contiguous range, summed in a fixed order.
    owner = seg.keys // num_embeddings
    sample_offsets = torch.searchsorted(owner, torch.arange(B + 1, device=G.device))
    out = empty((B,), torch.float32, G.device)
    if B > 0:
        launch(_per_sample_total_kernel, (B,), seg_sq, sample_offsets, out, BS=256)
    return out


def embedding_grad_sample(
    ids: torch.Tensor, G: torch.Tensor, num_embeddings: int, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """Per-sample embedding gradients: inherently B*V*d memory (zero-filled first); warns when
    that is large.

    Args:
        ids: token ids, [B, T] (or [B, *]) int32/int64.
        G: backprops, [B, T, d] (or [B, *, d]), fp32/bf16/fp16, any strides.
        num_embeddings: V, the table's rows.
        padding_idx: the row that stays zero, or None.

    Returns:
        [B, V, d] in G's dtype.
    """
    check_dtypes("embedding_grad_sample", G)
    B, d = ids.shape[0], G.shape[-1]
    if B * num_embeddings * d > EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS:
        warnings.warn(embedding_grad_sample_warning(B, num_embeddings, d, G.element_size()), ResourceWarning, stacklevel=3)
    # One spare row past the B*V real ones takes the padding positions.
    out = torch.zeros(B * num_embeddings + 1, d, dtype=G.dtype, device=G.device)
    seg = _segments(ids, num_embeddings, padding_idx, per_sample=True)
    _launch(G, seg, out, dest=seg.keys)
    return out[:B * num_embeddings].view(B, num_embeddings, d)


def embedding_clipped_sum(
    ids: torch.Tensor,
    G: torch.Tensor,
    coef: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Clipped gradient sum ``sum_b c_b * sum_t onehot(x_bt) g_bt^T``, accumulated in fp32.

    Args:
        ids: token ids, [B, T] (or [B, *]) int32/int64.
        G: backprops, [B, T, d] (or [B, *, d]), fp32/bf16/fp16, any strides.
        coef: clipping factors, [B], any float dtype.
        num_embeddings: V, the table's rows.
        padding_idx: the row that gets no gradient, or None.
        out_dtype: the sum's dtype; default G's.

    Returns:
        [V, d] in ``out_dtype``.
    """
    check_dtypes("embedding_clipped_sum", G)
    d = G.shape[-1]
    # One spare row past the V real ones takes the padding positions.
    out = torch.zeros(num_embeddings + 1, d, dtype=out_dtype or G.dtype, device=G.device)
    seg = _segments(ids, num_embeddings, padding_idx, per_sample=False)
    coef = coef.to(device=G.device, dtype=torch.float32).contiguous()
    _launch(G, seg, out, dest=seg.keys, coef=coef)
    return out[:num_embeddings]
