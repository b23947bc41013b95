"""Which layer outputs a norms-only backward pass must ask autograd for.

A backward pass that computes per-sample norms needs the gradient at every hooked layer's
output, and no weight gradient at all. ``torch.autograd.grad(loss, inputs=edges)`` does exactly
that when ``edges`` are gradient edges of layer outputs: autograd runs only the nodes that lead
to them, and a node whose weight leaf is not among them skips the weight's gradient (the GEMM
of a Linear, the dense (V, d) gradient of an Embedding). Every hooked output must lie on a path
to some edge. Asking for the outputs that have no other hooked output below them suffices (the
rest are above those), and keeps what autograd hands back small: the gradients it returns for
those few edges are the only ones it holds until the pass ends.

Hooked outputs are found by a mark in their node's metadata, so no list of them outlives the
graph, and only nodes this loss can reach are considered.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch.autograd.graph import GradientEdge, Node


def mark_output(out: torch.Tensor, mark: object) -> None:
    """Mark the node that produced ``out`` (before any later in-place change of ``out``)."""
    out.grad_fn.metadata.setdefault(mark, set()).add(out.output_nr)


def _children(node: Node) -> List[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def lowest_marked_edges(root: Node, mark: object) -> List[GradientEdge]:
    """Gradient edges of the marked outputs under ``root`` that have no marked node below them.

    One pass over the nodes ``root`` reaches, children before parents (iterative: graphs are
    deeper than Python's recursion limit).
    """
    marked_below: Dict[Node, bool] = {}  # a marked node is at or below this one
    children: Dict[Node, List[Node]] = {}  # next_functions builds new tuples at every call
    lowest: List[GradientEdge] = []
    stack = [root]
    while stack:
        node = stack[-1]
        if node in marked_below:
            stack.pop()
            continue
        below = children.get(node)
        if below is None:
            below = children[node] = _children(node)
            pending = [c for c in below if c not in marked_below]
            if pending:
                stack.extend(pending)
                continue
        stack.pop()
        outputs = node.metadata.get(mark)
        has_below = any(marked_below[c] for c in below)
        if outputs and not has_below:
            lowest.extend(GradientEdge(node, nr) for nr in sorted(outputs))
        marked_below[node] = bool(outputs) or has_below
    return lowest
