"""The backward path of dpgrad's wrappers, in one place: hook -> record -> finish.

Every hooked layer (a layer with trainable parameters of its own, whatever its mode) goes
through three steps:

1. Forward (``_on_layer_forward``, a forward hook): keep the layer's inputs and put a gradient
   hook on its output. Hooks on the model itself begin each forward pass (hooking the model
   anew if its trainable parameters or modules changed: ``_sync_with_model``) and end it
   with the guarantee's check of its graph, when its layout is new (``dpgrad.guarantee``).
2. Record (``_record``, that gradient hook, during backward): append ``Record(layer, inputs,
   backprops)`` to the pass. For ``GradSampleModule`` the record is the layer's per-sample
   gradients, computed there (Opacus's hooks do the same: they are what that mode keeps). For
   ``GradSampleModuleFastGradientClipping`` it is the inputs and backprops and nothing else:
   no arithmetic, no copy, no launch.
3. Finish (``_finish_pass``, once per backward pass, queued behind its last hook):
   - per-sample gradients: summed over the uses of each parameter, onto ``p.grad_sample``;
   - norms (``ClippingPath``): the records grouped by layer type and shapes
     (``dpgrad.samplers.groups``; the grouping is planned once for a pass of given layers,
     shapes and trainable parameters, and reused), each group's per-sample gradient norms in a few batched
     operations, rows of one (P, B) matrix; ``p._norm_sample`` and the total norm (B,) from
     it. A clipped backward then takes the coefficients ``min(1, C / (norm + 1e-6))`` once
     and, in single-backward mode, each group's clipped sums, which reach ``p.grad`` through
     autograd's own accumulation; each group lets go of its inputs as it is summed.

Under ``loss_reduction="mean"`` the backprops are those of the mean loss, 1/B of each sample's
own (Opacus multiplies them by B). Here the factor B is applied to (B,)-sized vectors (the
norms, the coefficients), never in a pass over a backprop.

No device-to-host synchronisation on the way: whether the per-sample values are finite (a
non-finite per-sample gradient makes its sample's norm non-finite) is one number computed on
the device, which the host reads once per step (``FiniteCheck``): at the end of a plain
backward pass, or, in a clipped backward, once the work that follows has been queued and
before anything reaches ``p.grad``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from dpgrad import registry
from dpgrad.autograd_graph import ForwardEdges
from dpgrad.backend import name_layers
from dpgrad.guarantee import (
    UnclippedGradientError,
    VerifiedLayouts,
    input_nodes,
    nodes_of,
    sequence_number,
    structure_version,
    tensors_in,
    uncovered_uses,
)
from dpgrad.kernels import reference
from dpgrad.samplers import ft_compute_per_sample_gradient, prepare_layer
from dpgrad.samplers.functorch import _first_tensor
from dpgrad.samplers.groups import Coefficients, GradSampleGroup, Group, Record, SamplerGroup, group_records

# What a clipped backward's norm pass does with the records besides taking norms.
NORMS_ONLY, KEEP_FOR_CLIPPING = "norms", "keep"
# A layer is clipped from its per-sample gradients when they (fp32) take at most this fraction
# of the memory of the inputs and backprops that book-keeping would keep for it, or when they
# have at most this many elements over the batch (too small to matter, and fewer operations).
GRAD_SAMPLE_MEMORY_FRACTION = 0.25
TINY_GRAD_SAMPLE_ELEMENTS = 1 << 18
# Finish plans kept per wrapper: one per pass layout (a batch size under Poisson sampling).
MAX_PLANS = 64


@dataclass
class FinishPlan:
    """How a clipped pass's records are served: ``groups``, (what makes the group from its
    records, the records' indices in the pass); ``by_norm``, the indices of the records clipped
    from their norms; ``shards``, each group's FSDP2 parameter group (None for a model not
    sharded); ``combined``, whether a parameter has several rows to combine (known after the
    first pass of the plan)."""

    groups: List[Tuple[Callable[[List[Record]], Group], Tuple[int, ...]]]
    by_norm: Tuple[int, ...]
    shards: Tuple[Optional[int], ...]
    combined: Optional[bool] = None


def _record_key(layer: nn.Module, params: Tuple[nn.Parameter, ...], activations: list, backprops: torch.Tensor) -> tuple:
    """What a record's place in a finish plan depends on: its layer, which of the layer's
    parameters train, and the shapes, dtypes and devices of its inputs and backprops."""
    return (layer, tuple(p.requires_grad for p in params), backprops.shape, backprops.dtype, backprops.device,
            *((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a) for a in activations))


def region(name: str):
    """A named range in a torch.profiler trace while a profiler runs; nothing otherwise
    (``record_function`` costs microseconds even with no profiler to see it)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def own_trainable(module: nn.Module) -> bool:
    """Whether ``module`` has trainable parameters of its own (not its children's)."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


class FiniteCheck:
    """Whether per-sample values (rows of (P, B) norms, or per-sample gradients) are all
    finite: one float64 sum computed on the device, read on the host by ``wait``.

    On a GPU the sum is copied to pinned host memory behind the work that made it and an event
    marks the copy, so ``wait`` blocks only until that work is done, not the work queued after.
    """

    def __init__(self, values: List[torch.Tensor], names: Callable[[], List[Tuple[str, torch.Tensor]]], what: str):
        total = torch.stack([v.sum(dtype=torch.float64) for v in values]).sum() if len(values) > 1 else \
            values[0].sum(dtype=torch.float64)
        self._names, self._what = names, what
        self._event = None
        if total.is_cuda:
            self._total = torch.empty((), dtype=torch.float64, pin_memory=True)
            self._total.copy_(total, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._total = total

    def wait(self) -> None:
        """Raise FloatingPointError, naming the parameters, if a value was not finite."""
        if self._event is not None:
            self._event.synchronize()
        if math.isfinite(self._total.item()):
            return
        bad = [name for name, value in self._names() if not bool(torch.isfinite(value).all())]
        raise FloatingPointError(
            f"non-finite per-sample {self._what} for parameters {bad}: the loss, the inputs or the "
            "weights hold inf or NaN (in reduced precision, an overflow). Fix the cause (loss "
            "scaling, learning rate, inputs), or pass check_finite=False to skip this check."
        )


class BackwardPath:
    """Hooks, records and the finish step; mixed into the wrappers (``nn.Module``s).

    The wrapper sets ``_module``, ``batch_first``, ``loss_reduction``, ``check_finite``,
    ``hooks_enabled``, ``_param_names`` and ``_skipped`` before ``add_hooks``, and gives
    ``_rescan``, which hooks the model anew after it changed.
    """

    GRAD_SAMPLERS = registry.GRAD_SAMPLERS
    _sharded = None  # the model's FSDP2 parameter groups (dpgrad.fsdp.ShardedParameters)
    # What UnclippedGradientError says first.
    _UNCLIPPED = ("these trainable parameters would get per-sample gradients (p.grad_sample) that miss "
                  "the uses below, so clipping them would not bound each sample's contribution. "
                  "Nothing has reached p.grad_sample from this pass.")
    # What a copy or a pickle of a wrapper leaves out: the state of passes in flight, caches
    # of the model's layout, and autograd nodes (which cannot be copied).
    TRANSIENT = ("_forward_batch", "_forward_seen", "_pass_open", "_records", "_edges", "_row_indices",
                 "_plans", "_verified", "_seen_version", "_seen_layout", "_seen_flags", "_checked",
                 "_pass_grads")

    def _init_path(self) -> None:
        self._forward_batch: Optional[int] = None
        self._forward_seen: set = set()
        self._pass_open = False
        self._records: List = []
        self._edges = ForwardEdges()
        self._row_indices: Dict[tuple, torch.Tensor] = {}
        self._plans: Dict[tuple, FinishPlan] = {}
        self._verified = VerifiedLayouts()  # graph layouts found to be clipped throughout
        self._scan_version = getattr(self, "_scan_version", 0) + 1
        self._seen_version = -1  # the structure_version of the last look at the model
        self._seen_layout: tuple = ((), ())  # (modules, parameters) of the wrapper then
        self._seen_flags: Optional[list] = None  # their requires_grad then
        self._checked: set = set()  # the trainable parameters the guarantee's check covers

    def _init_transient(self) -> None:
        """What a copy starts with in place of ``TRANSIENT``."""
        self._init_path()

    # ------------------------------------------------------------------ the layers hooked
    def _layers_to_hook(self, module: nn.Module, prefix: str = "", seen: Optional[set] = None):
        """Layers with own trainable parameters; a layer without a registered sampler is
        handled whole by torch.func, so its children are not visited. A layer registered
        under several names (one module in two containers) is yielded once: two hooks
        would count each of its uses twice."""
        seen = set() if seen is None else seen
        if module in seen:
            return
        seen.add(module)
        if own_trainable(module):
            yield prefix, module
            if type(module) not in self.GRAD_SAMPLERS:
                return
        for name, child in module.named_children():
            yield from self._layers_to_hook(child, f"{prefix}.{name}" if prefix else name, seen)

    def _attach(self, force_functorch: bool) -> list:
        """Hook every layer with trainable parameters of its own, and the model itself (at
        the start of each forward pass, and at its end for the guarantee's check)."""
        self._layer_names: Dict[nn.Module, str] = {}
        self._functorch_layers: set = set()
        self._own_params: Dict[nn.Module, Tuple[nn.Parameter, ...]] = {}
        handles = []
        for name, layer in self._layers_to_hook(self._module):
            if name in self._skipped:
                continue
            whole = force_functorch or type(layer) not in self.GRAD_SAMPLERS
            if whole:
                prepare_layer(layer, batch_first=self.batch_first)
                self._functorch_layers.add(layer)
            self._layer_names[layer] = name
            self._own_params[layer] = tuple(layer.parameters(recurse=whole))
            handles.append(layer.register_forward_hook(self._on_layer_forward))
        name_layers(self._layer_names)
        # One parameter, looked up at each forward pass: a model whose parameters were replaced
        # after wrapping (sharded by fully_shard then) would get per-sample state on others.
        self._probe = None
        if self._sharded is None:
            self._probe = next(((layer, n, p) for layer in self._layer_names
                                for n, p in layer.named_parameters(recurse=False)), None)
        # The hooked layers that hold each parameter (for messages).
        self._owners: Dict[nn.Parameter, List[nn.Module]] = {}
        for layer, params in self._own_params.items():
            for p in params:
                self._owners.setdefault(p, []).append(layer)
        # Parameters no hook sees (skipped layers and their children): no per-sample values.
        self._unhooked = {p for p in self._module.parameters() if p not in self._owners}
        # Those of layers skipped under strict=False, refused where their norms are asked for.
        self._skipped_params = {p for name, m in self._module.named_modules() if name in self._skipped
                                for p in m.parameters()}
        handles.append(self._module.register_forward_pre_hook(self._on_model_call))
        handles.append(self._module.register_forward_hook(self._on_model_output))
        return handles

    def _sync_with_model(self, rescan: bool = True) -> None:
        """Hook the model anew (``_rescan``) if its modules or parameters, or which parameters
        train, changed since the last look: gradual unfreezing, a head added after wrapping.
        Costs a look at each parameter's ``requires_grad``; the modules are looked at again
        only after a module or a parameter was registered somewhere (``structure_version``)."""
        changed = False
        version = structure_version()
        if version != self._seen_version:
            layout = (tuple(self.modules()), tuple(self.parameters()))
            if not all(_same_objects(a, b) for a, b in zip(layout, self._seen_layout)):
                self._seen_layout, changed = layout, True
            self._seen_version = version
        params = self._seen_layout[1]
        flags = [p.requires_grad for p in params]
        if changed or flags != self._seen_flags:
            if rescan:
                self._rescan()
                flags = [p.requires_grad for p in params]
            self._seen_flags = flags
            self._checked = {p for p, trains in zip(params, flags) if trains} - self._skipped_params

    def _layer_params(self, layer: nn.Module) -> List[nn.Parameter]:
        return [p for p in self._own_params[layer] if p.requires_grad]

    # ------------------------------------------------------------------ 1. forward
    def _on_model_call(self, module: nn.Module, args) -> None:
        self._begin_forward()

    def _begin_forward(self) -> None:
        if self._pass_open:
            # A backward pass that raised (in any hook, not only ours) never reached its
            # end-of-pass callback; its partial per-sample state must not leak into this step.
            self._abort_pass()
        self._sync_with_model()
        self._check_probe()
        self._forward_batch = None
        self._forward_seen = set()
        self._edges.begin_forward()
        self._on_begin_forward()

    def _on_begin_forward(self) -> None:
        """What a wrapper resets at each forward pass."""

    def _check_probe(self) -> None:
        if self._probe is None:
            return
        layer, name, p = self._probe
        if layer._parameters.get(name) is not p:
            raise RuntimeError(
                f"parameter '{self._layer_names[layer]}.{name}' is no longer the one this wrapper "
                "hooked: the model's parameters were replaced after wrapping (sharded by "
                "fully_shard, or assigned anew), and per-sample state would land on parameters "
                "nothing reads. Shard or change the model first, then wrap it."
            )

    def _on_layer_forward(self, layer: nn.Module, inputs, output) -> Optional[torch.Tensor]:
        # Whatever the layer's mode: eval() changes what a layer computes (dropout), not
        # whether its gradient must be clipped.
        if not (self.hooks_enabled and torch.is_grad_enabled()):
            return
        out = output if isinstance(output, torch.Tensor) else _first_tensor(output)
        if out is None or not out.requires_grad:
            return
        params = self._layer_params(layer)
        if not params:
            return
        widened = self._broadcast_inputs(layer, inputs)
        if widened is not None:
            # The layer again, on its input expanded to the batch: that call is the one its
            # hook records, and its output replaces this one.
            return layer(*widened)
        if _recomputing():
            return
        name = self._layer_names[layer]
        self._check_batch(layer, name, inputs)
        self._on_forward(layer, name, params, out)
        self._edges.add(out, layer, inputs, params)
        # Not detached: they are only read under no_grad, and the list is emptied when read.
        out.register_hook(partial(self._record, layer, params, list(inputs), self._edges.forward_id))

    def _on_model_output(self, module: nn.Module, args, output) -> None:
        """The end of a forward pass: the guarantee's check of its graph, when its layout is
        new (``dpgrad.guarantee``)."""
        edges = self._edges
        calls, edges.calls = edges.calls, []
        edges.outputs = nodes_of(tensors_in(output))
        if not calls or not edges.outputs:
            return
        edges.output_seq = max(sequence_number(node) for node in edges.outputs)
        key = (self._scan_version, tuple(call[0] for call in calls), edges.output_seq - sequence_number(calls[0][1]))
        if key not in self._verified:
            self._verify(key, edges.outputs, calls, edges.marked_elsewhere)

    def _verify(self, key: tuple, roots: list, calls: list, stop: Callable, in_loss: bool = False) -> None:
        """Raise ``UnclippedGradientError`` if a trainable parameter is reached from ``roots``
        other than through the hooked ``calls``; else remember ``key`` as clean."""
        canonical = None
        if self._sharded is not None:  # the graph holds FSDP's unsharded copies
            canonical = lambda t: self._sharded.canonical((t,))[0]  # noqa: E731
        uses = uncovered_uses(roots, [(node, input_nodes(inputs), set(params)) for _, node, inputs, params in calls],
                              self._checked, stop=stop, canonical=canonical, visit=self._visit_node)
        if uses:
            raise self._unclipped(uses, {call[0] for call in calls}, in_loss)
        self._verified.add(key)

    def _visit_node(self, node) -> None:
        """Called on every node the guarantee's check walks; a wrapper raises for nodes it
        cannot clip through."""

    def _unclipped(self, uses: list, called: set, in_loss: bool) -> UnclippedGradientError:
        """The error for parameters reached outside their layers' hooked calls."""
        names = {p: n for n, p in self.named_parameters()}
        lines, done = [], set()
        for p, node in uses:
            if p in done:
                continue
            done.add(p)
            name = self._param_names.get(p) or names.get(p, "?").removeprefix("_module.")
            how = f"autograd node {type(node).__name__}"
            owners = self._owners.get(p, [])
            owner = next((layer for layer in owners if layer in called), owners[0] if owners else None)
            layer = f"'{self._layer_names[owner]}'" if owner is not None else None
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
            lines.append(f"- parameter '{name}': {why}.")
        return UnclippedGradientError(self._UNCLIPPED + "\n" + "\n".join(lines))

    def _broadcast_inputs(self, layer: nn.Module, inputs) -> Optional[tuple]:
        """An Embedding's ids expanded to the forward pass's batch when it got one row of them
        after another layer saw the batch: the model broadcasts that row's embeddings over the
        batch (Hugging Face GPT-2 and BERT embed position ids (1, T) unless given them). An
        embedding looks each id up alone, so its output on the expanded ids is what
        broadcasting makes of it, and each sample gets its own gradient, exact where the output
        meets the batch by broadcasting (added to the token embeddings). None otherwise (then
        ``_check_batch`` decides)."""
        if not isinstance(layer, nn.Embedding) or not self.batch_first or layer in self._functorch_layers:
            return None
        if self._forward_batch is None or self._forward_batch == 1:
            return None
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if x is None or x.dim() < 2 or x.shape[0] != 1:
            return None
        B = self._forward_batch
        return tuple(a.expand(B, *a.shape[1:]) if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 1 else a
                     for a in inputs)

    def _on_forward(self, layer: nn.Module, name: str, params: List[nn.Parameter], out: torch.Tensor) -> None:
        self._forward_seen.add(layer)
        for p in params:
            p._forward_counter = getattr(p, "_forward_counter", 0) + 1

    def _check_batch(self, layer: nn.Module, name: str, inputs) -> None:
        batch_dim = 0 if self.batch_first else 1
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else next(
            (a for a in inputs if isinstance(a, torch.Tensor)), None)
        # A Linear given one sample's (d,) would otherwise take its features for the batch.
        if x is None or x.dim() <= batch_dim + _feature_dims(layer):
            shape = None if x is None else tuple(x.shape)
            raise ValueError(
                f"layer '{name}' got an input of shape {shape} with no batch dimension "
                f"{batch_dim} (batch_first={self.batch_first}, so inputs are "
                f"{'[B, ...]' if self.batch_first else '[K, B, ...]'}): feed a batch of samples, "
                f"e.g. x.unsqueeze({batch_dim}) for a single one"
            )
        n = x.shape[batch_dim]
        if self._forward_batch is None:
            self._forward_batch = n
        elif n == 1 and self._forward_batch > 1:
            raise ValueError(
                f"layer '{name}' got an input of shape {tuple(x.shape)}, with 1 along the batch "
                f"dimension {batch_dim} where earlier layers of this forward pass got "
                f"{self._forward_batch} samples: the model broadcasts it over the batch, so its "
                "gradient is the whole batch's, not per sample. Give the input one row per sample; "
                "for Hugging Face models, whose position ids default to a single row, pass "
                "position_ids=torch.arange(T).expand(B, T) (with B samples of T tokens)."
            )
        elif n != self._forward_batch:
            raise ValueError(
                f"layer '{name}' got {n} samples along dimension {batch_dim} (input shape "
                f"{tuple(x.shape)}) but an earlier layer of this forward pass got "
                f"{self._forward_batch}. Per-sample gradients need the batch on one dimension "
                f"throughout: check batch_first (now {self.batch_first}) and that the model does "
                "not fold the batch into another dimension, e.g. a (B*T, d) input to a Linear."
            )

    # ------------------------------------------------------------------ 2. record
    def _record(self, layer: nn.Module, params: List[nn.Parameter], activations: list, forward_id: int, grad):
        if not self.hooks_enabled:
            return None
        if not self._pass_open:
            torch.autograd.Variable._execution_engine.queue_callback(self._close_pass)
            self._pass_open = True
            self._begin_pass()
        try:
            if not activations:
                raise RuntimeError(
                    f"layer '{self._layer_names[layer]}' is in a second hooked backward pass through "
                    "the same graph; its inputs went to the first. Per-sample gradients take one "
                    "forward pass per hooked backward pass (disable_hooks() for any other pass)."
                )
            # The hook lives as long as the graph, which the caller's loss can keep alive after
            # backward: it must not keep the layer's inputs alive with it.
            inputs = activations.copy()
            activations.clear()
            self._edges.consumed(forward_id)
            self._keep(layer, inputs, grad)
            for p in params:
                p._forward_counter = max(0, p._forward_counter - 1)
        except BaseException:
            self._abort_pass()
            raise
        return None

    def _keep(self, layer: nn.Module, activations: list, backprops: torch.Tensor) -> None:
        """GradSampleModule: the layer's per-sample gradients, summed over its uses."""
        with torch.no_grad():
            activations, backprops = self._batch_front(activations, backprops)
            if self.loss_reduction == "mean":
                backprops = backprops * backprops.shape[0]
            grads = self._grad_sampler(layer)(layer, activations, backprops)
        for p, gs in grads.items():
            if not p.requires_grad:
                continue
            if p in self._pass_grads:
                if self._pass_grads[p].shape != gs.shape:
                    raise ValueError(
                        f"parameter '{self._param_names.get(p)}' of layer '{self._layer_names[layer]}' "
                        f"got per-sample gradients of shape {tuple(gs.shape)} and "
                        f"{tuple(self._pass_grads[p].shape)} in one backward pass: its uses saw "
                        "different batch sizes"
                    )
                self._pass_grads[p] = self._pass_grads[p] + gs
            else:
                self._pass_grads[p] = gs

    def _batch_front(self, activations: list, backprops: torch.Tensor):
        if self.batch_first:
            return activations, backprops
        return [_batch_to_front(a) for a in activations], _batch_to_front(backprops)

    def _grad_sampler(self, layer: nn.Module) -> Callable:
        if layer in self._functorch_layers:
            return ft_compute_per_sample_gradient
        return self.GRAD_SAMPLERS[type(layer)]

    # ------------------------------------------------------------------ 3. finish
    def _begin_pass(self) -> None:
        self._pass_grads: Dict[nn.Parameter, torch.Tensor] = {}

    def _close_pass(self) -> None:
        try:
            with torch.no_grad(), region("dpgrad.finish"):
                self._finish_pass()
        finally:
            self._end_pass()

    def _end_pass(self) -> None:
        """What a pass leaves behind once finished (or failed): nothing of its own."""
        self._records = []
        self.__dict__.pop("_pass_grads", None)
        self._pass_open = False
        self._forward_batch = None
        self._edges.release()

    def _abort_pass(self) -> None:
        for p in self._module.parameters():
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        self._end_pass()

    def _finish_pass(self) -> None:
        """GradSampleModule: promote the pass's per-sample gradients to ``p.grad_sample``."""
        grads = self._pass_grads
        if not self.grad_accumulation_allowed:
            for p in grads:
                if p.grad_sample is not None:
                    raise ValueError(
                        "Poisson sampling is not compatible with grad accumulation: parameter "
                        f"'{self._param_names.get(p)}' already holds per-sample gradients from an "
                        "earlier backward pass. Call optimizer.step() (or zero_grad()) after every "
                        "forward/backward pass, or use BatchMemoryManager."
                    )
        if self.check_finite and grads:
            FiniteCheck(list(grads.values()), lambda: [(self._param_names.get(p, "?"), g) for p, g in grads.items()],
                        "gradients").wait()
        for p, gs in grads.items():
            if p.grad_sample is None:
                p.grad_sample = gs
            elif isinstance(p.grad_sample, list):
                p.grad_sample.append(gs)
            else:
                p.grad_sample = [p.grad_sample, gs]


class ClippingPath(BackwardPath):
    """The ghost-clipping wrapper's finish: norms from records, then clipped sums.

    The wrapper sets ``_shared`` (parameters whose uses are combined by their factors),
    ``max_grad_norm``, ``single_backward`` and the norm-sampler predicate
    ``_uses_norm_sampler``.
    """

    FACTOR_SAMPLERS = registry.FACTOR_SAMPLERS
    _UNCLIPPED = ("these trainable parameters would get gradients that are not clipped per sample: the "
                  "uses below are not in the per-sample norms, so one sample could move the summed "
                  "gradient by more than max_grad_norm. Nothing has reached p.grad from this pass.")

    TRANSIENT = BackwardPath.TRANSIENT + ("_norm_pass", "_kept", "_kept_shards", "_finite", "_pass_norm",
                                          "_constants")

    def _init_transient(self) -> None:
        super()._init_transient()
        self._init_clipping()
        self._constants = {}

    def _init_clipping(self) -> None:
        self._norm_pass: Optional[str] = None  # NORMS_ONLY or KEEP_FOR_CLIPPING in clipped_backward
        self._kept: Optional[List[Group]] = None  # the groups a single backward sums next
        self._kept_shards: Tuple[Optional[int], ...] = ()  # their FSDP2 parameter groups
        self._finite: Optional[FiniteCheck] = None
        self._pass_norm: Optional[torch.Tensor] = None  # (B,) total norm of the last pass

    def _on_begin_forward(self) -> None:
        if self.hooks_enabled and torch.is_grad_enabled():
            for p in self.trainable_parameters:
                p._norm_sample = None
            self._pass_norm = None

    def _on_forward(self, layer, name, params, out) -> None:
        if self._uses_norm_sampler(layer) and layer in self._forward_seen and not self._shared.issuperset(params):
            # Called twice: from now on its parameters' uses are combined by their factors.
            self._check_factors({name: layer})
            self._shared.update(params)
        super()._on_forward(layer, name, params, out)

    def _visit_node(self, node) -> None:
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise RuntimeError(REENTRANT_CHECKPOINT)

    def _verify_loss(self, loss_per_sample: torch.Tensor) -> None:
        """The guarantee's check of the graph between the loss and the model's outputs (the
        model's own graph is checked at the end of its forward pass), when its layout is new."""
        edges = self._edges
        root = loss_per_sample.grad_fn
        outputs = set(edges.outputs)
        key = (self._scan_version, "loss", sequence_number(root) - edges.output_seq, bool(outputs))
        if key not in self._verified:
            self._verify(key, [root], [], lambda node: node in outputs or edges.marked(node), in_loss=True)

    def _keep(self, layer, activations, backprops) -> None:
        if self.single_backward and self._norm_pass is None:
            raise RuntimeError(
                f"layer '{self._layer_names[layer]}': this wrapper has single_backward=True, so its "
                "backward pass must come from dpgrad.DPLossFastGradientClipping (loss.backward() "
                "on what it returns) or wrapper.clipped_backward(per_sample_losses). A plain "
                "backward would leave unclipped gradients in p.grad; Opacus's "
                "DPLossFastGradientClipping needs single_backward=False."
            )
        self._records.append((layer, activations, backprops))

    def _begin_pass(self) -> None:
        # Norms belong to one backward pass: a parameter this pass does not reach has a zero
        # gradient in it, whatever an earlier pass (of another forward) left.
        for p in self.trainable_parameters:
            p._norm_sample = None
        self._pass_norm = None

    def _finish_pass(self) -> None:
        records = [(layer, *self._batch_front(acts, g)) for layer, acts, g in self._records]
        self._records = []
        params, rows = self._norm_rows(records)
        if rows is None:
            return
        B = rows.shape[1]
        if self.loss_reduction == "mean":
            rows = rows * B
        self._pass_norm = torch.linalg.vector_norm(rows, dim=0)
        for p, norm in zip(params, rows.unbind(0)):
            p._norm_sample = norm
            p.grad_sample = None
        if self.check_finite:
            self._finite = FiniteCheck([self._pass_norm], lambda: [(self._param_names.get(p, "?"), n) for p, n in
                                                                     zip(params, rows.unbind(0))], "gradient norms")
            if self._norm_pass is None:
                self._wait_finite()

    def _wait_finite(self) -> None:
        check, self._finite = self._finite, None
        if check is not None:
            with region("dpgrad.wait_finite"):
                check.wait()

    def _norm_rows(self, records: List[Record]) -> Tuple[List[nn.Parameter], Optional[torch.Tensor]]:
        """The pass's parameters (each once) and their per-sample gradient norms (P, B), by
        the pass's plan (``_finish_plan``): each group's norms, then, for a parameter used by
        several records, the norm of its summed gradient."""
        if not records:
            return [], None
        plan = self._finish_plan(records)
        groups = [make([records[i] for i in at]) for make, at in plan.groups]
        params, pieces = [], []
        for group in groups:
            ps, rows = group.norms()
            params += ps
            pieces += rows
        if self._sharded is not None:  # the samplers saw FSDP's unsharded copies
            params = self._sharded.canonical(params)
        self._kept = groups if self._norm_pass == KEEP_FOR_CLIPPING else None
        self._kept_shards = plan.shards
        if not params:
            return [], None
        rows = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(len(params), -1)
        if plan.combined is None:
            plan.combined = len(params) != len(set(params))
        if plan.combined:
            params, rows = self._combine_uses(params, rows, [records[i] for i in plan.by_norm])
        return params, rows

    def _finish_plan(self, records: List[Record]) -> "FinishPlan":
        """How the pass's records are grouped, planned once for a pass of the same layers,
        shapes, dtypes and trainable parameters (a training loop's every step): see
        ``_plan``."""
        key = (registry.version, len(self._shared), self.use_ghost_clipping, self.single_backward,
               *(_record_key(layer, self._own_params[layer], activations, backprops)
                 for layer, activations, backprops in records))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:  # Poisson batches: one plan per batch size seen
                self._plans.clear()
            plan = self._plans[key] = self._plan(records)
        return plan

    def _plan(self, records: List[Record]) -> "FinishPlan":
        """A record is clipped from its per-sample gradients when its layer has no norm
        sampler or when they are small (``_small_grad_sample``), else from its norm ("ghost").
        A parameter used by several records gets the norm of its summed gradient: from the
        sum of its per-sample gradients, or, for ghost uses, from the uses' norms and cross
        terms. The records are then grouped (``group_records``)."""
        uses: Dict[nn.Parameter, list] = {}
        for i, rec in enumerate(records):
            for p in self._layer_params(rec[0]):
                uses.setdefault(p, []).append(i)
        ghost = {}
        for i, rec in enumerate(records):
            layer = rec[0]
            if not self._uses_norm_sampler(layer):
                continue
            unshared = [p for p in self._layer_params(layer) if len(uses[p]) > 1 and p not in self._shared]
            if unshared:
                raise NotImplementedError(
                    f"parameter '{self._param_names.get(unshared[0])}' of layer '{self._layer_names[layer]}' "
                    "received two gradient contributions in one backward pass (several forward "
                    "passes before one backward); ghost clipping combines the uses of one forward "
                    "pass only. Run backward after every forward pass."
                )
            ghost[i] = not self._small_grad_sample(rec)
        # A parameter's uses are all summed as per-sample gradients or all ghost.
        for p, at in uses.items():
            if len(at) > 1 and any(ghost.get(i, False) for i in at):
                for i in at:
                    ghost[i] = True
        by_norm, alone, summed = [], [], []
        for i, rec in enumerate(records):
            if ghost.get(i, False):
                by_norm.append(i)
            elif any(len(uses[p]) > 1 for p in self._layer_params(rec[0])):
                summed.append(i)
            else:
                alone.append(i)
        per_sample = partial(GradSampleGroup, sampler_for=self._grad_sampler)
        makers = (
            (by_norm, lambda at: group_records(records, at, lambda layer: registry.NORM_GROUPS.get(type(layer)),
                                               SamplerGroup)),
            (alone, lambda at: group_records(records, at, self._grad_sample_group, per_sample)),
            (summed, lambda at: [(per_sample, tuple(at))]),
        )
        groups, shards = [], []
        # On a sharded model in single-backward mode no group spans two FSDP2 parameter groups:
        # their clipped sums are reduce-scattered one parameter group at a time.
        for indices, make in makers:
            for shard, at in self._by_shard(records, indices):
                made = make(at)
                groups += made
                shards += [shard] * len(made)
        return FinishPlan(groups, tuple(by_norm), tuple(shards))

    def _by_shard(self, records: List[Record], at: List[int]) -> List[Tuple[Optional[int], List[int]]]:
        """``at`` split by the FSDP2 parameter group of each record's layer, in order of first
        appearance: (group, indices); one part (None, at) for a model not sharded, or where
        the groups serve norms alone (double backward: FSDP's own pass makes the gradients)."""
        if self._sharded is None or not self.single_backward:
            return [(None, at)] if at else []
        parts: Dict[int, List[int]] = {}
        for i in at:
            parts.setdefault(self._sharded.group_of[records[i][0]], []).append(i)
        return list(parts.items())

    def _small_grad_sample(self, rec: Record) -> bool:
        """Whether a layer's per-sample gradients (fp32) take a small fraction of the memory of
        the inputs and backprops book-keeping would keep for it, or are tiny: then its norms and
        clipped sums come from them, with fewer flops and less memory (a LoRA adapter's are far
        smaller than its inputs)."""
        layer, activations, backprops = rec
        if layer in self._functorch_layers or type(layer) not in self.GRAD_SAMPLERS:
            return False
        elements = backprops.shape[0] * sum(p.numel() for p in self._layer_params(layer))
        kept = sum(t.numel() * t.element_size() for t in (backprops, *activations) if isinstance(t, torch.Tensor))
        return elements <= TINY_GRAD_SAMPLE_ELEMENTS or 4 * elements <= GRAD_SAMPLE_MEMORY_FRACTION * kept

    def _grad_sample_group(self, layer: nn.Module) -> Optional[type]:
        return None if layer in self._functorch_layers else registry.GRAD_SAMPLE_GROUPS.get(type(layer))

    def _combine_uses(self, params, rows, shared_records):
        """One row per parameter: a parameter with several uses gets the norm of its summed
        gradient, ``sqrt(sum_i |g_i|^2 + 2 sum_{i<j} <g_i, g_j>)``, the cross terms from the
        uses' factors (never a per-sample gradient)."""

        index: Dict[nn.Parameter, List[int]] = {}
        for i, p in enumerate(params):
            index.setdefault(p, []).append(i)
        factors: Dict[nn.Parameter, list] = {}
        for layer, activations, backprops in shared_records:
            mine = [p for p in self._layer_params(layer) if p in self._shared and len(index.get(p, ())) > 1]
            if mine:
                found = self.FACTOR_SAMPLERS[type(layer)](layer, activations, backprops)
                if self._sharded is not None:
                    found = self._sharded.canonical_keys(found)
                for p in mine:
                    factors.setdefault(p, []).append(found[p])
        once = [i for p, rows_of in index.items() if len(rows_of) == 1 for i in rows_of]
        out_params = [params[i] for i in once]
        combined = []
        for p, rows_of in index.items():
            if len(rows_of) == 1:
                continue
            sq = rows.index_select(0, self._row_index(rows_of, rows.device)).square().sum(0)
            uses = factors[p]
            for i in range(len(uses)):
                for j in range(i + 1, len(uses)):
                    # torch's own kernels on every backend (triton_ops re-exports reference's).
                    sq = sq + 2 * reference.outer_sum_inner(*uses[i], *uses[j]).to(sq.dtype)
            # Rounding can take the square of an exact zero (opposite uses) slightly below it.
            combined.append(sq.clamp_min(0).sqrt())
            out_params.append(p)
        kept = rows.index_select(0, self._row_index(once, rows.device))
        return out_params, torch.cat([kept, torch.stack(combined)])

    def _row_index(self, rows: List[int], device: torch.device) -> torch.Tensor:
        """``rows`` as an index tensor on ``device``, made once: indexing by a Python list
        copies the list to the device at every call, which on a GPU waits for the queue."""
        key = (tuple(rows), device)
        found = self._row_indices.get(key)
        if found is None:
            found = self._row_indices[key] = torch.tensor(rows, dtype=torch.int64, device=device)
        return found

    # ------------------------------------------------------------------ clipped sums
    def _clipped_sums(self, coef: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_b c_b g_b`` of every parameter of the kept groups, freeing each group as it
        is summed. ``coef`` (B,): the clipping coefficients of the samples' own losses."""
        groups, self._kept = self._kept or [], None
        sums: Dict[nn.Parameter, torch.Tensor] = {}
        with region("dpgrad.clipped_sums"):
            self._sum_groups(groups, self._coefficients(coef), sums)
        return sums

    def _coefficients(self, coef: torch.Tensor) -> Coefficients:
        if self.loss_reduction == "mean":
            coef = coef * coef.shape[0]  # the records' backprops are those of the mean
        return Coefficients(coef)

    def _sum_groups(self, groups: List[Group], coefs: Coefficients, sums: Dict[nn.Parameter, torch.Tensor]) -> None:
        """Add the clipped sums of ``groups`` to ``sums``, emptying the list (each group lets go
        of its inputs as it is summed)."""
        while groups:
            found = groups.pop().clipped_sums(coefs)
            if self._sharded is not None:  # keyed by FSDP's unsharded copies
                found = list(zip(self._sharded.canonical(p for p, _ in found), (s for _, s in found)))
            for p, s in found:
                sums[p] = s if p not in sums else sums[p] + s

    def _reduce_scatter_clipped(self, coef: torch.Tensor) -> None:
        """On a model sharded by FSDP2: the clipped sums of one FSDP2 parameter group at a time,
        each handed to FSDP's reduce-scatter before the next is computed (``dpgrad.fsdp``), so
        that no more than one group's full gradients exist at once. The host waits for the
        norms' finite check once the first group's sums are queued, before any reaches FSDP."""
        groups, self._kept = self._kept or [], None
        by_shard: Dict[int, List[Group]] = {}
        for group, shard in zip(groups, self._kept_shards):
            by_shard.setdefault(shard, []).append(group)
        del groups
        coefs = self._coefficients(coef)
        with region("dpgrad.clipped_sums"):
            for shard in list(by_shard):
                sums: Dict[nn.Parameter, torch.Tensor] = {}
                self._sum_groups(by_shard.pop(shard), coefs, sums)
                self._wait_finite()  # once: the check is gone after the first wait
                self._sharded.reduce_scatter(shard, sums)
        self._wait_finite()
        self._sharded.finish_backward()


REENTRANT_CHECKPOINT = (
    "the model uses reentrant activation checkpointing (torch.utils.checkpoint with "
    "use_reentrant=True, the default of Hugging Face's gradient_checkpointing_enable() before "
    "transformers 5), whose recomputation runs a backward pass of its own inside dpgrad's: the "
    "ghost-clipping wrapper cannot take the norms through it. Use non-reentrant checkpointing: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
    "(transformers 5: activation_checkpointing_enable(), non-reentrant by default), or "
    "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)."
)


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


def _recomputing() -> bool:
    """Whether non-reentrant activation checkpointing is recomputing a forward pass (inside
    the backward pass) for the tensors it saved: its layer calls are no forward pass of the
    model, and nothing backpropagates through their outputs."""
    top = _top_saved_tensors_hooks()
    return top is not None and "_recomputation_hook" in getattr(top[0], "__qualname__", "")


def _same_objects(a: tuple, b: tuple) -> bool:
    """Whether two tuples hold the same objects (tensors compared by identity, not value)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _feature_dims(layer: nn.Module) -> int:
    """Trailing input dimensions a layer consumes at each position (the rest are batch and
    tokens): 1 for Linear, the normalised shape's for LayerNorm and RMSNorm, else 0."""
    if isinstance(layer, nn.Linear):
        return 1
    if isinstance(layer, (nn.LayerNorm, nn.RMSNorm)):
        return len(layer.normalized_shape)
    return 0


def _batch_to_front(x):
    """Move dimension 1 (the batch under batch_first=False) to the front."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return x
    return x.movedim(1, 0)
