"""The calls of layers torch.func takes whole (``WholeCalls``, a mixin of
``dpgrad.backward.backward_pass.BackwardPath``): layers without samplers of their own, whose
per-sample gradients come from running their forward again on one sample at a time
(``dpgrad.samplers.functorch``). Such a call is recorded as any call, with what that
recomputation needs besides its input: its other arguments, positional or by keyword, the
tensors among them that hold one row per sample (split by sample as the input is; B*T rows of
the batch's tokens flattened, each sample's T) told apart from those given whole to every
sample (a causal mask, rotary tables of one row). A call whose input holds the batch along
another dimension (Gemma 3n's decoder layers on (streams, B, T, d), a time-first attention) is
recorded batch first and run again with its batch moved back. An output shared by all samples
(a parameter the layer returns) is handed on as one (``dpgrad.backward.shared_outputs``). The
first call read so is checked: run again on one sample at a time, it must give what the
forward pass gave (``Keywords.check``). Refused, naming the layer: a call whose forward
changed the layer's buffers (the recomputation would see other values), a tensor whose first
size equals the batch size (or the token count) by chance the first time the layer is seen
(whether it holds a row per sample cannot be told), and a recomputation that does not give
what the forward pass gave."""

from __future__ import annotations

import functools
import inspect
from functools import partial
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_unflatten

from dpgrad.backward.autograd_graph import nodes_behind
from dpgrad.backward.layer_inputs import recomputing
from dpgrad.backward.shared_outputs import SharedSite
from dpgrad.samplers.functorch import Keywords


