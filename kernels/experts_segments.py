"""Mixture-of-experts weights (E, p, q): per-sample norms, clipped sums and per-sample gradients
over (expert, sample) segments, in Triton: the CUDA twins of ``reference_experts``, under its
names and signatures.

Pair s adds ``left[s] ⊗ right[s]`` to its expert's (p, q) gradient (``right`` None: ``left[s]``
to a (p,) bias) and belongs to ``sample[s]``. The pairs are sorted on the device by the key
``expert * B + sample``, so that each (expert, sample) segment is a contiguous range of the
order (``torch.searchsorted`` gives every key's range: no size here waits for the device).
- norms: an item is one (segment, (p, q) tile): the tile of ``L_seg^T R_seg`` as a GEMM over
  the segment's pairs (K = pairs, BK at a time, their rows gathered through the order), on the
  GEMM skeleton's tiles (gemm_tiles.py), squared and summed in the epilogue into one partial
  per (segment, tile), a program per item of the segments that have pairs (at most
  min(S, E B); the rest exit at once). The K loop's bounds come from the data, so Triton
  cannot flatten it into a persistent loop over the items (gemm_tiles.py's kernels do):
  programs of their own, several resident per SM, overlap one item's epilogue with another's
  loads instead. The partials are added per sample in a fixed order (no atomics: the same
  bits every run).
- per-sample gradients: the same items over all E B segments, each tile stored at (b, e)
  (zeros where sample b routes nothing to expert e).
- clipped sums: per (expert, tile) one GEMM over the expert's pairs, taken in runs of one
  clipping coefficient (pairs sorted by expert, then coefficient): each run's product on the
  tensor cores from zero, scaled by its coefficient in fp32 (never a rounded ``c * left``, as
  in linear_clipped_sum.py), added up in fp32.
- biases: the same segments' rows summed in fp32 (scaled per pair for the clipped sum).
``left`` plays the part of a Linear's backprops G (the rows p of the gradient), ``right`` of
its inputs A (the columns q). Rows are read where they are, features contiguous (strided
features are copied); each row's base is 64-bit, offsets inside a tile 32-bit. Inputs of
fp32, bf16 or fp16, accumulated in fp32; a half ``left`` beside an fp32 ``right`` (or the
reverse) is widened to fp32, as the reference multiplies them.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .gemm_tiles import GEMM_TILES, I32_MAX, check_offsets, columns, grouped_tile
from .triton_common import INTERPRET, cdiv, check_dtypes, configs, dot_fp32, empty, family_configs, launch
from .triton_common import PRUNE_RULES, SPILLS, config_name, keep_only, min_block, one_family, placeholder, prune_for
from .triton_common import round_to_bf16, skeleton_family

# The configs are the ones that compile without spilling for every target (sm_80, sm_90,
# sm_100: tests/test_kernel_compile.py), ptxas's register budget for them being its own. The
# gathered rows are loaded one step of K ahead of the dot whatever the stages (4 take the
# shared memory of 3): the skeleton's 4-stage configs would only be timed twice.
_SKELETON = {family: [n for n in names if not n.endswith(" s4")] for family, names in GEMM_TILES.items()}
# Segments are often short (tens of pairs): K steps of 32 beside the skeleton's 64.
_SEGMENT_TILES = {**_SKELETON, "half": _SKELETON["half"] + ["BK=32 BM=64 BN=128 GROUP=8 w8",
                                                            "BK=32 BM=64 BN=64 GROUP=8 w4"]}
SEGMENT_CONFIGS = family_configs("_experts_segment_kernel", skeleton_family, _SEGMENT_TILES,
                                 interpret=dict(BM=32, BN=32, BK=16, GROUP=2))
# Two fp32 accumulators (the sum and a run's), as in linear_clipped_sum.py: its tiles.
_CLIPPED_TILES = {**_SKELETON,
                  "fp32": ["BK=16 BM=64 BN=64 GROUP=8 w8", "BK=16 BM=64 BN=32 GROUP=8 w4"],
                  "half unaligned": ["BK=32 BM=64 BN=64 GROUP=8 w8"],
                  "fp32 unaligned": ["BK=32 BM=64 BN=32 GROUP=8 w4", "BK=16 BM=64 BN=64 GROUP=8 w8"]}
CLIPPED_CONFIGS = family_configs("_experts_clipped_sum_kernel", skeleton_family, _CLIPPED_TILES,
                                 interpret=dict(BM=32, BN=32, BK=16, GROUP=2))
ROWS_CONFIGS = configs([dict(BP=bp, BR=br) for bp in (64, 128, 256) for br in (4, 16)],
                       interpret=dict(BP=32, BR=8), num_warps=(2, 4))
_ROWS = [f"BP={bp} BR={br} w{w}" for bp in (64, 128, 256) for br in (4, 16) for w in (2, 4)]
keep_only("_experts_rows_kernel", one_family("X"),
          {"fp32": _ROWS, "half": [n for n in _ROWS if n not in ("BP=256 BR=4 w2", "BP=256 BR=16 w2")]})
_MIN_BM, _MIN_BN = min_block(SEGMENT_CONFIGS, "BM"), min_block(SEGMENT_CONFIGS, "BN")
_MAX_BM = max(c.kwargs["BM"] for c in SEGMENT_CONFIGS + CLIPPED_CONFIGS)
_MAX_BN = max(c.kwargs["BN"] for c in SEGMENT_CONFIGS + CLIPPED_CONFIGS)
_MIN_BP = min_block(ROWS_CONFIGS, "BP")


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 ``x`` in DTYPE, rounded to nearest (bf16 by its bits: the interpreter's cast truncates)."""
    if DTYPE == tl.bfloat16:
        x = round_to_bf16(x)
    return x.to(DTYPE)


