"""``GradSampleModuleFastGradientClipping``: per-sample gradient norms, a drop-in for Opacus's.

Layers with a registered norm sampler (Linear, Embedding) get their per-sample gradient norms
without materialising per-sample gradients ("ghost clipping"); every other layer gets its
per-sample gradients, whose norms are taken at the end of the backward pass. Opacus's
``DPLossFastGradientClipping`` and ``DPOptimizerFastGradientClipping`` work with it unchanged.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn

from dpgrad import registry
from dpgrad.grad_sample_module import GradSampleModule


def _refuse_tied(m: nn.Module) -> None:
    """Raise before touching ``m`` if a trainable parameter is shared by a ghost-clipped layer."""
    # One module registered under two names is hooked once, so it is not tying.
    owners: Dict[nn.Parameter, Dict[nn.Module, str]] = {}
    ghost = set()
    for name, layer in m.named_modules(remove_duplicate=False):
        for p in layer.parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(p, {}).setdefault(layer, name)
                if type(layer) in registry.NORM_SAMPLERS:
                    ghost.add(p)
    for p, layers in owners.items():
        names = list(layers.values())
        if len(names) > 1 and p in ghost:
            raise NotImplementedError(
                f"parameter tying is not supported with ghost clipping: layers {names} share one "
                "parameter (tied input and output embeddings?), and the norm of its per-sample "
                "gradient is not the sum of the layers' norms. Untie it, e.g. "
                "`lm_head.weight = nn.Parameter(lm_head.weight.detach().clone())`, or wrap with "
                "use_ghost_clipping=False or with dpgrad.GradSampleModule."
            )


class GradSampleModuleFastGradientClipping(GradSampleModule):
    """Wraps a module so that each trainable parameter gets ``p._norm_sample`` (B,) after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's
    ``GradSampleModuleFastGradientClipping``; see ``GradSampleModule`` for the common
    arguments.

    Args:
        max_grad_norm: the clipping bound C of ``get_clipping_coef``.
        use_ghost_clipping: norms without per-sample gradients for layers with a norm sampler;
            with False, every layer's norm comes from its per-sample gradient.
    """

    NORM_SAMPLERS = registry.NORM_SAMPLERS

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
    ):
        if use_ghost_clipping:
            _refuse_tied(m)
        super().__init__(
            m,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            strict=strict,
            force_functorch=force_functorch,
            check_finite=check_finite,
        )
        self.use_ghost_clipping = use_ghost_clipping
        self.max_grad_norm = max_grad_norm
        self.trainable_parameters = [p for _, p in self._trainable_parameters()]
        self._per_sample_gradient_norms = None
        self._pass_norms: Dict[nn.Parameter, torch.Tensor] = {}

    def _uses_norm_sampler(self, layer: nn.Module) -> bool:
        return self.use_ghost_clipping and type(layer) in self.NORM_SAMPLERS

    def forward(self, *args, **kwargs):
        if self.hooks_enabled and self.training and torch.is_grad_enabled():
            for p in self.trainable_parameters:
                p._norm_sample = None
        return super().forward(*args, **kwargs)

    def _on_forward(self, layer: nn.Module, name: str, params: List[nn.Parameter]) -> None:
        if self._uses_norm_sampler(layer) and layer in self._forward_seen:
            raise NotImplementedError(
                f"layer '{name}' ran twice in one forward pass; under ghost clipping the norm of "
                "its per-sample gradient cannot be assembled from the two uses. Call each "
                "layer once per forward, or wrap with use_ghost_clipping=False."
            )
        super()._on_forward(layer, name, params)

    def _process_layer(self, layer: nn.Module, activations: list, backprops: torch.Tensor) -> None:
        if not self._uses_norm_sampler(layer):
            return super()._process_layer(layer, activations, backprops)
        norms = self.NORM_SAMPLERS[type(layer)](layer, activations, backprops)
        for p, norm in norms.items():
            if not p.requires_grad:
                continue
            if p in self._pass_norms:
                raise NotImplementedError(
                    f"parameter '{self._param_names.get(p)}' of layer '{self._layer_names[layer]}' "
                    "received two gradient contributions in one backward pass (several forward "
                    "passes before one backward, or a reused layer); ghost clipping cannot "
                    "combine their norms. Run backward after every forward pass."
                )
            self._pass_norms[p] = norm

    def _abort_pass(self) -> None:
        super()._abort_pass()
        self._pass_norms = {}

    def _finish_pass(self, params: List[nn.Parameter]) -> None:
        norms = dict(self._pass_norms)
        for p in params:
            gs = p._current_grad_sample
            acc = torch.float64 if gs.dtype == torch.float64 else torch.float32
            norms[p] = torch.linalg.vector_norm(gs.flatten(1), dim=1, dtype=acc)
        self._check_finite(norms, "gradient norms")
        for p, norm in norms.items():
            p._norm_sample = norm
            p.grad_sample = None

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
