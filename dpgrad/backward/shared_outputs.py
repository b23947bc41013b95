"""Layers shared by all samples: a hooked layer called on an input without the batch (T5's
relative attention bias on (T, T) position buckets, a learned position table on (1, T) ids, a
Linear on a learned token), whose output the model broadcasts over the batch.

Each sample's gradient of such a layer is its own: where the shared output meets the batch by
broadcasting (added to the attention scores, to the token embeddings), or is expanded to it
(``expand``, ``broadcast_to``: MPNet's relative bias), sample b's cotangent is row b of the
result's. So the output is handed on as ``SharedAcrossBatch``, a tensor
subclass that follows it through the model's operations; at the first operation that broadcasts
it against a tensor of the batch, it is expanded to the batch first (the same result), and a hook
on the expanded tensor takes row b's cotangent back to the layer's output, all rows at once (a
batched vector-Jacobian product over the operations in between). The layer's record then holds
its inputs expanded to the batch and these per-sample backprops, and every sampler takes it as
it takes any layer's.

What cannot be split so is refused, naming the layer: a shared output combined with the batch by
an operation that does not broadcast (indexing, concatenation), one that reaches the model's
output without meeting the batch, or one whose gradient arrives from elsewhere.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# Operations that broadcast their tensor arguments against each other (their in-place and
# reflected forms included): a shared operand expanded to the batch gives the same result.
_BROADCASTING = frozenset(
    f"{prefix}{name}{suffix}"
    for name in ("add", "sub", "mul", "div", "true_divide", "rsub", "where", "masked_fill", "matmul",
                 "addcmul", "addcdiv", "lerp", "maximum", "minimum", "scaled_dot_product_attention")
    for prefix, suffix in (("", ""), ("", "_"), ("__", "__"), ("__r", "__"), ("__i", "__"))
) | {"__truediv__", "__rtruediv__", "__itruediv__"}

# Operations that copy a tensor along new or size-1 dimensions: a shared tensor expanded so to a
# leading size of the batch (MPNet's relative bias, ``values.expand(bsz, -1, T, T)``) meets the
# batch there, each row being its sample's copy.
_EXPANDING = frozenset({"expand", "expand_as", "broadcast_to"})

# Per-sample cotangents taken by a nested backward pass are in flight: the shared layers' own
# output hooks must not take them for the pass's (they see them batched, mid-way).
_nested = [0]


class SharingError(RuntimeError):
    """A shared layer's gradient cannot be split by sample."""


class SharedSite:
    """One call of a hooked layer on an input without the batch: the layer's output and the
    per-sample cotangents gathered for it where it met the batch (``add``), taken once its own
    gradient arrives (``take``)."""

    __slots__ = ("name", "output", "batch", "leading", "per_sample", "shape")

    def __init__(self, name: str, output: torch.Tensor, batch: int, leading: bool):
        self.name, self.output, self.batch, self.leading = name, output, batch, leading
        self.shape = tuple(output.shape)
        self.per_sample: Optional[torch.Tensor] = None

    def expand(self, a):
        """An input of the call as each sample saw it: (B, ...) in place of its leading 1, or
        with the batch put in front."""
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            return a
        if self.leading:
            return a.expand(self.batch, *a.shape[1:])
        return a.unsqueeze(0).expand(self.batch, *a.shape)

    def add(self, grads: torch.Tensor) -> None:
        self.per_sample = grads if self.per_sample is None else self.per_sample + grads

    def take(self, total: torch.Tensor) -> torch.Tensor:
        """The per-sample backprops of the call, (B, ...) like its expanded inputs' outputs."""
        per, self.per_sample = self.per_sample, None
        if per is None:
            if self.batch == 0:
                per = total.new_zeros((0, *self.shape))
            else:
                raise SharingError(
                    f"layer '{self.name}' was called on an input without the batch dimension (the forward "
                    f"pass has {self.batch} samples), so its output of shape {self.shape} is shared by every "
                    "sample, and its gradient reached it without passing where the output meets the batch by "
                    "broadcasting: dpgrad cannot tell each sample's part. Broadcast the output against the "
                    "batch's tensors (added, multiplied), or, if its input folds the batch into another "
                    "dimension, give the input the batch first.")
        if self.leading:
            per = per.reshape(self.batch, *self.shape[1:])
        return per

    def shared(self, out: torch.Tensor) -> "SharedAcrossBatch":
        sites = out._dpgrad_sites if isinstance(out, SharedAcrossBatch) else ()
        return _wrap(out, (*sites, self))


def _wrap(t: torch.Tensor, sites: tuple) -> "SharedAcrossBatch":
    with torch._C.DisableTorchFunctionSubclass():
        shared = t.as_subclass(SharedAcrossBatch)
    shared._dpgrad_sites = sites
    return shared


def nested() -> bool:
    """Whether a nested backward pass of this module is taking per-sample cotangents."""
    return _nested[0] > 0


