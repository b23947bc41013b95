"""The backward path of dpgrad's wrappers: hook -> record -> finish.

How the backward pass works. A wrapper holds a path (``GradSamplePath`` for
``GradSampleModule``, ``ClippingPath`` for ``GradSampleModuleFastGradientClipping``) that hooks
the model. A forward pass begins at the model's pre-hook (``begin_forward``: the model is
hooked anew if its trainable parameters or modules changed), every call of a layer with
trainable parameters of its own, whatever its mode, puts a gradient hook on its output
(``_on_layer_call``), and the model's post-hook ends it (``end_forward``: the guarantee's check
of its graph, ``dpgrad.checks.guarantee``, when its layout is new, and the independence probes,
``dpgrad.checks.independence_check``, until a batch of the layout has been probed). A copy of the
model alone (``copy.deepcopy``) carries inert hooks. A backward pass opens at its
first recorded layer (``_open_pass``), keeps each layer's ``Record`` of inputs and backprops
(``keep``), and closes after its last hook (``_close_pass``: ``finish``, then ``_clear_pass``);
a forward pass that finds one still open (a backward that raised) clears it. What ``keep``
and ``finish`` do is the path's: per-sample gradients onto ``p.grad_sample``
(``GradSamplePath``, in ``dpgrad.grad_sample_module``), or per-sample norms, then clipped
sums (``ClippingPath``, in ``dpgrad.backward.clipping_path``). A hook does no arithmetic, copy or
launch beyond what its path keeps.

``BackwardPath`` holds the layers' hooks, the records and the opening and closing of a pass;
four mixins hold the rest: the layers hooked, and hooked anew when the model changes
(``HookedLayers``, in ``dpgrad.backward.hooked_layers``), the model's pre- and post-hook
(``ModelHooks``, in ``dpgrad.backward.model_hooks``), the calls whose samples are not one
row each (``SplitCalls``, in ``dpgrad.backward.split_calls``: a layer shared by all samples, the
batch's tokens flattened), and the calls of layers torch.func takes whole (``WholeCalls``, in
``dpgrad.backward.whole_calls``: their keyword arguments and buffers).

Under ``loss_reduction="mean"`` the backprops are those of the mean loss, 1/B of each sample's
own (Opacus multiplies them by B); the paths apply the factor B to (B,)-sized vectors where
they can, never in a pass over a backprop.

No device-to-host synchronisation on the way: whether the per-sample values are finite is one
number computed on the device (``FiniteCheck``, in ``dpgrad.backward.finite_checks``); a pass
whose values are not finite has its clipped gradients replaced by zeros on the device, and the
host reads the outcome without waiting, raising at the next forward pass (``FiniteReports``).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from functools import partial
from typing import List, Optional, Set

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from dpgrad.samplers import registry
from dpgrad.backward.autograd_graph import ForwardEdges, eager_when_compiled, in_region, region
from dpgrad.backward.finite_checks import FiniteReports
from dpgrad.backward.hooked_layers import HookedLayers
from dpgrad.backward.model_hooks import ModelHooks
from dpgrad.kernels.backend import name_layers
from dpgrad.checks.guarantee import VerifiedLayouts
from dpgrad.checks.independence import Probe
from dpgrad.checks.independence_check import IndependenceCheck, check_every
from dpgrad.backward.layer_inputs import (batch_to_front, broadcast_inputs, check_batch, folded_rows,
                                          recomputing, shared_before, shared_call, without_batch)
from dpgrad.backward.picked_rows import PickedScopes
from dpgrad.backward.split_calls import SplitCalls
from dpgrad.backward.whole_calls import WholeCalls, batch_front_of
from dpgrad.checks.model_checks import refuse_wrapped
from dpgrad.samplers.functorch import Keywords, _first_tensor
from dpgrad.samplers.groups import Record
from dpgrad.tuning.progress import TUNING_PROGRESS


class PendingCalls(dict):
    """One forward pass's hooked calls that its backward pass has not recorded yet (layer ->
    count). Each of the forward pass's gradient hooks holds it, and the path only weakly: it
    lasts as long as the forward pass's graph can still be backpropagated through."""

    def __init__(self, forward_id: int):
        super().__init__()
        self.forward_id = forward_id


