"""Flop and byte counts of every candidate, and what they predict on a device.

The model prunes candidates that cannot win and, with ``DPGRAD_TUNE=off``, makes the choice
alone. Counts follow DESIGN.md (B batch, T tokens, d in-features, p out-features, V
vocabulary, e bytes per input element): direct 2BTpd flops; tiled Gram BT^2(p+d) flops with
symmetry; Opacus's eager Gram 2BT^2(p+d) flops plus two (B, T, T) fp32 tensors. Predicted
time is max(flops / peak flops, bytes / bandwidth): a roofline, coarse on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpgrad.kernels.reference import CHUNK_ELEMENTS, GRAM_CHUNK, gram_by_halves

# Tile sizes the byte counts assume (the autotuner may pick others).
TILE = 128
GRAM_BLOCK = 64


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of a device: flops/s for half and fp32 inputs, bytes/s of memory."""

    name: str
    half_flops: float
    fp32_flops: float
    bandwidth: float


# Dense peak rates from the vendors' data sheets (no sparsity).
_GPUS = [
    ("H200", DeviceSpec("H200", 989e12, 67e12, 4.8e12)),
    ("H100", DeviceSpec("H100", 989e12, 67e12, 3.35e12)),
    ("A100", DeviceSpec("A100", 312e12, 19.5e12, 2.0e12)),
    ("L4", DeviceSpec("L4", 121e12, 30e12, 0.3e12)),
]
_GENERIC_GPU = DeviceSpec("GPU", 100e12, 15e12, 1.0e12)
# A few cores with AVX2/AVX-512: within a factor of a few of a laptop or a cloud VM.
_CPU = DeviceSpec("CPU", 1e11, 1e11, 2e10)


def device_spec(device: torch.device) -> DeviceSpec:
    """The spec for a device: a known GPU by name, else a generic GPU or CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return _CPU
    name = torch.cuda.get_device_name(device)
    for key, spec in _GPUS:
        if key in name:
            return spec
    return _GENERIC_GPU


@dataclass(frozen=True)
class Cost:
    """Work of one call: flops, bytes moved, and extra memory beyond inputs and outputs."""

    flops: float
    bytes: float
    extra_bytes: float

    def seconds(self, spec: DeviceSpec, half: bool) -> float:
        return max(self.flops / (spec.half_flops if half else spec.fp32_flops), self.bytes / spec.bandwidth)


def _chunked(elements_per_sample: float, B: int) -> float:
    """Elements of a per-sample intermediate the eager path holds at once (batch slicing)."""
    if elements_per_sample <= 0:
        return 0.0
    per_slice = max(1, CHUNK_ELEMENTS // max(1, int(elements_per_sample)))
    return min(B, per_slice) * elements_per_sample


def linear_norm_cost(algorithm: str, backend: str, B: int, T: int, d: int, p: int, e: int) -> Cost:
    """Squared weight norms of a Linear layer by ``algorithm`` on ``backend``."""
    inputs = B * T * (d + p) * e
    if algorithm == "outer":
        return Cost(2 * B * T * (d + p), inputs, 4 * B)
    if algorithm == "direct":
        flops = 2 * B * T * p * d
        if backend == "triton":
            # Each (p, d) tile re-reads its sample's T rows of A and G.
            tiles = math.ceil(p / TILE) * math.ceil(d / TILE)
            return Cost(flops, B * T * tiles * 2 * TILE * e, 4 * B * tiles)
        # fp32 copies of A and G, and the (B, p, d) product written and read once.
        held = _chunked(p * d, B)
        return Cost(flops, inputs + B * T * (d + p) * 4 + 2 * B * p * d * 4, held * 4 + B * T * (d + p) * 4)
    if algorithm == "gram":
        if backend == "triton":
            blocks = math.ceil(T / GRAM_BLOCK)
            pairs = blocks * (blocks + 1) / 2
            return Cost(B * T * T * (p + d), B * pairs * 2 * GRAM_BLOCK * (d + p) * e, 4 * B * blocks * blocks)
        # Each chunk of features' (B, T, T) fp32 Gram matrix written, then added to the sum:
        # three passes over it, two where the GEMM adds it itself (half operands on a GPU,
        # ``reference.baddbmm_acc``); three of its four blocks by halves (``reference.gram_by_halves``).
        held = _chunked(2 * T * T, B)
        chunks = math.ceil(d / GRAM_CHUNK) + math.ceil(p / GRAM_CHUNK)
        passes = 2 if e < 4 else 3
        share = 0.75 if gram_by_halves(T) else 1.0
        return Cost(share * 2 * B * T * T * (p + d), inputs + share * (passes * chunks + 2) * B * T * T * 4,
                    held * 4 + B * T * (d + p) * 4)
    raise ValueError(f"no cost model for the linear norm algorithm {algorithm!r}")


def linear_grad_sample_cost(backend: str, B: int, T: int, d: int, p: int, e: int) -> Cost:
    """Per-sample Linear gradients (B, p, d) written in the input dtype."""
    flops = 2 * B * T * p * d
    out = B * p * d * e
    if backend == "triton":
        tiles = math.ceil(p / TILE) * math.ceil(d / TILE)
        return Cost(flops, B * T * tiles * 2 * TILE * e + out, 0)
    # The eager path computes in fp32 and rounds: an fp32 (B, p, d) temporary for half inputs.
    extra = B * p * d * 4 + B * T * (d + p) * 4 if e < 4 else 0
    return Cost(flops, B * T * (d + p) * e + out + 2 * extra, extra)


def linear_clipped_sum_cost(backend: str, B: int, T: int, d: int, p: int, e: int) -> Cost:
    """The clipped weight gradient ``(c ⊙ G)^T A`` (p, d) in the input dtype."""
    flops = 2 * B * T * p * d
    out = p * d * e
    if backend == "triton":
        tiles = math.ceil(p / TILE) * math.ceil(d / TILE)
        return Cost(flops, B * T * tiles * 2 * TILE * e + out, 4 * p * d)
    # One pass writing the scaled smaller operand, then one GEMM reading both.
    scaled = B * T * min(p, d) * e
    return Cost(flops, B * T * (d + p) * e + 2 * scaled + out, scaled)


def conv_norm_workspace(algorithm: str, backend: str, T: int, d: int, p: int, g: int, e: int, cpu: bool) -> float:
    """Bytes that one sample's squared weight norm of a convolution (g groups of d = C_in/g*K
    unfolded inputs and p = C_out/g outputs, T output positions, e bytes per input element)
    holds at once besides its inputs, by ``algorithm`` on ``backend``; a batch slice holds
    this times its samples. ``cpu``: on a CPU, whose kernels make copies a GPU's do not. An
    upper estimate: what ``Tuner.select_by_memory`` cuts batch slices by.
    - grad-sample: the per-sample gradients (g*p*d, fp32) and the float64 pieces of their
      norms (``reference.sq_norms``, a quarter of their bytes); a CPU's convolution backward
      also makes the zero weight it is handed dense and copies its result, three times the
      gradients in all, and copies the backprops.
    - direct, gram: the unfolded input U (g*T*d elements) and the grouped backprops (g*T*p), in
      the inputs' dtype; on a CPU also the padded input (at most half of U for a 3x3 kernel)
      and, for Gram, U transposed again by the batched product. The eager direct norm adds each
      group's product (p*d, fp32) and its float64 copy (the whole of it for a small slice:
      twice its bytes), the eager Gram norm two (T, T) fp32 Gram matrices and their product;
      the Triton kernels hold a few partial sums per tile.
    """
    if algorithm == "grad-sample":
        grads = 4 * g * p * d
        return 3 * grads + g * T * p * e if cpu else 1.25 * grads
    unfolded, backprops = g * T * d * e, g * T * p * e
    held = unfolded * (1.5 if cpu else 1.0) + backprops
    if backend == "triton":
        return held
    if algorithm == "direct":
        return held + 3 * 4 * g * p * d
    if algorithm == "gram":
        return held + (unfolded if cpu else 0) + 3 * 4 * g * T * T
    raise ValueError(f"no workspace model for the convolution norm algorithm {algorithm!r}")


def conv_norm_slice_elements(algorithm: str, T: int, d: int, p: int, g: int) -> int:
    """Elements per sample by which the eager convolution norms cut the batch into slices of at
    most CHUNK_ELEMENTS (``reference.batch_slices``): the per-sample gradients' for
    grad-sample, the unfolded input's otherwise."""
    return g * p * d if algorithm == "grad-sample" else g * T * d


