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
graph, and only nodes this loss can reach are considered. That walk visits every node of the
graph in Python, milliseconds for a large model; ``ForwardEdges`` spares it in the common case
(one forward pass, then its backward): it keeps the edges of the latest forward pass's hooked
outputs and hands all of them to autograd, which walks the graph itself. Asking for every
hooked output instead of the lowest ones runs the same nodes; their gradients are what the
hooks record anyway, as long as the records are held to the end of the pass. A pass that lets
go of records early because memory is short (``dpgrad.backward.group_flush``) asks for the lowest
outputs only (``targets(root, lowest=True)``): autograd holds every gradient it is asked for
until the pass ends, and one held for each hooked output would keep alive all the backprops
that the records let go of (WideResNet-16-4 at B=32 on a CPU: 65 MiB, half the non-private
step's peak).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Dict, List, Optional

import torch
from torch.autograd.profiler import record_function
from torch.autograd.graph import GradientEdge, Node

from dpgrad.checks.guarantee import sequence_number

# What a backward pass that keeps the graph says when the model's compiled backward cannot run twice.
DONATED_BUFFERS = (
    "the model runs through torch.compile with donated buffers (its compiled backward reuses the memory of "
    "what it saved, so it can run only once), and dpgrad backpropagates through the graph twice: its "
    "independence probe on a new layout, and the norm pass of double backward, keep the graph for the "
    "backward pass that follows. Set torch._functorch.config.donated_buffer = False (import "
    "torch._functorch.config) before the first compiled call, or call torch._dynamo.reset() after setting "
    "it; check_independence=False also does (with the ghost-clipping wrapper, under single_backward=True), "
    "giving up that check. Nothing has reached p.grad or p.grad_sample from this pass."
)


def eager_when_compiled(fn):
    """``fn``, run eagerly inside ``torch.compile`` (``torch.compiler.disable``): dpgrad's hooks,
    loss and noise, which read autograd's nodes or must draw as the eager step draws. The
    disabled function is made at the first call, so importing dpgrad does not import torch's
    compiler (nor Triton through it)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        disabled = run.__dict__.get("_disabled")
        if disabled is None:
            disabled = run._disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return run


def region(name: str):
    """A named range in a torch.profiler trace while a profiler runs; nothing otherwise
    (``record_function`` costs microseconds even with no profiler to see it)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def in_region(name: str):
    """A decorator: the function runs inside ``region(name)``, its time named in a profile
    (a hook's, the norms', the noise's)."""

    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with region(name):
                return fn(*args, **kwargs)

        return run

    return decorate


@contextlib.contextmanager
def refusing_reentrant(message: str):
    """Inside: torch's refusal of ``torch.autograd.grad`` through a reentrant activation
    checkpoint raised as ``RuntimeError(message)``, which says what to do."""
    try:
        yield
    except RuntimeError as error:
        if "use_reentrant=True" in str(error):
            raise RuntimeError(message) from error
        raise


def grad_keeping_graph(outputs, inputs, grad_outputs=None, **kwargs):
    """``torch.autograd.grad`` with ``retain_graph=True``, a compiled backward that cannot run
    twice (donated buffers) refused with what to do (``DONATED_BUFFERS``)."""
    try:
        return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, **kwargs)
    except RuntimeError as error:
        if "donated buffers" in str(error):
            raise RuntimeError(DONATED_BUFFERS) from error
        raise


def mark_output(out: torch.Tensor, mark: object, forward_id: int = 0) -> None:
    """Mark the node that produced ``out`` (before any later in-place change of ``out``) as
    a hooked output of forward pass ``forward_id``."""
    out.grad_fn.metadata.setdefault(mark, (forward_id, set()))[1].add(out.output_nr)


def _first_marked_forward(root: Node, mark: object) -> Optional[int]:
    """The forward pass of the marked node nearest ``root`` (breadth first), or None."""
    seen = {root}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        found = node.metadata.get(mark)
        if found is not None:
            return found[0]
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return None