class BackwardPath(HookedLayers, ModelHooks, SplitCalls, WholeCalls):
    """A model's layers hooked (``HookedLayers``), its forward passes begun and ended
    (``ModelHooks``), the calls whose samples are not their rows (``SplitCalls``), the records of each backward pass, and the pass finished (see the module
    docstring). Subclasses say what a pass keeps (``keep``) and does with it
    (``finish``). Built with the model and how its losses come (``batch_first``,
    ``loss_reduction``); checks the model at once, raising before anything is touched; hooks
    it with ``attach``."""

    GRAD_SAMPLERS = registry.GRAD_SAMPLERS
    # What UnclippedGradientError says first.
    UNCLIPPED = ("these trainable parameters would get per-sample gradients (p.grad_sample) that miss "
                 "the uses below, so clipping them would not bound each sample's contribution. "
                 "Nothing has reached p.grad_sample from this pass.")
    # What a copy or a pickle of a path leaves out: the state of passes in flight, caches of the
    # model's layout, and autograd nodes (which cannot be copied).
    TRANSIENT = ("_forward_batch", "_input_batch", "_shared_layers", "_forward_seen", "_pass_open", "_edges",
                 "_verified", "_seen_version", "_seen_layout", "_seen_flags", "_checked", "_unrecorded", "_pending",
                 "_pass_forwards", "_probing", "independence", "finite_reports", "_buffer_state", "_keyword_rows",
                 "_batch_from", "_input_tokens", "_batch_dims", "_readings", "_picked_scopes", "_unview_all",
                 "_unview_layers", "_unviewed_calls")
    sharded = None  # the model's FSDP2 parameter groups (dpgrad.backward.fsdp.ShardedParameters)

    def __init__(self, model: nn.Module, *, batch_first: bool, loss_reduction: str, check_finite: bool,
                 force_functorch: bool, strict: bool, check_independence: bool = True,
                 recheck_independence: Optional[int] = None):
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction = {loss_reduction!r}: only 'sum' and 'mean' are supported")
        refuse_wrapped(model)
        self.model = model
        self.batch_first, self.loss_reduction, self.check_finite = batch_first, loss_reduction, check_finite
        self.force_functorch, self.strict = force_functorch, strict
        self.check_independence = bool(check_independence)
        self.recheck_independence = check_every(recheck_independence)
        self.hooks_enabled = False
        self.inert = False  # the path of a copy of the model alone: its hooks do nothing
        self.grad_accumulation_allowed = True  # Opacus's flag, read by GradSamplePath
        self.handles: list = []  # every hook on the model (the wrappers' autograd_grad_sample_hooks)
        self.root: Optional[nn.Module] = None  # the module whose parameters the guarantee covers
        self._scan_version = 0
        self._init_transient()
        self._skipped = self._check(model)

    def _init_transient(self) -> None:
        """What a new path, or a copy, starts with in place of ``TRANSIENT``."""
        self._forward_batch: Optional[int] = None
        self._batch_from: Optional[tuple] = None  # (layer name, input shape) that gave it
        self._input_batch: Optional[int] = None  # the batch size the model's first tensor input shows
        self._input_tokens: Optional[int] = None  # and its next size
        # The layers called without the batch dimension (and their inputs' dimensions then).
        self._shared_layers: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
        self._forward_seen: Set[nn.Module] = set()
        # Per forward pass (its id), the hooked calls of each layer its backward has not recorded
        # yet: the wrapper's own count (zero_grad() and user code leave it alone), dropped with the
        # forward passes a backward pass reached once it ends (their graphs are spent), and with
        # the last of a forward pass's hooks, which autograd drops with its graph (a forward pass
        # whose backward never comes).
        self._unrecorded: "weakref.WeakValueDictionary[int, PendingCalls]" = weakref.WeakValueDictionary()
        self._pending: Optional[PendingCalls] = None  # the latest forward pass's, until its hooks hold it
        self._pass_forwards: Set[int] = set()  # the forward passes this backward pass reached
        self._pass_open = False
        self._edges = ForwardEdges()
        self._verified = VerifiedLayouts()  # graph layouts found to be clipped throughout
        self._scan_version += 1
        self._seen_version = -1  # the structure_version of the last look at the model
        self._seen_layout: tuple = ((), ())  # (modules, parameters) of the root then
        self._seen_flags: Optional[list] = None  # their requires_grad then
        self._checked: set = set()  # the trainable parameters the guarantee's check covers
        self._probing: Optional[Probe] = None  # the independence probe in flight (its hooks record nothing)
        self._picked_scopes = PickedScopes()  # the latest picks of rows from the batch, by module
        # Outputs that are views, given as tensors of their own (``_unviewed``): all of them in the
        # first forward pass, then those of the layers whose output was changed in place.
        self._unview_all = True
        self._unview_layers: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._unviewed_calls: list = []
        self.independence = IndependenceCheck(self)  # when the independence probes run
        self.finite_reports = FiniteReports()  # finite checks the host has not read yet
        self._buffer_state: dict = {}  # layers taken whole: their buffers' state as their forward began
        # Layers taken whole: (layer, keyword tensor position) -> whether it held a row per sample, at
        # which batch size, and its shape then.
        self._keyword_rows: dict = {}
        # Layers taken whole: how their calls were read (``WholeCalls._check_new_reading``).
        self._readings: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()
        # The dimension a layer's calls hold the batch along, where one could hold it along several.
        self._batch_dims: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self.TRANSIENT}

    def __deepcopy__(self, memo: dict) -> "BackwardPath":
        # A copy of the wrapper (or of a hooks object) copies the wrapper before its path: the
        # copy's path is its own, hooked to its copy of the model. A copy of the model alone
        # reaches the path first, through the hooks: that copy is a plain model (an EMA copy,
        # a reference), its hooks inert, and the wrapper is not copied with it.
        alone = self.root is not None and id(self.root) not in memo
        state = self.__getstate__()
        if alone:
            state = dict(state, root=None, inert=True, hooks_enabled=False)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    def __setstate__(self, state: dict) -> None:
        # Runs before the model in the state is complete (a copy of the model alone copies its
        # path through the hooks): only the state's own mappings are used here.
        self.__dict__.update(state)
        self._init_transient()
        for p in self._param_names:
            if p.requires_grad:
                p.__dict__.setdefault("grad_sample", None)
                p.__dict__.setdefault("_forward_counter", 0)
        name_layers(self.layer_names)

    # ------------------------------------------------------------------ forward
    @eager_when_compiled
    @in_region("dpgrad.forward_hooks")
    def _on_layer_call(self, layer: nn.Module, inputs, output, again=None) -> Optional[torch.Tensor]:
        """A hooked layer's call (its forward hook): what replaces ``output``, or None; ``again`` reruns it."""
        own = self._unviewed(layer, output)  # a view that may be changed in place, as a tensor of its own
        given = self._layer_call(layer, inputs, output if own is None else own, again)
        return own if given is None else given

    def _layer_call(self, layer: nn.Module, inputs, output, again=None) -> Optional[torch.Tensor]:
        whole = bool(inputs) and isinstance(inputs[-1], Keywords)  # a layer taken whole: its input batch first
        if self.independence.rerunning:  # a forward probe's run: the outputs changed on its rows
            perturb = self.independence.perturb
            if perturb is None or shared_before(layer, inputs, self._shared_layers):
                return None  # a layer shared by all samples has no rows of theirs to change
            if layer in self._picked_scopes.layers:
                return None  # nor one on picked rows, which this run (no graph) cannot tell
            moved = inputs[-1].moved if whole else self._call_batch_dim(layer, inputs)
            return perturb(output, moved or self.batch_dim)
        # Whatever the layer's mode: eval() changes what a layer computes (dropout), not
        # whether its gradient must be clipped.
        if not (self.hooks_enabled and torch.is_grad_enabled()):
            return None
        out = output if isinstance(output, torch.Tensor) else _first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        params = self.layer_params(layer)
        if not params:
            return None
        if self._forward_batch is None and self.batch_first and without_batch(layer, inputs, self._input_batch,
                                                                              self._shared_layers):
            self._forward_batch = self._input_batch  # the model's input holds the batch
        picked = self._picked(layer, inputs, out)
        if picked is not None:  # rows picked from the batch's tokens (a module per expert)
            return None if recomputing() else self._picked_call(layer, self.layer_names[layer], params, inputs, out,
                                                                 picked, output)
        widened = broadcast_inputs(layer, inputs, self._forward_batch, self.batch_first, self.functorch_layers)
        if widened is not None:
            # The layer again, on its input expanded to the batch: that call is the one its
            # hook records, and its output replaces this one.
            return (again or layer)(*widened)
        if recomputing():
            return None
        name = self.layer_names[layer]
        batch = self._forward_batch or self._input_batch or None
        transposed = 0 if layer in self.functorch_layers else self._call_batch_dim(layer, inputs)
        if transposed:  # (T, B, ...) in a batch-first model
            if self._forward_batch is None:  # the model input's (``_call_batch_dim``), 0 included
                self._forward_batch, self._batch_from = self._input_batch, (name, tuple(inputs[0].shape))
            return self._transposed_call(layer, name, params, inputs, out, output)
        # A layer taken whole holding the batch along another dimension (``_on_whole_call``): its
        # input as recorded, batch first.
        given = batch_front_of(inputs, inputs[-1].moved) if whole else inputs
        rows = folded_rows(layer, given, batch, self.batch_first, self._input_tokens)
        if rows is not None:  # the batch's tokens flattened, (B*T, ...)
            if self._forward_batch is None:  # the first hooked call: the batch is the model input's
                self._forward_batch, self._batch_from = batch, (name, tuple(inputs[0].shape))
            return self._folded_call(layer, name, params, inputs, out, rows, output)
        leading = shared_call(layer, inputs, self._forward_batch, self.batch_first, self.functorch_layers,
                              self._shared_layers)
        if leading is not None and isinstance(output, torch.Tensor):
            return self._shared_call(layer, name, params, inputs, output, leading)
        if self._forward_batch is None:  # the layer whose input gives the batch size (for messages)
            self._batch_from = (name, next((tuple(a.shape) for a in given if isinstance(a, torch.Tensor)), None))
        if not self._makes_batch(layer, inputs, out, batch if self._forward_batch is None else self._forward_batch):
            self._forward_batch = check_batch(layer, name, given, self._forward_batch, self.batch_first,
                                              ambiguous=transposed is None or (whole and inputs[-1].moved is None))
        self._note_call(layer, name, params)
        self._edges.add(out, layer, inputs, params)
        keep = registry.KEPT_INPUTS.get(type(layer))
        kept = list(given) if keep is None or layer in self.functorch_layers else keep(layer, inputs, out)
        # Not detached: they are only read under no_grad, and the list is emptied when read.
        return self._hook_output(layer, kept, out, output, partial(self._record, layer, params, kept, self._pending))

    def _makes_batch(self, layer: nn.Module, inputs, out: torch.Tensor, batch: Optional[int]) -> bool:
        """Whether ``layer``, taken whole, was given no tensor and returned the batch's rows, as
        an expand makes them (Perceiver's latents, ``self.latents.expand(batch_size, -1, -1)``):
        its samples' gradients are those of its output's rows (``dpgrad.samplers.functorch``). A
        table whose first size is the batch size by chance is no expand."""
        dim = self.batch_dim
        return (layer in self.functorch_layers and batch is not None and out.dim() > dim and out.shape[dim] == batch
                and (out.stride(dim) == 0 or batch <= 1) and not any(isinstance(t, torch.Tensor)
                            for t in tree_leaves([a.values if isinstance(a, Keywords) else a for a in inputs])))

    def _note_call(self, layer: nn.Module, name: str, params: List[nn.Parameter]) -> None:
        """A hooked call of ``layer`` in this forward pass."""
        self._forward_seen.add(layer)
        calls = self._pending
        if calls is None or calls.forward_id != self._edges.forward_id:
            calls = self._pending = PendingCalls(self._edges.forward_id)
            self._unrecorded[calls.forward_id] = calls
        calls[layer] = calls.get(layer, 0) + 1
        for p in params:
            p._forward_counter = getattr(p, "_forward_counter", 0) + 1

    @property
    def batch_dim(self) -> int:
        return 0 if self.batch_first else 1

    # ------------------------------------------------------------------ backward
    @in_region("dpgrad.backward_hooks")
    def _record(self, layer: nn.Module, params: List[nn.Parameter], activations: list, calls: PendingCalls,
                grad):
        if self._probing is not None:  # an independence probe: read the backprops, record nothing
            if self._probing.hooks:
                self._probing.observe(f"layer '{self.layer_names.get(layer, '?')}' ({type(layer).__name__})", grad)
            return None
        if not self.hooks_enabled:
            return None
        self._pass_forwards.add(calls.forward_id)
        if not self._pass_open:
            self._check_trainable_since_forward()
            torch.autograd.Variable._execution_engine.queue_callback(self._close_pass)
            self._pass_open = True
            self._open_pass()
        try:
            if not activations:
                raise RuntimeError(
                    f"{self.layer_label(layer)} is in a second hooked backward pass through "
                    "the same graph; its inputs went to the first. Per-sample gradients take one "
                    "forward pass per hooked backward pass (disable_hooks() for any other pass)."
                )
            # The hook lives as long as the graph, which the caller's loss can keep alive after
            # backward: it must not keep the layer's inputs alive with it.
            inputs = activations.copy()
            activations.clear()
            self._edges.consumed(calls.forward_id)
            calls[layer] = max(0, calls.get(layer, 0) - 1)
            self.keep(Record(layer, inputs, grad))
            for p in params:
                p._forward_counter = max(0, p._forward_counter - 1)
        except BaseException:
            self._abort_pass()
            raise
        return None

    def batch_front(self, record: Record) -> Record:
        """``record`` with the batch first in its inputs and backprops."""
        if self.batch_first:
            return record
        return Record(record.layer, [batch_to_front(a) for a in record.inputs], batch_to_front(record.backprops))

    def _open_pass(self) -> None:
        """A backward pass begins (at its first recorded layer)."""

    def keep(self, record: Record) -> None:
        """What the pass keeps of a layer's record."""
        raise NotImplementedError

    def finish(self) -> None:
        """What the pass does once its last layer is recorded."""
        raise NotImplementedError

    def _close_pass(self) -> None:
        try:
            with torch.no_grad(), region("dpgrad.finish"):
                self.finish()
        finally:
            self._clear_pass()

    def _clear_pass(self) -> None:
        """What a pass leaves behind once finished (or failed): nothing of its own, and nothing
        of the forward passes it reached, whose graphs it spent (a call whose output reached no
        loss is never recorded)."""
        self._pass_open = False
        self._forward_batch = None
        if TUNING_PROGRESS.bar is not None:  # shapes were measured in this pass
            TUNING_PROGRESS.end()
        self._edges.release()
        for forward_id in self._pass_forwards:
            self._unrecorded.pop(forward_id, None)
        self._pass_forwards.clear()

    def _abort_pass(self) -> None:
        for p in self.model.parameters():
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        self._clear_pass()

    @contextlib.contextmanager
    def hooks_off(self):
        """A context in which the hooks record nothing (the second pass of Opacus's protocol)."""
        was, self.hooks_enabled = self.hooks_enabled, False
        try:
            yield
        finally:
            self.hooks_enabled = was
