"""The Triton launchers under the names and signatures of ``reference``.

``dpgrad.backend`` hands out either this module or ``reference``; callers never need to know
which. Importing it imports Triton (set ``TRITON_INTERPRET=1`` first to run on CPU tensors).
"""

from __future__ import annotations

import sys

import torch

from .embedding_segment_sum import embedding_clipped_sum, embedding_grad_sample, embedding_sq_norm
from .linear_clipped_sum import linear_clipped_sum
from .linear_grad_sample import linear_per_sample
from .linear_norm_direct import linear_weight_sq_norm_direct
from .linear_norm_gram import linear_weight_sq_norm_gram
from .linear_token_sum import linear_bias_grad_sample, linear_bias_sq_norm, linear_weight_sq_norm_outer
# The cross term of a parameter used twice is two batched GEMMs (or a gather): torch's own
# kernels serve on every device.
from .reference import LinearPerSample, outer_sum_inner, run_linear_norm

NAME = "triton"

__all__ = [
    "LinearPerSample",
    "embedding_clipped_sum",
    "embedding_grad_sample",
    "embedding_sq_norm",
    "linear_bias_grad_sample",
    "linear_bias_sq_norm",
    "linear_clipped_sum",
    "linear_grad_sample",
    "linear_norm_algorithm",
    "linear_per_sample",
    "linear_weight_sq_norm",
    "linear_weight_sq_norm_direct",
    "linear_weight_sq_norm_gram",
    "linear_weight_sq_norm_outer",
    "outer_sum_inner",
]


def linear_grad_sample(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients ``W_b = G_b^T A_b``: (B, T, d), (B, T, p) -> (B, p, d)."""
    return linear_per_sample(A, G).weight


def linear_norm_algorithm(T: int, d: int, p: int) -> str:
    """The algorithm with fewer flops for a layer shape: "outer", "gram" or "direct".

    The tiled Gram kernel uses symmetry, B*T^2*(p+d) flops against the direct form's
    2*B*T*p*d. A flop count, not a measurement: the autotuner times the candidates.
    """
    if T == 1:
        return "outer"
    return "gram" if T * (p + d) < 2 * p * d else "direct"


def linear_weight_sq_norm(A: torch.Tensor, G: torch.Tensor, algorithm: str = "auto") -> torch.Tensor:
    """Squared per-sample weight-gradient norms of a Linear layer, (B, T, d), (B, T, p) -> (B,)."""
    return run_linear_norm(sys.modules[__name__], A, G, algorithm)
