"""A hooked layer's inputs in a forward pass: the batch each call sees, one row broadcast over
the batch, and the calls that are no forward pass (activation checkpointing recomputing one).

``BackwardPath._on_layer_call`` (``dpgrad.backward.backward_pass``) asks these at each call of a layer
with trainable parameters: ``broadcast_inputs`` first (an Embedding given one row of ids after
other layers saw the batch is called again on them expanded), then ``recomputing``, then
``shared_call``, which tells a call without the batch (a layer shared by all samples, handled
by ``dpgrad.backward.shared_outputs``), then ``check_batch``, which keeps the forward pass's
batch size and raises for a call that does not hold it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.backward.shared_outputs import SharedAcrossBatch
from dpgrad.samplers import registry


def broadcast_inputs(layer: nn.Module, inputs, batch: Optional[int], batch_first: bool, whole_layers
                     ) -> Optional[tuple]:
    """An Embedding's ids expanded to the forward pass's ``batch`` when it got one row of them
    after another layer saw the batch: the model broadcasts that row's embeddings over the
    batch (Hugging Face GPT-2 and BERT embed position ids (1, T) unless given them). An
    embedding looks each id up alone, so its output on the expanded ids is what
    broadcasting makes of it, and each sample gets its own gradient, exact where the output
    meets the batch by broadcasting (added to the token embeddings). None otherwise (then
    ``check_batch`` decides); ``whole_layers``: the layers whose gradients torch.func takes
    whole (an Embedding among them is left alone)."""
    if not isinstance(layer, nn.Embedding) or not batch_first or layer in whole_layers:
        return None
    if batch is None or batch == 1:
        return None
    x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    if x is None or x.dim() < 2 or x.shape[0] != 1:
        return None
    return tuple(a.expand(batch, *a.shape[1:]) if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 1 else a
                 for a in inputs)


def shared_call(layer: nn.Module, inputs, batch: Optional[int], batch_first: bool, whole_layers, shared_before
                ) -> Optional[bool]:
    """Whether this call of ``layer`` is shared by all samples of the forward pass's ``batch``:
    None where its input holds the batch (or cannot be told: the batch not known yet, inputs
    time-first, a layer torch.func takes whole, whose samplers see one sample at a time), else
    whether its input's leading 1 stands for the batch (True), or the batch is missing (False).
    An input with an autograd history is computed from the batch, not shared: it folds the
    batch (a (B*T, d) input to a Linear, ``folded_rows``) or ``check_batch`` refuses it; an input
    computed from shared outputs is shared. ``shared_before``: the layers called without the batch in earlier forward
    passes, whose input of as many dimensions is still without it where its first size happens
    to be the batch's (T5's (T, T) position buckets in a batch of T samples)."""
    if not batch_first or batch is None or layer in whole_layers:
        return None
    x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    if x is None:
        return None
    if x.dim() <= feature_dims(layer):
        return False
    n = x.shape[0]
    if isinstance(x, SharedAcrossBatch):
        return n == 1
    if x.grad_fn is not None:
        return None  # computed from the batch: folded (``folded_rows``), or refused by ``check_batch``
    if n == batch:
        known = shared_before.get(layer)
        return None if known is None or known != x.dim() else False
    if n != 1:
        shared_before[layer] = x.dim()
    return n == 1


def folded_rows(layer: nn.Module, inputs, batch: Optional[int], batch_first: bool,
                tokens: Optional[int] = None) -> Optional[int]:
    """The rows per sample of a call whose input folds the forward pass's ``batch`` into its
    first dimension (a (B*T, d) view of the batch-first activations: mixture-of-experts routers
    and experts, which take the tokens flattened), or None. The input is derived from the
    model's differentiable inputs (it has an autograd history), or has ``batch * tokens`` rows
    (``tokens``: the second size of the model's input, T, where no layer before it trains, as
    under LoRA); its first size a multiple of the batch; row i is sample i // (that
    multiple)'s, as a view of a batch-first tensor has it (the independence check catches
    another order)."""
    if not batch_first or not batch:
        return None
    x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    if x is None or x.dim() <= feature_dims(layer) or isinstance(x, SharedAcrossBatch):
        return None
    n = x.shape[0]
    if x.grad_fn is None and (tokens is None or n != batch * tokens):
        return None
    return n // batch if n > batch and n % batch == 0 else None


def unfold(a, batch: int, n: int, copies: int = 1):
    """``a`` with its first dimension of ``n`` rows as (batch, n // batch); of ``copies`` of
    the batch one after the other, as (batch, copies, n // (copies * batch)); else as it is."""
    if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n:
        if copies == 1:
            return a.reshape(batch, n // batch, *a.shape[1:])
        return a.reshape(copies, batch, n // (copies * batch), *a.shape[1:]).transpose(0, 1)
    return a


def without_batch(layer: nn.Module, inputs, batch: Optional[int], shared: dict) -> bool:
    """Whether a layer's first tensor input, called before any layer saw the batch, cannot hold
    the model input's ``batch`` (batch first): one row of a batch of several (a row broadcast
    over the batch), a first size other than the batch's where its second is not the batch's
    either (a table, as a position table on (T,) ids, not the batch time-first), or an input
    ``shared_before`` (such a table seen at another batch size, its first size now the batch's)."""
    x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
    if batch is None or x is None or x.dim() == 0:
        return False
    if x.shape[0] == batch:
        return shared_before(layer, inputs, shared)
    return x.shape[0] == 1 or x.dim() < 2 or x.shape[1] != batch


def input_batch(args: tuple, kwargs: dict, batch_dim: int) -> Tuple[Optional[int], Optional[int]]:
    """The batch size the model's first tensor argument (positional, then keyword) shows along
    ``batch_dim``, or None: where the first hooked call has one row, whether it is a row
    broadcast over the batch or a batch of one; and its next size (tokens, batch first), or
    None: where a call takes the batch's tokens flattened before any layer trains (LoRA)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return (a.shape[batch_dim] if a.dim() > batch_dim else None), (a.shape[1] if a.dim() > 1 else None)
    return None, None


def shared_before(layer: nn.Module, inputs, shared: dict) -> bool:
    """Whether ``layer`` was called without the batch in an earlier forward pass on an input of
    as many dimensions as this call's (see ``shared_call``)."""
    x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    return x is not None and shared.get(layer) == x.dim()


AMBIGUOUS = (" Or its input holds the batch along another dimension, as a time-first layer's (T, B, ...) or Gemma "
             "3n's decoder layers' (streams, B, T, d) do, which dpgrad cannot tell in a batch of as many samples as "
             "another of the input's sizes: run a first step at another batch size (what it shows is remembered "
             "for the layer).")


def check_batch(layer: nn.Module, name: str, inputs, batch: Optional[int], batch_first: bool,
                ambiguous: bool = False) -> int:
    """The forward pass's batch size after this call of ``layer`` (``name``): its own where
    ``batch`` is None (the pass's first hooked call). Raises ValueError, naming the layer, for
    an input with no batch dimension, one row where the pass has several samples (a row the
    model broadcasts over the batch), or another number of samples; ``ambiguous``: the input
    might be time-first (``batch_dim_of`` could not tell), which the message adds."""
    hint = AMBIGUOUS if ambiguous else ""
    batch_dim = 0 if batch_first else 1
    x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else next(
        (a for a in inputs if isinstance(a, torch.Tensor)), None)
    if x is None:
        raise ValueError(
            f"layer '{name}' ({type(layer).__name__}) got no tensor among its positional inputs, where dpgrad "
            "reads each sample's rows: call it with its input positionally (layer(x), not layer(input=x)). A "
            "module called with no input that returns its own parameter (a learned token) has no rows of the "
            "samples: hold that nn.Parameter in the module that combines it with the batch's tensors instead."
        )
    # A Linear given one sample's (d,) would otherwise take its features for the batch.
    if x.dim() <= batch_dim + feature_dims(layer):
        raise ValueError(
            f"layer '{name}' got an input of shape {tuple(x.shape)} with no batch dimension "
            f"{batch_dim} (batch_first={batch_first}, so inputs are "
            f"{'[B, ...]' if batch_first else '[K, B, ...]'}): feed a batch of samples, "
            f"e.g. x.unsqueeze({batch_dim}) for a single one"
        )
    n = x.shape[batch_dim]
    if batch is None:
        return n
    if n == 1 and batch > 1:
        raise ValueError(
            f"layer '{name}' got an input of shape {tuple(x.shape)}, with 1 along the batch "
            f"dimension {batch_dim} where earlier layers of this forward pass got "
            f"{batch} samples: the model broadcasts it over the batch, so its "
            "gradient is the whole batch's, not per sample. Give the input one row per sample; "
            "for Hugging Face models, whose position ids default to a single row, pass "
            "position_ids=torch.arange(T).expand(B, T) (with B samples of T tokens)." + hint
        )
    if n != batch:
        picked = x.grad_fn is not None and type(x.grad_fn).__name__.startswith("Index")
        raise ValueError(
            f"layer '{name}' got {n} samples along dimension {batch_dim} (input shape "
            f"{tuple(x.shape)}) but an earlier layer of this forward pass got "
            f"{batch}. Per-sample gradients need the batch on one dimension "
            f"throughout: check batch_first (now {batch_first}) and that the model does "
            "not fold the batch into another dimension, e.g. a (B*T, d) input to a Linear."
            + (" Its input is rows picked by indexing (x[mask] or x[index], as a mixture-of-experts block with "
               "a module per expert routes tokens), but not whole rows of a tensor of the batch's tokens, (B, T, "
               "...) or (B*T, ...), which is where dpgrad tells each picked row's sample: pick from the batch's "
               "tokens, freeze those modules and train the others or adapters elsewhere, or use a model whose "
               "experts are one grouped module (transformers' grouped experts)." if picked else "") + hint
        )
    return batch


def _top_saved_tensors_hooks():
    """The innermost ``saved_tensors_hooks`` (pack, unpack) in force, or None (also where
    this torch cannot say: its recomputations are then hooked like forward passes, harmless
    but for the memory they hold until the pass ends)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except TypeError:  # an older signature, without the argument
        try:
            return top()
        except RuntimeError:
            return None
    except RuntimeError:
        return None


def saved_operand(node, attr: str) -> Optional[torch.Tensor]:
    """The tensor the autograd node ``node`` saved as ``attr`` (e.g. ``_saved_mat1``), read as it
    is: None where saved-tensor hooks are in force (activation checkpointing, offloading: reading
    would unpack it, which may recompute or copy it), where ``node`` has no such attribute, or
    where it saved none (an operand whose partner needs no gradient)."""
    if node is None or _top_saved_tensors_hooks() is not None:
        return None
    try:
        saved = getattr(node, attr)
    except (AttributeError, RuntimeError):
        return None
    return saved if isinstance(saved, torch.Tensor) else None


def recomputing() -> bool:
    """Whether non-reentrant activation checkpointing is recomputing a forward pass (inside
    the backward pass) for the tensors it saved: its layer calls are no forward pass of the
    model, and nothing backpropagates through their outputs. (Never while torch.compile
    traces: a recomputation runs eagerly.)"""
    if torch.compiler.is_compiling():
        return False
    top = _top_saved_tensors_hooks()
    return top is not None and "_recomputation_hook" in getattr(top[0], "__qualname__", "")


_PER_POSITION = {"dpgrad.samplers.linear": 1, "dpgrad.samplers.embedding": 0, "dpgrad.samplers.norms": None}


def position_features(layer: nn.Module) -> Optional[int]:
    """The trailing input dimensions a layer's samplers take as its features where every
    dimension before them is a position, its samples' rows along any of them: 1 for Linear,
    the normalised shape's for LayerNorm and RMSNorm, 0 for Embedding (ids); None for the rest
    (convolutions, GroupNorm, a user's own samplers), whose batch is where batch_first says."""
    cls = type(layer)
    if cls not in registry.GRAD_SAMPLERS or isinstance(layer, nn.GroupNorm):
        return None
    for module, features in _PER_POSITION.items():
        if registry.served_by(cls, module):  # a norm: its normalised shape (a Llama-family RMSNorm's weight's)
            return features if features is not None else feature_dims(layer) or layer.weight.dim()
    return None


def batch_dim_of(layer: nn.Module, x, batch: Optional[int], tokens: Optional[int], batch_first: bool,
                 whole: bool, known) -> Optional[int]:
    """The dimension along which this call of ``layer``, on input ``x``, holds the forward
    pass's ``batch`` inside a batch-first model: 0 as the model does, or another where the
    layer runs with the batch elsewhere. A layer whose samplers take every dimension before
    its features as positions (``position_features``) may hold it along dimension 1, (T, B,
    ...) (XLNet's layers and the summary after them, Longformer's global attention on (G, B,
    d), G global tokens); a layer torch.func takes ``whole`` along any one dimension of a
    3-D or larger input (Gemma 3n's decoder layers on (streams, B, T, d)). Taken so where the
    input's first size is neither the batch, nor the batch's tokens flattened (``tokens``: the
    model input's second size), nor, with 1 there, a (1, T, d) table broadcast over the batch.
    Where the first size is the batch's too (T == B), or the batch's size is at two other
    dimensions, what an earlier call at another batch size showed (``known``: layer -> dim,
    kept up to date here) decides; None where nothing has (taken batch first: a wrong guess is
    the independence check's to catch, and ``check_batch`` says why it may refuse)."""
    if not batch_first or batch is None or not isinstance(x, torch.Tensor) or x.dim() < (3 if whole else 2):
        return 0
    first = x.shape[0]
    dims = [d for d in range(1, x.dim()) if x.shape[d] == batch] if whole else [1] if x.shape[1] == batch else []
    if dims and not whole:  # (the common call, batch first, asks no more than its sizes)
        features = position_features(layer)
        dims = [] if features is None or x.dim() < 2 + features else dims
    if not dims or isinstance(x, SharedAcrossBatch):
        if first == batch and known.get(layer) != 0:
            known[layer] = 0
        return 0
    if tokens is not None and first == batch * tokens and first != batch:
        return 0
    if first == batch or len(dims) > 1 or (first == 1 and dims == [1] and x.shape[1] == tokens):
        return known.get(layer)
    known[layer] = dims[0]
    return dims[0]


def feature_dims(layer: nn.Module) -> int:
    """Trailing input dimensions a layer consumes at each position (the rest are batch and
    tokens): 1 for Linear, the normalised shape's for LayerNorm and RMSNorm, else 0."""
    if isinstance(layer, nn.Linear):
        return 1
    if isinstance(layer, (nn.LayerNorm, nn.RMSNorm)):
        return len(layer.normalized_shape)
    return 0


def batch_to_front(x):
    """Move dimension 1 (the batch under batch_first=False) to the front."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return x
    return x.movedim(1, 0)