class WholeCalls:
    """Calls of the layers taken whole, for a ``BackwardPath`` (whose ``_on_layer_call``,
    names and settings they use)."""

    def _before_whole_call(self, layer: nn.Module, args) -> None:
        """A forward pre-hook on a layer taken whole that holds buffers: their state, to tell
        whether its forward changes them."""
        if self.hooks_enabled and torch.is_grad_enabled():
            self._buffer_state[layer] = _buffer_state(layer)

    def _on_whole_call(self, layer: nn.Module, args, kwargs, output) -> Optional[torch.Tensor]:
        """A call of a layer torch.func takes whole: recorded as any call, with its keyword
        arguments for the recomputation (``Keywords``)."""
        before = self._buffer_state.pop(layer, None)
        if before is not None and before != _buffer_state(layer) and self.layer_params(layer):
            changed = [n for n, state in _buffer_state(layer).items() if before.get(n) != state]
            raise ValueError(
                f"layer '{self.layer_names[layer]}' ({type(layer).__name__}) has no per-sample gradient sampler, "
                "so torch.func computes its per-sample gradients by running its forward again, reading its "
                f"buffers; its forward changed buffers {changed} (running statistics, a counter), so that "
                "recomputation would not see what this pass saw. Freeze the layer's own parameters "
                "(requires_grad_(False)) and train the others or adapters (LoRA), or register a grad sampler "
                "for its type (dpgrad.register_grad_sampler).")
        if kwargs and not any(isinstance(a, torch.Tensor) for a in args):
            args, kwargs = _first_by_position(layer, args, kwargs)
        moved = self._moved_batch(layer, args, output)  # the batch along another dimension: recorded batch first
        # Positional arguments after the input that are tensors, or hold some (a tuple of masks):
        # split by sample or given whole as keywords are (``_rows_per_sample``).
        packed = {i: a for i, a in enumerate(args)
                  if (i > 0 and isinstance(a, torch.Tensor))
                  or (not isinstance(a, torch.Tensor) and any(isinstance(t, torch.Tensor) for t in tree_leaves(a)))}
        call = Keywords(kwargs, packed, moved=moved)

        def again(*inputs):  # the layer on inputs widened to the batch, with its keywords
            return layer(*inputs[:-1], **kwargs)

        out = self._on_layer_call(layer, (*args, call), output, again)
        if (kwargs or packed) and not call.folded and self._forward_batch and not self.independence.rerunning:
            call.split, flat, call.along = self._rows_per_sample(layer, batch_front_of(args, moved), call.values,
                                                                 moved)
            if flat:
                call.flatten_tokens(flat, self._forward_batch)
        self._check_new_reading(layer, args, call, output if out is None else out)
        return out

    def _check_new_reading(self, layer: nn.Module, args, call: Keywords, output) -> None:
        """Have the recomputation of this call checked against its forward pass
        (``Keywords.check``: its outputs copied, as the model may change them in place) where
        the call was given tensors besides its input, or the batch along another dimension, and
        the layer is called so for the first time: its input's shape and where the batch lies in
        it and in the other tensors it was given are new."""
        if call.folded or self.independence.rerunning or not (self.hooks_enabled and torch.is_grad_enabled()) \
                or recomputing():
            return
        if not call.moved and not any(isinstance(t, torch.Tensor) for t in tree_leaves(call.values)):
            return  # its input alone, split along the batch dimension: nothing was read
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        reading = (None if x is None else tuple(x.shape), call.moved, call.split, call.flat, tuple(call.along.items()))
        seen = self._readings.setdefault(layer, set())
        if reading in seen:
            return
        seen.add(reading)
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        chosen = [tensors[i] for i in call.outputs] if call.outputs else tensors[:1]
        call.check = (call.moved or self.batch_dim, tuple(t.detach().clone() for t in chosen))

    def _moved_batch(self, layer: nn.Module, args, output) -> Optional[int]:
        """The dimension other than the model's that this call holds the batch along, in its
        first input and in each output tensor that carries gradients (``batch_dim_of``), or 0
        (also where an output holds it elsewhere; refused, naming the fix, where one holds it
        first while the input's first size is not the batch's); None where it cannot be told yet."""
        if self.independence.rerunning:
            return self._batch_dims.get(layer) or 0
        if not (self.hooks_enabled and torch.is_grad_enabled()) or recomputing():
            return 0
        if not args or not isinstance(args[0], torch.Tensor):
            return 0
        dim = self._call_batch_dim(layer, args[:1])
        batch = self._input_batch if self._forward_batch is None else self._forward_batch
        outs = _grad_outputs(output)
        elsewhere = [k for k, t in enumerate(outs) if t.dim() <= dim or t.shape[dim] != batch] if dim else []
        if dim and elsewhere and args[0].shape[0] != batch and outs[elsewhere[0]].shape[:1] == (batch,):
            raise _batch_first_output(self.layer_names[layer], layer, dim, args[0], elsewhere[0], outs[elsewhere[0]])
        return 0 if elsewhere else dim

    def _hook_output(self, layer: nn.Module, kept: list, out: torch.Tensor, output, record: Callable,
                     rows: Optional[int] = None):
        """Have ``record(grad)`` called with the backprops of a call's output ``out``; returns
        what the call gives instead of ``output``, or None. A layer taken whole whose output
        holds several tensors that carry gradients (a router's scores and the top-k weights
        taken from them, an attention's output and its weights) gives copies of them, so that
        what reaches each is its gradient from outside the layer alone; those of all of them
        are recorded at once, each sample's flattened and laid end to end, (B, N) along the
        batch dimension, which the recomputation takes apart (``Keywords.outputs``). Each has
        ``rows`` along the batch dimension (the batch size; B*T for a call on the tokens
        flattened), or B*T rows flattening a (B, T, ...) input; or none (a parameter the layer
        returns, added outside it): shared by all samples, it is handed on as one
        (``dpgrad.backward.shared_outputs``), and each sample's gradient of it is taken where
        it meets the batch."""
        outs = _grad_outputs(output) if layer in self.functorch_layers and not isinstance(output, torch.Tensor) else []
        moved = kept[-1].moved if kept and isinstance(kept[-1], Keywords) else 0
        if len(outs) < 2 or not isinstance(kept[-1], Keywords):
            out.register_hook(partial(_moved_front, moved, record) if moved else record)
            return None
        dim, rows = moved or self.batch_dim, rows or self._forward_batch
        x = next((a for a in kept if isinstance(a, torch.Tensor)), None)
        flat = rows * x.shape[1] if x is not None and x.dim() > 1 and dim == 0 else None  # (B*T, ...) of (B, T, ...)
        name = self.layer_names[layer]
        # An output without a row per sample (a parameter the layer returns, added outside it):
        # shared by all samples, each sample's gradient taken where it meets the batch.
        sites = {k: SharedSite(name, o, self._forward_batch, o.dim() > 0 and o.shape[0] == 1)
                 for k, o in enumerate(outs) if o.dim() <= dim or o.shape[dim] not in (rows, flat)}
        if sites and dim != 0:
            k = next(iter(sites))
            if outs[k].shape[:1] == (self._forward_batch,) and x is not None:
                raise _batch_first_output(name, layer, dim, x, k, outs[k])
            raise ValueError(
                f"layer '{name}' ({type(layer).__name__}) has no per-sample gradient sampler, and its output tensor "
                f"{k} of shape {tuple(outs[k].shape)}, which carries gradients, has no row per sample along "
                f"dimension {dim}: a tensor shared by all samples (a parameter it returns), whose uses outside the "
                "layer dpgrad tells apart by sample only with batch_first=True. Use the parameter inside the "
                "layer, or freeze the layer's own parameters (requires_grad_(False)).")
        leaves, spec = tree_flatten(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        kept[-1].outputs = tuple(next(i for i, t in enumerate(tensors) if t is o) for o in outs)
        made = _Joined.apply(partial(self._record_outputs, record, self._forward_batch, sites, dim), *outs)
        for k, site in sites.items():
            site.output = made[k]
        copies = {id(o): sites[k].shared(m) if k in sites else m for k, (o, m) in enumerate(zip(outs, made))}
        params = self.layer_params(layer)
        for o in made:  # the hooked outputs, for the guarantee's check of the graph
            self._edges.add(o, layer, kept[:-1], params)
        return tree_unflatten([copies.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in leaves], spec)

    def _record_outputs(self, record: Callable, batch: int, sites: dict, dim: int, grads) -> None:
        """Each output's gradient by sample (the batch along ``dim`` in each), flattened and laid
        end to end: (B, N) along the model's batch dimension; a shared output's from where it met
        the batch (zeros where unused)."""
        rows = []
        for k, (g, (shape, like)) in enumerate(grads):
            if k in sites:
                try:
                    per = sites[k].take(g) if g is not None else like.new_zeros((batch, *shape))
                except BaseException:
                    self._abort_pass()
                    raise
                rows.append(per.reshape(batch, -1) if batch else per.new_zeros(0, 0))
            else:
                g = like.new_zeros(shape) if g is None else g
                rows.append(g.movedim(dim, 0).reshape(batch, -1) if batch else g.new_zeros(0, 0))
        record(torch.cat([r.to(rows[0].dtype) for r in rows], 1).movedim(0, self.batch_dim))


    def _rows_per_sample(self, layer: nn.Module, args, values, moved: Optional[int] = 0
                         ) -> Tuple[frozenset, frozenset, dict]:
        """The positions (among the tensors of ``values``, ``tree_flatten`` order) of those
        holding one row per sample: their size along the batch dimension is the batch size; and
        among them, those holding each sample's tokens flattened (batch first, B*T rows where
        the layer's input is (B, T, ...): a router's weights of the tokens); and of those laid out
        as the layer's input where it holds the batch along dimension ``moved`` (the key and
        value of a time-first attention), that dimension by position. A tensor of the
        shape it had at another batch size does not hold the batch, whatever its sizes (a
        position table as long as B*T by chance). Where that size could be another (it is also
        a size of the layer's input), and no step at another batch size has been seen, a tensor
        computed from the input's own tracked tensor holds the batch; another is refused."""
        B, dim = self._forward_batch, self.batch_dim
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        sizes = () if x is None else tuple(x.shape[:dim]) + tuple(x.shape[dim + 1:])
        tokens = B * x.shape[1] if dim == 0 and x is not None and x.dim() > 2 and x.shape[1] > 1 else None
        leaves, _ = tree_flatten_with_path(values)
        paths = [path for path, v in leaves if isinstance(v, torch.Tensor)]
        tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]
        # (layer, position) -> (held a row per sample, at which batch size, its shape then)
        seen: Dict[Tuple[nn.Module, int], Tuple[bool, int, tuple]] = self._keyword_rows
        split, flat, along = set(), set(), {}
        for i, t in enumerate(tensors):
            folded = tokens is not None and B > 1 and t.dim() > 0 and t.shape[0] == tokens
            if moved and B > 1 and t.dim() > moved and t.shape[moved] == B and t.shape[0] != B and not folded:
                split.add(i)
                along[i] = moved
                seen[(layer, i)] = (True, B, tuple(t.shape))
                continue
            rows = t.dim() > dim and (t.shape[dim] == B or folded) and B > 1
            known = seen.get((layer, i))
            if known is not None and known[1] != B:  # seen at another batch size: same shape, no batch in it
                rows = rows and tuple(t.shape) != known[2]
            elif rows and t.shape[dim] in sizes:
                if known is None and not _computed_from(t, x):  # from the batch's own rows (Funnel's unpooled states)
                    what = f"the batch's {tokens} tokens" if folded else f"the batch size {B}"
                    raise ValueError(
                        f"layer '{self.layer_names[layer]}' ({type(layer).__name__}) has no per-sample gradient "
                        "sampler, so torch.func runs its forward again on one sample at a time, splitting the "
                        f"tensors it was given that hold one row per sample; its {_argument(paths[i])} of shape "
                        f"{tuple(t.shape)} has {what} along dimension {dim}, and so has the layer's "
                        f"input, of shape {tuple(x.shape)}, along another, so whether it holds a row per sample "
                        "cannot be told. Run a first step at a batch size that is none of the input's other "
                        "sizes (it is remembered for this layer), or freeze the layer's own parameters.")
                rows = True if known is None else known[0]
            seen[(layer, i)] = (rows, B, tuple(t.shape))
            if rows:
                split.add(i)
            if rows and folded:
                flat.add(i)
        return frozenset(split), frozenset(flat), along