class ForwardEdges:
    """The gradient edges of the hooked outputs of the latest forward pass.

    ``targets(root)`` gives them all when the loss comes from that forward pass and from no
    other one still waiting for its backward; otherwise (several forward passes before their
    backward passes) the lowest marked edges found by walking the graph. The list is dropped
    once a backward pass has used the forward pass, or when the next one begins: it keeps at
    most one graph's nodes (not their saved tensors, which backward frees) alive.

    For the guarantee's check (``dpgrad.checks.guarantee``) it also keeps, until the forward pass
    ends, each hooked call (its output's node, its inputs, the parameters it covers), and,
    as long as the edges, the nodes of the model's outputs.
    """

    def __init__(self):
        self.mark = object()  # this wrapper's mark in node metadata
        self.forward_id = 0
        self._edges: List[GradientEdge] = []
        self._consumed = True
        self._ambiguous = False
        self.calls: List[tuple] = []  # (layer, output node, inputs, parameters) of this forward
        self.views: List[tuple] = []  # (layer, output, its version) of the hooked outputs that are views
        self.outputs: List[Node] = []  # the model's output nodes, once the forward has ended
        self.output_edges: List[GradientEdge] = []  # and their edges, with the outputs' shapes
        self.output_shapes: List[tuple] = []
        self.output_seq = 0  # the largest sequence number among them

    def begin_forward(self) -> None:
        # A forward pass whose backward has not come: a loss might reach both graphs.
        self._ambiguous = bool(self._edges) and not self._consumed
        self.forward_id += 1
        self._edges = []
        self.calls = []
        self.views: List[tuple] = []  # (layer, output, its version) of the hooked outputs that are views
        self.set_outputs([])
        self._consumed = False

    def add(self, out: torch.Tensor, layer, inputs, params) -> None:
        """A hooked call of ``layer``: its output, its inputs, the parameters it covers."""
        mark_output(out, self.mark, self.forward_id)
        self._edges.append(GradientEdge(out.grad_fn, out.output_nr))
        self.calls.append((layer, out.grad_fn, inputs, params))
        if out._base is not None:  # a view: changed in place, its node leaves the graph (``changed_views``)
            self.views.append((layer, out, out._version))


    def set_outputs(self, tensors: List[torch.Tensor]) -> None:
        """The model's outputs (tensors with a graph) at the end of the forward pass."""
        self.outputs = [t.grad_fn for t in tensors]
        self.output_edges = [GradientEdge(t.grad_fn, t.output_nr) for t in tensors]
        self.output_shapes = [tuple(t.shape) for t in tensors]
        self.output_seq = max((sequence_number(node) for node in self.outputs), default=0)

    def all_edges(self) -> List[GradientEdge]:
        """The edges of every hooked output of the latest forward pass."""
        return list(self._edges)

    def marked_elsewhere(self, node: Node) -> bool:
        """Whether ``node`` is a hooked output of another forward pass than the latest."""
        found = node.metadata.get(self.mark)
        return found is not None and found[0] != self.forward_id

    def marked(self, node: Node) -> bool:
        """Whether ``node`` is a hooked output of any forward pass."""
        return self.mark in node.metadata

    def consumed(self, forward_id: int) -> None:
        """A hooked backward pass reached forward pass ``forward_id``."""
        if forward_id == self.forward_id:
            self._consumed = True

    def release(self) -> None:
        if self._consumed:
            self._edges = []
            self.set_outputs([])

    def targets(self, root: Node, lowest: bool = False) -> List[GradientEdge]:
        """The edges a norm pass from ``root`` must ask autograd for (see the module docstring);
        with ``lowest``, the lowest marked edges alone, whatever the forward passes."""
        if not lowest and self._edges and not self._consumed and not self._ambiguous:
            if _first_marked_forward(root, self.mark) == self.forward_id:
                return list(self._edges)
        return lowest_marked_edges(root, self.mark)


def _children(node: Node) -> List[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def nodes_behind(start: Optional[Node], limit: int) -> set:
    """The first ``limit`` autograd nodes behind ``start`` (itself included), breadth first."""
    seen, frontier, found = {start}, [start], set()
    while frontier and len(found) < limit:
        node = frontier.pop(0)
        if node is None or not hasattr(node, "next_functions"):
            continue
        found.add(node)
        for child in _children(node):
            if child not in seen:
                seen.add(child)
                frontier.append(child)
    return found


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
        found = node.metadata.get(mark)
        outputs = found[1] if found is not None else None
        has_below = any(marked_below[c] for c in below)
        if outputs and not has_below:
            lowest.extend(GradientEdge(node, nr) for nr in sorted(outputs))
        marked_below[node] = bool(outputs) or has_below
    return lowest


def changed_views(views: list) -> list:
    """The layers among ``views`` (``ForwardEdges.views``) whose output was changed in place
    since their call (``h += x`` on a Linear's (B, T, p) view of its (B*T, p) product):
    autograd then replaces the view's node, and the hook on it never runs."""
    return list(dict.fromkeys(layer for layer, out, version in views if out._version != version))
