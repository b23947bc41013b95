"""Eager-PyTorch versions of every dpgrad launcher.

This module is both the CPU fallback and the test oracle of the Triton kernels, under the
same names as ``triton_ops`` (``backend.ops_for`` hands out one or the other). Tensors in,
tensors out: no modules, no hooks, no autograd. The functions live in five modules, each
importing only those listed before it, and are gathered here:
    reference_common     accumulation dtypes, autocast's operands, batch slices, squared
                         norms, fp32-accumulating batched GEMMs
    reference_linear     Linear layers, and the cross term of a parameter used twice
    reference_embedding  embedding layers
    reference_conv       convolutions (on ``conv_unfold``'s geometry)
    reference_experts    mixture-of-experts weights (E, p, q), from per-pair factors
A module-level setting (``CHUNK_ELEMENTS``, ``GRAM_CHUNK``, ...) is read where it is defined.

Shapes (B batch, T tokens, d in-features, p out-features, V vocabulary):
    A    (B, T, d)  layer inputs (activations)
    G    (B, T, p)  gradients of each sample's loss w.r.t. the layer outputs (backprops)
    ids  (B, T)     token ids of an embedding layer

Norms are returned *squared*, one per sample, in float32 (float64 when an input is float64).
Large intermediates are built one slice of the batch at a time, so memory stays bounded
whatever B is.
"""

from __future__ import annotations

from .reference_common import (
    CHUNK_ELEMENTS,
    HALF,
    SQ_NORMS_PIECES,
    SQ_NORMS_WHOLE_ELEMENTS,
    accumulation_dtype,
    autocast_operand,
    autocast_operands,
    autocast_rounded,
    baddbmm_acc,
    batch_slices,
    bmm_acc,
    same_layout,
    sq_norms,
)
from .reference_linear import (
    GRAM_CHUNK,
    GRAM_HALVES_TOKENS,
    LinearPerSample,
    coefficients_in,
    gram_acc,
    gram_by_halves,
    linear_bias_grad_sample,
    linear_bias_sq_norm,
    linear_clipped_sum,
    linear_clipped_sum_gemm,
    linear_grad_sample,
    linear_norm_function,
    linear_per_sample,
    linear_weight_norm,
    linear_weight_norms,
    linear_weight_sq_norm,
    linear_weight_sq_norm_direct,
    linear_weight_sq_norm_gram,
    linear_weight_sq_norm_outer,
    outer_sum_inner,
)
from .reference_embedding import (
    EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS,
    embedding_clipped_sum,
    embedding_grad_sample,
    embedding_grad_sample_warning,
    embedding_sq_norm,
    embedding_sq_norm_gram,
)
from .reference_conv import (
    conv_clipped_sum,
    conv_per_sample,
    conv_weight_sq_norm_direct,
    conv_weight_sq_norm_grad_sample,
    conv_weight_sq_norm_gram,
    conv_weight_sq_norm_unfolded,
)
from .reference_experts import experts_clipped_sum, experts_grad_sample, experts_sq_norms

NAME = "eager"

__all__ = [
    "CHUNK_ELEMENTS",
    "EMBEDDING_GRAD_SAMPLE_WARN_ELEMENTS",
    "GRAM_CHUNK",
    "GRAM_HALVES_TOKENS",
    "HALF",
    "LinearPerSample",
    "NAME",
    "SQ_NORMS_PIECES",
    "SQ_NORMS_WHOLE_ELEMENTS",
    "accumulation_dtype",
    "autocast_operand",
    "autocast_operands",
    "autocast_rounded",
    "baddbmm_acc",
    "batch_slices",
    "bmm_acc",
    "coefficients_in",
    "conv_clipped_sum",
    "conv_per_sample",
    "conv_weight_sq_norm_direct",
    "conv_weight_sq_norm_grad_sample",
    "conv_weight_sq_norm_gram",
    "conv_weight_sq_norm_unfolded",
    "embedding_clipped_sum",
    "experts_clipped_sum",
    "experts_grad_sample",
    "experts_sq_norms",
    "embedding_grad_sample",
    "embedding_grad_sample_warning",
    "embedding_sq_norm",
    "embedding_sq_norm_gram",
    "gram_acc",
    "gram_by_halves",
    "linear_bias_grad_sample",
    "linear_bias_sq_norm",
    "linear_clipped_sum",
    "linear_clipped_sum_gemm",
    "linear_grad_sample",
    "linear_norm_function",
    "linear_per_sample",
    "linear_weight_norm",
    "linear_weight_norms",
    "linear_weight_sq_norm",
    "linear_weight_sq_norm_direct",
    "linear_weight_sq_norm_gram",
    "linear_weight_sq_norm_outer",
    "outer_sum_inner",
    "same_layout",
    "sq_norms",
]
