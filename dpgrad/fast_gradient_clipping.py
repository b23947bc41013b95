"""``GradSampleModuleFastGradientClipping``: per-sample gradient norms, a drop-in for Opacus's.

Layers with a registered norm sampler (Linear, Embedding, Hugging Face's Conv1D) get their
per-sample gradient norms without materialising per-sample gradients ("ghost clipping");
every other layer gets its per-sample gradients, whose norms are taken at the end of the
backward pass. Opacus's ``DPLossFastGradientClipping`` and ``DPOptimizerFastGradientClipping``
work with it unchanged. Tied parameters (an input embedding tied to the output layer, a
layer called twice) get the exact norm of their summed per-sample gradient.

``clipped_backward`` (what ``dpgrad.DPLossFastGradientClipping`` calls) does better than
Opacus's protocol. Its norm pass asks autograd only for the gradients of the layer outputs
(``dpgrad.backward.autograd_graph``), so no weight gradient is computed to be thrown away. Then either
a second backward of ``sum_b c_b loss_b`` gives the clipped gradient (double backward, as in
Opacus), or, with ``single_backward=True``, each layer's clipped gradient comes from the
inputs and backprops the norm pass kept ("book-keeping"). The wrapper holds its backward path,
``dpgrad.backward.clipping_path.ClippingPath``, which does all of it; this module is Opacus's
interface around it.

A model sharded by FSDP2 (``fully_shard``) is taken in both modes: see ``dpgrad.backward.fsdp``.
"""

from __future__ import annotations

import contextlib

from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.clipping.groups import CLIPPINGS, ClipGroups
from dpgrad.backward.clipping_path import ClippingPath
from dpgrad.clipping.coefficients import automatic_gamma as checked_gamma
from dpgrad.clipping.coefficients import clipping_bound, clipping_coefficients, per_sample_bounds
from dpgrad.backward.fsdp import sharded_modules
from dpgrad.grad_sample_module import GradSampleModule, _delegated


# Automatic clipping's forms, and the clipping whose groups each takes.
AUTOMATIC = {"automatic": "flat", "automatic_per_layer": "per_layer", "automatic_groups": "groups"}


def automatic_settings(clipping: str, automatic_gamma: Optional[float]) -> Tuple[str, Optional[float]]:
    """The groups ``clipping`` takes ("flat", "per_layer", "groups": an automatic form's own)
    and automatic clipping's gamma (checked; 0.01 by default), None for a fixed bound. Raises
    ValueError for ``automatic_gamma`` given with a fixed bound."""
    if clipping in AUTOMATIC:
        return AUTOMATIC[clipping], checked_gamma(0.01 if automatic_gamma is None else automatic_gamma)
    if automatic_gamma is not None:
        raise ValueError(f"automatic_gamma is for automatic clipping ({', '.join(AUTOMATIC)}), not "
                         f"clipping={clipping!r}")
    return clipping, None


def _counts_batches(optimizer) -> bool:
    """Whether the step ``optimizer`` will take counts the batches ``p.grad`` accumulated: dpgrad's
    DP optimizers do; Opacus's ghost-clipping ones count one per step; another optimizer (or
    none given) has no accountant of a DP optimizer to mislead."""
    kind = type(optimizer)
    return getattr(kind, "counts_accumulated_batches", False) or not hasattr(kind, "accumulated_iterations")


