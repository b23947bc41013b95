"""Samplers for ``nn.Embedding``.

Positions holding ``padding_idx`` contribute nothing: PyTorch gives that row no gradient.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpgrad.kernels.backend import guarded
from dpgrad.tuning import get_tuner
from dpgrad.samplers.registry import (
    FUNCTIONAL_CALLS,
    register_clipped_sum_sampler,
    register_factor_sampler,
    register_grad_sampler,
    register_norm_sampler,
)

# A subclass of nn.Embedding that does more in its forward (scales, offsets its ids) is hooked
# at its F.embedding calls on its weight.
FUNCTIONAL_CALLS[nn.Embedding] = F.embedding


def _ids_and_backprops(layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor):
    """(B, T) ids and (B, T, d) backprops of a trainable embedding; None if it is frozen."""
    if layer.scale_grad_by_freq:
        raise NotImplementedError(
            "nn.Embedding(scale_grad_by_freq=True) scales each row's gradient by its frequency "
            "in the whole batch, so one sample's gradient depends on the others; per-sample "
            "gradients are undefined. Construct the embedding with scale_grad_by_freq=False."
        )
    if not layer.weight.requires_grad:
        return None
    ids = activations[0]
    if backprops.dim() != ids.dim() + 1:
        backprops = backprops.reshape(*ids.shape, layer.embedding_dim)
    return ids, backprops


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(
    layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of an Embedding layer: (B, V, d)."""
    prepared = _ids_and_backprops(layer, activations, backprops)
    if prepared is None:
        return {}
    inputs = (*prepared, layer.num_embeddings, layer.padding_idx)
    return {layer.weight: get_tuner().call("embedding_grad_sample", inputs, layer)}


@register_norm_sampler(nn.Embedding)
def embedding_norm_sample(
    layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms of an Embedding layer, (B,), in O(B*T*d)."""
    prepared = _ids_and_backprops(layer, activations, backprops)
    if prepared is None:
        return {}
    inputs = (*prepared, layer.num_embeddings, layer.padding_idx)
    return {layer.weight: get_tuner().call("embedding_norm", inputs, layer).sqrt()}


@register_clipped_sum_sampler(nn.Embedding)
def embedding_clipped_sum(
    layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor, coef: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradient of an Embedding layer, ``index_add`` of ``c_b * g_bt`` rows: (V, d) in
    the weight's dtype, accumulated in fp32; coef: (B,)."""
    prepared = _ids_and_backprops(layer, activations, backprops)
    if prepared is None:
        return {}
    ids, G = prepared
    clipped = guarded("the clipped sum", layer, (G,), lambda ops: ops.embedding_clipped_sum(
        ids, G, coef, layer.num_embeddings, layer.padding_idx, out_dtype=layer.weight.dtype))
    return {layer.weight: clipped}


@register_factor_sampler(nn.Embedding)
def embedding_factors(
    layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, Tuple[torch.Tensor, torch.Tensor]]:
    """The per-sample gradient as ``sum_t onehot(x_bt) ⊗ g_bt``: ids (B, T) with padding
    positions set to -1 (no row), and the backprops (B, T, d)."""
    prepared = _ids_and_backprops(layer, activations, backprops)
    if prepared is None:
        return {}
    ids, G = prepared
    B = ids.shape[0]
    # Not reshape(B, -1): that is ambiguous for an empty batch.
    T = math.prod(ids.shape[1:])
    ids = ids.reshape(B, T)
    if layer.padding_idx is not None:
        ids = ids.masked_fill(ids == layer.padding_idx, -1)
    return {layer.weight: (ids, G.reshape(B, T, G.shape[-1]))}
