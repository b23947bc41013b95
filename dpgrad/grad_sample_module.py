"""``GradSampleModule``: per-sample gradients through hooks, a drop-in for Opacus's.

The hooks and the end of each backward pass are ``dpgrad.backward_pass``'s: a layer's gradient
hook computes its per-sample gradients, and a callback queued for the end of the pass promotes
them onto the parameters (``p.grad_sample``), so weight tying, module reuse and forward passes
that never see a backward cannot leave stale per-sample state behind. This module is Opacus's
interface around it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from dpgrad import registry
from dpgrad.backend import name_layers
from dpgrad.backward_pass import BackwardPath, own_trainable
from dpgrad.fsdp import sharded_modules
from dpgrad.guarantee import watch_structure

logger = logging.getLogger(__name__)

# Attributes dpgrad (like Opacus) puts on parameters.
PARAM_ATTRS = ("grad_sample", "_forward_counter", "_norm_sample")


def _trainable_modules(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    for name, m in module.named_modules():
        if own_trainable(m):
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
    sharded = sharded_modules(m)
    if sharded:
        name = sharded[0][0]
        raise NotImplementedError(
            f"{'layer ' + repr(name) if name else 'the model'} is sharded by FSDP (fully_shard), "
            "which GradSampleModule does not support: FSDP swaps each parameter for an unsharded "
            "copy during forward and backward, so per-sample gradients would land on the copies. "
            "Use dpgrad.GradSampleModuleFastGradientClipping (ghost clipping, which supports "
            "FSDP2), or torch.nn.parallel.DistributedDataParallel."
        )


class GradSampleModule(BackwardPath, nn.Module):
    """Wraps a module so that each trainable parameter gets ``p.grad_sample`` after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's ``GradSampleModule``.
    A model sharded by FSDP2 is refused (the ghost-clipping wrapper takes it). Every layer with
    trainable parameters is hooked whatever its mode (train or eval), and the model is hooked
    anew at the forward pass after its trainable parameters or its modules changed; a
    parameter reached other than through its layer's hooked calls raises
    ``dpgrad.UnclippedGradientError`` (``dpgrad.guarantee``).

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

    SHARDED_MODELS = False  # whether a model sharded by FSDP2 (fully_shard) is taken

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
        if not self.SHARDED_MODELS:
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
        self.strict = strict
        self.hooks_enabled = False
        self.grad_accumulation_allowed = True
        self.grad_accumulation_hook = None
        self._param_names: Dict[torch.Tensor, str] = {p: n for n, p in m.named_parameters()}
        self._skipped = {e.args[1] for e in errors}
        self._init_path()
        for _, p in self._trainable_parameters():
            p.grad_sample = None
            p._forward_counter = 0
        watch_structure()
        self.add_hooks(loss_reduction=loss_reduction, batch_first=batch_first, force_functorch=force_functorch)
        self._sync_with_model(rescan=False)

    # ------------------------------------------------------------------ module plumbing
    def forward(self, *args, **kwargs):
        # The model's own pre-hook begins the pass (also when the model is called directly).
        return self._module(*args, **kwargs)

    def _rescan(self) -> None:
        """Take the model as it is now: the layers with trainable parameters, checked and
        hooked anew (after gradual unfreezing, or a layer added after wrapping). Raises, as at
        construction, for a layer that cannot be clipped (leaving the hooks as they were)."""
        m = self._module
        if self._sharded is None and sharded_modules(m):
            raise RuntimeError(
                "the model was sharded by fully_shard after it was wrapped, and per-sample state "
                "would land on parameters nothing reads. Shard the model first, then wrap it."
            )
        registry.resolve(m)
        errors = self.validate(m, strict=self.strict)
        self._check_layers(m, self.force_functorch)
        self._param_names = {p: n for n, p in m.named_parameters()}
        self._skipped = {e.args[1] for e in errors}
        for _, p in self._trainable_parameters():
            if "grad_sample" not in p.__dict__:
                p.grad_sample = None
            if "_forward_counter" not in p.__dict__:
                p._forward_counter = 0
        handles = self.__dict__.get("autograd_grad_sample_hooks")
        if handles is not None:
            for handle in handles:
                handle.remove()
            handles[:] = self._attach(self.force_functorch)
        self._on_rescan()
        self._plans.clear()
        self._verified.clear()
        self._scan_version += 1

    def _on_rescan(self) -> None:
        """What a subclass updates after ``_rescan``."""

    # ------------------------------------------------------------------ copies
    def __getstate__(self):
        state = super().__getstate__()
        for name in self.TRANSIENT:
            state.pop(name, None)
        return state

    def __setstate__(self, state) -> None:
        # Runs before the model in the state is complete (a copy of the model alone copies its
        # wrapper through the hooks): only the state's own mappings are used here.
        super().__setstate__(state)
        self._init_transient()
        for p in self._param_names:
            if p.requires_grad:
                p.__dict__.setdefault("grad_sample", None)
                p.__dict__.setdefault("_forward_counter", 0)
        name_layers(self._layer_names)

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
    def add_hooks(self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False) -> None:
        """Hook every layer with trainable parameters (Opacus's signature)."""
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        self.loss_reduction, self.batch_first, self.force_functorch = loss_reduction, batch_first, force_functorch
        handles = self._attach(force_functorch)
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

