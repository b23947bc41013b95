"""``GradSampleModule``: per-sample gradients through hooks, a drop-in for Opacus's.

The wrapper holds its backward path (``GradSamplePath``, a ``dpgrad.backward.backward_pass.BackwardPath``)
and keeps Opacus's interface around it: a layer's gradient hook computes its per-sample
gradients, and a callback queued for the end of the pass promotes them onto the parameters
(``p.grad_sample``), so weight tying, module reuse and forward passes that never see a
backward cannot leave stale per-sample state behind.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from dpgrad.samplers import registry
from dpgrad.backward.backward_pass import BackwardPath
from dpgrad.backward.finite_checks import FiniteCheck
from dpgrad.backward import grad_marks
from dpgrad.backward.fsdp import sharded_modules
from dpgrad.checks.model_checks import validate
from dpgrad.samplers.groups import Record

# Attributes dpgrad (like Opacus) puts on parameters.
PARAM_ATTRS = ("grad_sample", "_forward_counter", "_norm_sample")


class GradSamplePath(BackwardPath):
    """``GradSampleModule``'s path: each layer's per-sample gradients, computed as its record
    comes (as Opacus's hooks do), summed over the uses of each parameter, and promoted to
    ``p.grad_sample`` when the pass ends."""

    TRANSIENT = BackwardPath.TRANSIENT + ("_pass_grads",)

    def _check_layers(self, model: nn.Module) -> None:
        sharded = sharded_modules(model)
        if sharded:
            name = sharded[0][0]
            raise NotImplementedError(
                f"{'layer ' + repr(name) if name else 'the model'} is sharded by FSDP (fully_shard), "
                "which GradSampleModule does not support: FSDP swaps each parameter for an unsharded "
                "copy during forward and backward, so per-sample gradients would land on the copies. "
                "Use dpgrad.GradSampleModuleFastGradientClipping (ghost clipping, which supports "
                "FSDP2), or torch.nn.parallel.DistributedDataParallel."
            )

    def _open_pass(self) -> None:
        self._pass_grads: Dict[nn.Parameter, torch.Tensor] = {}

    def _clear_pass(self) -> None:
        self.__dict__.pop("_pass_grads", None)
        super()._clear_pass()

    def keep(self, record: Record) -> None:
        layer = record.layer
        with torch.no_grad():
            _, inputs, backprops = self.batch_front(record)
            if self.loss_reduction == "mean":
                backprops = backprops * backprops.shape[0]
            grads = self.grad_sampler(layer)(layer, inputs, backprops)
        for p, gs in grads.items():
            if not p.requires_grad:
                continue
            if p in self._pass_grads:
                if self._pass_grads[p].shape != gs.shape:
                    raise ValueError(
                        f"parameter '{self.param_name(p)}' of layer '{self.layer_names[layer]}' "
                        f"got per-sample gradients of shape {tuple(gs.shape)} and "
                        f"{tuple(self._pass_grads[p].shape)} in one backward pass: its uses saw "
                        "different batch sizes"
                    )
                self._pass_grads[p] = self._pass_grads[p] + gs
            else:
                self._pass_grads[p] = gs

    def finish(self) -> None:
        """Promote the pass's per-sample gradients to ``p.grad_sample``: added to those of an
        earlier pass no optimizer step has clipped yet (gradient accumulation; refused under
        Poisson sampling), in place of those a step clipped already (Opacus marks them
        processed), so that a loop calling ``zero_grad()`` only after the real step of a logical
        batch, or never, counts each batch once."""
        grads = self._pass_grads
        for p in grads:
            if _processed(p.grad_sample):
                p.grad_sample = None
        if not self.grad_accumulation_allowed:
            for p in grads:
                if p.grad_sample is not None:
                    raise ValueError(
                        "Poisson sampling is not compatible with grad accumulation: parameter "
                        f"'{self.param_name(p)}' already holds per-sample gradients from an "
                        "earlier backward pass. Call optimizer.step() (or zero_grad()) after every "
                        "forward/backward pass, or use BatchMemoryManager."
                    )
        if self.check_finite and grads:
            # Not finite: the pass's per-sample gradients are replaced by zeros on the device (new
            # tensors: a sampler's output may be a view of tensors autograd still holds), and the
            # next forward pass raises.
            named = list(grads.items())
            check = FiniteCheck([g for _, g in named], lambda: [(self.param_name(p), g) for p, g in named],
                                "gradients", self.finite_reports)
            grads.update(zip(grads, check.zeroed(grads.values())))
            self.finite_reports.add(check)
        for p, gs in grads.items():
            if p.grad_sample is None:
                p.grad_sample = gs
            elif isinstance(p.grad_sample, list):
                p.grad_sample.append(gs)
            else:
                p.grad_sample = [p.grad_sample, gs]


def _processed(grad_sample) -> bool:
    """Whether per-sample gradients were clipped and summed by an optimizer step (Opacus's
    ``_mark_as_processed``)."""
    if isinstance(grad_sample, list):
        return bool(grad_sample) and all(getattr(g, "_processed", False) for g in grad_sample)
    return getattr(grad_sample, "_processed", False)


def _delegated(name: str, doc: str) -> property:
    """A wrapper attribute that is its path's."""
    return property(lambda self: getattr(self._path, name), lambda self, value: setattr(self._path, name, value),
                    doc=doc)


class GradSampleModule(nn.Module):
    """Wraps a module so that each trainable parameter gets ``p.grad_sample`` after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's ``GradSampleModule``.
    A model sharded by FSDP2 is refused (the ghost-clipping wrapper takes it). Every layer with
    trainable parameters is hooked whatever its mode (train or eval), and the model is hooked
    anew at the forward pass after its trainable parameters or its modules changed; a
    parameter reached other than through its layer's hooked calls raises
    ``dpgrad.UnclippedGradientError`` (``dpgrad.checks.guarantee``).

    Args:
        m: the module to wrap.
        batch_first: inputs are ``[B, ...]`` if True, ``[K, B, ...]`` if False.
        loss_reduction: "mean" or "sum", how the loss aggregates over the batch.
        strict: raise on trainable layers that have no per-sample gradients (BatchNorm, an
            Embedding with ``scale_grad_by_freq``); with False such layers are skipped, with a
            warning, and get none.
        force_functorch: compute every layer through torch.func, not the registered samplers.
        check_finite: when a per-sample gradient (or norm) is not finite, replace the pass's
            per-sample gradients (clipped gradients) by zeros on the device, so that nothing
            reaches ``p.grad``, and raise FloatingPointError, naming the parameters, at the next
            forward pass (or at ``raise_if_not_finite()``): no host wait in the step. dpgrad's
            own keyword; pass False to turn the check off.
        check_independence: verify that each sample's rows are its own
            (``dpgrad.checks.independence``): on the first forward pass of each layout with two
            samples or more, backward passes from sets of samples' outputs (about log2 B of
            them) must reach no other sample's rows of any hooked layer, and the model run again
            with the sets' rows changed must not move other samples' outputs, else
            ``SampleMixingError`` names the layers. dpgrad's own keyword; False gives up the
            check (for a model known to be per-sample).
        recheck_independence: dpgrad's own keyword: also probe every this many forward
            passes, whatever the layout (a model whose mixing depends on the data or on a
            flag the graph does not show); None (the default) probes new layouts only.
    """

    batch_first = _delegated("batch_first", "Inputs are [B, ...] if True, [K, B, ...] if False.")
    loss_reduction = _delegated("loss_reduction", '"mean" or "sum": how the loss aggregates over the batch.')
    force_functorch = _delegated("force_functorch", "Every layer through torch.func.")
    strict = _delegated("strict", "Whether trainable layers without per-sample gradients (BatchNorm) are refused "
                                  "(else skipped).")
    check_finite = _delegated("check_finite", "Whether non-finite per-sample values raise.")
    check_independence = _delegated("check_independence", "Whether samples mixed by the model (or the loss) "
                                    "are refused (dpgrad.checks.independence).")
    recheck_independence = _delegated("recheck_independence", "Probe again every this many forward passes "
                                      "(None: new layouts only).")
    hooks_enabled = _delegated("hooks_enabled", "Whether the hooks record (disable_hooks, enable_hooks).")

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        check_finite: bool = True,
        check_independence: bool = True,
        recheck_independence: Optional[int] = None,
    ):
        self._wrap(m, GradSamplePath(m, batch_first=batch_first, loss_reduction=loss_reduction,
                                     check_finite=check_finite, force_functorch=force_functorch, strict=strict,
                                     check_independence=check_independence,
                                     recheck_independence=recheck_independence))

    def _wrap(self, m: nn.Module, path: BackwardPath) -> None:
        """Take ``m`` with ``path`` (built, and the model checked, before it is touched)."""
        super().__init__()
        self._module = m
        self._path = path
        self.grad_accumulation_hook = None
        self._attach()

    grad_accumulation_allowed = _delegated("grad_accumulation_allowed", "Whether a second backward pass may add "
                                           "per-sample gradients before they are cleared.")

    # ------------------------------------------------------------------ module plumbing
    def forward(self, *args, **kwargs):
        # The model's own pre-hook begins the pass (also when the model is called directly).
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

    # ------------------------------------------------------------------ validation
    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> List[NotImplementedError]:
        """Trainable layers dpgrad cannot treat per sample (BatchNorm, an Embedding that scales
        its gradient by frequency).

        Returns the list of errors; raises the first with all of them listed if ``strict``.
        Each error's ``args`` are ``(message, layer_name)``.
        """
        registry.resolve(module)
        return validate(module, strict=strict, sampled=lambda m: type(m) in registry.GRAD_SAMPLERS)

    @classmethod
    def is_supported(cls, module: nn.Module) -> bool:
        """Whether per-sample gradients of ``module``'s own parameters can be computed.

        True for registered layer types and, through torch.func, for any layer without buffers.
        """
        return type(module) in registry.GRAD_SAMPLERS or not list(module.buffers())

    # ------------------------------------------------------------------ hooks
    def _attach(self) -> None:
        self._path.attach(self)
        self._module.autograd_grad_sample_hooks = self._path.handles
        self.autograd_grad_sample_hooks = self._path.handles

    def add_hooks(self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False) -> None:
        """Hook every layer with trainable parameters (Opacus's signature)."""
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        self._path.loss_reduction, self._path.batch_first = loss_reduction, batch_first
        self._path.force_functorch = force_functorch
        self._attach()

    def remove_hooks(self) -> None:
        """Remove every hook ``add_hooks`` put on the model."""
        self._path.detach()
        self.__dict__.pop("autograd_grad_sample_hooks", None)
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            del self._module.autograd_grad_sample_hooks

    def disable_hooks(self) -> None:
        """Turn the hooks off (they stay registered); needed for Opacus's second backward."""
        self._path.hooks_enabled = False

    def enable_hooks(self) -> None:
        """Turn the hooks back on."""
        self._path.hooks_enabled = True

    def raise_if_not_finite(self) -> None:
        """Raise FloatingPointError now if a backward pass since the last report had non-finite
        per-sample values (``check_finite``), waiting for the device to tell: the next forward
        pass raises anyway, once the outcome has reached the host, without waiting. Call it
        after the last step of a run, or where a step must be known good."""
        self._path.finite_reports.raise_pending()

    # ------------------------------------------------------------------ Opacus's methods
    def forbid_grad_accumulation(self) -> None:
        """Raise if a second backward pass adds per-sample gradients before they are cleared."""
        self._path.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        """Let per-sample gradients of several backward passes pile up in a list."""
        self._path.grad_accumulation_allowed = True

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
            grad_marks.clear(self._module.parameters())

    def to_standard_module(self) -> nn.Module:
        """Return the wrapped module with no trace of hooks or per-sample fields."""
        self.cleanup()
        return self._module
