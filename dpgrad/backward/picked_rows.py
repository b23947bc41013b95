"""Layers called on rows picked from the batch's tokens: a mixture-of-experts block with a module
per expert routes each token to its experts by indexing (``expert(x[top_x])``, Switch
Transformers, NLLB-MoE, and most hand-written MoE code), so an expert's layers see a subset of the
B*T tokens in no fixed order.

The rows are told from the autograd graph of the first such layer's input: through views and
casts back to the indexing (``IndexBackward0``, ``IndexSelectBackward0`` along dimension 0),
whose saved indices, applied to a grid of the source's leading positions, give each row's token;
the source holds the batch's tokens batch-first (B, T, ...) or flattened (B*T, ...), so token i
is sample i // T's (the independence check refuses another order). The later layers of the same
module call, on rows of the same count (the expert's second Linear, after its activation),
take the same tokens. A call is recorded with its inputs and backprops scattered to each row's
token, (B, T, ...), zero where the expert got no token (a token picked twice gets a place per
pick): every sampler takes it as any call, and a zero row adds nothing to a sample's gradient.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, Optional, Tuple

import torch

from dpgrad.backward.autograd_graph import nodes_behind

# Autograd nodes between the indexing and the layer's input that keep its rows in order.
_KEEP_ROWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",
                        "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
                        "ToCopyBackward0", "CloneBackward0"})
_DEPTH = 8  # nodes walked at most


class PickedRows:
    """Where each of a call's ``rows`` rows goes: ``tokens`` (rows,), its slot in a grid of
    ``batch * per_sample`` positions, sample-major (its token's, or one of its token's where a
    token is picked twice)."""

    __slots__ = ("tokens", "rows", "batch", "per_sample")

    def __init__(self, tokens: torch.Tensor, per_sample: int, batch: int):
        self.tokens, self.rows = tokens, tokens.numel()
        self.batch, self.per_sample = batch, per_sample

    def spread(self, a):
        """``a`` with its ``rows`` rows put at their tokens, (B, T, ...), zeros elsewhere; any
        other value as it is."""
        if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != self.rows:
            return a
        out = a.new_zeros((self.batch * self.per_sample, *a.shape[1:]))
        out = out.index_copy(0, self.tokens, a)
        return out.view(self.batch, self.per_sample, *a.shape[1:])


def _source_index(x: torch.Tensor):
    """The indexing node ``x`` comes from through row-keeping nodes, or None."""
    fn = x.grad_fn
    for _ in range(_DEPTH):
        if fn is None:
            return None
        kind = type(fn).__name__
        if kind in ("IndexBackward0", "IndexSelectBackward0"):
            return fn
        if kind not in _KEEP_ROWS or not fn.next_functions:
            return None
        fn = fn.next_functions[0][0]
    return None


def _tokens(fn) -> Optional[Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]]:
    """(the token of each row the indexing ``fn`` picked, flattened; the grid of positions it
    indexed; the sizes it left whole), or None where it is no pick of rows."""
    sizes = tuple(int(s) for s in fn._saved_self_sym_sizes)
    if type(fn).__name__ == "IndexSelectBackward0":
        if fn._saved_dim != 0:
            return None
        indices = (fn._saved_index,)
    else:
        indices = tuple(fn._saved_indices)
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1 for i in indices)
    if consumed >= len(sizes):
        return None  # an index into the features: not a pick of whole rows
    grid = sizes[:consumed]
    device = next((i.device for i in indices if isinstance(i, torch.Tensor)), None)
    if device is None:
        return None
    positions = torch.arange(math.prod(grid), device=device).view(grid)
    picked = positions[tuple(slice(None) if i is None else i for i in indices)]
    return picked.reshape(-1), grid, sizes[consumed:]


def picked_rows(x: torch.Tensor, batch: int) -> Optional[PickedRows]:
    """The tokens of the rows of ``x``, a layer's input, where it is rows picked by
    indexing from a tensor of the batch's B*T tokens; else None. A token picked twice in the
    call (one token routed to an expert twice) gets a slot per pick."""
    fn = _source_index(x) if x.grad_fn is not None else None
    found = _tokens(fn) if fn is not None else None
    if found is None or batch <= 0:
        return None
    tokens, grid, whole = found
    count = math.prod(grid)
    if count % batch or tokens.numel() != x.shape[0] or tuple(x.shape[1:]) != whole:
        return None
    return PickedRows(*_slots(tokens, count // batch), batch)


def _slots(tokens: torch.Tensor, per_sample: int) -> Tuple[torch.Tensor, int]:
    """(each row's slot, slots per sample): its token's, where no token is picked twice; else
    ``m`` slots a token (m its most picks), a row's being ``token * m`` plus how many rows
    before it picked the same token. One wait for the device (the count of distinct tokens)."""
    if tokens.numel() == 0 or torch.unique(tokens).numel() == tokens.numel():
        return tokens, per_sample
    order = torch.argsort(tokens, stable=True)
    ordered = tokens[order]
    first = torch.searchsorted(ordered, ordered)  # where each row's token begins among the sorted
    repeat = torch.empty_like(tokens)
    repeat[order] = torch.arange(tokens.numel(), device=tokens.device) - first
    m = int(repeat.max()) + 1
    return tokens * m + repeat, per_sample * m


class PickedScopes:
    """The picks of the latest module calls, by the names of the modules holding the layer that
    found them, with that layer's output: a later layer inside one of those modules, on as many
    rows computed from it (the expert's second Linear), takes the same tokens."""

    def __init__(self):
        self._scopes: Dict[str, Tuple[int, PickedRows, object]] = {}
        # The layers called on picked rows: a forward probe's run (under no_grad, no graph to
        # tell their rows by) leaves their outputs as they are.
        self.layers: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def begin_forward(self) -> None:
        """Let go of the last forward pass's picks (and the autograd nodes they hold)."""
        self._scopes.clear()

    def note(self, layer: torch.nn.Module, name: str, forward_id: int, picked: PickedRows, out: torch.Tensor) -> None:
        scope = name
        while scope:  # every module holding the layer (a LoRA adapter's lora_B is lora_A's sibling)
            scope = scope.rpartition(".")[0]
            self._scopes[scope] = (forward_id, picked, out.grad_fn)
        self.layers.add(layer)

    def find(self, name: str, forward_id: int, x: torch.Tensor) -> Optional[PickedRows]:
        """The pick a module holding the layer ``name`` noted in this forward pass, where the
        layer's input ``x`` has as many rows and is computed from that pick's layer's output."""
        scope = name
        while True:
            scope = scope.rpartition(".")[0]
            found = self._scopes.get(scope)
            if (found is not None and found[0] == forward_id and found[1].rows == x.shape[0]
                    and _reaches(x.grad_fn, found[2])):
                return found[1]
            if not scope:
                return None


def _reaches(start, target, limit: int = 64) -> bool:
    """Whether the autograd node ``target`` is among the first ``limit`` nodes behind ``start``."""
    return start is not None and target is not None and target in nodes_behind(start, limit)
    seen, frontier = {start}, [start]
    while frontier and len(seen) <= limit:
        fn = frontier.pop(0)
        if fn is target:
            return True
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return False