def batch_front_of(inputs, moved: int):
    """A call's inputs with the first one's batch moved from dimension ``moved`` to the front."""
    return (inputs[0].movedim(moved, 0), *inputs[1:]) if moved else inputs


def _moved_front(dim: int, record: Callable, grad: torch.Tensor):
    """``record`` given the backprops of an output holding the batch along ``dim``, batch first."""
    return record(grad.movedim(dim, 0))


def _computed_from(t: torch.Tensor, x: torch.Tensor, limit: int = 256) -> bool:
    """Whether ``t`` and the layer's input ``x`` (which holds the batch along the batch
    dimension) were computed from one tensor that autograd tracked: a node other than a
    parameter's among the first ``limit`` behind each. A table shared by all samples (positions,
    a relative bias) is computed from parameters and constants alone, not from the batch's rows."""
    behind_x = _behind(x.grad_fn, limit)
    return bool(behind_x) and not behind_x.isdisjoint(_behind(t.grad_fn, limit))


def _behind(start, limit: int) -> set:
    """The autograd nodes behind ``start`` (``nodes_behind``) but parameters' AccumulateGrad."""
    return {node for node in nodes_behind(start, limit) if type(node).__name__ != "AccumulateGrad"}


def _batch_first_output(name: str, layer: nn.Module, dim: int, x: torch.Tensor, k: int, out: torch.Tensor):
    """The error for a call taking the batch along ``dim`` whose output ``k`` holds it first."""
    return ValueError(
        f"layer '{name}' ({type(layer).__name__}) takes its input with the batch along dimension {dim} (shape "
        f"{tuple(x.shape)}), but its output tensor {k}, of shape {tuple(out.shape)}, which carries gradients, holds "
        "it along dimension 0 (nn.MultiheadAttention's attention weights, batch first whatever its batch_first): "
        "dpgrad reads a layer's outputs with the batch along one dimension. Return only what is used "
        "(nn.MultiheadAttention: need_weights=False), or build the layer batch first (batch_first=True) and give "
        "it (B, T, ...).")


