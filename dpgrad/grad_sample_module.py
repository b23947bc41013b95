"""``GradSampleModule``: per-sample gradients through hooks, a drop-in for Opacus's.

A forward hook on every layer with trainable parameters keeps the layer's inputs and puts a
gradient hook on its output; that hook receives the backprops and hands both to the layer's
sampler. Results of one backward pass are promoted onto the parameters (``p.grad_sample``)
by a callback queued for the end of that pass, so weight tying, module reuse and forward
passes that never see a backward cannot leave stale per-sample state behind.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad import registry
from dpgrad.samplers import ft_compute_per_sample_gradient, prepare_layer
from dpgrad.samplers.functorch import _first_tensor

logger = logging.getLogger(__name__)

# Attributes dpgrad (like Opacus) puts on parameters.
PARAM_ATTRS = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample")


def _own_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _trainable_modules(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    for name, m in module.named_modules():
        if _own_trainable(m):
            yield name, m


def _refuse_wrapped(m: nn.Module) -> None:
    """Raise before touching ``m`` if it, or a submodule, already carries per-sample hooks."""
    for name, sub in m.named_modules():
        if hasattr(sub, "autograd_grad_sample_hooks"):
            where = f"its submodule '{name}'" if name else "it"
            raise ValueError(
                f"this model is already wrapped for per-sample gradients ({where} carries "
                f"{type(sub).__name__} hooks). Wrap the original module once: call "
                ".to_standard_module() on the existing wrapper to get it back."
            )


def _refuse_sharded(m: nn.Module) -> None:
    """Raise before touching ``m`` if FSDP (``fully_shard``) shards it or a submodule."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed support
        return
    for name, sub in m.named_modules():
        if isinstance(sub, FSDPModule):
            raise NotImplementedError(
                f"{'layer ' + repr(name) if name else 'the model'} is sharded by FSDP (fully_shard), "
                "which dpgrad does not support: FSDP swaps each parameter for an unsharded copy "
                "during forward and backward, so per-sample state would land on the copies. "
                "Use torch.nn.parallel.DistributedDataParallel."
            )


