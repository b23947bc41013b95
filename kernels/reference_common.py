"""What the eager launchers of every layer type share (``dpgrad.kernels.reference`` re-exports
it): accumulation dtypes, operands as autocast's matmuls took them, batch slices of bounded
memory, squared norms in one pass, and batched GEMMs that accumulate in fp32. The Triton
launchers use some of it too (``same_layout``). Tensors in, tensors out.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

# Upper bound on the elements of one batch slice's intermediate tensor.
CHUNK_ELEMENTS = 1 << 24


def same_layout(tensors) -> bool:
    """Whether tensors share shape, dtype and strides: one grouped kernel launch reads them all
    where they are (``triton_common.grouped``)."""
    first = tensors[0]
    return all(t.shape == first.shape and t.dtype == first.dtype and t.stride() == first.stride() for t in tensors)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs accumulate in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


HALF = (torch.float16, torch.bfloat16)


def autocast_operand(x: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    """``x`` as the matmul took it beside ``partner`` (``autocast_operands`` for one operand):
    rounded to the half dtype of ``partner`` if ``x`` is fp32 beside a half ``partner``."""
    if x.dtype == torch.float32 and partner.is_floating_point() and partner.dtype in HALF:
        return x.to(partner.dtype)
    return x


def autocast_operands(A: torch.Tensor, G: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A Linear's inputs and backprops as its matmul under ``torch.autocast`` took them: an
    fp32 one beside a half one is rounded to that half dtype (the forward pass multiplied the
    input cast to the autocast dtype, so autograd's weight gradient is ``G^T cast(A)``; for
    Conv1D's swapped roles, likewise). Other pairs are returned as they are."""
    return autocast_operand(A, G), autocast_operand(G, A)


