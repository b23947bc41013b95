"""The GEMM skeleton the Linear kernels are built on, after Triton's own matmul tutorials.

Tiles of 128 x 128 outputs for 8 warps, K in steps of 64 with 3 or 4 stages of asynchronous
loads (cp.async on sm_80, and with wgmma on sm_90), grouped rasterisation (``grouped_tile``:
GROUP rows of tiles walked column by column, so the operands a group shares stay in L2), and,
where a program's work is short, a persistent grid whose loop Triton flattens into one
software pipeline. Addresses: a 64-bit base per layer, sample, tile corner and K step,
32-bit offsets inside a tile (``columns``, ``k_offsets``), which ``check_offsets`` proves
cannot overflow before a launch; features contiguous (``unit_features``).
"""

from __future__ import annotations

from typing import List, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

# The largest offset a tile may hold in 32 bits.
I32_MAX = 2**31 - 1

# The skeleton's configs per family of launches (``triton_common.skeleton_family``): for half
# operands 128 x 128 tiles with 8 warps, 3 or 4 stages, and narrower tiles for narrow layers;
# autocast's fp32 operand (rounded in registers) with 8 warps; fp32's dots run on the CUDA
# cores, in steps of K = 32 (their operands in registers: at K = 64 ptxas spills on sm_80).
# Rows not on 16 bytes are loaded element by element, their offsets in registers: narrow tiles.
_NARROW = ["BK=32 BM=64 BN=64 GROUP=8 w4", "BK=32 BM=64 BN=64 GROUP=8 w8"]
GEMM_TILES = {
    "half": ["BK=64 BM=128 BN=128 GROUP=8 w8", "BK=64 BM=128 BN=128 GROUP=8 w8 s4",
             "BK=64 BM=128 BN=64 GROUP=8 w8", "BK=64 BM=128 BN=64 GROUP=8 w8 s4", "BK=64 BM=64 BN=64 GROUP=8 w4"],
    "autocast": ["BK=64 BM=128 BN=128 GROUP=8 w8", "BK=64 BM=128 BN=64 GROUP=8 w8", "BK=32 BM=64 BN=64 GROUP=8 w8"],
    "fp32": ["BK=32 BM=64 BN=64 GROUP=8 w8", "BK=32 BM=128 BN=64 GROUP=8 w8"],
    "half unaligned": _NARROW, "autocast unaligned": _NARROW, "fp32 unaligned": _NARROW[1:],
}


def unit_features(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The skeleton's operands, [B, T, n] each, with their features (the last dim) contiguous:
    those whose features are strided are copied (the kernels' tiles take a unit stride there,
    which spares the registers of per-element offsets)."""
    return [t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in tensors]


def check_offsets(name: str, block_k: int, *extents) -> None:
    """Raise ValueError unless every tile's 32-bit offsets fit: ``extents`` are
    ``(stride along K, the tile's width across it)`` of each operand (unit stride across K),
    whose tiles span ``block_k`` rows of K (and whose K loop steps ``block_k * s_k`` at once)."""
    for s_k, n in extents:
        largest = block_k * abs(s_k) + max(n - 1, 0)
        if largest > I32_MAX:
            raise ValueError(f"{name}: an operand's tile spans {largest} elements (stride {s_k} along K), past "
                             "32-bit offsets: make it contiguous, or use the eager backend (DPGRAD_BACKEND=eager)")


@triton.jit
def layer_base(X, X_OFFS, i_l, grouped, ALIGN: tl.constexpr):
    """Layer ``i_l``'s tensor in a grouped launch: X plus its offset from X, read from the table
    ``X_OFFS`` (``triton_common.relative``; a multiple of ALIGN elements), or X itself. Derived
    from the argument X, the pointer keeps the alignment Triton specialises X on."""
    off = tl.load(X_OFFS + i_l, mask=grouped != 0, other=0)
    return X + tl.multiple_of(off, ALIGN)


@triton.jit
def grouped_tile(tile, n_m, n_n, GROUP: tl.constexpr):
    """Tile ``tile`` of an (n_m x n_n) grid of tiles, walked GROUP rows at a time, column by
    column inside each group (Triton's matmul tutorial's order): (row, column)."""
    in_group = GROUP * n_n
    first = (tile // in_group) * GROUP
    rows = tl.minimum(n_m - first, GROUP)
    return first + (tile % in_group) % rows, (tile % in_group) // rows


@triton.jit
def k_offsets(o_n, s_k, BK: tl.constexpr):
    """The 32-bit offsets of a [BK, BN] tile of a (K, N) operand, N contiguous (``o_n``: its
    columns, from ``columns``), from a row's base, which the K loop advances by ``BK * s_k``."""
    return tl.arange(0, BK)[:, None] * s_k + o_n[None, :]


@triton.jit
def k_tile(base, offsets, k0, K, m_n, BK: tl.constexpr):
    """The tile at ``base + offsets`` (``k_offsets``), rows from ``k0`` on: rows past K and
    columns outside ``m_n`` read as 0 (masked loads keep the offsets contiguous, which the
    asynchronous copies need)."""
    return tl.load(base + offsets, mask=((k0 + tl.arange(0, BK))[:, None] < K) & m_n[None, :], other=0.0)


@triton.jit
def columns(i, N, BN: tl.constexpr):
    """Offsets inside tile ``i`` along an axis of N (0 to BN - 1, 32-bit: the caller's base
    points at the tile's first column) and which of them are inside N."""
    o = tl.arange(0, BN)
    return o, i * BN + o < N


@triton.jit
def triangle(q):
    """The pair (i, j), i <= j, numbered ``q`` in the order (0,0), (0,1), (1,1), (0,2)..."""
    j = ((tl.sqrt(8.0 * q.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    # fp32's square root may land one off either way for large q.
    j = tl.where(j * (j + 1) // 2 > q, j - 1, j)
    j = tl.where((j + 1) * (j + 2) // 2 <= q, j + 1, j)
    return q - j * (j + 1) // 2, j


# Below the kernels' helpers, so that their line numbers (part of Triton's cache keys) stay.
from .triton_common import Relative, check_dtypes, relative  # noqa: E402


class Operands(NamedTuple):
    """What a skeleton launcher reads its L layers from (``operands``): the first layer's A and
    G, the tables of the layers' offsets (``triton_common.relative``, which hold the layers'
    tensors, copies among them, until the launch), and the sizes."""

    A: torch.Tensor
    G: torch.Tensor
    a: Relative
    g: Relative
    B: int
    T: int
    d: int
    p: int


def operands(name: str, As: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor]) -> Operands:
    """The launchers' common preparation of L layers' inputs [B, T, d] and backprops [B, T, p]:
    features made contiguous (``unit_features``), dtypes checked, offset tables made."""
    As, Gs = unit_features(As), unit_features(Gs)
    check_dtypes(name, As[0], Gs[0])
    B, T, d = As[0].shape
    return Operands(As[0], Gs[0], relative(As), relative(Gs), B, T, d, Gs[0].shape[2])
