"""``DPLossFastGradientClipping``: the loss wrapper of ghost clipping, with Opacus 1.6's signature.

The criterion gives one loss per sample; ``backward()`` on the result leaves in ``p.grad`` the
clipped gradient ``sum_b c_b * grad(loss_b)``. With dpgrad's
``GradSampleModuleFastGradientClipping`` it calls the wrapper's ``clipped_backward``: one
backward pass with ``single_backward=True``, else a norm pass that computes no weight
gradients and the second pass of Opacus's protocol. Gradients accumulate over several
backward calls (micro-batches) until the optimizer clears them. With Opacus's own wrapper it
runs Opacus's protocol, unchanged. Opacus's ``DPOptimizerFastGradientClipping`` then adds the
noise and takes the step, and its accountant counts it.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Optional

import torch

from dpgrad.backward.autograd_graph import eager_when_compiled
from dpgrad.clipping.coefficients import clipping_bound, reduce_losses
from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.checks.forward_probe import copied, perturbed
from dpgrad.hooks import GradSampleHooksFastGradientClipping

REDUCTIONS = ("mean", "sum")


def clipping_wrapper(module):
    """The ghost-clipping wrapper in ``module``: itself, or the one inside a
    ``DistributedDataParallel``, a ``torch.compile`` of it, or any wrapper that keeps it as
    ``.module`` or ``._orig_mod``; for a hooks object (``dpgrad.hooks``), the wrapper it holds."""
    if isinstance(module, GradSampleHooksFastGradientClipping):
        return module.wrapper
    found = module
    while not isinstance(found, GradSampleModuleFastGradientClipping):
        inner = found.__dict__.get("_modules", {}).get("_orig_mod")  # torch.compile's OptimizedModule
        if inner is None:
            inner = getattr(found, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        found = inner
    if isinstance(found, GradSampleModuleFastGradientClipping):
        return found
    # Another wrapper with Opacus's interface (Opacus's own), possibly inside others.
    found = module
    while not hasattr(found, "get_clipping_coef") and isinstance(getattr(found, "module", None), torch.nn.Module):
        found = found.module
    return found if hasattr(found, "get_clipping_coef") else module


def check_bounds(wrapper, optimizer) -> None:
    """Raise ValueError unless the optimizer adds noise for the bound the module clips to: the
    noise's scale is ``noise_multiplier * max_grad_norm`` of the optimizer, and a sample moves
    the gradient by up to the module's ``max_grad_norm``."""
    bound = getattr(optimizer, "max_grad_norm", None)
    clips = getattr(wrapper, "max_grad_norm", None)
    if bound is None or clips is None:
        return
    bound = clipping_bound(bound, "the optimizer's max_grad_norm")
    if bound != clips:
        raise ValueError(
            f"the module clips at max_grad_norm={clips} but the optimizer adds noise for "
            f"max_grad_norm={bound}: the noise must be scaled to the bound each sample's gradient "
            "is clipped to. Give both the same max_grad_norm."
        )


def weighted_backward(module, coef: torch.Tensor, loss_per_sample: torch.Tensor) -> None:
    """The second pass of Opacus's protocol with Opacus's own wrapper: backward of
    ``sum_b c_b loss_b`` with ``module``'s hooks off, which adds ``sum_b c_b grad(loss_b)`` to
    ``p.grad``."""
    module.disable_hooks()
    try:
        (coef.to(loss_per_sample.device) * loss_per_sample).sum().backward()
    finally:
        module.enable_hooks()


