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

Under ``loss_reduction="mean"`` the backprops are those of the mean loss, 1/B of each sample's
own (Opacus multiplies them by B); the paths apply the factor B to (B,)-sized vectors where
they can, never in a pass over a backprop.

No device-to-host synchronisation on the way: whether the per-sample values are finite is one
number computed on the device (``FiniteCheck``); a pass whose values are not finite has its
clipped gradients replaced by zeros on the device, and the host reads the outcome without
waiting, raising at the next forward pass (``FiniteReports``).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from dpgrad.samplers import registry
from dpgrad.backward.autograd_graph import ForwardEdges, eager_when_compiled, region
from dpgrad.kernels.backend import name_layers
from dpgrad.backward.fsdp import sharded_modules
from dpgrad.checks.guarantee import (
    VerifiedLayouts,
    input_nodes,
    sequence_number,
    structure_version,
    tensors_in,
    unclipped_error,
    uncovered_uses,
    watch_modules,
    watch_structure,
)
from dpgrad.checks.independence import Probe
from dpgrad.checks.independence_check import IndependenceCheck, check_every
from dpgrad.backward.layer_inputs import batch_to_front, broadcast_inputs, check_batch, recomputing
from dpgrad.checks.model_checks import own_trainable, refuse_wrapped, validate
from dpgrad.samplers import ft_compute_per_sample_gradient, prepare_layer
from dpgrad.samplers.functorch import _first_tensor
from dpgrad.samplers.groups import Record


