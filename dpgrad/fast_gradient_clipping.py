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
inputs and backprops the norm pass kept ("book-keeping"): the clipped-sum samplers for
Linear and Embedding, ``sum_b c_b g_b`` of the per-sample gradients for every other layer.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad import registry
from dpgrad.autograd_graph import lowest_marked_edges, mark_output
from dpgrad.backend import ops_for
from dpgrad.grad_sample_module import GradSampleModule
from dpgrad.kernels.reference import accumulation_dtype

# What a norm pass does with the layers' inputs and backprops besides taking norms.
NORMS_ONLY, KEEP_FOR_CLIPPING = "norms", "keep"


class GradSampleModuleFastGradientClipping(GradSampleModule):
    """Wraps a module so that each trainable parameter gets ``p._norm_sample`` (B,) after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's
    ``GradSampleModuleFastGradientClipping``; see ``GradSampleModule`` for the common
    arguments.

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
    FACTOR_SAMPLERS = registry.FACTOR_SAMPLERS

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
        # Squared norms of the ghost-clipped parameters, and the factors of shared ones' uses.
        self._pass_sq: Dict[nn.Parameter, torch.Tensor] = {}
        self._pass_factors: Dict[nn.Parameter, list] = {}
        # Marks this wrapper's layer outputs in the autograd graph (dpgrad.autograd_graph).
        self._output_mark = object()
        self._norm_pass: Optional[str] = None  # NORMS_ONLY or KEEP_FOR_CLIPPING during clipped_backward
        self._pass_kept: List[Tuple[nn.Module, list, torch.Tensor]] = []  # (layer, activations, backprops)
        self._to_clip: Optional[Tuple[list, Dict[nn.Parameter, torch.Tensor]]] = None

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
        self._shared = self._shared_ghost_parameters(m, force_functorch)

    def _shared_ghost_parameters(self, m: nn.Module, force_functorch: bool) -> set:
        """Trainable parameters that several hooked layers use, at least one ghost-clipped.

        Raises, before the model is touched, where a shared parameter's norm cannot be exact:
        a ghost-clipped use beside a per-sample-gradient one, or a layer without a factor
        sampler.
        """
        owners: Dict[nn.Parameter, Dict[str, bool]] = {}
        hooked = dict(self._layers_to_hook(m))
        for name, layer in hooked.items():
            whole = force_functorch or type(layer) not in self.GRAD_SAMPLERS
            for p in layer.parameters(recurse=whole):
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

    def forward(self, *args, **kwargs):
        if self.hooks_enabled and self.training and torch.is_grad_enabled():
            for p in self.trainable_parameters:
                p._norm_sample = None
        return super().forward(*args, **kwargs)

    def _on_forward(self, layer: nn.Module, name: str, params: List[nn.Parameter], out: torch.Tensor) -> None:
        if self._uses_norm_sampler(layer) and layer in self._forward_seen and not self._shared.issuperset(params):
            # Called twice: from now on its parameters' uses are combined by their factors.
            self._check_factors({name: layer})
            self._shared.update(params)
        super()._on_forward(layer, name, params, out)
        mark_output(out, self._output_mark)

    def _process_layer(self, layer: nn.Module, activations: list, backprops: torch.Tensor) -> None:
        if self.single_backward and self._norm_pass is None:
            raise RuntimeError(
                f"layer '{self._layer_names[layer]}': this wrapper has single_backward=True, so its "
                "backward pass must come from dpgrad.DPLossFastGradientClipping (loss.backward() "
                "on what it returns) or wrapper.clipped_backward(per_sample_losses). A plain "
                "backward would leave unclipped gradients in p.grad; Opacus's "
                "DPLossFastGradientClipping needs single_backward=False."
            )
        if not self._uses_norm_sampler(layer):
            return super()._process_layer(layer, activations, backprops)
        norms = self.NORM_SAMPLERS[type(layer)](layer, activations, backprops)
        factors = None
        for p, norm in norms.items():
            if not p.requires_grad:
                continue
            sq = norm.to(accumulation_dtype(norm)).square()
            if p in self._shared:
                if factors is None:
                    factors = self.FACTOR_SAMPLERS[type(layer)](layer, activations, backprops)
                mine = factors[p]
                ops = ops_for(*(t for t in mine if t.is_floating_point()))
                for earlier in self._pass_factors.get(p, ()):
                    sq = sq + 2 * ops.outer_sum_inner(*earlier, *mine)
                self._pass_factors.setdefault(p, []).append(mine)
            elif p in self._pass_sq:
                raise NotImplementedError(
                    f"parameter '{self._param_names.get(p)}' of layer '{self._layer_names[layer]}' "
                    "received two gradient contributions in one backward pass (several forward "
                    "passes before one backward); ghost clipping combines the uses of one forward "
                    "pass only. Run backward after every forward pass."
                )
            self._pass_sq[p] = sq if p not in self._pass_sq else self._pass_sq[p] + sq
        if self._norm_pass == KEEP_FOR_CLIPPING:
            self._pass_kept.append((layer, activations, backprops))

    def _begin_pass(self) -> None:
        # Norms belong to one backward pass: a parameter this pass does not reach has a zero
        # gradient in it, whatever an earlier pass (of another forward) left.
        for p in self.trainable_parameters:
            p._norm_sample = None

    def _abort_pass(self) -> None:
        super()._abort_pass()
        self._pass_sq = {}
        self._pass_factors = {}
        self._pass_kept = []

    def _finish_pass(self, params: List[nn.Parameter]) -> None:
        # Rounding can take the square of an exact zero (opposite uses) slightly below it.
        norms = {p: sq.clamp_min(0).sqrt() for p, sq in self._pass_sq.items()}
        grad_samples = {p: p._current_grad_sample for p in params}
        for p, gs in grad_samples.items():
            norms[p] = torch.linalg.vector_norm(gs.flatten(1), dim=1, dtype=accumulation_dtype(gs))
        self._check_finite(norms, "gradient norms")
        for p, norm in norms.items():
            p._norm_sample = norm
            p.grad_sample = None
        if self._norm_pass == KEEP_FOR_CLIPPING:
            self._to_clip = (self._pass_kept, grad_samples)
            self._pass_kept = []

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
        layer this wrapper hooked in training mode.
        """
        if loss_per_sample.dim() != 1:
            raise ValueError(
                f"clipped_backward takes one loss per sample, shape (B,), not {tuple(loss_per_sample.shape)}; "
                "for a loss per token, reduce each sequence first (DPLossFastGradientClipping's shape=)"
            )
        if loss_per_sample.grad_fn is None:
            raise ValueError("the per-sample losses have no autograd graph (computed under torch.no_grad()?)")
        reduced = reduce_losses(loss_per_sample, self.loss_reduction)
        targets = lowest_marked_edges(reduced.grad_fn, self._output_mark)
        if not targets:
            raise RuntimeError(
                "the loss depends on no layer this wrapper hooked: run the forward pass through "
                "the wrapper, in training mode, with hooks enabled and gradients on"
            )
        self._norm_pass = KEEP_FOR_CLIPPING if self.single_backward else NORMS_ONLY
        try:
            torch.autograd.grad(reduced, targets, retain_graph=not self.single_backward, allow_unused=True)
        finally:
            self._norm_pass = None
        try:
            coef = self.get_clipping_coef()
            if coef.shape != loss_per_sample.shape:
                raise ValueError(
                    f"{loss_per_sample.shape[0]} losses for a batch of {coef.shape[0]} samples: "
                    "give one loss per sample"
                )
            if self.single_backward:
                self._add_clipped_gradients(coef)
            else:
                weighted_backward(self, coef, loss_per_sample)
        finally:
            self._to_clip = None

    def _add_clipped_gradients(self, coef: torch.Tensor) -> None:
        """``p.grad += sum_b c_b g_b`` for every parameter of the kept pass, freeing as it goes.

        The sums reach ``p.grad`` through autograd's own accumulation, in one backward call
        (``_ClippedGradients``): ``p.grad`` is set or added to as by any backward pass, with
        no copy, and the hooks others put on parameters run (DistributedDataParallel reduces
        the gradients there).
        """
        if self._to_clip is None:
            raise RuntimeError(
                "the norm pass reached no hooked layer (hooks disabled after the forward pass?): "
                "nothing to clip"
            )
        layers, grad_samples = self._to_clip
        params = list(dict.fromkeys([p for layer, _, _ in layers for p in self._layer_params(layer)] + list(grad_samples)))

        def contributions():
            # Popped as they go: each layer's inputs and backprops are freed once summed.
            while layers:
                layer, activations, backprops = layers.pop()
                yield from self.CLIPPED_SUM_SAMPLERS[type(layer)](layer, activations, backprops, coef).items()
            while grad_samples:
                p, gs = grad_samples.popitem()
                acc = accumulation_dtype(gs)
                yield p, (coef.to(device=gs.device, dtype=acc) @ gs.flatten(1).to(acc)).view(p.shape).to(p.dtype)

        def clipped_sums() -> Dict[nn.Parameter, torch.Tensor]:
            sums: Dict[nn.Parameter, torch.Tensor] = {}
            for p, g in contributions():  # a parameter used twice gets both uses' sums
                sums[p] = g if p not in sums else sums[p] + g
            return sums

        if params:
            _ClippedGradients.apply(clipped_sums, params, *params).backward()

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample gradient norms over all trainable parameters, (B,)."""
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

    def get_clipping_coef(self) -> torch.Tensor:
        """Per-sample clipping factors ``min(1, C / (norm + 1e-6))``, (B,) (Opacus's formula)."""
        norm_sample = self.get_norm_sample()
        return (self.max_grad_norm / (norm_sample + 1e-6)).clamp(max=1.0)

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

    Computed inside backward, the sums are held by autograd alone when they reach the
    parameters, so a missing ``p.grad`` takes the tensor itself rather than a copy.
    """

    @staticmethod
    def forward(ctx, compute, params, *tensors):
        ctx.compute, ctx.params = compute, params
        return tensors[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        sums = ctx.compute()
        return (None, None, *(sums.get(p) for p in ctx.params))
