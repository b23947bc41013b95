"""The hooks a backward path puts on the model itself (``ModelHooks``, a mixin of
``dpgrad.backward.backward_pass.BackwardPath``): the pre-hook that begins each forward pass
(what the last one left reset, the model's layout looked at again, the finite checks that
arrived reported), and the post-hook that ends it with the guarantee's check of its graph when
its layout is new (``dpgrad.checks.guarantee``) and the independence probes
(``dpgrad.checks.independence_check``). The hooks of the layers are the path's own."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from dpgrad.backward.autograd_graph import changed_views, eager_when_compiled
from dpgrad.backward.layer_inputs import input_batch
from dpgrad.backward.shared_outputs import reaching_output_error, shared_outputs
from dpgrad.checks.guarantee import input_nodes, sequence_number, tensors_in, unclipped_error, uncovered_uses


class ModelHooks:
    """The hooks on the model itself, for a ``BackwardPath``: a forward pass begun
    (``begin_forward``) and ended (``end_forward``, with the guarantee's check, ``_verify``).
    The state they use and the ``UNCLIPPED`` message are the path's."""

    @eager_when_compiled
    def _on_model_call(self, module: nn.Module, args, kwargs) -> None:
        if self.inert or self.independence.rerunning:
            return None  # a copy of the model alone, or a forward probe's run (dpgrad.checks.forward_probe)
        self.begin_forward()
        self._input_batch, self._input_tokens = input_batch(args, kwargs, self.batch_dim)
        if self.check_independence:
            self.independence.begin_forward(args, kwargs)
        return None

    def begin_forward(self) -> None:
        """A forward pass of the model begins: what the last one left is reset."""
        if self._pass_open:
            # A backward pass that raised (in any hook, not only ours) never reached its
            # end-of-pass callback; its partial per-sample state must not leak into this step.
            self._abort_pass()
        self.finite_reports.poll()
        self._sync_with_model()
        self._check_probe()
        self._forward_batch = None
        self._input_batch, self._input_tokens = None, None
        self._forward_seen = set()
        self._unviewed_calls = []
        self._picked_scopes.begin_forward()
        self._edges.begin_forward()

    @eager_when_compiled
    def _on_model_output(self, module: nn.Module, args, output) -> None:
        if not (self.inert or self.independence.rerunning):
            self.end_forward(output)

    def end_forward(self, output) -> None:
        """The end of a forward pass: the guarantee's check of its graph, when its layout is
        new (``dpgrad.checks.guarantee``)."""
        passing = self._learn_changed_outputs()
        edges = self._edges
        calls, edges.calls = edges.calls, []
        found = tensors_in(output)
        if calls and not found:
            # Nothing to check the guarantee from: the loss could reach the layers unseen.
            raise TypeError(
                f"the model's output is a {type(output).__name__}, in which dpgrad finds no tensor: it checks "
                "the graph from the model's outputs (that every trainable parameter is clipped and each "
                "sample's outputs are its own), so return a tensor, or tuples, lists, dicts, dataclasses or "
                "SimpleNamespaces of them (Hugging Face's ModelOutput is a dict)")
        shared = shared_outputs(found)
        if shared:
            raise reaching_output_error(shared)
        tensors = [t for t in found if t.grad_fn is not None]
        edges.set_outputs(tensors)
        if not calls or not edges.outputs:
            self.independence.call = None
            if edges.outputs and self.hooks_enabled and torch.is_grad_enabled():
                # No hooked call, yet outputs with a graph: any trainable parameter they reach
                # went around the hooks (a model torch.compile compiled before it was wrapped).
                self._verify(edges.outputs, [], edges.marked_elsewhere)
            return
        first = sequence_number(calls[0][1])
        extra = sum(n >= first for n in passing) - (first in passing)
        key = (self._scan_version, tuple(call[0] for call in calls), edges.output_seq - first - extra)
        views, edges.views = edges.views, []
        if key not in self._verified:
            self._refuse_changed_views(views)
            self._verify(edges.outputs, calls, edges.marked_elsewhere)
            self._verified.add(key)
        if self.check_independence:
            self.independence.end_forward(key, tensors)

    def _unviewed(self, layer: nn.Module, output) -> Optional[torch.Tensor]:
        """``output`` as a tensor of its own, where it is a view of the whole of a tensor (a
        Linear's (B, T, p) view of its (B*T, p) product) that may be changed in place after the
        layer (``h += x``): autograd drops a view's node, and the hook on it, when the view is
        changed in place, while a hook on a tensor of its own gets its gradient before the
        change. Done for every layer in the first forward pass (an operation each), then for
        the layers whose output was changed in place (``_learn_changed_outputs``).

        The tensor of its own is made from the view's base, unless hooks that ran before this
        one put their own on ``output`` (FSDP2's forward hook on a module sharded on its own puts
        there the pre-backward hook that all-gathers its parameters): then from ``output``, for
        its gradient to pass through them. (Made from ``output`` always, it would keep an fp32
        input alive under autocast that autograd lets go.)"""
        if not (self._unview_all or layer in self._unview_layers):
            return None
        if not isinstance(output, torch.Tensor) or output._base is None or not output.requires_grad:
            return None
        base = output._base
        if base.numel() != output.numel() or not (base.is_contiguous() and output.is_contiguous()):
            return None
        own = torch.ops.aten._unsafe_view(output if output._backward_hooks else base, output.shape)
        self._unviewed_calls.append((layer, own, own._version))
        return own

    def _learn_changed_outputs(self) -> list:
        """Learn the layers whose output was changed in place; returns the sequence numbers of
        the nodes this forward pass added for the others (the first one's ``_unviewed``), which
        the later ones will not add: the layout's key leaves them out."""
        calls, self._unviewed_calls = self._unviewed_calls, []
        self._unview_layers.update(layer for layer, own, version in calls if own._version != version)
        self._unview_all = False
        return [sequence_number(own.grad_fn) for layer, own, _ in calls if layer not in self._unview_layers]

    def _refuse_changed_views(self, views: list) -> None:
        """Raise, naming the layers, where a hooked output that is a view was changed in place
        after its layer (checked once per layout: a model's code changes the same outputs)."""
        changed = changed_views(views)
        if changed:
            names = ", ".join(f"'{self.layer_names[layer]}' ({type(layer).__name__})" for layer in changed)
            raise ValueError(
                f"the output of layer {names} was changed in place after the layer (e.g. h += x, h.mul_(s)); it "
                "is a view of the layer's product, and autograd then drops the node dpgrad's hook is on, so that "
                "layer's per-sample gradients would be left out. Change it out of place (h = h + x).")

    def _verify(self, roots: list, calls: list, stop: Callable, in_loss: bool = False) -> None:
        """Raise ``UnclippedGradientError`` if a trainable parameter is reached from ``roots``
        other than through the hooked ``calls``."""
        canonical = None
        if self.sharded is not None:  # the graph holds FSDP's unsharded copies
            canonical = lambda t: self.sharded.canonical((t,))[0]  # noqa: E731
        # In the loss any trainable tensor counts: one the model does not hold (a learned temperature
        # outside it) would get no clipped gradient.
        uses = uncovered_uses(roots, [(node, input_nodes(inputs), set(params)) for _, node, inputs, params in calls],
                              None if in_loss else self._checked, stop=stop, canonical=canonical,
                              visit=self._visit_node)
        if uses:
            names = {p: n.removeprefix("_module.") for n, p in self.root.named_parameters()}
            names.update(self._param_names)
            raise unclipped_error(self.UNCLIPPED, uses, names, self._owners, self.layer_names,
                                  {call[0] for call in calls}, in_loss)

    def probes_model_at_forward(self) -> bool:
        """Whether the model's probe runs at the end of a forward pass of a new layout (else the
        probe of the per-sample losses, in a backward pass dpgrad runs, takes the model too)."""
        return True

    def _visit_node(self, node) -> None:
        """Called on every node the guarantee's check walks; a path raises for nodes it cannot
        clip through."""