def _grad_outputs(output) -> list:
    """The tensors of a layer's output that carry gradients."""
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def _argument(path) -> str:
    """A tensor's place among a call's arguments (a path into ``Keywords.values``), in words."""
    rest = f", item {keystr(path[2:])}" if len(path) > 2 else ""
    if path[0].idx == 0:
        return f"positional argument {path[1].key}{rest}"
    return f"keyword argument '{path[1].key}'{rest}"


def _first_by_position(layer: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """A call given everything by keyword (``attn(hidden_states=h, ...)``): its forward's first
    parameter moved to the positional inputs, where the batch is looked for and split."""
    name = _first_parameter(type(layer))
    if args or name not in kwargs:
        return args, kwargs
    return (kwargs[name],), {k: v for k, v in kwargs.items() if k != name}


@functools.lru_cache(maxsize=None)
def _first_parameter(cls: type) -> Optional[str]:
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # after self
    first = params[0] if params else None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return first.name if first is not None and first.kind in kinds else None


def _buffer_state(layer: nn.Module) -> Dict[str, tuple]:
    """Each buffer's identity and version: a forward that assigns or changes one alters it."""
    return {n: (id(b), b._version) for n, b in layer.named_buffers()}


class _Joined(torch.autograd.Function):
    """Copies of a layer's outputs, one node whose backward gets all of their gradients at once
    (None for those not used, with their shapes) and hands them to ``record`` (also inside a checkpoint's
    recomputation, where a hook on several tensors is not called)."""

    @staticmethod
    def forward(ctx, record, *outs):
        ctx.record = record
        ctx.set_materialize_grads(False)
        ctx.like = [(o.shape, o.new_empty(())) for o in outs]  # for zeros where an output is unused
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.record(list(zip(grads, ctx.like)))
        return (None, *grads)