def _first_dim(args, kwargs) -> Optional[int]:
    """The first dimension of the criterion's first tensor argument (its outputs)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    return None


def _check_one_loss_per_sample(loss_per_sample: torch.Tensor, batch: Optional[int], shape, source=None,
                               batch_dim: int = 0) -> None:
    """Refuse, where the criterion is called, losses that are not one per sample of the last
    forward pass's batch (``batch``; None where it is not known; ``source``: the layer name and
    input shape it was read from), naming the fix."""
    if batch is None or loss_per_sample.shape == (batch,):
        return
    got = tuple(loss_per_sample.shape)
    if loss_per_sample.dim() == 1 and got[0] > batch and got[0] % batch == 0 and shape is None:
        raise ValueError(
            f"the criterion gave {got[0]} losses for a batch of {batch} samples: one per token, from outputs "
            f"flattened to (B*T, ...). Give the outputs' shape before flattening, so that each sequence's loss "
            f"is its sample's: criterion(logits.reshape(-1, V), labels.reshape(-1), shape=logits.shape[:2]); "
            f"or use a criterion that returns one loss per sample")
    seen = ""
    if source is not None and got[:1] != (batch,):  # not even a leading size of the batch's
        seen = (f" (the batch size along dimension {batch_dim} of the input of layer '{source[0]}', of shape "
                f"{source[1]}, the first layer called; a model whose input holds the batch along dimension 1, "
                f"(T, B, ...), is wrapped with batch_first=False, while layers that take it so inside a batch-first "
                f"model are found by dpgrad)")
    raise ValueError(
        f"the criterion gave losses of shape {got} for a batch of {batch} samples{seen}: give one loss per sample, "
        f"shape ({batch},) (for a loss per token, pass shape=(B, T) of the outputs before they were flattened)")


def _from_grad_scaler() -> bool:
    """Whether the caller's caller is ``torch.amp.GradScaler.scale`` multiplying a loss by its
    scale (the frames between are torch's own dispatch, at most two)."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code is _GRAD_SCALER_SCALE:
            return True
        frame = frame.f_back
    return False


_GRAD_SCALER_SCALE = torch.amp.GradScaler.scale.__code__


class DPTensorFastGradientClipping(torch.Tensor):
    """Per-sample losses (B,) whose ``backward()`` is the clipped backward of ghost clipping.

    A 0-d tensor holding the batch's loss (the mean or sum of the per-sample losses; in a padded
    batch, over its sampled samples), so that what loops do with a loss works: ``item()``,
    ``float()``, ``f"{loss:.3f}"``, ``torch.isfinite(loss)``, ``loss.detach()``, ``copy.deepcopy``
    and pickling (plain tensors); ``loss.mean()``, ``loss.sum()``, ``loss.clone()`` are the loss.
    Scalar arithmetic (``loss / k``, ``w * loss``, ``loss + other``...) applies to every sample's
    loss and gives another such loss. ``scaler.scale(loss)`` (a ``torch.amp.GradScaler``)
    gives the loss scaled for mixed precision: its backward clips the norms of the unscaled
    gradients and leaves the clipped gradient times the scale in ``p.grad``, which
    ``scaler.step(optimizer)`` removes (``loss_scale`` holds it).
    """

    loss_per_sample: torch.Tensor

    @staticmethod
    def __new__(cls, module, optimizer, loss_per_sample: torch.Tensor, loss_reduction: str = "mean",
                weights: Optional[torch.Tensor] = None, *args, **kwargs):
        with torch.no_grad():  # (no graph: the value alone)
            if weights is not None and loss_reduction == "mean":
                # On the device (what a step captured in a CUDA graph returns follows each batch).
                value = loss_per_sample.sum() / weights.sum().clamp(min=1)
            else:
                value = reduce_losses(loss_per_sample, loss_reduction)
        return torch.Tensor._make_subclass(cls, value, False)

    def __init__(self, module, optimizer, loss_per_sample: torch.Tensor, loss_reduction: str = "mean",
                 weights: Optional[torch.Tensor] = None):
        self.module = module
        self.optimizer = optimizer
        self.loss_per_sample = loss_per_sample
        self.loss_reduction = loss_reduction
        self.weights = weights  # a padded batch's loss weights (1: sampled, 0: padding)
        self.loss_scale: Optional[torch.Tensor] = None  # a GradScaler's scale the losses carry

    def _with(self, loss_per_sample: torch.Tensor) -> "DPTensorFastGradientClipping":
        return DPTensorFastGradientClipping(self.module, self.optimizer, loss_per_sample, self.loss_reduction,
                                            self.weights)

    def _derived(self, loss_per_sample: torch.Tensor, scale=None) -> "DPTensorFastGradientClipping":
        new = self._with(loss_per_sample)
        new.loss_scale = self.loss_scale if scale is None else \
            scale if self.loss_scale is None else self.loss_scale * scale
        return new

    def _other(self, other):
        if isinstance(other, DPTensorFastGradientClipping):
            if other.loss_reduction != self.loss_reduction:
                raise ValueError(
                    f"cannot combine losses reduced by {self.loss_reduction!r} and {other.loss_reduction!r}"
                )
            if (other.loss_scale is None) != (self.loss_scale is None):
                raise ValueError("cannot combine a loss scaled by a GradScaler with one that is not: scale their "
                                 "sum once, scaler.scale(loss + other)")
            return other.loss_per_sample
        return other

    @classmethod
    @eager_when_compiled  # (traced, a subclass's own dispatch would recurse in the compiler)
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arithmetic = _ARITHMETIC.get(func)
        if arithmetic is not None and kwargs.keys() <= {"alpha"} and isinstance(args[0], cls) and len(args) <= 2:
            if func in _MULTIPLY and len(args) == 2 and isinstance(args[1], torch.Tensor) and _from_grad_scaler():
                self, scale = args  # a GradScaler's loss scale, removed by scaler.step before the noise
                return self._derived(self.loss_per_sample * scale, scale=scale)
            return arithmetic(*args, **kwargs)
        if func in _ITSELF and len(args) == 1 and not kwargs and isinstance(args[0], cls):
            return args[0]._derived(args[0].loss_per_sample)  # the batch's loss is a scalar: mean() is itself
        if func is torch.autograd.backward and len(args) == 1 and isinstance(args[0], cls) and not kwargs:
            return args[0].backward()
        # Anything else on the batch's loss, as on a plain tensor (what it returns is plain).
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @eager_when_compiled  # (traced, a compiler's graph would run it on the subclass without its dispatch)
    def detach(self) -> torch.Tensor:
        """The batch's loss (mean or sum over samples; in a padded batch, over its sampled
        samples), detached, as a plain tensor."""
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.detach(self)

    def __repr__(self, *args, **kwargs) -> str:
        return (
            f"DPTensorFastGradientClipping(loss_reduction={self.loss_reduction}, "
            f"shape={tuple(self.loss_per_sample.shape)})"
        )

    def __str__(self) -> str:
        return f"DPTensorFastGradientClipping({self.item():.4f})"

    def __format__(self, spec: str) -> str:
        return self.item().__format__(spec)

    def __reduce_ex__(self, protocol):
        return self.detach().__reduce_ex__(protocol)  # a saved loss is its value

    def __deepcopy__(self, memo):
        return self.detach().clone()  # as saved: its value

    @eager_when_compiled
    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
        """Add ``sum_b c_b * grad(loss_b)`` to ``p.grad`` (see the module docstring)."""
        if gradient is not None or create_graph or inputs is not None:
            raise ValueError("the clipped backward of dpgrad's loss takes no gradient, create_graph or inputs")
        wrapper = clipping_wrapper(self.module)
        check_bounds(wrapper, self.optimizer)
        if isinstance(wrapper, GradSampleModuleFastGradientClipping):
            wrapper.clipped_backward(self.loss_per_sample, loss_scale=self.loss_scale, optimizer=self.optimizer)
            return
        if self.loss_scale is not None:
            raise ValueError("loss scaling (a GradScaler) takes dpgrad's GradSampleModuleFastGradientClipping, whose "
                             "norms are of the unscaled gradients; Opacus's wrapper would clip the scaled ones")
        # Another wrapper with Opacus's interface (Opacus's own): Opacus's protocol, whose first
        # pass also fills p.grad, cleared before the second.
        reduce_losses(self.loss_per_sample, self.loss_reduction).backward(retain_graph=True)
        self.optimizer.zero_grad()
        weighted_backward(wrapper, wrapper.get_clipping_coef(), self.loss_per_sample)


def _add(self, other, alpha=1):
    return self._derived(self.loss_per_sample + alpha * self._other(other))


def _sub(self, other, alpha=1):
    return self._derived(self.loss_per_sample - alpha * self._other(other))


def _rsub(self, other):
    return self._derived(self._other(other) - self.loss_per_sample)


def _mul(self, other):
    return self._derived(self.loss_per_sample * self._other(other))


def _div(self, other):
    return self._derived(self.loss_per_sample / self._other(other))


def _neg(self):
    return self._derived(-self.loss_per_sample)


_T = torch.Tensor
# The operations that apply to every sample's loss; an in-place one gives a new loss too.
_ARITHMETIC = {
    **dict.fromkeys([_T.__add__, _T.__radd__, _T.__iadd__, _T.add, _T.add_, torch.add], _add),
    **dict.fromkeys([_T.__sub__, _T.__isub__, _T.sub, _T.sub_, torch.sub], _sub),
    _T.__rsub__: _rsub,
    **dict.fromkeys([_T.__mul__, _T.__rmul__, _T.__imul__, _T.mul, _T.mul_, torch.mul], _mul),
    **dict.fromkeys([_T.__truediv__, _T.__itruediv__, _T.div, _T.div_, torch.div, _T.true_divide,
                      torch.true_divide], _div),
    **dict.fromkeys([_T.__neg__, _T.neg, _T.neg_, torch.neg], _neg),
}
_MULTIPLY = {_T.__mul__, _T.__rmul__, _T.mul, torch.mul}
# What gives a scalar itself (``loss.mean()`` in a loop written for losses of several devices).
_ITSELF = {_T.mean, torch.mean, _T.sum, torch.sum, _T.clone, torch.clone, _T.squeeze, torch.squeeze, _T.contiguous}


class DPLossFastGradientClipping:
    """Wraps a criterion so that it returns per-sample losses ready for clipped backward.

    Opacus 1.6's signature and behaviour.

    Args:
        module: ``dpgrad.GradSampleModuleFastGradientClipping`` (or Opacus's), possibly inside
            ``torch.nn.parallel.DistributedDataParallel``, or a
            ``dpgrad.GradSampleHooksFastGradientClipping`` (the model left unwrapped).
        optimizer: the DP optimizer (Opacus's ``DPOptimizerFastGradientClipping``); its
            ``loss_reduction`` must match.
        criterion: a loss with a ``reduction`` attribute (set to the module's if missing),
            e.g. ``nn.CrossEntropyLoss``; it is called with ``reduction="none"``.
        loss_reduction: "mean" or "sum", the same as the module's, the optimizer's and the
            criterion's.
        batches: dpgrad's own keyword: the ``dpgrad.batches.FixedShapeBatches`` the batches
            come from (``dpgrad.opacus.make_private(physical_batch_size=...)`` passes it), whose
            padded samples get a loss weight of exactly zero.
    """

    def __init__(self, module, optimizer, criterion, loss_reduction: str = "mean", batches=None):
        if loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction = {loss_reduction!r}: use 'mean' or 'sum'")
        wrapper = clipping_wrapper(module)
        if not hasattr(criterion, "reduction"):
            criterion.reduction = wrapper.loss_reduction
        found = {
            "loss_reduction": loss_reduction,
            "criterion.reduction": criterion.reduction,
            "module.loss_reduction": wrapper.loss_reduction,
        }
        if hasattr(optimizer, "loss_reduction"):
            found["optimizer.loss_reduction"] = optimizer.loss_reduction
        if len(set(found.values())) > 1:
            raise ValueError(
                "the module, the optimizer, the criterion and DPLossFastGradientClipping must "
                f"reduce the loss the same way; got {found}"
            )
        check_bounds(wrapper, optimizer)
        self.module = module
        self.optimizer = optimizer
        self.criterion = criterion
        self.loss_reduction = loss_reduction
        self.batches = batches

    @eager_when_compiled
    def __call__(self, *args, shape=None, **kwargs) -> DPTensorFastGradientClipping:
        """The criterion's per-sample losses, wrapped.

        ``shape``: the (B, T, ...) shape of the outputs before they were flattened to
        (B*T, ...) for a token-level criterion (e.g. language-model logits (B, T, V)); each
        sequence is then one sample, its loss the mean over its tokens (those not equal to the
        criterion's ``ignore_index``, when it has one) or, under "sum", their sum.
        """
        loss_per_sample = self._losses(args, kwargs, shape)
        wrapper = clipping_wrapper(self.module)
        if self.batches is None:  # (a padded batch's losses are checked against its size below)
            path = getattr(wrapper, "_path", None)
            _check_one_loss_per_sample(loss_per_sample, getattr(path, "_forward_batch", None), shape,
                                       getattr(path, "_batch_from", None), getattr(path, "batch_dim", 0))
        if isinstance(wrapper, GradSampleModuleFastGradientClipping) and wrapper.check_independence:
            # For the loss's forward probe (dpgrad.checks.forward_probe), run where it is due.
            modules = [self.criterion] if isinstance(self.criterion, torch.nn.Module) else []
            wrapper._path.note_loss(loss_per_sample, partial(self._moved, args, kwargs, shape), modules)
        weights = None
        if self.batches is not None:
            if loss_per_sample.shape != (self.batches.size,):
                raise ValueError(
                    f"{tuple(loss_per_sample.shape)} losses for a physical batch of {self.batches.size} "
                    "samples: give one loss per sample (for a loss per token, pass shape=)"
                )
            # A padded sample's loss weighs exactly zero: it adds nothing to the gradient.
            weights = self.batches.weights(loss_per_sample)
            loss_per_sample = loss_per_sample * weights
        return DPTensorFastGradientClipping(self.module, self.optimizer, loss_per_sample, self.loss_reduction,
                                            weights)

    def _losses(self, args, kwargs, shape) -> torch.Tensor:
        """The criterion's per-sample losses (per sequence, with ``shape``)."""
        old = self.criterion.reduction
        self.criterion.reduction = "none"
        try:
            loss_per_sample = self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = old
        if shape is not None and loss_per_sample.shape[0] == shape[0] * shape[1]:
            loss_per_sample = self._per_sequence(loss_per_sample.view(shape[0], shape[1]), args, kwargs)
        return loss_per_sample

    def _moved(self, args, kwargs, shape, rows, generator) -> torch.Tensor:
        """The per-sample losses with the criterion's arguments changed on the samples of
        ``rows`` (a ``dpgrad.checks.independence.RowSet``; None: unchanged): the outputs (the first
        argument) get random values added (``dpgrad.checks.forward_probe.perturbed``), every other
        tensor whose first dimension is the batch's (B, or B * T tokens with ``shape``), the
        targets, takes another sample's values on those rows (``copied``: values the batch
        holds, whatever they encode)."""
        if rows is None:
            return self._losses(args, kwargs, shape)
        batch = shape[0] if shape is not None else _first_dim(args, kwargs)
        tokens = batch * shape[1] if shape is not None else None

        def move(value, outputs: bool):
            if not isinstance(value, torch.Tensor) or not value.dim():
                return value
            per = 1 if value.shape[0] == batch else shape[1] if value.shape[0] == tokens else None
            if per is None:
                return value
            if outputs and value.is_floating_point():
                return perturbed(value, rows.mask(value.device), 0, generator(value.device), samples_of=per)
            return copied(value, rows, samples_of=per)

        moved = tuple(move(a, i == 0) for i, a in enumerate(args))
        return self._losses(moved, {k: move(v, k == "input" and not args) for k, v in kwargs.items()}, shape)

    def _per_sequence(self, token_losses: torch.Tensor, args, kwargs) -> torch.Tensor:
        if self.loss_reduction == "sum":
            return token_losses.sum(dim=1)
        ignore_index = getattr(self.criterion, "ignore_index", None)
        targets: Optional[torch.Tensor] = kwargs.get("target", args[1] if len(args) >= 2 else None)
        if ignore_index is None or targets is None:
            return token_losses.mean(dim=1)
        # Ignored positions have a zero loss; they must not count in the mean either.
        counted = (targets.view(token_losses.shape) != ignore_index).sum(dim=1).clamp(min=1)
        return token_losses.sum(dim=1) / counted
