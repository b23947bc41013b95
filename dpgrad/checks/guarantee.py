"""The guarantee: every parameter that gets a gradient from a dpgrad backward pass was clipped.

A wrapper clips what its hooks see: the per-sample gradient of a parameter through the calls
of its layer. A parameter that autograd reaches some other way (its layer ran without its
hooks, its weight was also used outside the layer, it belongs to no hooked layer) would get
a gradient that is not in the norm. This module finds such uses in the autograd graph:

- ``uncovered_uses`` walks a graph from its roots and returns every edge into the gradient
  accumulator of a trainable parameter that no hooked layer call accounts for. A call
  accounts for the edges of the nodes it created: those reachable from its output without
  passing through its inputs' nodes.
- The wrappers walk each forward pass's graph when its layout is new (the sequence of hooked
  calls, the trainable parameters, and the number of autograd nodes between the first hooked
  output and the model's output, read from the nodes' sequence numbers); a training loop
  walks once per layout, not once per step. dpgrad's loss wrapper also walks the part of the
  graph between the loss and the model's outputs, once per layout of that part.
- ``structure_version`` counts the modules and parameters registered into a module of a
  wrapped model (global registration hooks, ``watch_modules``), so a wrapper notices a module
  added to its model after wrapping without looking at the model at every step; registrations
  into other modules do not count (a forward pass that slices a ModuleList, as Hugging Face's
  Llama does, builds a new one at every step); a change of ``requires_grad`` is found by
  comparing the flags at each forward pass.

Nothing here runs on the device or waits for it.
"""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.nn.modules import module as _module

_structure_version = 0
_watching = False
# The modules of the wrapped models, as their wrappers last looked at them.
_watched: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


class UnclippedGradientError(RuntimeError):
    """A trainable parameter would get a gradient that dpgrad did not clip; nothing reached
    ``p.grad`` (or ``p.grad_sample``) from the pass that found it."""


def _bump(module, *_args) -> None:
    global _structure_version
    if module in _watched:
        _structure_version += 1


def watch_modules(modules: Iterable[torch.nn.Module]) -> None:
    """Count the registrations into ``modules`` (a wrapped model's, as its wrapper looked at
    them) from now on, besides those already watched."""
    _watched.update(modules)


def watch_structure() -> None:
    """Count module and parameter registrations into watched modules from now on (once per
    process)."""
    global _watching
    if not _watching:
        _module.register_module_module_registration_hook(_bump)
        _module.register_module_parameter_registration_hook(_bump)
        _watching = True


def structure_version() -> int:
    """Changes whenever a module or a parameter is registered into a watched module
    (``watch_modules``)."""
    return _structure_version


_ACCUMULATE_GRAD: Optional[type] = None


def _accumulate_grad() -> type:
    """The class of the nodes that accumulate a leaf's gradient (torch does not export it)."""
    global _ACCUMULATE_GRAD
    if _ACCUMULATE_GRAD is None:
        leaf = torch.zeros(1, requires_grad=True)
        _ACCUMULATE_GRAD = type(leaf.view(1).grad_fn.next_functions[0][0])
    return _ACCUMULATE_GRAD


# A call of a hooked layer: its output's node, its inputs' nodes, the parameters it covers.
Call = Tuple[object, Set[object], Set[torch.Tensor]]


def input_nodes(inputs) -> Set[object]:
    """The autograd nodes that made the tensors among ``inputs``."""
    return {a.grad_fn for a in inputs if isinstance(a, torch.Tensor) and a.grad_fn is not None}