@triton.jit
def pair_rows(ORDER, k0, end, BK: tl.constexpr):
    """The pairs at places k0 to k0 + BK - 1 of the order (0 past ``end``) and which are real."""
    o_k = k0 + tl.arange(0, BK)
    m_k = o_k < end
    return tl.load(ORDER + o_k, mask=m_k, other=0), m_k


@triton.jit
def row_tile(X, pairs, m_k, s_x, o_c, m_c, ALIGN: tl.constexpr):
    """[BK, BC]: the rows of ``pairs`` (64-bit bases, multiples of ALIGN elements), columns
    ``o_c`` (32-bit, contiguous), 0 outside ``m_k`` x ``m_c``."""
    rows = tl.multiple_of(pairs.to(tl.int64) * s_x, ALIGN)
    return tl.load(X + rows[:, None] + o_c[None, :], mask=m_k[:, None] & m_c[None, :], other=0.0)


@triton.jit
def segment_product(G, A, ORDER, start, end, s_gk, s_ak, o_m, m_m, o_n, m_n, UPCAST: tl.constexpr,
                    A_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """[BM, BN] fp32: ``sum_{k in [start, end)} G[order[k]]^T A[order[k]]`` over the tile's rows
    and columns (G, A: the tile's corners)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, end, BK):
        pairs, m_k = pair_rows(ORDER, k0, end, BK)
        b_g = row_tile(G, pairs, m_k, s_gk, o_m, m_m, G_ALIGN)  # [BK, BM]
        b_a = row_tile(A, pairs, m_k, s_ak, o_n, m_n, A_ALIGN)  # [BK, BN]
        acc = dot_fp32(tl.trans(b_g), b_a, acc, UPCAST)
    return acc


# Norm partials are laid out for the smallest tiles: what a config tried while tuning leaves is
# cleared (reset_to_zero).
@triton.autotune(configs=SEGMENT_CONFIGS, key=["p", "q", "STORE", "A_ALIGN", "G_ALIGN"], reset_to_zero=["SQ"],
                 prune_configs_by=prune_for("_experts_segment_kernel"))
@triton.jit(do_not_specialize=["B", "E"])
def _experts_segment_kernel(
    G, A, ORDER, KEYS, OFFSETS, W, SQ,
    B, E, p, q, s_gk, s_ak, n_tiles_max,
    STORE: tl.constexpr, UPCAST: tl.constexpr, A_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):
    n_m = tl.cdiv(p, BM)
    n_n = tl.cdiv(q, BN)
    tiles = n_m * n_n
    # Items of one segment are neighbours: its rows stay in L2 while its tiles are walked.
    item = tl.program_id(0)
    i_seg = item // tiles
    i_m, i_n = grouped_tile(item % tiles, n_m, n_n, GROUP)
    key = tl.load(KEYS + i_seg)  # expert * B + sample; past the real ones a key with no pairs
    start = tl.load(OFFSETS + key)
    end = tl.load(OFFSETS + key + 1)
    o_m, m_m = columns(i_m, p, BM)
    o_n, m_n = columns(i_n, q, BN)
    acc = segment_product(G + i_m * BM, A + i_n * BN, ORDER, start, end, s_gk, s_ak, o_m, m_m, o_n, m_n,
                          UPCAST, A_ALIGN, G_ALIGN, BM, BN, BK)
    if STORE:
        # Sample b's gradient of expert e at W[b, e]: a 64-bit base, 32-bit offsets in the tile.
        key = key.to(tl.int64)
        p_w = W + ((key % B) * E + key // B) * p * q + (i_m * BM).to(tl.int64) * q + i_n * BN
        tl.store(p_w + o_m[:, None] * q + o_n[None, :], rounded(acc, W.dtype.element_ty),
                 mask=m_m[:, None] & m_n[None, :])
    else:
        # Rows and columns outside the matrix are exact zeros: they add nothing.
        tl.store(SQ + i_seg.to(tl.int64) * n_tiles_max + item % tiles, tl.sum(acc * acc))


@triton.autotune(configs=CLIPPED_CONFIGS, key=["p", "q", "A_ALIGN", "G_ALIGN"],
                 prune_configs_by=prune_for("_experts_clipped_sum_kernel"))
@triton.jit
def _experts_clipped_sum_kernel(
    G, A, ORDER, COEF, RUNS, RUN_OFFSETS, W,
    p, q, s_gk, s_ak,
    UPCAST: tl.constexpr, A_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):
    n_m = tl.cdiv(p, BM)
    n_n = tl.cdiv(q, BN)
    i_m, i_n = grouped_tile(tl.program_id(0), n_m, n_n, GROUP)
    e = tl.program_id(1).to(tl.int64)
    o_m, m_m = columns(i_m, p, BM)
    o_n, m_n = columns(i_n, q, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for run in range(tl.load(RUNS + e), tl.load(RUNS + e + 1)):
        start = tl.load(RUN_OFFSETS + run)
        end = tl.load(RUN_OFFSETS + run + 1)
        acc_r = segment_product(G + i_m * BM, A + i_n * BN, ORDER, start, end, s_gk, s_ak, o_m, m_m, o_n, m_n,
                                UPCAST, A_ALIGN, G_ALIGN, BM, BN, BK)
        # A run is never empty: its first pair's coefficient is every one of its pairs'.
        acc += tl.load(COEF + tl.load(ORDER + start)) * acc_r
    p_w = W + e * p * q + (i_m * BM).to(tl.int64) * q + i_n * BN
    tl.store(p_w + o_m[:, None] * q + o_n[None, :], rounded(acc, W.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


@triton.autotune(configs=ROWS_CONFIGS, key=["p", "SCALED", "STORE"], reset_to_zero=["SQ"],
                 prune_configs_by=prune_for("_experts_rows_kernel"))
@triton.jit(do_not_specialize=["B", "E"])
def _experts_rows_kernel(
    X, ORDER, KEYS, OFFSETS, COEF, OUT, SQ,
    B, E, p, s_xk, n_tiles_max,
    SCALED: tl.constexpr, STORE: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr,
):
    """A bias: each group's rows summed in fp32 (``SCALED``: each row times its pair's COEF), then
    stored at OUT[key % B, key // B] (``STORE``) or squared into one partial per (group, tile)."""
    i_g = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    key = tl.load(KEYS + i_g)
    start = tl.load(OFFSETS + key)
    end = tl.load(OFFSETS + key + 1)
    o_p, m_p = columns(i_p, p, BP)
    acc = tl.zeros((BP,), dtype=tl.float32)
    for r0 in range(start, end, BR):
        pairs, m_r = pair_rows(ORDER, r0, end, BR)
        b_x = row_tile(X + i_p * BP, pairs, m_r, s_xk, o_p, m_p, 1).to(tl.float32)  # [BR, BP]
        if SCALED:
            b_x = b_x * tl.load(COEF + pairs, mask=m_r, other=0.0)[:, None]
        acc += tl.sum(b_x, axis=0)
    if STORE:
        key = key.to(tl.int64)
        p_out = OUT + ((key % B) * E + key // B) * p + i_p * BP
        tl.store(p_out + o_p, rounded(acc, OUT.dtype.element_ty), mask=m_p)
    else:
        tl.store(SQ + i_g * n_tiles_max + i_p, tl.sum(acc * acc))


# ----------------------------------------------------------------------------- the launchers
# Pair numbers, keys and offsets are int32 for the kernels (64-bit loop counters and pair
# numbers cost the GEMM kernels registers that ptxas then spills on sm_80): S, E B < 2^31.
I32 = torch.int32


class _Segments(NamedTuple):
    order: torch.Tensor  # (S,) int32: the pairs sorted by key expert * B + sample (stable)
    offsets: torch.Tensor  # (E B + 2,) int32: each key's range in the order; E B and E B + 1 empty, at S
    present: torch.Tensor  # (min(S, E B),) int64: the keys that have pairs, ascending, then E B (no pairs)


def _segments(expert: torch.Tensor, sample: torch.Tensor, E: int, B: int) -> _Segments:
    """The (expert, sample) segments, on the device with no wait for it (searchsorted, not
    bincount, whose CUDA version reads the largest key back to size its output)."""
    device = expert.device
    key, order = torch.sort(expert.to(torch.int64) * B + sample.to(torch.int64), stable=True)
    offsets = torch.searchsorted(key, torch.arange(E * B + 2, device=device), out_int32=True)
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    present = torch.full((min(key.numel(), E * B),), E * B, dtype=torch.int64, device=device)
    # Every pair of a segment writes the segment's own key at the segment's place: one value.
    present.scatter_(0, torch.cumsum(first, 0) - 1, key)
    return _Segments(order.to(I32), offsets, present)


def _runs(expert: torch.Tensor, coef: torch.Tensor, E: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, then coefficient (``order``), cut into runs of one expert and
    one coefficient: each run's range in the order (``run_offsets``, (S + 1,), S past the last)
    and each expert's first run (``runs``, (E + 1,), the number of runs last); all int32."""
    S, device, expert = expert.numel(), expert.device, expert.to(torch.int64)
    by_coef = torch.argsort(coef, stable=True)
    order = by_coef[torch.argsort(expert[by_coef], stable=True)]
    e_sorted, c_sorted = expert[order], coef[order]
    new = torch.ones(S, dtype=torch.bool, device=device)
    new[1:] = (e_sorted[1:] != e_sorted[:-1]) | (c_sorted[1:] != c_sorted[:-1])
    run = torch.cumsum(new, 0) - 1
    places = torch.arange(S, device=device)
    run_offsets = torch.full((S + 1,), S, dtype=torch.int64, device=device)
    run_offsets.scatter_reduce_(0, run, places, reduce="amin")
    first_pair = torch.searchsorted(e_sorted, torch.arange(E + 1, device=device))
    runs = torch.cat([run, run[-1:] + 1])[first_pair]
    return order.to(I32), run_offsets.to(I32), runs.to(I32)


def _operands(name: str, left: torch.Tensor, right: Optional[torch.Tensor]):
    """Dtypes checked; features contiguous; a half beside fp32 widened, as the reference does."""
    check_dtypes(name, *(t for t in (left, right) if t is not None))
    if right is not None and left.dtype != right.dtype:
        left, right = left.float(), right.float()
    return [t if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in (left, right)]


def _align(x: torch.Tensor) -> int:
    """The largest power of two, up to 16 bytes, in elements, dividing x's address and row stride."""
    size = x.element_size()
    align = 16 // size
    while align > 1 and ((x.data_ptr() // size) % align or x.stride(0) % align):
        align //= 2
    return align


def _kernel_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels store: ``out_dtype`` where they can, else fp32 (converted after)."""
    return out_dtype if out_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def _check_sizes(name: str, S: int, keys: int) -> None:
    if max(S, keys + 2) > I32_MAX:
        raise ValueError(f"{name}: {S} pairs, {keys} segments pass the kernels' 32-bit pair numbers: use the eager "
                         "backend (DPGRAD_BACKEND=eager) for these shapes")


def _segment_launch(L, R, order, keys, offsets, W, SQ, B, E, n_tiles_max, store: bool) -> None:
    S, p = L.shape
    q, n = R.shape[1], keys.numel()
    if n * cdiv(p, _MIN_BM) * cdiv(q, _MIN_BN) > I32_MAX:
        raise ValueError(f"experts: {n} segments of ({p}, {q}) tiles pass 32-bit item numbers: use the eager "
                         "backend (DPGRAD_BACKEND=eager) for these shapes")
    check_offsets("experts", _MAX_BM, (q, _MAX_BN))
    launch(_experts_segment_kernel, lambda meta: (n * cdiv(p, meta["BM"]) * cdiv(q, meta["BN"]),),
           L, R, order, keys, offsets, W, SQ, B, E, p, q, L.stride(0), R.stride(0), n_tiles_max,
           STORE=store, UPCAST=INTERPRET, A_ALIGN=_align(R), G_ALIGN=_align(L))


def _rows_launch(X, order, keys, offsets, coef, out, SQ, B, E, n_tiles_max, store: bool) -> None:
    p = X.shape[1]
    launch(_experts_rows_kernel, lambda meta: (keys.numel(), cdiv(p, meta["BP"])),
           X, order, keys, offsets, placeholder(X.device) if coef is None else coef, out, SQ,
           B, E, p, X.stride(0), n_tiles_max, SCALED=coef is not None, STORE=store)


def experts_sq_norms(left: torch.Tensor, right: Optional[torch.Tensor], expert: torch.Tensor, sample: torch.Tensor,
                     num_experts: int, batch: int) -> torch.Tensor:
    """(B,) fp32 squared norms of each sample's gradient of the (E, p, q) weight (or (E, p) bias).

    Args:
        left: (S, p), fp32/bf16/fp16; right: (S, q) or None (a bias).
        expert, sample: (S,) int, each pair's expert in [0, E) and sample in [0, B).
    """
    left, right = _operands("experts_sq_norms", left, right)
    E, B, (S, p) = num_experts, batch, left.shape
    q = 1 if right is None else right.shape[1]
    device = left.device
    if S == 0 or p * q == 0:
        return torch.zeros(B, dtype=torch.float32, device=device)
    _check_sizes("experts_sq_norms", S, E * B)
    seg = _segments(expert, sample, E, B)
    keys, n = seg.present.to(I32), seg.present.numel()
    if right is None:
        n_tiles_max = cdiv(p, _MIN_BP)
        part = torch.zeros(n, n_tiles_max, dtype=torch.float32, device=device)
        _rows_launch(left, seg.order, keys, seg.offsets, None, placeholder(device), part, B, E, n_tiles_max,
                     store=False)
    else:
        n_tiles_max = cdiv(p, _MIN_BM) * cdiv(q, _MIN_BN)
        # Bigger tiles fill a prefix of each row; the rest must add zero.
        part = torch.zeros(n, n_tiles_max, dtype=torch.float32, device=device)
        _segment_launch(left, right, seg.order, keys, seg.offsets, placeholder(device), part, B, E, n_tiles_max,
                        store=False)
    # Each segment's partials, then each sample's segments over the experts, in a fixed order.
    dense = torch.zeros(E * B + 1, dtype=torch.float64, device=device)
    dense.scatter_(0, seg.present, part.sum(dim=1, dtype=torch.float64))
    return dense[:E * B].view(E, B).sum(dim=0).float()


def experts_clipped_sum(left: torch.Tensor, right: Optional[torch.Tensor], expert: torch.Tensor,
                        pair_coef: torch.Tensor, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The clipped gradient ``sum_s coef[s] left[s] ⊗ right[s]`` into each pair's expert, (E, p, q)
    (or (E, p)) in ``out_dtype``; ``pair_coef`` (S,) is each pair's sample's clipping coefficient."""
    left, right = _operands("experts_clipped_sum", left, right)
    E, (S, p) = num_experts, left.shape
    device = left.device
    shape = (E, p) if right is None else (E, p, right.shape[1])
    if S == 0 or 0 in shape:
        return torch.zeros(shape, dtype=out_dtype, device=device)
    _check_sizes("experts_clipped_sum", S, E)
    coef = pair_coef.to(device=device, dtype=torch.float32).contiguous()
    out = empty(shape, _kernel_dtype(out_dtype), device)
    if right is None:
        # Each row scaled in fp32 as it is read: a plain sum per expert.
        order = torch.argsort(expert, stable=True)
        offsets = torch.searchsorted(expert[order].to(torch.int64), torch.arange(E + 1, device=device), out_int32=True)
        _rows_launch(left, order.to(I32), torch.arange(E, dtype=I32, device=device), offsets, coef, out,
                     placeholder(device), 1, E, 0, store=True)
        return out.to(out_dtype)
    order, run_offsets, runs = _runs(expert, coef, E)
    q = right.shape[1]
    check_offsets("experts_clipped_sum", _MAX_BM, (q, _MAX_BN))
    launch(_experts_clipped_sum_kernel, lambda meta: (cdiv(p, meta["BM"]) * cdiv(q, meta["BN"]), E),
           left, right, order, coef, runs, run_offsets, out, p, q, left.stride(0), right.stride(0),
           UPCAST=INTERPRET, A_ALIGN=_align(right), G_ALIGN=_align(left))
    return out.to(out_dtype)


def experts_grad_sample(left: torch.Tensor, right: Optional[torch.Tensor], expert: torch.Tensor, sample: torch.Tensor,
                        num_experts: int, batch: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-sample gradients, (B, E, p, q) (or (B, E, p)) in ``out_dtype``: every (sample, expert)
    written once, zeros where the sample routes nothing to the expert."""
    left, right = _operands("experts_grad_sample", left, right)
    E, B, (S, p) = num_experts, batch, left.shape
    device = left.device
    shape = (B, E, p) if right is None else (B, E, p, right.shape[1])
    if S == 0 or 0 in shape:
        return torch.zeros(shape, dtype=out_dtype, device=device)
    _check_sizes("experts_grad_sample", S, E * B)
    seg = _segments(expert, sample, E, B)
    every = torch.arange(E * B, dtype=I32, device=device)
    out = empty(shape, _kernel_dtype(out_dtype), device)
    if right is None:
        _rows_launch(left, seg.order, every, seg.offsets, None, out, placeholder(device), B, E, 0, store=True)
    else:
        _segment_launch(left, right, seg.order, every, seg.offsets, out, placeholder(device), B, E, 0, store=True)
    return out.to(out_dtype)


# What the oldest supported Triton (3.6) spills with besides (``python -m
# dpgrad.tools.kernel_compile`` under triton==3.6.0, sm_80 and sm_90), kept from those launches
# here, below the kernels, whose compile results are keyed by their lines.
keep_only("_experts_rows_kernel", one_family("X"),
          {"half": [n for n in _ROWS if n not in ("BP=128 BR=16 w2", "BP=256 BR=16 w4")]})
keep_only("_experts_clipped_sum_kernel", skeleton_family, {"fp32": ["BK=16 BM=64 BN=64 GROUP=8 w8"]})


def _wide_half_into_fp32(config: Dict[str, Any], capability: int, pointers: Dict[str, Optional[str]]) -> bool:
    """The segment kernel's widest half tile writing fp32 per-sample gradients on sm_80."""
    return (capability == 80 and pointers.get("W") == "fp32" and pointers.get("G") in ("bf16", "fp16")
            and config_name(config) == "BK=64 BM=128 BN=64 GROUP=8 w8")


PRUNE_RULES.setdefault("_experts_segment_kernel", []).append((_wide_half_into_fp32, SPILLS))