class GradSampleModule(nn.Module):
    """Wraps a module so that each trainable parameter gets ``p.grad_sample`` after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's ``GradSampleModule``.

    Args:
        m: the module to wrap.
        batch_first: inputs are ``[B, ...]`` if True, ``[K, B, ...]`` if False.
        loss_reduction: "mean" or "sum", how the loss aggregates over the batch.
        strict: raise on trainable layers with buffers (e.g. BatchNorm); with False such
            layers are skipped, with a warning, and get no per-sample gradients.
        force_functorch: compute every layer through torch.func, not the registered samplers.
        check_finite: raise, naming the layer, when a per-sample gradient (or norm) is not
            finite. dpgrad's own keyword; pass False to turn the check off.
    """

    GRAD_SAMPLERS = registry.GRAD_SAMPLERS

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        check_finite: bool = True,
    ):
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction = {loss_reduction!r}: only 'sum' and 'mean' are supported")
        _refuse_wrapped(m)
        _refuse_sharded(m)
        registry.resolve(m)
        errors = self.validate(m, strict=strict)
        self._check_layers(m, force_functorch)
        super().__init__()
        self._module = m
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.force_functorch = force_functorch
        self.check_finite = check_finite
        self.hooks_enabled = False
        self.grad_accumulation_allowed = True
        self.grad_accumulation_hook = None
        self._param_names: Dict[torch.Tensor, str] = {p: n for n, p in m.named_parameters()}
        self._skipped = {e.args[1] for e in errors}
        self._forward_batch: Optional[int] = None
        self._forward_seen: set = set()
        self._pass_open = False
        self._pass_params: Dict[torch.Tensor, None] = {}
        for _, p in self._trainable_parameters():
            p.grad_sample = None
            p._forward_counter = 0
        self.add_hooks(loss_reduction=loss_reduction, batch_first=batch_first, force_functorch=force_functorch)

    # ------------------------------------------------------------------ module plumbing
    def forward(self, *args, **kwargs):
        if self._pass_open:
            # A backward pass that raised (in any hook, not only ours) never reached its
            # end-of-pass callback; its partial per-sample state must not leak into this step.
            self._abort_pass()
        self._forward_batch = None
        self._forward_seen = set()
        return self._module(*args, **kwargs)

    def __getattr__(self, item):
        try:
            return super().__getattr__(item)
        except AttributeError:
            if item != "_module" and "_module" in self.__dict__.get("_modules", {}):
                submodules = dict(self._modules["_module"].named_modules())
                if item in submodules:
                    return submodules[item]
            raise

    def __repr__(self):
        return f"{type(self).__name__}({self._module!r})"

    def _trainable_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self._module.named_parameters() if p.requires_grad)

    # ------------------------------------------------------------------ validation
    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> List[NotImplementedError]:
        """Trainable layers dpgrad cannot treat per sample (layers with buffers).

        Returns the list of errors; raises the first with all of them listed if ``strict``.
        Each error's ``args`` are ``(message, layer_name)``.
        """
        errors = []
        for name, m in _trainable_modules(module):
            buffers = [b for b, _ in m.named_buffers()]
            if buffers:
                errors.append(
                    NotImplementedError(
                        f"layer '{name}' ({type(m).__name__}) is trainable and has buffers "
                        f"{buffers}: buffer state is shared across the samples of a batch, so "
                        "per-sample gradients are undefined. Replace the layer (e.g. BatchNorm by "
                        "GroupNorm; opacus.validators.ModuleValidator.fix does this), freeze it "
                        "with requires_grad_(False), or pass strict=False to skip it.",
                        name,
                    )
                )
            elif isinstance(m, nn.Embedding) and m.scale_grad_by_freq:
                errors.append(
                    NotImplementedError(
                        f"layer '{name}' (Embedding) has scale_grad_by_freq=True: each row's "
                        "gradient is scaled by its frequency in the whole batch, so one sample's "
                        "gradient depends on the others and per-sample gradients are undefined. "
                        "Construct it with scale_grad_by_freq=False, freeze it with "
                        "requires_grad_(False), or pass strict=False to skip it.",
                        name,
                    )
                )
        if strict and errors:
            raise NotImplementedError("\n".join(e.args[0] for e in errors))
        if errors:
            warnings.warn(
                "strict=False: these layers get no per-sample gradients: "
                + ", ".join(repr(e.args[1]) for e in errors),
                stacklevel=3,
            )
        return errors

    def _check_layers(self, m: nn.Module, force_functorch: bool) -> None:
        """A subclass's checks of the layers it will hook, before the model is touched
        (before ``nn.Module.__init__``: plain attributes only)."""

    @classmethod
    def is_supported(cls, module: nn.Module) -> bool:
        """Whether per-sample gradients of ``module``'s own parameters can be computed.

        True for registered layer types and, through torch.func, for any layer without buffers.
        """
        return type(module) in registry.GRAD_SAMPLERS or not list(module.buffers())

    # ------------------------------------------------------------------ hooks
    def _layers_to_hook(
        self, module: nn.Module, prefix: str = "", seen: Optional[set] = None
    ) -> Iterator[Tuple[str, nn.Module]]:
        """Layers with own trainable parameters; a layer without a registered sampler is
        handled whole by torch.func, so its children are not visited. A layer registered
        under several names (one module in two containers) is yielded once: two hooks
        would count each of its uses twice."""
        seen = set() if seen is None else seen
        if module in seen:
            return
        seen.add(module)
        if _own_trainable(module):
            yield prefix, module
            if type(module) not in self.GRAD_SAMPLERS:
                return
        for name, child in module.named_children():
            yield from self._layers_to_hook(child, f"{prefix}.{name}" if prefix else name, seen)

    def add_hooks(self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False) -> None:
        """Hook every layer with trainable parameters (Opacus's signature)."""
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        self.loss_reduction, self.batch_first, self.force_functorch = loss_reduction, batch_first, force_functorch
        self._layer_names: Dict[nn.Module, str] = {}
        self._functorch_layers: set = set()
        handles = []
        for name, layer in self._layers_to_hook(self._module):
            if name in self._skipped:
                continue
            if force_functorch or type(layer) not in self.GRAD_SAMPLERS:
                prepare_layer(layer, batch_first=batch_first)
                self._functorch_layers.add(layer)
            self._layer_names[layer] = name
            handles.append(layer.register_forward_hook(self._capture_activations))
        covered = {p for layer in self._layer_names for p in layer.parameters(recurse=layer in self._functorch_layers)}
        # Parameters no hook sees (skipped layers and their children): no per-sample values.
        self._unhooked = {p for p in self._module.parameters() if p not in covered}
        self._module.autograd_grad_sample_hooks = handles
        self.autograd_grad_sample_hooks = handles
        self.enable_hooks()

    def remove_hooks(self) -> None:
        """Remove every hook ``add_hooks`` put on the model."""
        self.disable_hooks()
        handles = self.__dict__.pop("autograd_grad_sample_hooks", None) or []
        for handle in handles:
            handle.remove()
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            del self._module.autograd_grad_sample_hooks
        for layer in getattr(self, "_functorch_layers", ()):
            if hasattr(layer, "ft_compute_sample_grad"):
                del layer.ft_compute_sample_grad

    def disable_hooks(self) -> None:
        """Turn the hooks off (they stay registered); needed for Opacus's second backward."""
        self.hooks_enabled = False

    def enable_hooks(self) -> None:
        """Turn the hooks back on."""
        self.hooks_enabled = True

    def _layer_params(self, layer: nn.Module) -> List[nn.Parameter]:
        recurse = layer in self._functorch_layers
        return [p for p in layer.parameters(recurse=recurse) if p.requires_grad]

    def _batch_size(self, layer: nn.Module, name: str, activations: list) -> int:
        x = next((a for a in activations if isinstance(a, torch.Tensor)), None)
        batch_dim = 0 if self.batch_first else 1
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
        return n

    def _capture_activations(self, layer: nn.Module, inputs, output) -> None:
        if not (self.hooks_enabled and layer.training and torch.is_grad_enabled()):
            return
        params = self._layer_params(layer)
        out = _first_tensor(output)
        if not params or out is None or not out.requires_grad:
            return
        name = self._layer_names[layer]
        activations = [a.detach() if isinstance(a, torch.Tensor) else a for a in inputs]
        batch_size = self._batch_size(layer, name, activations)
        self._on_forward(layer, name, params, out)
        out.register_hook(partial(self._capture_backprops, layer, params, activations, batch_size))

    def _on_forward(self, layer: nn.Module, name: str, params: List[nn.Parameter], out: torch.Tensor) -> None:
        self._forward_seen.add(layer)
        for p in params:
            p._forward_counter += 1

    def _capture_backprops(
        self, layer: nn.Module, params: List[nn.Parameter], activations: list, batch_size: int, grad: torch.Tensor
    ):
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
            activations, taken = list(activations), activations
            taken.clear()
            backprops = grad.detach()
            if self.loss_reduction == "mean":
                backprops = backprops * batch_size
            if not self.batch_first:
                activations = [_batch_to_front(a) for a in activations]
                backprops = _batch_to_front(backprops)
            self._process_layer(layer, activations, backprops)
            for p in params:
                p._forward_counter = max(0, p._forward_counter - 1)
        except BaseException:
            self._abort_pass()
            raise
        return None

    def _grad_sampler(self, layer: nn.Module):
        if layer in self._functorch_layers:
            return ft_compute_per_sample_gradient
        return self.GRAD_SAMPLERS[type(layer)]

    def _process_layer(self, layer: nn.Module, activations: list, backprops: torch.Tensor) -> None:
        """Add this layer's per-sample gradients to the pass (summed for tied parameters)."""
        grads = self._grad_sampler(layer)(layer, activations, backprops)
        for p, gs in grads.items():
            if not p.requires_grad:
                continue
            if p in self._pass_params:
                if p._current_grad_sample.shape != gs.shape:
                    raise ValueError(
                        f"parameter '{self._param_names.get(p)}' of layer "
                        f"'{self._layer_names[layer]}' got per-sample gradients of shape "
                        f"{tuple(gs.shape)} and {tuple(p._current_grad_sample.shape)} in one "
                        "backward pass: its uses saw different batch sizes"
                    )
                p._current_grad_sample = p._current_grad_sample + gs
            else:
                p._current_grad_sample = gs
                self._pass_params[p] = None

    # ------------------------------------------------------------------ end of a backward pass
    def _begin_pass(self) -> None:
        """Called at the first hook of a backward pass; per-sample gradients accumulate across
        passes, so there is nothing to reset here."""

    def _close_pass(self) -> None:
        try:
            self._finish_pass(list(self._pass_params))
        finally:
            self._abort_pass()

    def _abort_pass(self) -> None:
        for p in self._pass_params:
            p.__dict__.pop("_current_grad_sample", None)
            p._forward_counter = 0
        self._pass_params = {}
        self._pass_open = False
        self._forward_batch = None

    def _finish_pass(self, params: List[nn.Parameter]) -> None:
        if not self.grad_accumulation_allowed:
            for p in params:
                if p.grad_sample is not None:
                    raise ValueError(
                        "Poisson sampling is not compatible with grad accumulation: parameter "
                        f"'{self._param_names.get(p)}' already holds per-sample gradients from an "
                        "earlier backward pass. Call optimizer.step() (or zero_grad()) after every "
                        "forward/backward pass, or use BatchMemoryManager."
                    )
        self._check_finite({p: p._current_grad_sample for p in params}, "gradients")
        for p in params:
            gs = p._current_grad_sample
            if p.grad_sample is None:
                p.grad_sample = gs
            elif isinstance(p.grad_sample, list):
                p.grad_sample.append(gs)
            else:
                p.grad_sample = [p.grad_sample, gs]

    def _check_finite(self, values: Dict[torch.Tensor, torch.Tensor], what: str) -> None:
        """Raise FloatingPointError naming the parameters whose per-sample values are not finite."""
        if not self.check_finite or not values:
            return
        device = next(iter(values.values())).device
        flags = torch.stack([torch.isfinite(v).all().to(device) for v in values.values()])
        if bool(flags.all()):
            return
        bad = [self._param_names.get(p, "?") for p, ok in zip(values, flags.tolist()) if not ok]
        raise FloatingPointError(
            f"non-finite per-sample {what} for parameters {bad}: the loss, the inputs or the "
            "weights hold inf or NaN (in reduced precision, an overflow). Fix the cause (loss "
            "scaling, learning rate, inputs), or pass check_finite=False to skip this check."
        )

    # ------------------------------------------------------------------ Opacus's methods
    def forbid_grad_accumulation(self) -> None:
        """Raise if a second backward pass adds per-sample gradients before they are cleared."""
        self.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        """Let per-sample gradients of several backward passes pile up in a list."""
        self.grad_accumulation_allowed = True

    def set_grad_sample_to_none(self) -> None:
        """Set ``p.grad_sample`` to None on every parameter."""
        for p in self._module.parameters():
            p.grad_sample = None

    def del_grad_sample(self) -> None:
        """Delete ``p.grad_sample`` from every parameter."""
        for p in self._module.parameters():
            p.__dict__.pop("grad_sample", None)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clear ``p.grad`` (as nn.Module does) and always set ``p.grad_sample`` to None."""
        self.set_grad_sample_to_none()
        for p in self._module.parameters():
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        super().zero_grad(set_to_none)

    def cleanup(self) -> None:
        """Remove the hooks and every attribute dpgrad put on the parameters."""
        try:
            self.remove_hooks()
        finally:
            for p in self._module.parameters():
                for attr in PARAM_ATTRS:
                    p.__dict__.pop(attr, None)

    def to_standard_module(self) -> nn.Module:
        """Return the wrapped module with no trace of hooks or per-sample fields."""
        self.cleanup()
        return self._module


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
