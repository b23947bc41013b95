"""Layers hooked at a function's calls on their weight, not at their own forward: a subclass of
a layer type with samplers whose forward does more than the type's (Hugging Face's
``BartScaledWordEmbedding`` multiplies the embeddings by a scale, ``BartLearnedPositionalEmbedding``
offsets its position ids, Phi-MoE's router draws its experts at random after ``super().forward``).
Its samplers are its base type's, given what the function was given (the ids, the input) and
the gradient of what it returned, whatever the forward does around it.

``FunctionalCalls`` is a ``TorchFunctionMode`` in force during such a layer's forward only (its
forward pre-hook enters it, its forward hook, which runs even when the forward raises, leaves
it): each call of the layer type's function (``F.embedding``, ``F.linear``) on the layer's weight
is handed to the path as a call of the layer, and so is an Embedding subclass's own indexing of
its weight by a slice or by ids (Whisper's learned positions, ``self.weight[a:b]``), the lookup
``F.embedding`` makes of those rows.
"""

from __future__ import annotations

from typing import Callable, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dpgrad.samplers import registry


class FunctionalCallError(RuntimeError):
    """A layer hooked at its function's calls that did not call it as its samplers need."""


class FunctionalCalls(TorchFunctionMode):
    """During one forward of ``layer``: its calls of ``function`` on its weight, handed to
    ``on_call(layer, inputs, output, again)`` (a path's ``_on_layer_call``), whose return value,
    where not None, replaces the call's output."""

    def __init__(self, layer: nn.Module, name: str, function: Callable, on_call: Callable):
        super().__init__()
        self.layer, self.name, self.function, self.on_call = layer, name, function, on_call
        self.calls = 0
        self._signature = registry.signature(function)
        self._label = f"F.{function.__name__}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and args[0] is self.layer.weight and self.function is F.embedding:
            ids = _lookup_ids(args[1], self.layer.weight)
            if ids is not None:  # weight[a:b] or weight[ids] (Whisper's positions): F.embedding's rows
                return self._lookup(self.function, self._signature.bind(ids, self.layer.weight), "indexes its weight")
        if func is not self.function:
            return func(*args, **kwargs)
        bound = self._signature.bind(*args, **kwargs)
        if bound.arguments["weight"] is not self.layer.weight:
            return func(*args, **kwargs)
        return self._lookup(func, bound, f"calls {self._label} on its weight")

    def _lookup(self, func, bound, how: str):
        bound.apply_defaults()
        call = bound.arguments
        self._check(call, how)
        self.calls += 1
        return self._call(func, call)

    def _call(self, func, call: dict):
        """The function's output on ``call``, as the path hands it on (a call it makes again,
        on the ids expanded to the batch, is handed to it too)."""
        out = func(**call)
        replaced = self.on_call(self.layer, (call["input"],), out, lambda ids: self._call(func, dict(call, input=ids)))
        return out if replaced is None else replaced

    def _check(self, call: dict, how: str) -> None:
        """Refuse a call whose arguments the samplers, which read them from the layer, would
        not follow."""
        layer = self.layer
        if self.function is F.linear:
            if call["bias"] is not layer.bias:
                raise FunctionalCallError(
                    f"layer '{self.name}' ({type(layer).__name__}, an nn.Linear subclass) {how} with "
                    f"{'no bias' if call['bias'] is None else 'a bias other than its own'}, where the layer has "
                    f"{'none' if layer.bias is None else 'one'}; dpgrad clips it as nn.Linear's samplers do, its "
                    "weight and its own bias together. Call F.linear(x, self.weight, self.bias) (or "
                    f"super().forward), or register samplers for {type(layer).__name__} "
                    "(dpgrad.register_grad_sampler and register_norm_sampler).")
            return
        padding = call["padding_idx"]
        if padding is not None and padding < 0:
            padding += layer.num_embeddings
        differs = [k for k, mine in (("padding_idx", padding), ("max_norm", call["max_norm"]),
                                     ("scale_grad_by_freq", call["scale_grad_by_freq"]))
                   if mine != getattr(layer, k)]
        if differs:
            raise FunctionalCallError(
                f"layer '{self.name}' ({type(layer).__name__}, an nn.Embedding subclass) {how}, a lookup "
                f"with {', '.join(f'{k}={call[k]!r}' for k in differs)}, where the layer has "
                f"{', '.join(f'{k}={getattr(layer, k)!r}' for k in differs)}; dpgrad clips it as the layer's "
                "attributes say. Call F.embedding with the layer's own settings, or register samplers for "
                f"{type(layer).__name__} (dpgrad.register_grad_sampler and register_norm_sampler).")


# For messages: the layer type each function computes, and how a forward calls it.
_CALLS = {F.embedding: ("nn.Embedding", "F.embedding(ids, self.weight, ...)"),
          F.linear: ("nn.Linear", "F.linear(x, self.weight, self.bias)")}


def _lookup_ids(index, weight: torch.Tensor):
    """The ids of the rows ``weight[index]`` reads, where that is a lookup (a slice of rows, or
    a tensor of integer ids), or None."""
    if isinstance(index, slice):
        return torch.arange(weight.shape[0], device=weight.device)[index]
    if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
        return index
    return None


class FunctionalHooks:
    """A layer's pre- and post-hook that put ``FunctionalCalls`` in force for its forward."""

    def __init__(self, layer: nn.Module, name: str, function: Callable, on_call: Callable, active: Callable):
        self.layer, self.name, self.function, self.on_call, self.active = layer, name, function, on_call, active
        self._modes: List[FunctionalCalls] = []

    def register(self) -> list:
        return [self.layer.register_forward_pre_hook(self.enter),
                self.layer.register_forward_hook(self.leave, always_call=True)]

    def enter(self, layer, args) -> None:
        mode = FunctionalCalls(layer, self.name, self.function, self.on_call)
        mode.__enter__()
        self._modes.append(mode)

    def leave(self, layer, args, output) -> None:
        mode = self._modes.pop()
        mode.__exit__(None, None, None)
        # None: the forward raised (the hook runs all the same), and that error stands.
        trains = any(p.requires_grad for p in layer.parameters(recurse=False))
        if output is not None and mode.calls == 0 and self.active() and trains:
            base, call = _CALLS[self.function]
            raise FunctionalCallError(
                f"layer '{self.name}' ({type(layer).__name__}, a subclass of {base} with a forward of its "
                f"own) computed its output without calling F.{self.function.__name__} on its weight, where dpgrad "
                f"takes each sample's gradient. Compute it with {call} (or super().forward), or register "
                "samplers for the class (dpgrad.register_grad_sampler and register_norm_sampler).")