def autocast_rounded(x: torch.Tensor, partner: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``x`` in ``acc``, through the half dtype of ``partner`` if ``x`` is fp32 beside a half
    ``partner`` (``autocast_operand``, then widened)."""
    return autocast_operand(x, partner).to(acc)


def batch_slices(batch: int, elements_per_sample: int, samples: Optional[int] = None) -> Iterator[slice]:
    """Slices of range(batch) whose intermediates hold at most CHUNK_ELEMENTS elements, and at
    most ``samples`` samples where it is given."""
    step = max(1, CHUNK_ELEMENTS // max(1, elements_per_sample))
    if samples is not None:
        step = max(1, min(step, samples))
    for start in range(0, batch, step):
        yield slice(start, min(batch, start + step))


# Above this many elements, ``sq_norms`` widens its input to float64 a piece at a time.
SQ_NORMS_WHOLE_ELEMENTS = 1 << 20
# Pieces ``sq_norms`` takes at most: each piece's float64 copy then holds at most a quarter of
# the input's fp32 bytes.
SQ_NORMS_PIECES = 8


def sq_norms(x: torch.Tensor, dim, pieces: Optional[bool] = None) -> torch.Tensor:
    """Squared norms of ``x`` over ``dim`` in one pass over it: one reduction, no squared copy
    of ``x`` written and read back (on a GPU that copy of a batch's per-sample gradients cost
    about as much as the product that made them). The reduction accumulates in float64 (a
    memory-bound pass, no slower for it): a sum of p * d squares in fp32 would lose more than the
    products that made them (sqrt(p d) of fp32's unit, 5e-6 at p d = 7e5), in x's dtype or
    fp32, whichever is wider.

    torch widens the whole input to float64 before reducing it (twice the bytes of fp32
    per-sample gradients): above ``SQ_NORMS_WHOLE_ELEMENTS`` elements, or whatever the size
    with ``pieces`` (memory short), with ``dim`` every dimension after the first and ``x``
    contiguous, the rows are reduced in at most ``SQ_NORMS_PIECES`` pieces of columns, their
    float64 squares added."""
    out = _at_least_fp32(x)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if pieces is None:
        pieces = x.numel() > SQ_NORMS_WHOLE_ELEMENTS
    if (x.dtype == torch.float64 or not pieces or not x.is_contiguous()
            or sorted(d % x.dim() for d in dims) != list(range(1, x.dim()))):
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64).square().to(out)
    rows = x.view(x.shape[0], -1)
    width = -(-rows.shape[1] // SQ_NORMS_PIECES)
    total = None
    for start in range(0, rows.shape[1], width):
        part = torch.linalg.vector_norm(rows[:, start:start + width], dim=1, dtype=torch.float64).square()
        total = part if total is None else total.add_(part)
    return total.to(out)


def _at_least_fp32(x: torch.Tensor) -> torch.dtype:
    """x's dtype or fp32, whichever is wider (decided on the host: no operation dispatched)."""
    return x.dtype if x.dtype == torch.float64 else torch.float32


_OUT_DTYPE_MATMUL: dict = {}


def _half_cuda_pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are CUDA tensors of one half dtype (the matrix units' inputs)."""
    return a.is_cuda and a.dtype == b.dtype and a.dtype in HALF


def bmm_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` accumulated and returned in fp32 (fp64 for fp64 inputs).

    Half-precision CUDA operands go to the matrix units as they are, with an fp32 result
    (``out_dtype``, where this torch has it): no fp32 copies of the operands. Elsewhere the
    operands are widened first (a no-op for fp32 inputs).
    """
    acc = accumulation_dtype(a, b)
    if _half_cuda_pair(a, b):
        supported = _OUT_DTYPE_MATMUL.get(a.device)
        if supported is not False:
            try:
                out = torch.bmm(a, b, out_dtype=acc)
                _OUT_DTYPE_MATMUL[a.device] = True
                return out
            except (TypeError, RuntimeError):  # a torch without bmm's out_dtype
                _OUT_DTYPE_MATMUL[a.device] = False
    return torch.bmm(a.to(acc), b.to(acc))


# Whether a GEMM of this torch adds a half product to an fp32 matrix itself (``baddbmm``'s
# ``out_dtype``), per (device, dtype): checked once on exact small integers.
_GEMM_ADDS: dict = {}


def _gemm_adds_exactly(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.baddbmm(c, a, b, out_dtype=torch.float32)`` with ``a``, ``b`` in ``dtype``
    on ``device`` returns ``c + a @ b`` in fp32: small integers, whose products and sums every
    path computes exactly, so the answer is equality (a torch without the overload, or one
    that dropped ``c``, gives False)."""
    try:
        a = (torch.arange(2 * 8 * 32, device=device) % 7 - 3).to(dtype).view(2, 8, 32)
        c = (torch.arange(2 * 8 * 8, device=device) % 5 - 2).to(torch.float32).view(2, 8, 8)
        got = torch.baddbmm(c, a, a.transpose(1, 2), out_dtype=torch.float32)
        want = c + torch.bmm(a.float(), a.float().transpose(1, 2))
        return got.dtype == torch.float32 and bool(torch.equal(got, want))
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _adds_in_gemm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``baddbmm_acc`` lets the GEMM add its product to ``c``: half CUDA operands, an
    fp32 ``c``, and a torch that does so exactly (``_gemm_adds_exactly``, once per device)."""
    if not (_half_cuda_pair(a, b) and c.dtype == torch.float32):
        return False
    key = (a.device, a.dtype)
    if key not in _GEMM_ADDS:
        _GEMM_ADDS[key] = _gemm_adds_exactly(a.device, a.dtype)
    return _GEMM_ADDS[key]


def baddbmm_acc(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + bmm_acc(a, b)``, ``c`` in the accumulation dtype (and added to in place where the
    product is taken on its own). Half CUDA operands: the GEMM adds its fp32 result to ``c``
    (one pass over ``c``, no product written and read back), where this torch can."""
    if _adds_in_gemm(c, a, b):
        return torch.baddbmm(c, a, b, out_dtype=torch.float32)
    return c.add_(bmm_acc(a, b))
