"""``GradSampleModuleFastGradientClipping``: per-sample gradient norms, a drop-in for Opacus's.

Layers with a registered norm sampler (Linear, Embedding, Hugging Face's Conv1D) get their
per-sample gradient norms without materialising per-sample gradients ("ghost clipping");
every other layer gets its per-sample gradients, whose norms are taken at the end of the
backward pass. Opacus's ``DPLossFastGradientClipping`` and ``DPOptimizerFastGradientClipping``
work with it unchanged.

A parameter used more than once (an input embedding tied to the output layer, a layer
called twice) gets the exact norm of its summed per-sample gradient, ``sqrt(sum_i |g_i|^2 +
2 sum_{i<j} <g_i, g_j>)``: each use's norm from its norm sampler, each cross term from the
uses' factors (``registry.register_factor_sampler``), never a per-sample gradient.

``clipped_backward`` (what ``dpgrad.DPLossFastGradientClipping`` calls) does better than
Opacus's protocol. Its norm pass asks autograd only for the gradients of the layer outputs
(``dpgrad.autograd_graph``), so no weight gradient is computed to be thrown away. Then either
a second backward of ``sum_b c_b loss_b`` gives the clipped gradient (double backward, as in
Opacus), or, with ``single_backward=True``, each layer's clipped gradient comes from the
inputs and backprops the norm pass kept ("book-keeping"): the clipped sums of the groups of
``dpgrad.backward_pass``, which holds the hooks, the records and the finish step; this module
is Opacus's interface around it.

A model sharded by FSDP2 (``fully_shard``) is taken in both modes: see ``dpgrad.fsdp``.
"""

from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn as nn

from dpgrad import registry
from dpgrad.backward_pass import KEEP_FOR_CLIPPING, NORMS_ONLY, REENTRANT_CHECKPOINT, ClippingPath
from dpgrad.fsdp import ShardedParameters, sharded_modules
from dpgrad.grad_sample_module import GradSampleModule


