"""The Triton launchers under the names and signatures of ``reference``.

``dpgrad.kernels.backend`` hands out either this module or ``reference``; callers never need to know
which. Importing it imports Triton (set ``TRITON_INTERPRET=1`` first to run on CPU tensors).
"""

from __future__ import annotations

import torch

from .embedding_segment_sum import embedding_clipped_sum, embedding_grad_sample, embedding_sq_norm
from .experts_segments import experts_clipped_sum, experts_grad_sample, experts_sq_norms
from .linear_clipped_sum import linear_clipped_sum, linear_clipped_sum_grouped
from .linear_grad_sample import linear_per_sample, linear_per_sample_grouped
from .linear_norm_direct import linear_weight_sq_norm_direct, linear_weight_sq_norm_direct_grouped
from .linear_norm_gram import linear_weight_sq_norm_gram, linear_weight_sq_norm_gram_grouped
from .linear_token_sum import (
    linear_bias_grad_sample,
    linear_bias_grad_sample_grouped,
    linear_bias_sq_norm,
    linear_weight_sq_norm_outer,
    linear_weight_sq_norm_outer_grouped,
)
from .group_norm_grad_sample import group_norm_fits, group_norm_grad_sample_grouped
from .norm_layer_grad_sample import norm_layer_fits, norm_layer_grad_sample_grouped
# The cross term of a parameter used twice is two batched GEMMs (or a gather): torch's own
# kernels serve on every device.
from .reference import LinearPerSample, linear_norm_function, outer_sum_inner
# A convolution's norms are a Linear kernel's on its unfolded input (its per-sample gradients
# and clipped sums are the convolution's own backward, reference's, on every device).
from .reference import conv_weight_sq_norm_unfolded

NAME = "triton"

__all__ = [
    "LinearPerSample",
    "conv_weight_sq_norm_direct",
    "conv_weight_sq_norm_gram",
    "embedding_clipped_sum",
    "embedding_grad_sample",
    "embedding_sq_norm",
    "experts_clipped_sum",
    "experts_grad_sample",
    "experts_sq_norms",
    "group_norm_fits",
    "group_norm_grad_sample_grouped",
    "linear_bias_grad_sample",
    "linear_bias_grad_sample_grouped",
    "linear_bias_sq_norm",
    "linear_clipped_sum",
    "linear_clipped_sum_grouped",
    "linear_grad_sample",
    "linear_per_sample",
    "linear_per_sample_grouped",
    "linear_weight_sq_norm",
    "linear_weight_sq_norm_direct",
    "linear_weight_sq_norm_direct_grouped",
    "linear_weight_sq_norm_gram",
    "linear_weight_sq_norm_gram_grouped",
    "linear_weight_sq_norm_outer",
    "linear_weight_sq_norm_outer_grouped",
    "norm_layer_fits",
    "norm_layer_grad_sample_grouped",
    "outer_sum_inner",
]


def linear_grad_sample(A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients ``W_b = G_b^T A_b``: (B, T, d), (B, T, p) -> (B, p, d)."""
    return linear_per_sample(A, G).weight


def linear_weight_sq_norm(A: torch.Tensor, G: torch.Tensor, algorithm: str) -> torch.Tensor:
    """Squared per-sample weight-gradient norms of a Linear layer by the named kernel
    ("direct", "gram", or "outer" for T == 1): (B, T, d), (B, T, p) -> (B,) fp32."""
    return linear_norm_function(_SQ_NORMS, A, algorithm)(A, G)


_SQ_NORMS = {"direct": linear_weight_sq_norm_direct, "gram": linear_weight_sq_norm_gram,
             "outer": linear_weight_sq_norm_outer}


def conv_weight_sq_norm_gram(x: torch.Tensor, G: torch.Tensor, geom, batch_slice=None) -> torch.Tensor:
    """Squared per-sample weight-gradient norms of a convolution by the Gram kernel on its
    unfolded input (``reference.conv_weight_sq_norm_unfolded``, at most ``batch_slice`` samples
    unfolded at once where it is given): (B,) fp32."""
    return conv_weight_sq_norm_unfolded(x, G, geom, linear_weight_sq_norm_gram, batch_slice)


def conv_weight_sq_norm_direct(x: torch.Tensor, G: torch.Tensor, geom, batch_slice=None) -> torch.Tensor:
    """As ``conv_weight_sq_norm_gram``, by the direct kernel: (B,) fp32."""
    return conv_weight_sq_norm_unfolded(x, G, geom, linear_weight_sq_norm_direct, batch_slice)