class GradSampleModuleFastGradientClipping(GradSampleModule):
    """Wraps a module so that each trainable parameter gets ``p._norm_sample`` (B,) after backward.

    Same constructor, methods and per-parameter fields as Opacus 1.6's
    ``GradSampleModuleFastGradientClipping``; see ``GradSampleModule`` for the common
    arguments. ``m`` may be sharded by FSDP2 (``fully_shard`` on its blocks and its root,
    before wrapping): ``p._norm_sample`` is then on the sharded parameters, and the clipped
    gradients reach their shards through FSDP's reduce-scatter (``dpgrad.backward.fsdp``).

    Args:
        max_grad_norm: the clipping bound C of ``get_clipping_coef``: a finite positive number.
        use_ghost_clipping: norms without per-sample gradients for layers with a norm sampler;
            with False, every layer's norm comes from its per-sample gradient.
        single_backward: dpgrad's own keyword. One backward pass gives the norms and then the
            clipped gradient ("book-keeping"); the pass must come from
            ``dpgrad.DPLossFastGradientClipping`` or ``clipped_backward``. With False (the
            default) ``clipped_backward`` runs two passes, as Opacus does, and a plain
            backward works as in Opacus.
        clipping: "flat" (the default: one ``max_grad_norm`` C over all parameters),
            "per_layer" (Opacus's: each trainable parameter clipped on its own, ``max_grad_norm``
            a list of one threshold per trainable parameter, in ``m.parameters()`` order) or
            "groups" (each group of ``clipping_groups`` clipped on its own, ``max_grad_norm``
            one threshold per group). See ``dpgrad.clipping.groups``: a sample then moves the
            gradient by at most ``max_grad_norm`` = ``sqrt(sum C_g^2)``, the bound the
            optimizer's noise must be scaled to (``max_grad_norms`` holds the thresholds).
            Per-layer and group-wise clipping take one backward pass in either mode (Opacus's
            second pass has one coefficient per sample, not one per sample and group), and
            are not available on a model sharded by FSDP2.
            "automatic", "automatic_per_layer" and "automatic_groups" are the same with
            automatic clipping (Bu et al. 2022, fastDP's default): every sample's gradient
            (of the group) scaled by ``c = C / (norm + automatic_gamma)``, to just below C,
            instead of clipped by ``min(1, C / (norm + 1e-6))``; the bound the noise is scaled
            to is the same.
        clipping_groups: for "groups": lists of parameters (every trainable parameter in one),
            or a rule from a parameter's qualified name to its group's label, such as
            ``dpgrad.clipping.groups.per_block`` (one group per transformer block).
        automatic_gamma: automatic clipping's gamma, a finite number > 0 (0.01, as in the
            paper); only with an automatic clipping.
        check_independence: as for ``GradSampleModule``; ``clipped_backward`` (and so
            ``DPLossFastGradientClipping``) also probes the loss, once per layout of it: one
            sample's loss must depend on that sample's rows of the model's outputs alone, else
            ``SampleMixingError`` says whether the losses are in another order than the batch
            or the loss mixes samples (with ``DPLossFastGradientClipping``, also from the
            criterion run again with some samples' outputs and targets changed).
        recheck_independence: as for ``GradSampleModule``.
    """

    use_ghost_clipping = _delegated("ghost", "Norms without per-sample gradients where a norm sampler exists.")
    single_backward = _delegated("single_backward", "One backward pass per clipped step.")

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
        check_independence: bool = True,
        single_backward: bool = False,
        clipping: str = "flat",
        clipping_groups=None,
        automatic_gamma: Optional[float] = None,
        recheck_independence: Optional[int] = None,
    ):
        if clipping not in CLIPPINGS + tuple(AUTOMATIC):
            raise ValueError(f"clipping={clipping!r}: use one of {', '.join(CLIPPINGS + tuple(AUTOMATIC))}")
        groups = None
        clipping_style, gamma = automatic_settings(clipping, automatic_gamma)
        if clipping_style == "flat" and clipping_groups is None:
            if isinstance(max_grad_norm, (list, tuple)):
                raise ValueError("flat clipping takes one max_grad_norm, not a list: for one threshold per "
                                 "parameter or group, give clipping='per_layer' or 'groups'")
            clipping_bound(max_grad_norm)
        else:
            if clipping_style == "flat":
                raise ValueError("clipping_groups needs clipping='groups' (or 'automatic_groups')")
            groups = ClipGroups(m, clipping_style, max_grad_norm, clipping_groups, gamma)
            if sharded_modules(m):
                raise ValueError(f"clipping={clipping!r} is not available on a model sharded by FSDP2 yet: use "
                                 "flat clipping, or DistributedDataParallel")
        self._wrap(m, ClippingPath(m, batch_first=batch_first, loss_reduction=loss_reduction,
                                   check_finite=check_finite, check_independence=check_independence,
                                   recheck_independence=recheck_independence,
                                   force_functorch=force_functorch, strict=strict,
                                   ghost=use_ghost_clipping, single_backward=single_backward, clip_groups=groups,
                                   gamma=gamma))
        self.clipping = clipping
        self.max_grad_norms = None if groups is None else list(groups.bounds)
        self._max_grad_norm = clipping_bound(max_grad_norm if groups is None else groups.total)
        self._per_sample_gradient_norms = None
        self.per_sample_group_norms = None

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C: a finite positive number (checked when set); under adaptive
        clipping, a 0-d tensor on the device."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        if self._path.clip_groups is not None:
            raise ValueError(f"with clipping={self.clipping!r}, max_grad_norm is the total of the groups' "
                             "thresholds: wrap the model again to change them")
        self._max_grad_norm = clipping_bound(value)

    def adapt_max_grad_norm(self, bound: torch.Tensor) -> None:
        """Set the flat bound to a 0-d tensor on the device (``dpgrad.clipping.adaptive``: the bound
        each step computes, never read back to the host); ``max_grad_norm`` returns it."""
        if self._path.clip_groups is not None:
            raise ValueError(f"clipping={self.clipping!r} has one bound per group: it cannot adapt one")
        self._max_grad_norm = bound

    @property
    def trainable_parameters(self) -> List[nn.Parameter]:
        """The model's trainable parameters (as of the last forward pass)."""
        return self._path.trainable_parameters

    # ------------------------------------------------------------------ dpgrad's backward
    def clipped_backward(self, loss_per_sample: torch.Tensor, max_grad_norms=None, bound_from_norms=None, *,
                         loss_scale: Optional[torch.Tensor] = None, optimizer=None) -> None:
        """Add the clipped gradient ``sum_b c_b * grad(loss_b)`` of the last forward pass to ``p.grad``.

        ``loss_per_sample``: (B,), each sample's own loss. ``c_b = min(1, C / (norm_b + 1e-6))``
        from per-sample norms over all trainable parameters (``get_clipping_coef``). ``p.grad``
        ends as Opacus's two-pass protocol leaves it (for either ``loss_reduction``), plus
        what it held before: several calls before one optimizer step accumulate micro-batches,
        each clipped on its own. ``p._norm_sample`` and ``per_sample_gradient_norms`` are set.

        The norm pass computes no weight gradients. Then, with ``single_backward``, the
        clipped gradients come from what that pass kept; otherwise a second backward pass of
        ``sum_b c_b * loss_b`` (hooks disabled) computes them. A batch of one sample is clipped
        from its plain gradient, in one backward pass, in either mode. Raises ValueError for a loss
        that is not (B,) or has no graph, RuntimeError when the loss does not depend on any
        layer this wrapper hooked, ``UnclippedGradientError`` when a trainable parameter would
        get a gradient that is not clipped (``dpgrad.checks.guarantee``).

        ``max_grad_norms``: optional per-sample bounds (B,), each between 0 and
        ``max_grad_norm``, in place of ``max_grad_norm`` (``c_b = min(1, C_b / (norm_b + 1e-6))``):
        e.g. the rows of one user each clipped to ``C / rows``, so that the user moves the gradient
        by at most ``C`` (``dpgrad.hf``). A sequence or a CPU tensor is checked without waiting
        for the device; a bound outside ``[0, max_grad_norm]`` raises ValueError.

        ``bound_from_norms``: optional, a function of the per-sample norms (B,) that returns the
        bound (a float or a 0-d tensor) to clip them to, called between the norm pass and the
        clipping (``dpgrad.clipping.adaptive``); flat clipping, without ``max_grad_norms``.

        ``loss_scale``: the 0-d tensor the losses were multiplied by (a ``torch.amp.GradScaler``'s
        scale, ``scaler.scale(torch.ones(()))``): the norms of the unscaled gradients are
        clipped, ``p.grad`` gets the clipped sum times the scale, and the step must come from
        ``scaler.step(optimizer)`` (dpgrad's DP optimizers refuse it otherwise); a pass whose
        values are not finite puts NaN in ``p.grad``, for the scaler to skip the step.

        Each call is one more batch in the step (a loop's gradient accumulation): a step, or
        ``zero_grad()``, since the last call makes this one start from nothing, and the DP
        optimizer counts the batches ``p.grad`` holds for its accountant. Under Poisson sampling
        (``forbid_grad_accumulation()``) a second batch before a step is refused; the calls in
        ``one_batch()`` are physical parts of one batch. ``optimizer``: the DP optimizer the step
        will take, if known (a second batch is refused where it does not count them).
        """
        bound = self.max_grad_norm
        if bound_from_norms is not None:
            if max_grad_norms is not None or self._path.clip_groups is not None:
                raise ValueError("bound_from_norms takes flat clipping, without per-sample bounds")
            bound = bound_from_norms
        elif max_grad_norms is not None:
            if self._path.clip_groups is not None:
                raise ValueError(f"per-sample bounds (max_grad_norms) are for flat clipping, not clipping="
                                 f"{self.clipping!r}")
            bound = per_sample_bounds(max_grad_norms, self.max_grad_norm, loss_per_sample)
        self.per_sample_gradient_norms = self._path.clipped_backward(
            loss_per_sample, bound, loss_scale=loss_scale,
            counted=_counts_batches(optimizer),
            optimizer_kind=type(optimizer).__name__)
        if self._path.clip_groups is not None:
            # (G, B): each group's per-sample norms (not private, for debugging, as the total's).
            self.per_sample_group_norms = self._path.group_norms

    @contextlib.contextmanager
    def one_batch(self):
        """A context in which the clipped backward passes are physical parts of one logical
        batch (one draw of the data loader, run in parts that fit in memory): the DP optimizer
        counts them as one batch, and under Poisson sampling they are not an accumulation. The
        optimizer steps once after the context (``DPTrainer`` runs its physical batches so; with
        Opacus's ``BatchMemoryManager`` or ``make_private(physical_batch_size=...)`` the skipped
        steps between parts say it instead)."""
        path = self._path
        if path._one_batch is not None:
            raise RuntimeError("one_batch() is open already: one logical batch at a time")
        path._one_batch = 0
        try:
            yield
        finally:
            path._one_batch = None

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample gradient norms over all trainable parameters, (B,)."""
        norm_sample = self._path.norm_sample()
        self.per_sample_gradient_norms = norm_sample
        return norm_sample

    def get_clipping_coef(self) -> torch.Tensor:
        """Per-sample clipping factors ``min(1, C / (norm + 1e-6))``, (B,) (Opacus's formula;
        ``C / (norm + automatic_gamma)`` under automatic clipping).
        Flat clipping only: per-layer and group-wise clipping have one per sample and group,
        applied by ``clipped_backward``."""
        if self._path.clip_groups is not None:
            raise RuntimeError(f"clipping={self.clipping!r} has one coefficient per sample and group, not per "
                               "sample: clip with clipped_backward (dpgrad.DPLossFastGradientClipping does), not "
                               "with Opacus's loss wrapper")
        return clipping_coefficients(self.get_norm_sample(), self.max_grad_norm, self._path.gamma)

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


class GradSampleModuleFastGradientClippingFSDP(GradSampleModuleFastGradientClipping):
    """Opacus 1.6's name and constructor for ghost clipping of a model sharded by FSDP2.

    ``GradSampleModuleFastGradientClipping`` on ``m``, which must be sharded by ``fully_shard``
    (on its blocks and its root) already, with ghost clipping always on, as in Opacus. Unlike
    Opacus's, it takes tied parameters, ``single_backward=True`` and ``clipping="automatic"``
    (with ``automatic_gamma``), and its norms are on ``p._norm_sample`` of the sharded
    parameters.
    """

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = True, max_grad_norm: float = 1, check_finite: bool = True,
                 check_independence: bool = True, single_backward: bool = False, clipping: str = "flat",
                 automatic_gamma: Optional[float] = None, recheck_independence: Optional[int] = None):
        if not sharded_modules(m):
            raise ValueError(
                "GradSampleModuleFastGradientClippingFSDP takes a model sharded by FSDP2: call "
                "fully_shard on its blocks and its root first, or use GradSampleModuleFastGradientClipping"
            )
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                         max_grad_norm=max_grad_norm, use_ghost_clipping=True, check_finite=check_finite,
                         check_independence=check_independence, single_backward=single_backward,
                         clipping=clipping, automatic_gamma=automatic_gamma,
                         recheck_independence=recheck_independence)