class FiniteCheck:
    """Whether the per-sample values of one backward pass (rows of (P, B) norms, or per-sample
    gradients) are all finite, decided on the device, with no host wait.

    ``bad`` is a 0-d bool on the device (one float64 sum of the values, then whether it is inf
    or NaN). ``withhold`` uses it to replace, on the device, the pass's clipped gradients by
    zeros when it is set, so no inf or NaN reaches ``p.grad`` whatever the host knows. A copy of
    it travels to host memory behind the work that made it (pinned, non-blocking, an event
    marking it on a GPU): ``ready`` says, without waiting, whether it has arrived; ``report``
    reads it and raises FloatingPointError naming the parameters when it was set; ``wait``
    waits for it first.
    """

    def __init__(self, values: List[torch.Tensor], names: Callable[[], List[Tuple[str, torch.Tensor]]], what: str,
                 reports: Optional["FiniteReports"] = None):
        total = torch.stack([v.sum(dtype=torch.float64) for v in values]).sum() if len(values) > 1 else \
            values[0].sum(dtype=torch.float64)
        self._names, self._what = names, what
        self.bad = (total - total).isnan()  # inf - inf and NaN - NaN are NaN, finite - finite 0
        self._reports = reports
        self.withheld = False  # whether ``withhold`` ran
        self._event = None
        # In a step being captured in a CUDA graph (``dpgrad.graphs``): counted on the device,
        # read by the graphed step after its replays; no host copy (the graph would replay it
        # into the same host memory behind the host's back).
        self.counted = FiniteReports.device_count is not None
        if self.counted:
            FiniteReports.device_count.add_(self.bad)
            return
        # The host copy's memory: one ``reports`` has read before, else new.
        self._host, self._array = reports.host_memory(self.bad.is_cuda) if reports is not None else \
            FiniteReports.new_host_memory(self.bad.is_cuda)
        self._host.copy_(self.bad, non_blocking=True)
        if self.bad.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def withhold(self, tensors) -> None:
        """Zero ``tensors`` (in place, on the device) if the values were not finite: each
        storage once, through the tensor a view was taken of (one operation for the sums of a
        group of layers made by one product)."""
        self.withheld = True
        seen = set()
        for t in tensors:
            base = t if t._base is None else t._base
            if id(base) not in seen:
                seen.add(id(base))
                base.masked_fill_(self.bad, 0)

    def zeroed(self, tensors) -> List[torch.Tensor]:
        """``tensors`` as new tensors, zeros if the values were not finite (for values a view
        of which autograd may still hold, which ``withhold`` would change in place)."""
        self.withheld = True
        return [t.masked_fill(self.bad, 0) for t in tensors]

    def ready(self) -> bool:
        """Whether the host copy has arrived (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """``report``, once the host copy has arrived (the host waits for the values)."""
        if self.counted:
            raise RuntimeError(
                "a plain loss.backward() through the ghost-clipping wrapper cannot be captured in a "
                "CUDA graph: its finite check makes the host wait for the device before the second "
                "pass. Use the loss wrapper (the criterion make_private returns, or "
                "dpgrad.DPLossFastGradientClipping), whose backward() needs no wait.")
        if self._event is not None:
            self._event.synchronize()
        self.report()

    def report(self) -> None:
        """Raise FloatingPointError, naming the parameters, if a value was not finite (read
        from host memory: call once ``ready``); the message says whether the pass's clipped
        gradients were withheld."""
        if not bool(self._array):
            if self._reports is not None:
                self._reports.free.setdefault(self._event is not None, []).append((self._host, self._array))
            return
        bad = [name for name, value in self._names() if not bool(torch.isfinite(value).all())]
        # Norms come from sums of squares in fp32: a finite gradient whose norm passes
        # sqrt(float32 max), about 1.8e19, has an infinite square.
        huge = (" or a per-sample gradient's norm above about 1.8e19, whose square overflows "
                "float32") if "norms" in self._what else ""
        kept = (" That backward pass added nothing to p.grad (its clipped gradients were replaced by "
                "zeros on the device), so no parameter took inf or NaN from it." if self.withheld else "")
        raise FloatingPointError(
            f"non-finite per-sample {self._what} for parameters {bad}: the loss, the inputs or the "
            f"weights hold inf or NaN (in reduced precision, an overflow){huge}.{kept} Fix the cause "
            "(loss scaling, learning rate, inputs), or pass check_finite=False to skip this check."
        )


class FiniteReports:
    """The finite checks of a path's backward passes whose outcome the host has not read yet
    (``FiniteCheck``, their clipped gradients withheld on the device when not finite): read,
    and raised, at the next forward pass (``poll``) once they have arrived, which needs no wait;
    by ``raise_pending`` (the wrapper's ``raise_if_not_finite``) at once, waiting for them."""

    # Passes whose outcome may be in flight at once: beyond, the host waits for the oldest
    # (a host more than this many passes ahead of the device).
    IN_FLIGHT = 2

    # While a step is captured in a CUDA graph (``dpgrad.graphs``): the device counter of
    # passes that were not finite, which every finite check made then adds to.
    device_count: Optional[torch.Tensor] = None

    def __init__(self):
        self._checks: List[FiniteCheck] = []
        # Host memory of checks read and found finite (with its NumPy view), by whether it is pinned.
        self.free: Dict[bool, List[tuple]] = {}

    def host_memory(self, pinned: bool) -> Tuple[torch.Tensor, "numpy.ndarray"]:
        """A 0-d bool in host memory (pinned for a GPU's copy) for a check's outcome, and a
        NumPy view of it to read it through: one a finite check was read from, or a new one (no
        allocation, and no operation to read it, per step)."""
        free = self.free.get(pinned)
        return free.pop() if free else self.new_host_memory(pinned)

    @staticmethod
    def new_host_memory(pinned: bool) -> Tuple[torch.Tensor, "numpy.ndarray"]:
        host = torch.empty((), dtype=torch.bool, pin_memory=pinned)
        return host, host.numpy()

    def add(self, check: FiniteCheck) -> None:
        if not check.counted:
            self._checks.append(check)

    def poll(self) -> None:
        """Report every check that has arrived, oldest first; wait for the oldest while more
        than ``IN_FLIGHT`` are in flight (not while a step is captured: the graphed step
        reports what came before)."""
        if FiniteReports.device_count is not None:
            return
        while self._checks and (self._checks[0].ready() or len(self._checks) > self.IN_FLIGHT):
            self._checks.pop(0).wait()

    def raise_pending(self) -> None:
        """Report every check, waiting for those in flight."""
        while self._checks:
            self._checks.pop(0).wait()


class PendingCalls(dict):
    """One forward pass's hooked calls that its backward pass has not recorded yet (layer ->
    count). Each of the forward pass's gradient hooks holds it, and the path only weakly: it
    lasts as long as the forward pass's graph can still be backpropagated through."""

    def __init__(self, forward_id: int):
        super().__init__()
        self.forward_id = forward_id


class BackwardPath:
    """A model's layers hooked, the records of each backward pass, and the pass finished (see
    the module docstring). Subclasses say what a pass keeps (``keep``) and does with it
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
    TRANSIENT = ("_forward_batch", "_forward_seen", "_pass_open", "_edges", "_verified", "_seen_version",
                 "_seen_layout", "_seen_flags", "_checked", "_unrecorded", "_pending", "_pass_forwards",
                 "_probing", "independence", "finite_reports")
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
        self.independence = IndependenceCheck(self)  # when the independence probes run
        self.finite_reports = FiniteReports()  # finite checks the host has not read yet

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

    # ------------------------------------------------------------------ the model
    def _check(self, model: nn.Module) -> Set[str]:
        """Check the model's layers (raising, before anything is touched, for what cannot be
        clipped); the names of the layers skipped under strict=False."""
        registry.resolve(model)
        errors = validate(model, strict=self.strict)
        self._check_layers(model)
        return {e.args[1] for e in errors}

    def _check_layers(self, model: nn.Module) -> None:
        """A path's own checks of the model; nothing here."""

    def attach(self, root: nn.Module) -> None:
        """Hook the model and give its trainable parameters dpgrad's fields; ``root`` is the
        module whose trainable parameters the guarantee covers (the wrapper: the model's and
        any it holds itself)."""
        self.root = root
        watch_structure()
        self._param_names = {p: n for n, p in self.model.named_parameters()}
        self._init_fields()
        self.handles[:] = self._hook()
        self.hooks_enabled = True
        self._sync_with_model(rescan=False)

    def detach(self) -> None:
        """Remove every hook ``attach`` put on the model."""
        self.hooks_enabled = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for layer in getattr(self, "functorch_layers", ()):
            layer.__dict__.pop("ft_compute_sample_grad", None)

    def _init_fields(self) -> None:
        for p in self.model.parameters():
            if p.requires_grad:
                p.__dict__.setdefault("grad_sample", None)
                p.__dict__.setdefault("_forward_counter", 0)

    def layers_to_hook(self, module: nn.Module, prefix: str = "", seen: Optional[set] = None
                       ) -> Iterator[Tuple[str, nn.Module]]:
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
            yield from self.layers_to_hook(child, f"{prefix}.{name}" if prefix else name, seen)

    def whole(self, layer: nn.Module) -> bool:
        """Whether the layer's per-sample gradients come from torch.func, for it whole."""
        return self.force_functorch or type(layer) not in self.GRAD_SAMPLERS

    def _hook(self) -> list:
        """Hook every layer with trainable parameters of its own, and the model itself (at
        the start of each forward pass, and at its end for the guarantee's check)."""
        model = self.model
        self.layer_names: Dict[nn.Module, str] = {}
        self.functorch_layers: Set[nn.Module] = set()
        self._own_params: Dict[nn.Module, Tuple[nn.Parameter, ...]] = {}
        handles = []
        for name, layer in self.layers_to_hook(model):
            if name in self._skipped:
                continue
            whole = self.whole(layer)
            if whole:
                prepare_layer(layer, batch_first=self.batch_first)
                self.functorch_layers.add(layer)
            self.layer_names[layer] = name
            self._own_params[layer] = tuple(layer.parameters(recurse=whole))
            handles.append(layer.register_forward_hook(self._on_layer_call))
        name_layers(self.layer_names)
        # One parameter, looked up at each forward pass: a model whose parameters were replaced
        # without a registration (sharded by fully_shard after wrapping) would get per-sample
        # state on others.
        self._probe = None
        if self.sharded is None:
            self._probe = next(((layer, n, p) for layer in self.layer_names
                                for n, p in layer.named_parameters(recurse=False)), None)
        # The hooked layers that hold each parameter (for messages).
        self._owners: Dict[nn.Parameter, List[nn.Module]] = {}
        for layer, params in self._own_params.items():
            for p in params:
                self._owners.setdefault(p, []).append(layer)
        # Parameters no hook sees (skipped layers and their children): no per-sample values.
        self.unhooked = {p for p in model.parameters() if p not in self._owners}
        # Those of layers skipped under strict=False, refused where their norms are asked for.
        self._skipped_params = {p for name, m in model.named_modules() if name in self._skipped
                                for p in m.parameters()}
        handles.append(model.register_forward_pre_hook(self._on_model_call, with_kwargs=True))
        handles.append(model.register_forward_hook(self._on_model_output))
        return handles

    def _sync_with_model(self, rescan: bool = True) -> None:
        """Hook the model anew (``_rescan``) if its modules or parameters, or which parameters
        train, changed since the last look: gradual unfreezing, a head added after wrapping.
        Costs a look at each parameter's ``requires_grad``; the modules are looked at again
        only after a module or a parameter was registered into one of them (``structure_version``)."""
        changed = False
        version = structure_version()
        if version != self._seen_version:
            layout = (tuple(self.root.modules()), tuple(self.root.parameters()))
            if not all(_same_objects(a, b) for a, b in zip(layout, self._seen_layout)):
                self._seen_layout, changed = layout, True
                watch_modules(layout[0])
            self._seen_version = version
        params = self._seen_layout[1]
        flags = [p.requires_grad for p in params]
        if changed or flags != self._seen_flags:
            if rescan:
                self._rescan()
                flags = [p.requires_grad for p in params]
            self._seen_flags = flags
            self._checked = {p for p, trains in zip(params, flags) if trains} - self._skipped_params

    def _rescan(self) -> None:
        """Take the model as it is now: checked and hooked anew (after gradual unfreezing, or a
        layer added after wrapping). Raises, as at construction, for a layer that cannot be
        clipped, leaving the hooks as they were."""
        model = self.model
        if self.sharded is None and sharded_modules(model):
            raise RuntimeError(
                "the model was sharded by fully_shard after it was wrapped, and per-sample state "
                "would land on parameters nothing reads. Shard the model first, then wrap it."
            )
        self._skipped = self._check(model)
        self._param_names = {p: n for n, p in model.named_parameters()}
        self._init_fields()
        if self.handles:
            for handle in self.handles:
                handle.remove()
            self.handles[:] = self._hook()
        self._verified.clear()
        self.independence.clear()
        self._scan_version += 1

    def layer_params(self, layer: nn.Module) -> List[nn.Parameter]:
        """The layer's trainable parameters, as its per-sample gradients see them."""
        return [p for p in self._own_params[layer] if p.requires_grad]

    def param_name(self, p: nn.Parameter) -> str:
        return self._param_names.get(p, "?")

    def grad_sampler(self, layer: nn.Module) -> Callable:
        if layer in self.functorch_layers:
            return ft_compute_per_sample_gradient
        return self.GRAD_SAMPLERS[type(layer)]

    # ------------------------------------------------------------------ forward
    @eager_when_compiled
    def _on_model_call(self, module: nn.Module, args, kwargs) -> None:
        if self.inert or self.independence.rerunning:
            return None  # a copy of the model alone, or a forward probe's run (dpgrad.checks.forward_probe)
        self.begin_forward()
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
        self._forward_seen = set()
        self._edges.begin_forward()

    def _check_probe(self) -> None:
        if self._probe is None:
            return
        layer, name, p = self._probe
        if layer._parameters.get(name) is not p:
            raise RuntimeError(
                f"parameter '{self.layer_names[layer]}.{name}' is no longer the one this wrapper "
                "hooked: the model's parameters were replaced after wrapping (sharded by "
                "fully_shard, or assigned anew), and per-sample state would land on parameters "
                "nothing reads. Shard or change the model first, then wrap it."
            )

    @eager_when_compiled
    def _on_layer_call(self, layer: nn.Module, inputs, output) -> Optional[torch.Tensor]:
        if self.independence.rerunning:  # a forward probe's run: the outputs changed on its rows
            perturb = self.independence.perturb
            return None if perturb is None else perturb(output)
        # Whatever the layer's mode: eval() changes what a layer computes (dropout), not
        # whether its gradient must be clipped.
        if not (self.hooks_enabled and torch.is_grad_enabled()):
            return None
        out = output if isinstance(output, torch.Tensor) else _first_tensor(output)
        if out is None and isinstance(output, dict) and self.layer_params(layer):
            self._refuse_mapping_output(layer, output)
        if out is None or not out.requires_grad:
            return None
        params = self.layer_params(layer)
        if not params:
            return None
        widened = broadcast_inputs(layer, inputs, self._forward_batch, self.batch_first, self.functorch_layers)
        if widened is not None:
            # The layer again, on its input expanded to the batch: that call is the one its
            # hook records, and its output replaces this one.
            return layer(*widened)
        if recomputing():
            return None
        name = self.layer_names[layer]
        self._forward_batch = check_batch(layer, name, inputs, self._forward_batch, self.batch_first)
        self._note_call(layer, name, params)
        self._edges.add(out, layer, inputs, params)
        keep = registry.KEPT_INPUTS.get(type(layer))
        kept = list(inputs) if keep is None or layer in self.functorch_layers else keep(layer, inputs, out)
        # Not detached: they are only read under no_grad, and the list is emptied when read.
        out.register_hook(partial(self._record, layer, params, kept, self._pending))
        return None

    def _refuse_mapping_output(self, layer: nn.Module, output: dict) -> None:
        """Raise for a layer taken whole by torch.func whose output is a mapping of tensors
        (a Hugging Face ModelOutput, a dict): its per-sample gradients follow its first output
        tensor, and a mapping has none to follow."""
        if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in output.values()):
            return
        name = self.layer_names[layer]
        own = [n for n, p in layer.named_parameters(recurse=False) if p.requires_grad]
        who = f"layer '{name}'" if name else "the model itself"
        raise ValueError(
            f"{who} holds trainable parameters of its own ({own}), so its per-sample gradients come "
            f"from torch.func, taking it whole, through its output; it returned a {type(output).__name__}, "
            "whose tensors cannot be followed. Move those parameters into a submodule that returns a "
            "tensor (e.g. a small nn.Module holding them, called in forward), or have the layer return a "
            "tensor or a tuple."
        )

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

    @eager_when_compiled
    def _on_model_output(self, module: nn.Module, args, output) -> None:
        if not (self.inert or self.independence.rerunning):
            self.end_forward(output)

    def end_forward(self, output) -> None:
        """The end of a forward pass: the guarantee's check of its graph, when its layout is
        new (``dpgrad.checks.guarantee``)."""
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
        tensors = [t for t in found if t.grad_fn is not None]
        edges.set_outputs(tensors)
        if not calls or not edges.outputs:
            self.independence.call = None
            return
        key = (self._scan_version, tuple(call[0] for call in calls), edges.output_seq - sequence_number(calls[0][1]))
        if key not in self._verified:
            self._verify(edges.outputs, calls, edges.marked_elsewhere)
            self._verified.add(key)
        if self.check_independence:
            self.independence.end_forward(key, tensors)

    def _verify(self, roots: list, calls: list, stop: Callable, in_loss: bool = False) -> None:
        """Raise ``UnclippedGradientError`` if a trainable parameter is reached from ``roots``
        other than through the hooked ``calls``."""
        canonical = None
        if self.sharded is not None:  # the graph holds FSDP's unsharded copies
            canonical = lambda t: self.sharded.canonical((t,))[0]  # noqa: E731
        uses = uncovered_uses(roots, [(node, input_nodes(inputs), set(params)) for _, node, inputs, params in calls],
                              self._checked, stop=stop, canonical=canonical, visit=self._visit_node)
        if uses:
            names = {p: n.removeprefix("_module.") for n, p in self.root.named_parameters()}
            names.update(self._param_names)
            raise unclipped_error(self.UNCLIPPED, uses, names, self._owners, self.layer_names,
                                  {call[0] for call in calls}, in_loss)

    @property
    def batch_dim(self) -> int:
        return 0 if self.batch_first else 1

    def probes_model_at_forward(self) -> bool:
        """Whether the model's probe runs at the end of a forward pass of a new layout (else the
        probe of the per-sample losses, in a backward pass dpgrad runs, takes the model too)."""
        return True

    def _visit_node(self, node) -> None:
        """Called on every node the guarantee's check walks; a path raises for nodes it cannot
        clip through."""

    # ------------------------------------------------------------------ backward
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
                    f"layer '{self.layer_names[layer]}' is in a second hooked backward pass through "
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
        self._edges.release()
        for forward_id in self._pass_forwards:
            self._unrecorded.pop(forward_id, None)
        self._pass_forwards.clear()

    def _abort_pass(self) -> None:
        for p in self.model.parameters():
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        self._clear_pass()

    def _check_trainable_since_forward(self) -> None:
        """Raise, before anything reaches a gradient, if a parameter was frozen or made
        trainable after the last forward pass: its per-sample state and autograd's graph follow
        the forward pass, what would be clipped and summed follows ``requires_grad`` now."""
        params = self._seen_layout[1]
        if self._seen_flags is None or all(p.requires_grad == was for p, was in zip(params, self._seen_flags)):
            return
        changed = [f"'{self.param_name(p)}' ({'trainable' if p.requires_grad else 'frozen'} now)"
                   for p, was in zip(params, self._seen_flags) if p.requires_grad != was]
        self._pass_forwards.add(self._edges.forward_id)
        self._abort_pass()
        raise RuntimeError(
            f"parameters {', '.join(changed)} changed requires_grad between the forward pass and its "
            "backward pass: the forward pass decided which gradients autograd computes, and they would "
            "be clipped as the parameters are now. Freeze or unfreeze parameters before the forward "
            "pass (then the wrapper takes the model as it is). Nothing has reached p.grad from this pass."
        )

    @contextlib.contextmanager
    def hooks_off(self):
        """A context in which the hooks record nothing (the second pass of Opacus's protocol)."""
        was, self.hooks_enabled = self.hooks_enabled, False
        try:
            yield
        finally:
            self.hooks_enabled = was


def _same_objects(a: tuple, b: tuple) -> bool:
    """Whether two tuples hold the same objects (tensors compared by identity, not value)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