def conv_norm_cost(algorithm: str, backend: str, B: int, T: int, d: int, p: int, g: int, e: int,
                   cpu: bool = False) -> Cost:
    """Squared weight norms of a convolution with g groups of d = C_in/g*K unfolded inputs and
    p = C_out/g outputs each: a Linear algorithm on the unfolded input (written once, B*g*T*d
    elements, a batch slice at a time), or the per-sample gradients (B, g*p*d) in fp32. The
    extra memory: a default batch slice's ``conv_norm_workspace`` (``cpu``: on a CPU)."""
    per_slice = max(1, CHUNK_ELEMENTS // max(1, conv_norm_slice_elements(algorithm, T, d, p, g)))
    extra = min(B, per_slice) * conv_norm_workspace(algorithm, backend, T, d, p, g, e, cpu)
    if algorithm == "grad-sample":
        grads = g * p * d
        return Cost(2 * B * T * g * p * d, B * T * g * (d + p) * e + 2 * B * grads * 4, extra)
    linear = linear_norm_cost(algorithm, backend, B * g, T, d, p, e)
    unfolded = B * g * T * (d + p) * e
    return Cost(linear.flops, linear.bytes + 2 * unfolded, extra)


def embedding_cost(kind: str, backend: str, B: int, T: int, V: int, d: int, e: int, algorithm: str = "") -> Cost:
    """Embedding norms ("norm") or per-sample gradients ("grad_sample")."""
    rows = B * T * d
    out = B * V * d * e if kind == "grad_sample" else 4 * B
    if algorithm == "gram":
        # G G^T per sample and the token-equality mask, (B, T, T) in fp32, a batch slice at a time.
        held = _chunked(3 * T * T, B)
        return Cost(2 * B * T * T * d, rows * e + 3 * B * T * T * 4, held * 4)
    if backend == "triton":
        # Sorting the (B*T) keys, one gathered read of every row, the output.
        return Cost(2 * rows, rows * e + 16 * B * T + out, 16 * B * T + (4 * B * T * math.ceil(d / 64)))
    # fp32 copies of the kept rows and the segment sums.
    return Cost(2 * rows, rows * e + 3 * rows * 4 + out, 2 * rows * 4 + 16 * B * T)