class SharedAcrossBatch(torch.Tensor):
    """A tensor computed from shared layers' outputs only (see the module docstring): its
    operations give tensors of this kind, until one broadcasts it against the batch."""

    _dpgrad_sites: tuple = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        shared = [i for i, a in enumerate(flat) if isinstance(a, SharedAcrossBatch)]
        sites = tuple(dict.fromkeys(s for i in shared for s in flat[i]._dpgrad_sites))
        if not sites:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        batch = sites[0].batch
        with torch._C.DisableTorchFunctionSubclass():
            width = max((a.dim() for i, a in enumerate(flat) if i not in shared and isinstance(a, torch.Tensor)
                         and a.dim() and a.shape[0] == batch), default=None)
            meeting = [i for i in shared if width is not None and _lacks_batch(flat[i], width, batch)]
            if not meeting:
                ret = func(*args, **kwargs)
                if any(ret is flat[i] for i in shared):
                    return ret
                if _expanded_to_batch(func, flat, shared, ret, batch):
                    return _met(flat[shared[0]], ret.dim(), batch).expand(ret.shape)
                return tree_map(lambda r: _wrap(r, sites) if isinstance(r, torch.Tensor) else r, ret)
            name = getattr(func, "__name__", repr(func))
            others = [i for i in shared if i not in meeting]
            if name not in _BROADCASTING | _EXPANDING or others:
                raise SharingError(_unsplittable(sites, name, [tuple(flat[i].shape) for i in shared], batch))
            for i in meeting:
                flat[i] = _met(flat[i], width, batch)
            args, kwargs = tree_unflatten(flat, spec)
            return func(*args, **kwargs)


def _expanded_to_batch(func, flat: list, shared: List[int], ret, batch: int) -> bool:
    """Whether ``ret`` is the one shared operand expanded to a leading size of the batch
    (``_EXPANDING``), from a size of 1 there or a dimension it did not have."""
    if getattr(func, "__name__", None) not in _EXPANDING or len(shared) != 1 or shared[0] != 0:
        return False
    return (isinstance(ret, torch.Tensor) and ret.dim() > 0 and ret.shape[0] == batch
            and _lacks_batch(flat[0], ret.dim(), batch))


def _lacks_batch(t: torch.Tensor, width: int, batch: int) -> bool:
    """Whether ``t`` broadcasts over dimension 0 of a batch tensor of ``width`` dimensions."""
    return t.dim() < width or (t.dim() == width and t.shape[0] == 1)


def _met(t: SharedAcrossBatch, width: int, batch: int) -> torch.Tensor:
    """``t`` expanded to the batch, with a hook that takes each sample's cotangent back to the
    shared layers' outputs."""
    aligned = t.reshape((1,) * (width - t.dim()) + tuple(t.shape))
    expanded = aligned.expand(batch, *aligned.shape[1:])
    if expanded.requires_grad:
        sites, shape = t._dpgrad_sites, tuple(t.shape)
        expanded.register_hook(lambda g: _split(t, sites, g.reshape(batch, *shape)))
    return expanded


def _split(t: torch.Tensor, sites: Sequence[SharedSite], grads: torch.Tensor) -> None:
    """Hand each shared output its per-sample cotangents, ``grads`` (B, *t.shape) taken back
    from ``t`` through the operations between them."""
    batch = grads.shape[0]
    if batch == 0:
        return None
    outputs = [s.output for s in sites]
    _nested[0] += 1
    try:
        with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():
            per = _batched_vjp(t, outputs, grads)
    finally:
        _nested[0] -= 1
    for site, g in zip(sites, per):
        if g is not None:
            site.add(g)
    return None


def _batched_vjp(t: torch.Tensor, outputs: List[torch.Tensor], grads: torch.Tensor) -> Tuple:
    try:
        return torch.autograd.grad(t, outputs, grads, retain_graph=True, allow_unused=True, is_grads_batched=True)
    except RuntimeError:  # an operation without a batching rule: one sample at a time
        rows = [torch.autograd.grad(t, outputs, g, retain_graph=True, allow_unused=True) for g in grads]
        return tuple(None if r[0] is None else torch.stack(r) for r in zip(*rows))


def _unsplittable(sites: Sequence[SharedSite], op: str, shapes: list, batch: int) -> str:
    names = ", ".join(f"'{s.name}'" for s in sites)
    return (
        f"the output of layer {names}, called on an input without the batch dimension and so shared by "
        f"all {batch} samples, meets the batch in {op} (shared operands of shape "
        f"{', '.join(map(str, shapes))}), which dpgrad cannot split by sample: it splits a shared output "
        "where an elementwise operation, a matmul or attention broadcasts it over the batch. Broadcast it "
        "so (e.g. add it to the batch's tensor) before other operations, or give the layer's input the "
        "batch dimension.")


def shared_outputs(tensors) -> List[SharedAcrossBatch]:
    """The shared tensors among ``tensors`` (a model's outputs)."""
    return [t for t in tensors if isinstance(t, SharedAcrossBatch)]


def reaching_output_error(tensors: List[SharedAcrossBatch]) -> SharingError:
    sites = tuple(dict.fromkeys(s for t in tensors for s in t._dpgrad_sites))
    names = ", ".join(f"'{s.name}'" for s in sites)
    return SharingError(
        f"the model's output of shape {tuple(tensors[0].shape)} comes from layer {names} alone, called on an "
        "input without the batch dimension: it is shared by all samples, not one row per sample. Give the "
        "layer's input the batch dimension (if it folds the batch into another dimension, put the batch "
        "first), or broadcast the output against the batch's tensors before the model returns it.")