def uncovered_uses(roots: Iterable[object], calls: Iterable[Call], trainable: Optional[Set[torch.Tensor]],
                   stop: Callable[[object], bool] = lambda node: False,
                   canonical: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   visit: Callable[[object], None] = lambda node: None) -> List[Tuple[torch.Tensor, object]]:
    """``(parameter, node)`` for each edge from a node reachable from ``roots`` into the
    gradient accumulator of a parameter in ``trainable`` (None: of any tensor) that no call in
    ``calls`` accounts for. The walk does not enter a node for which ``stop`` is true (what another check
    covers), and calls ``visit`` on every node it enters. ``canonical`` maps the tensor an
    accumulator holds to the parameter it stands for (FSDP2's unsharded copies)."""
    acc = _accumulate_grad()

    def param_of(node):
        var = node.variable
        return canonical(var) if canonical is not None else var

    covered: Set[Tuple[object, torch.Tensor]] = set()
    for out, inputs, params in calls:
        seen, stack = {out}, [out]
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None or child in seen or child in inputs:
                    continue
                if type(child) is acc:
                    p = param_of(child)
                    if p in params:
                        covered.add((node, p))
                    continue
                seen.add(child)
                stack.append(child)
    found: List[Tuple[torch.Tensor, object]] = []
    roots = [r for r in roots if r is not None and not stop(r)]
    seen, stack = set(roots), list(roots)
    while stack:
        node = stack.pop()
        if type(node) is acc:
            continue
        visit(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            if type(child) is acc:
                p = param_of(child)
                if (trainable is None or p in trainable) and (node, p) not in covered:
                    found.append((p, node))
                continue
            if child not in seen and not stop(child):
                seen.add(child)
                stack.append(child)
    return found


def unclipped_error(head: str, uses: List[Tuple[torch.Tensor, object]], names: Dict[torch.Tensor, str],
                    owners: Dict[torch.Tensor, list], layer_names: Dict[object, str], called: Set[object],
                    in_loss: bool) -> UnclippedGradientError:
    """The error for parameters reached outside their layers' hooked calls: ``head``, then a
    line per parameter (``names``) saying why and what to do, from the hooked layers that hold
    it (``owners``, named by ``layer_names``), those ``called`` in the forward pass, and the
    node that reached it."""
    lines, done = [], set()
    for p, node in uses:
        if p in done:
            continue
        done.add(p)
        how = f"autograd node {type(node).__name__}"
        holders = owners.get(p, [])
        owner = next((layer for layer in holders if layer in called), holders[0] if holders else None)
        layer = f"'{layer_names[owner]}'" if owner is not None else None
        if p not in names:
            lines.append(f"- a trainable tensor of shape {tuple(p.shape)} that the wrapped model does not hold: the loss "
                         f"uses it ({how}), so its gradient would be neither clipped per sample nor computed by the "
                         "clipped backward, and an optimizer holding it would move it by noise alone. Make it a "
                         "parameter of the model (a module called in its forward pass, e.g. a learned temperature), "
                         "or freeze it.")
            continue
        if in_loss:
            why = (f"it is used in the loss, outside the model's forward pass ({how}). Compute the "
                   "loss from the model's outputs only, or freeze the parameter")
        elif layer is None:
            why = (f"no layer that dpgrad hooks holds it ({how}). Make it a parameter of a layer "
                   "of the wrapped model, or freeze it")
        elif owner in called:
            why = (f"it is also used outside the forward pass of its layer {layer} ({how}: e.g. "
                   "F.linear(x, layer.weight), or an output of the layer other than its first). Use "
                   "it through the layer itself (for a tied output layer, an nn.Linear whose "
                   "weight is the embedding's), or freeze it")
        elif "Compiled" in type(node).__name__:
            why = (f"its layer {layer} ran in code that torch.compile compiled before the model "
                   f"was wrapped, without the hooks ({how}). Wrap the model first and compile "
                   "the wrapper, or call torch._dynamo.reset() after wrapping")
        else:
            why = (f"its layer {layer} ran without dpgrad's hooks ({how}): called as "
                   "layer.forward(...) rather than layer(...), or with its hooks removed. Call "
                   "the layer itself")
        lines.append(f"- parameter '{names[p]}': {why}.")
    return UnclippedGradientError(head + "\n" + "\n".join(lines))


def tensors_in(output, limit: int = 10_000) -> List[torch.Tensor]:
    """The tensors in a model's output: a tensor, or tuples, lists, dicts, dataclasses and
    ``SimpleNamespace``s of them (Hugging Face's ``ModelOutput`` is a dict), at any depth."""
    found: List[torch.Tensor] = []
    stack = [output]
    while stack and len(found) < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, SimpleNamespace):
            stack.extend(vars(item).values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    return found


def sequence_number(node) -> int:
    """The order in which autograd made ``node`` (per thread)."""
    return node._sequence_nr()


class VerifiedLayouts:
    """Keys of graph layouts already walked and found clean, at most ``limit`` of them (a
    model whose layout changes at every step is walked at every step, and stays bounded)."""

    def __init__(self, limit: int = 256):
        self._keys: Dict[tuple, None] = {}
        self._limit = limit

    def __contains__(self, key: tuple) -> bool:
        return key in self._keys

    def add(self, key: tuple) -> None:
        if len(self._keys) >= self._limit:
            self._keys.clear()
        self._keys[key] = None

    def clear(self) -> None:
        self._keys.clear()