class GradSampleModuleFastGradientClipping(ClippingPath, GradSampleModule):
    """Wraps a module so that each trainable parameter gets ``p._norm_sample`` (B,) after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's
    ``GradSampleModuleFastGradientClipping``; see ``GradSampleModule`` for the common
    arguments. ``m`` may be sharded by FSDP2 (``fully_shard`` on its blocks and its root,
    before wrapping): ``p._norm_sample`` is then on the sharded parameters, and the clipped
    gradients reach their shards through FSDP's reduce-scatter (``dpgrad.fsdp``).

    Args:
        max_grad_norm: the clipping bound C of ``get_clipping_coef``.
        use_ghost_clipping: norms without per-sample gradients for layers with a norm sampler;
            with False, every layer's norm comes from its per-sample gradient.
        single_backward: dpgrad's own keyword. One backward pass gives the norms and then the
            clipped gradient ("book-keeping"); the pass must come from
            ``dpgrad.DPLossFastGradientClipping`` or ``clipped_backward``. With False (the
            default) ``clipped_backward`` runs two passes, as Opacus does, and a plain
            backward works as in Opacus.
    """

    NORM_SAMPLERS = registry.NORM_SAMPLERS
    CLIPPED_SUM_SAMPLERS = registry.CLIPPED_SUM_SAMPLERS
    SHARDED_MODELS = True

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        max_grad_norm: float = 1,
        use_ghost_clipping: bool = True,
        check_finite: bool = True,
        single_backward: bool = False,
    ):
        clipping_bound(max_grad_norm)
        # Plain attributes, read by _check_layers before nn.Module.__init__.
        self.use_ghost_clipping = use_ghost_clipping
        self.single_backward = single_backward
        super().__init__(
            m,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            strict=strict,
            force_functorch=force_functorch,
            check_finite=check_finite,
        )
        self.max_grad_norm = max_grad_norm
        self.trainable_parameters = [p for _, p in self._trainable_parameters()]
        self._per_sample_gradient_norms = None
        self._constants: Dict[tuple, torch.Tensor] = {}
        self._init_clipping()

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C: a finite positive number (checked when set)."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._max_grad_norm = clipping_bound(value)

    def _on_rescan(self) -> None:
        self.trainable_parameters = [p for _, p in self._trainable_parameters()]

    def _uses_norm_sampler(self, layer: nn.Module) -> bool:
        # Single backward clips a layer from its norm alone only if it can also sum it clipped.
        kind = type(layer)
        return (
            self.use_ghost_clipping
            and kind in self.NORM_SAMPLERS
            and (not self.single_backward or kind in self.CLIPPED_SUM_SAMPLERS)
        )

    def _check_layers(self, m: nn.Module, force_functorch: bool) -> None:
        # Parameters a ghost-clipped layer shares: their uses' factors are kept for the cross
        # terms. Found here for tied weights, in the forward pass for a layer called twice.
        hooked = dict(self._layers_to_hook(m))
        whole = {layer: force_functorch or type(layer) not in self.GRAD_SAMPLERS for layer in hooked.values()}
        self._shared = self._shared_ghost_parameters(hooked, whole)
        # A model sharded by FSDP2: its parameter groups, checked before the model is touched.
        self._sharded = ShardedParameters.of(m, hooked, whole, {p: n for n, p in m.named_parameters()})

    def _shared_ghost_parameters(self, hooked: Dict[str, nn.Module], whole: Dict[nn.Module, bool]) -> set:
        """Trainable parameters that several hooked layers use, at least one ghost-clipped.

        Raises, before the model is touched, where a shared parameter's norm cannot be exact:
        a ghost-clipped use beside a per-sample-gradient one, or a layer without a factor
        sampler.
        """
        owners: Dict[nn.Parameter, Dict[str, bool]] = {}
        for name, layer in hooked.items():
            for p in layer.parameters(recurse=whole[layer]):
                if p.requires_grad:
                    owners.setdefault(p, {})[name] = self._uses_norm_sampler(layer)
        shared = set()
        for p, layers in owners.items():
            if len(layers) < 2 or not any(layers.values()):
                continue
            names = list(layers)
            if not all(layers.values()):
                raise NotImplementedError(
                    f"layers {names} share one parameter, and ghost clipping takes the norms of "
                    f"{[n for n, g in layers.items() if g]} from norm samplers but of "
                    f"{[n for n, g in layers.items() if not g]} from per-sample gradients, which "
                    "cannot be combined exactly. Untie the parameter, or wrap with "
                    "use_ghost_clipping=False."
                )
            self._check_factors({n: hooked[n] for n in names})
            shared.add(p)
        return shared

    def _check_factors(self, layers: Dict[str, nn.Module]) -> None:
        """Raise unless every one of these layers, which use one parameter, has a factor sampler."""
        missing = {n: type(layer).__name__ for n, layer in layers.items() if type(layer) not in self.FACTOR_SAMPLERS}
        if missing:
            raise NotImplementedError(
                f"layers {list(layers)} use one parameter under ghost clipping, but {missing} have "
                "no factor sampler (dpgrad.register_factor_sampler), so the norm of the summed "
                "gradient cannot be exact. Register one, untie the parameter, or wrap with "
                "use_ghost_clipping=False."
            )

    # ------------------------------------------------------------------ dpgrad's backward
    def clipped_backward(self, loss_per_sample: torch.Tensor) -> None:
        """Add the clipped gradient ``sum_b c_b * grad(loss_b)`` of the last forward pass to ``p.grad``.

        ``loss_per_sample``: (B,), each sample's own loss. ``c_b = min(1, C / (norm_b + 1e-6))``
        from per-sample norms over all trainable parameters (``get_clipping_coef``). ``p.grad``
        ends as Opacus's two-pass protocol leaves it (for either ``loss_reduction``), plus
        what it held before: several calls before one optimizer step accumulate micro-batches,
        each clipped on its own. ``p._norm_sample`` and ``per_sample_gradient_norms`` are set.

        The norm pass computes no weight gradients. Then, with ``single_backward``, the
        clipped gradients come from what that pass kept; otherwise a second backward pass of
        ``sum_b c_b * loss_b`` (hooks disabled) computes them. Raises ValueError for a loss
        that is not (B,) or has no graph, RuntimeError when the loss does not depend on any
        layer this wrapper hooked, ``UnclippedGradientError`` when a trainable parameter would
        get a gradient that is not clipped (``dpgrad.guarantee``).
        """
        if loss_per_sample.dim() != 1:
            raise ValueError(
                f"clipped_backward takes one loss per sample, shape (B,), not {tuple(loss_per_sample.shape)}; "
                "for a loss per token, reduce each sequence first (DPLossFastGradientClipping's shape=)"
            )
        if loss_per_sample.grad_fn is None:
            raise ValueError("the per-sample losses have no autograd graph (computed under torch.no_grad()?)")
        reduced = reduce_losses(loss_per_sample, self.loss_reduction)
        targets = self._edges.targets(reduced.grad_fn)
        if not targets:
            raise RuntimeError(
                "the loss depends on no layer this wrapper hooked: run the forward pass through "
                "the wrapper with hooks enabled and gradients on"
            )
        self._verify_loss(loss_per_sample)
        self._norm_pass = KEEP_FOR_CLIPPING if self.single_backward else NORMS_ONLY
        try:
            try:
                torch.autograd.grad(reduced, targets, retain_graph=not self.single_backward, allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant=True" in str(error):
                    raise RuntimeError(REENTRANT_CHECKPOINT) from error
                raise
            del targets
            self._edges.release()
            coef = self.get_clipping_coef()
            if coef.shape != loss_per_sample.shape:
                raise ValueError(
                    f"{loss_per_sample.shape[0]} losses for a batch of {coef.shape[0]} samples: "
                    "give one loss per sample"
                )
            if self.single_backward:
                self._add_clipped_gradients(coef)
            else:
                self._wait_finite()
                weighted_backward(self, coef, loss_per_sample)
        finally:
            self._norm_pass = None
            self._kept = self._finite = None

    def _add_clipped_gradients(self, coef: torch.Tensor) -> None:
        """``p.grad += sum_b c_b g_b`` for every parameter the norm pass reached.

        The sums are queued first; the host then waits for the norms' finite check (the sums
        go on on the device meanwhile) and only then hands them to ``p.grad``, through
        autograd's own accumulation, in one backward call (``_ClippedGradients``): ``p.grad``
        is set or added to as by any backward pass, with no copy, and the hooks others put on
        parameters run (DistributedDataParallel reduces the gradients there).
        """
        if self._kept is None:
            raise RuntimeError(
                "the norm pass reached no hooked layer (hooks disabled after the forward pass?): "
                "nothing to clip"
            )
        if self._sharded is not None:
            with torch.no_grad():
                self._reduce_scatter_clipped(coef)
            return
        with torch.no_grad():
            held = [self._clipped_sums(coef)]
        self._wait_finite()
        params = list(held[0])
        if params:
            # Only autograd holds the sums when they reach AccumulateGrad: no copy is made.
            out = _ClippedGradients.apply(held.pop, params, *params)
            out.backward(self._constant(1.0, out))

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample gradient norms over all trainable parameters, (B,)."""
        if self._pass_norm is not None and not self._skipped_trainable():
            self.per_sample_gradient_norms = self._pass_norm
            return self._pass_norm
        missing = [p for p in self.trainable_parameters if getattr(p, "_norm_sample", None) is None]
        present = [p._norm_sample for p in self.trainable_parameters if getattr(p, "_norm_sample", None) is not None]
        if missing and not present:
            raise RuntimeError(
                "no per-sample gradient norms yet: run forward and backward (with hooks enabled) "
                "before get_norm_sample / get_clipping_coef"
            )
        # A parameter no hook sees has an unknown norm, not a zero one.
        skipped = [self._param_names.get(p) for p in missing if p in self._unhooked]
        if skipped:
            raise RuntimeError(
                f"parameters {skipped} belong to layers skipped under strict=False and have no "
                "per-sample norm, so their gradients cannot be clipped. Freeze them "
                "(requires_grad_(False)) or replace those layers."
            )
        device = present[0].device
        # A trainable parameter the last backward did not reach has a zero gradient.
        stacked = torch.stack(
            [n.to(device) for n in present] + [torch.zeros_like(present[0]) for _ in missing], dim=0
        )
        norm_sample = stacked.norm(2, dim=0)
        self.per_sample_gradient_norms = norm_sample
        return norm_sample

    def _skipped_trainable(self) -> bool:
        return any(p.requires_grad for p in self._unhooked)

    def get_clipping_coef(self) -> torch.Tensor:
        """Per-sample clipping factors ``min(1, C / (norm + 1e-6))``, (B,) (Opacus's formula)."""
        norm_sample = self.get_norm_sample()
        return (self.max_grad_norm / (norm_sample + 1e-6)).clamp(max=1.0)

    def _constant(self, value: float, like: torch.Tensor) -> torch.Tensor:
        """``value`` as a 0-d tensor like ``like``, made once (not an operation every step)."""
        key = (value, like.dtype, like.device)
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return found

    @property
    def per_sample_gradient_norms(self) -> torch.Tensor:
        """Per-sample gradient norms of the last ``get_norm_sample``; not private, for debugging."""
        if self._per_sample_gradient_norms is None:
            raise AttributeError(
                "per_sample_gradient_norms is not set: run forward and backward, then "
                "get_norm_sample() or get_clipping_coef()"
            )
        return self._per_sample_gradient_norms

    @per_sample_gradient_norms.setter
    def per_sample_gradient_norms(self, value: torch.Tensor) -> None:
        self._per_sample_gradient_norms = value


def clipping_bound(value, what: str = "max_grad_norm") -> float:
    """``value`` as a float if it is a finite positive number (a clipping bound), else raise
    ValueError: a negative bound would make the coefficients negative (gradient ascent), and a
    NaN or infinite one would put NaN in, or take the clipping out of, every gradient."""
    try:
        if isinstance(value, (bool, str)) or (isinstance(value, torch.Tensor) and value.numel() != 1):
            raise TypeError(value)
        bound = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a finite positive number (the clipping bound C), not {value!r}") from None
    if not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"{what} must be a finite positive number (the clipping bound C), not {bound}")
    return bound


def reduce_losses(loss_per_sample: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    """The batch's loss from per-sample losses (B,): their mean or their sum."""
    return loss_per_sample.mean(dim=0) if loss_reduction == "mean" else loss_per_sample.sum(dim=0)


def weighted_backward(module, coef: torch.Tensor, loss_per_sample: torch.Tensor) -> None:
    """The second pass of Opacus's protocol: backward of ``sum_b c_b loss_b`` with ``module``'s
    hooks off, which adds ``sum_b c_b grad(loss_b)`` to ``p.grad``."""
    module.disable_hooks()
    try:
        (coef.to(loss_per_sample.device) * loss_per_sample).sum().backward()
    finally:
        module.enable_hooks()


class _ClippedGradients(torch.autograd.Function):
    """A node whose backward hands the parameters their clipped gradients.

    ``compute()`` gives the sums (popped from where they were held), so autograd alone holds
    them when they reach the parameters, and a missing ``p.grad`` takes the tensor itself
    rather than a copy.
    """

    @staticmethod
    def forward(ctx, compute, params, *tensors):
        ctx.compute, ctx.params = compute, params
        return tensors[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        sums = ctx.compute()
        ctx.compute = None
        return (None, None, *(sums.pop(p, None) for p in ctx.params))


class GradSampleModuleFastGradientClippingFSDP(GradSampleModuleFastGradientClipping):
    """Opacus 1.6's name and constructor for ghost clipping of a model sharded by FSDP2.

    ``GradSampleModuleFastGradientClipping`` on ``m``, which must be sharded by ``fully_shard``
    (on its blocks and its root) already, with ghost clipping always on, as in Opacus. Unlike
    Opacus's, it takes tied parameters and ``single_backward=True``, and its norms are on
    ``p._norm_sample`` of the sharded parameters.
    """

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = True, max_grad_norm: float = 1, check_finite: bool = True,
                 single_backward: bool = False):
        if not sharded_modules(m):
            raise ValueError(
                "GradSampleModuleFastGradientClippingFSDP takes a model sharded by FSDP2: call "
                "fully_shard on its blocks and its root first, or use GradSampleModuleFastGradientClipping"
            )
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                         max_grad_norm=max_grad_norm, use_ghost_clipping=True, check_finite=check_finite,
                         single_backward=single_backward)
