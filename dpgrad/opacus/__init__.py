"""Optional integration with an installed Opacus (1.6): use dpgrad with ``PrivacyEngine``.

Two ways in:

* ``make_private(engine, ...)``: like ``PrivacyEngine.make_private``, but the model is wrapped
  by dpgrad's ``GradSampleModule`` / ``GradSampleModuleFastGradientClipping`` and, under ghost
  clipping, the loss by dpgrad's ``DPLossFastGradientClipping`` (``single_backward=True`` for
  one backward pass); the data loader and the privacy accounting are Opacus's, and so is the
  optimizer, batched under ghost clipping (``DPOptimizerFastGradientClipping`` below).
* ``DPOptimizerFastGradientClipping``: Opacus's DP optimizer for ghost clipping (same
  arguments, accounting and noise), with its per-parameter loops done as a few batched
  operations; ``make_private`` returns it under ghost clipping in one process.
* ``register_with_opacus()``: put dpgrad's samplers for Linear, Embedding, LayerNorm and
  RMSNorm into Opacus's registries, so that Opacus's own wrappers use them. Returns a handle
  that undoes it (``.unregister()`` or ``with``).

This module imports Opacus and is never imported by ``dpgrad/__init__.py``; import it only
where Opacus is installed (``pip install dpgrad[opacus]``).
"""

from __future__ import annotations

from itertools import chain
from typing import Dict, Iterable, List, Optional, Tuple, Type

import torch
import torch.nn as nn
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from opacus.optimizers import DPOptimizerFastGradientClipping as _OpacusDPOptimizerFastGradientClipping
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping as _OpacusDistributedDPOptimizerFastGradientClipping,
)
from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping as _OpacusPrivacyEngineAdaptiveClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from dpgrad.samplers import registry
from dpgrad.backward.autograd_graph import eager_when_compiled
from dpgrad.batches import FixedShapeBatches, rank_generator
from dpgrad.clipping.coefficients import clipping_bound
from dpgrad.fast_gradient_clipping import (GradSampleModuleFastGradientClipping,
                                           GradSampleModuleFastGradientClippingFSDP, automatic_settings)
from dpgrad.backward.fsdp import sharded_modules
from dpgrad import hooks as dpgrad_hooks
from dpgrad.grad_sample_module import GradSampleModule
from dpgrad.loss import DPLossFastGradientClipping

__all__ = ["DPOptimizerFastGradientClipping", "OpacusRegistration", "make_private", "register_with_opacus"]

# Layer types whose samplers register_with_opacus hands to Opacus by default.
DEFAULT_LAYERS: Tuple[Type[nn.Module], ...] = tuple(
    cls for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, getattr(nn, "RMSNorm", None)) if cls is not None
)

# grad_sample_mode -> the dpgrad wrapper that make_private builds.
_WRAPPERS = {
    "ghost": GradSampleModuleFastGradientClipping,
    "hooks": GradSampleModule,
    "functorch": GradSampleModule,
}

_MISSING = object()


# ---------------------------------------------------------------------- registration
class OpacusRegistration:
    """What ``register_with_opacus`` replaced in Opacus's registries, and how to put it back.

    ``replaced`` maps ``(registry name, layer type)`` to Opacus's previous sampler (None where
    there was none). Call ``unregister()`` (idempotent) or use the object as a context manager.
    """

    def __init__(self, changes: List[Tuple[str, Dict, Type[nn.Module], object]]):
        self._changes = changes
        self.active = True

    @property
    def replaced(self) -> Dict[Tuple[str, Type[nn.Module]], Optional[object]]:
        return {(name, cls): (None if old is _MISSING else old) for name, _, cls, old in self._changes}

    def unregister(self) -> None:
        """Restore Opacus's registries as they were before ``register_with_opacus``."""
        if not self.active:
            return
        for _, table, cls, old in reversed(self._changes):
            if old is _MISSING:
                table.pop(cls, None)
            else:
                table[cls] = old
        self.active = False

    def __enter__(self) -> "OpacusRegistration":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()

    def __repr__(self) -> str:
        names = sorted({f"{name}[{cls.__name__}]" for name, _, cls, _ in self._changes})
        return f"OpacusRegistration(active={self.active}, entries={names})"


def register_with_opacus(layers: Iterable[Type[nn.Module]] = DEFAULT_LAYERS) -> OpacusRegistration:
    """Make Opacus's own wrappers use dpgrad's samplers for ``layers``.

    Opacus 1.6 keeps one grad-sampler dict, shared by ``GradSampleModule`` and
    ``GradSampleModuleFastGradientClipping`` (``GradSampleHooks.GRAD_SAMPLERS``), and one
    norm-sampler dict (``GradSampleHooksFastGradientClipping.NORM_SAMPLERS``). For each layer
    type, dpgrad's grad sampler and norm sampler, where dpgrad has one, replace Opacus's.
    Among other things this gives correct per-sample gradients and norms for an
    ``nn.Embedding`` with ``padding_idx`` (Opacus counts the padding positions).

    Returns:
        An ``OpacusRegistration``; its ``unregister()`` restores Opacus's samplers.

    Example::

        with dpgrad.opacus.register_with_opacus():
            model, optimizer, data_loader = PrivacyEngine().make_private(...)
            train(model)  # Opacus's wrapper, dpgrad's samplers
    """
    tables = [
        ("GRAD_SAMPLERS", GradSampleHooks.GRAD_SAMPLERS, registry.GRAD_SAMPLERS),
        ("NORM_SAMPLERS", GradSampleHooksFastGradientClipping.NORM_SAMPLERS, registry.NORM_SAMPLERS),
    ]
    changes = []
    for cls in layers:
        for name, opacus_table, ours in tables:
            if cls in ours:
                changes.append((name, opacus_table, cls, opacus_table.get(cls, _MISSING)))
                opacus_table[cls] = ours[cls]
    return OpacusRegistration(changes)


# ---------------------------------------------------------------------- DP optimizer
class DPOptimizerFastGradientClipping(_OpacusDPOptimizerFastGradientClipping):
    """Opacus's ``DPOptimizerFastGradientClipping`` with its per-parameter work batched.

    Same arguments, attributes, step skipping (virtual steps), accountant hooks and result as
    Opacus's: ``p.grad`` becomes ``(p.summed_grad + N(0, (noise_multiplier * max_grad_norm)^2))``
    divided by the expected batch size under "mean". Opacus does it with about five operations
    per parameter (a copy of the gradient, a zero tensor, the noise, the sum, the division);
    on a GPU a model with hundreds of parameters then spends more host time in the optimizer
    than in its backward pass. Here:

    - ``p.summed_grad`` is the clipped gradient itself, not a copy (a copy is made only when
      the step is skipped, so that a later ``zero_grad`` cannot clear it);
    - the noise of all parameters of one device and dtype is drawn in one call into one
      buffer, already divided by the expected batch size under "mean" (its standard deviation
      divided), the clipped sums are added to it times the same factor (one multi-tensor
      operation, rounded once), and every ``p.grad`` is a view of that buffer: no pass of its
      own for the division (without noise, the sums are divided as Opacus divides them);
    - a trainable parameter the backward pass did not reach (``p.grad`` None) is given a zero
      sum: it receives noise like every other parameter (Opacus's optimizer fails on it).

    The noise has Opacus's distribution (independent Gaussians, in the gradient's dtype), but a
    seeded ``generator`` gives other draws than Opacus's per-parameter calls. With
    ``secure_mode`` the noise is drawn by Opacus's own code, parameter by parameter.
    """

    def accumulate(self):
        summed, grads = [], []
        for p in self.params:
            if p.summed_grad is None:
                # The gradient itself: pre_step copies it only if the step is skipped.
                p.summed_grad = p.grad if p.grad is not None else torch.zeros_like(p)
            elif p.grad is not None:
                summed.append(p.summed_grad)
                grads.append(p.grad)
        if summed:
            torch._foreach_add_(summed, grads)

    @eager_when_compiled
    def pre_step(self, closure=None) -> bool:
        stepped = super().pre_step(closure)
        if not stepped:
            # A skipped step's sums outlive it: they must not be p.grad, which zero_grad may clear.
            for p in self.params:
                if p.summed_grad is p.grad:
                    p.summed_grad = p.grad.clone()
        return stepped

    def add_noise(self):
        if self.secure_mode:
            return super().add_noise()
        # A tensor under adaptive clipping (dpgrad.clipping.adaptive): the bound stays on the device.
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        params = self.params
        for p in params:
            _check_processed_flag(p.summed_grad)
        groups: Dict[Tuple[torch.device, torch.dtype], List[nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.summed_grad.device, p.summed_grad.dtype), []).append(p)
        # Under "mean" the division of scale_grad, folded in here where noise is drawn.
        divisor = self._divisor()
        folded = divisor != 1 and not (isinstance(std, (int, float)) and std == 0)
        for (device, dtype), group in groups.items():
            sizes = [p.numel() for p in group]
            noise = torch.empty(sum(sizes), device=device, dtype=dtype)
            if isinstance(std, torch.Tensor):
                noise.normal_(0, 1, generator=self.generator).mul_((std / divisor).to(device=device, dtype=dtype))
            elif std == 0:
                noise.zero_()
            else:
                noise.normal_(0, std / divisor, generator=self.generator)
            noisy = [piece.view_as(p) for piece, p in zip(noise.split(sizes), group)]
            torch._foreach_add_(noisy, [p.summed_grad for p in group], alpha=1 / divisor if folded else 1)
            for p, g in zip(group, noisy):
                p.grad = g
        self._scaled = folded
        for p in params:
            _mark_as_processed(p.summed_grad)

    def _divisor(self) -> float:
        """What scale_grad divides the noisy sums by: the expected batch size (times the
        accumulated steps) under "mean", else 1."""
        return self.expected_batch_size * self.accumulated_iterations if self.loss_reduction == "mean" else 1

    def scale_grad(self):
        if self.__dict__.pop("_scaled", False):  # add_noise divided them already
            return
        if self.loss_reduction == "mean":
            torch._foreach_div_([p.grad for p in self.params], self._divisor())


class DistributedDPOptimizerFastGradientClipping(DPOptimizerFastGradientClipping):
    """Opacus's ``DistributedDPOptimizerFastGradientClipping`` (the noise added once, on rank
    0, then the ranks' gradients summed, and averaged under "mean"), with the batched noise of
    ``DPOptimizerFastGradientClipping``, which takes a bound on the device: what adaptive
    clipping under DDP uses. Same arguments."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    def add_noise(self):
        if self.rank == 0:
            super().add_noise()
        else:
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)

    def reduce_gradients(self):
        grads = [p.grad for p in self.params if p.requires_grad]
        for g in grads:
            torch.distributed.all_reduce(g, op=torch.distributed.ReduceOp.SUM)
        if self.loss_reduction == "mean" and grads:
            torch._foreach_div_(grads, self.world_size)

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.pre_step():
            self.reduce_gradients()
            return self.original_optimizer.step()
        return None


class PrivacyEngineAdaptiveClipping(_OpacusPrivacyEngineAdaptiveClipping):
    """Opacus 1.6's ``PrivacyEngineAdaptiveClipping`` whose ``make_private`` is dpgrad's
    (``make_private`` below with this engine: ghost clipping, dpgrad's wrapper and
    ``dpgrad.DPLossFastGradientAdaptiveClipping``). The same keywords: the adaptive ones
    (``target_unclipped_quantile``, ``min_clipbound``, ``max_clipbound``,
    ``clipbound_learning_rate``) and dpgrad's ``public_batch_size``."""

    def make_private(self, **kwargs):
        return make_private(self, **kwargs)


# The adaptive rule's keywords (Opacus's), with their defaults.
ADAPTIVE_SETTINGS = {"target_unclipped_quantile": 0.5, "min_clipbound": 1, "max_clipbound": 1e8,
                     "clipbound_learning_rate": 0.2}


# ---------------------------------------------------------------------- make_private
def _distribution(module: nn.Module) -> Optional[str]:
    """How ``module`` is trained over several processes: "ddp" (torch's or Opacus's
    ``DistributedDataParallel``), "fsdp" (sharded by FSDP2's ``fully_shard``), or None."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(module, (DPDDP, DDP)):
        return "ddp"
    if sharded_modules(module):
        return "fsdp"
    return None


def _sample_independently(data_loader) -> None:
    """Give each rank's Poisson sampler a generator of its own.

    Opacus's distributed sampler draws each rank's mask over its share of the data set from the
    global generator when it has none (outside secure mode), and processes seeded alike (as for
    identical initial weights, or torch's fixed default seed) draw the same masks: the same
    positions of every rank's share are taken together, where the accountant assumes each
    sample is taken independently. The generator is seeded from the process's seed and its
    rank, so a seeded run stays reproducible.
    """
    from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler

    sampler = getattr(data_loader, "batch_sampler", None)
    if isinstance(sampler, DistributedUniformWithReplacementSampler) and sampler.generator is None:
        sampler.generator = rank_generator(torch.initial_seed(), sampler.rank)


def _check_optimizer_params(module: nn.Module, optimizer) -> None:
    model_parameters = set(module.parameters())
    for p in chain.from_iterable(group["params"] for group in optimizer.param_groups):
        if p not in model_parameters:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                "parameter of the module: build the optimizer from module.parameters()"
            )


def _wrap(
    module: nn.Module,
    *,
    grad_sample_mode: str,
    batch_first: bool,
    loss_reduction: str,
    max_grad_norm,
    single_backward: bool,
    clipping_groups=None,
    check_independence: bool = True,
    automatic_gamma: Optional[float] = None,
    recheck_independence: Optional[int] = None,
):
    cls = _WRAPPERS[grad_sample_mode]
    # The wrapper's clipping: groups (per layer: one per parameter) or flat, automatic or not.
    clipping = ("flat" if clipping_groups is None else "groups") if automatic_gamma is None else (
        "automatic" if clipping_groups is None else "automatic_groups")
    if isinstance(module, GradSampleModule):
        # A dpgrad wrapper is reused only if it already is what this call would build.
        ghost = cls is GradSampleModuleFastGradientClipping
        # Opacus's name for ghost clipping of a sharded model is the same wrapper.
        accepted = (cls, GradSampleModuleFastGradientClippingFSDP) if ghost else (cls,)
        mismatch = (
            type(module) not in accepted
            or module.batch_first != batch_first
            or module.loss_reduction != loss_reduction
            or module.force_functorch != (grad_sample_mode == "functorch")
            or module.check_independence != check_independence
            or module.recheck_independence != recheck_independence
            or (ghost and (module.clipping != clipping or module._path.gamma != automatic_gamma
                           or (module.max_grad_norms or module.max_grad_norm) != max_grad_norm
                           or module.single_backward != single_backward))
        )
        if mismatch:
            raise ValueError(
                f"the module is already a {type(module).__name__} (batch_first="
                f"{module.batch_first}, loss_reduction={module.loss_reduction!r}) that does not "
                f"match grad_sample_mode={grad_sample_mode!r}, batch_first={batch_first}, "
                f"loss_reduction={loss_reduction!r}, max_grad_norm={max_grad_norm}, "
                f"single_backward={single_backward}, check_independence={check_independence}: pass the "
                "plain module (wrapper.to_standard_module())"
            )
        return module
    kwargs = dict(batch_first=batch_first, loss_reduction=loss_reduction, check_independence=check_independence,
                  recheck_independence=recheck_independence)
    if grad_sample_mode == "functorch":
        kwargs["force_functorch"] = True
    if cls is GradSampleModuleFastGradientClipping:
        kwargs.update(max_grad_norm=max_grad_norm, single_backward=single_backward, clipping=clipping,
                      clipping_groups=clipping_groups, automatic_gamma=automatic_gamma)
    return cls(module, **kwargs)


def _check_capturable(privacy_engine, optimizer, *, grad_sample_mode: str, adaptive: bool, distributed: bool,
                      poisson_sampling: bool, physical_batch_size: Optional[int],
                      recheck_independence: Optional[int]) -> None:
    """``make_private(cuda_graph=True)``: refuse what ``dpgrad.graphed_step`` cannot replay, and
    make the optimizer capturable where it has the setting."""
    refusals = []
    if poisson_sampling and physical_batch_size is None:
        refusals.append("Poisson batches differ in size and a graph replays one shape: pass physical_batch_size "
                        "(each batch padded to it with samples whose loss weighs zero)")
    if grad_sample_mode != "ghost":
        refusals.append(f"grad_sample_mode={grad_sample_mode!r}: the graphed step is ghost clipping's "
                        "(grad_sample_mode='ghost')")
    if adaptive:
        refusals.append("adaptive clipping makes a new bound tensor at every step, which a replay would not see")
    if recheck_independence is not None:
        refusals.append("recheck_independence probes the model from Python, which a replay does not run")
    if privacy_engine.secure_mode:
        refusals.append("secure_mode's noise generator cannot be replayed by a CUDA graph")
    if distributed:
        refusals.append("distributed training (DDP, FSDP2) is not captured yet")
    if refusals:
        raise ValueError("cuda_graph=True: " + "; ".join(refusals))
    for group in optimizer.param_groups:
        # On a CPU, where there is no graph to capture, the optimizer is left as it is.
        if "capturable" in group and all(p.is_cuda for p in group["params"]):
            group["capturable"] = True


def make_private(
    privacy_engine,
    *,
    module: nn.Module,
    optimizer,
    data_loader,
    noise_multiplier: float,
    max_grad_norm: float,
    criterion=None,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    poisson_sampling: bool = True,
    grad_sample_mode: str = "ghost",
    noise_generator=None,
    clipping: str = "flat",
    clipping_groups=None,
    automatic_gamma: Optional[float] = None,
    public_batch_size: bool = False,
    wrap_model: bool = True,
    rand_on_empty: bool = False,
    single_backward: bool = False,
    physical_batch_size: Optional[int] = None,
    check_independence: bool = True,
    recheck_independence: Optional[int] = None,
    cuda_graph: bool = False,
    **kwargs,
):
    """``PrivacyEngine.make_private`` with the model wrapped by dpgrad.

    Assembled from the engine's own pieces, in the order ``PrivacyEngine.make_private``
    (Opacus 1.6) uses them: the engine's module validation, its data loader (Poisson
    sampling), its DP optimizer (in one process under ghost clipping, the batched
    ``DPOptimizerFastGradientClipping`` of this module, with the same arguments), its
    accountant (hooked on ``optimizer.step``) and, under
    ghost clipping, dpgrad's ``DPLossFastGradientClipping`` (Opacus's signature; its backward
    computes no weight gradient it throws away). So ``privacy_engine.get_epsilon`` accounts
    for training done with the returned objects.

    A ``module`` in ``torch.nn.parallel.DistributedDataParallel`` (or Opacus's DPDDP) is
    trained distributed, as Opacus does it: dpgrad's wrapper goes around it, each process
    draws its own share of the Poisson batches (with a generator of its own: see
    ``_sample_independently``), and Opacus's distributed optimizer adds the
    noise once, on rank 0, before summing over the processes. The norm pass of ghost clipping
    computes no parameter gradients, so DistributedDataParallel reduces nothing until the
    clipped gradients exist.

    A ``module`` sharded by FSDP2 (``fully_shard`` on its blocks and its root) is trained
    the same way under ``grad_sample_mode="ghost"`` (``dpgrad.backward.fsdp``): the clipped sums reach
    the sharded gradients through FSDP's reduce-scatter, and Opacus's
    ``FSDPOptimizerFastGradientClipping`` adds the noise: each rank draws it for the whole
    parameter and adds its own shard's slice, so every coordinate gets noise once, from the
    rank that holds it (with generators seeded alike on every rank, exactly the one-process
    noise).

    Args:
        privacy_engine: an ``opacus.PrivacyEngine``.
        module, optimizer, data_loader, noise_multiplier, max_grad_norm, batch_first,
        loss_reduction, poisson_sampling, noise_generator, rand_on_empty: as for
            ``PrivacyEngine.make_private``.
        criterion: the loss (reduction ``loss_reduction``), wrapped for ghost clipping;
            defaults to ``nn.CrossEntropyLoss(reduction=loss_reduction)``. Unused otherwise.
        grad_sample_mode: "ghost" (``dpgrad.GradSampleModuleFastGradientClipping``, the
            default), "hooks" (``dpgrad.GradSampleModule``) or "functorch" (the same with
            ``force_functorch=True``); "ghost_fsdp", Opacus's name for ghost clipping of a
            model sharded by FSDP2, is "ghost" on such a model.
        clipping: "flat" (one ``max_grad_norm`` over all parameters) or "per_layer" (Opacus's:
            ``max_grad_norm`` a list, one bound per trainable parameter of the optimizer, in its order).
            Under "ghost" each parameter is clipped in the backward pass
            (``GradSampleModuleFastGradientClipping(clipping="groups")``, one backward pass in
            either mode) and the optimizer adds noise for ``sqrt(sum C_l^2)``; under "hooks",
            Opacus's ``DPPerLayerOptimizer`` clips the per-sample gradients. dpgrad's own
            "groups" (under "ghost" only): the parameters clipped in ``clipping_groups``,
            ``max_grad_norm`` one bound per group, the noise for ``sqrt(sum C_g^2)``.
            "automatic", "automatic_per_layer", "automatic_groups" (under "ghost" only): the same
            with automatic clipping (each sample's gradient scaled by ``C / (norm +
            automatic_gamma)``, Bu et al. 2022). "adaptive" (or a ``PrivacyEngineAdaptiveClipping``
            engine, Opacus's or dpgrad's): Opacus 1.6's adaptive clipping (``dpgrad.clipping.adaptive``)
            under "ghost", flat, with the keywords ``target_unclipped_quantile``,
            ``min_clipbound``, ``max_clipbound`` and ``clipbound_learning_rate``;
            ``max_grad_norm`` the initial bound.
        clipping_groups: for ``clipping="groups"``, lists of parameters or a rule from a
            parameter's name to its group's label (e.g. ``dpgrad.clipping.groups.per_block``),
            as ``GradSampleModuleFastGradientClipping`` takes them.
        automatic_gamma: automatic clipping's gamma (default 0.01).
        public_batch_size: with adaptive clipping, count the unclipped samples over the expected
            batch size (public) instead of the drawn one (dpgrad's; see ``dpgrad.clipping.adaptive``).
        single_backward: under "ghost", one backward pass per step instead of two
            (``GradSampleModuleFastGradientClipping(single_backward=True)``).
        physical_batch_size: under "ghost" with Poisson sampling in one process, serve every
            Poisson batch as batches of exactly this many samples (``dpgrad.batches``): a
            larger one is split, the last part padded with samples whose loss weighs exactly
            zero, and the optimizer steps once per Poisson batch (call ``optimizer.step()``
            and ``zero_grad()`` after every batch, as with Opacus's BatchMemoryManager). The
            sampling, ``expected_batch_size`` and the accountant are unchanged.
        check_independence: dpgrad's own keyword: verify on the first step of each layout that
            each sample's rows and loss are its own (``dpgrad.checks.independence``); False gives up
            that check.
        recheck_independence: dpgrad's own keyword: also probe every this many steps (forward
            passes), whatever the layout; None (the default): new layouts only.
        cuda_graph: dpgrad's own keyword: True prepares the step for ``dpgrad.graphed_step``
            (one CUDA graph for the whole step): what a graph cannot replay is refused now
            (Poisson sampling without ``physical_batch_size``, adaptive clipping,
            ``recheck_independence``, ``secure_mode``, distributed training) and an optimizer
            that has the setting (Adam, AdamW, ...) of a model on a CUDA device is made
            ``capturable``.
        wrap_model: False leaves the model as it is (its class, attributes and state_dict
            keys): the hooks object (``dpgrad.hooks``: ``GradSampleHooksFastGradientClipping``
            under "ghost", ``GradSampleHooks`` otherwise) is returned in the wrapper's place, and
            the caller calls the model itself; ``hooks.cleanup()`` takes the hooks off.
        **kwargs: passed to the DP optimizer, as ``PrivacyEngine.make_private`` does.

    Returns:
        ``(module, optimizer, criterion, data_loader)`` for "ghost";
        ``(module, optimizer, data_loader)`` otherwise; ``module`` the wrapper, or with
        ``wrap_model=False`` the hooks object.

    Raises:
        ValueError: for a module sharded by FSDP2 under a mode other than "ghost" (or
            "ghost_fsdp" for one that is not), clipping other than "flat", "per_layer" or "groups"
            ("groups" other than under "ghost", or without ``clipping_groups``), a list
            of bounds for "flat" (or not one per trainable optimizer parameter for "per_layer"), a bound
            that is not a finite positive number, an unknown
            ``grad_sample_mode``, ``physical_batch_size`` other than a positive integer or
            without Poisson sampling, "ghost" or one process, ``single_backward`` without "ghost", or
            optimizer parameters that are not the module's.

    Example::

        from opacus import PrivacyEngine
        import dpgrad.opacus

        engine = PrivacyEngine()
        model, optimizer, criterion, train_loader = dpgrad.opacus.make_private(
            engine,
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=train_loader,
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()  # norms, clipping factors, clipped gradient
            optimizer.step()
        print(engine.get_epsilon(delta=1e-5))
    """
    distribution = _distribution(module)
    if grad_sample_mode == "ghost_fsdp":  # Opacus's name for ghost clipping of a sharded model
        if distribution != "fsdp":
            raise ValueError(
                "grad_sample_mode='ghost_fsdp' is for a model sharded by FSDP2 (fully_shard), and this "
                "one is not: use grad_sample_mode='ghost'"
            )
        grad_sample_mode = "ghost"
    if grad_sample_mode not in _WRAPPERS:
        raise ValueError(
            f"grad_sample_mode={grad_sample_mode!r} is not supported by dpgrad.opacus.make_private: "
            f"use one of {sorted(_WRAPPERS)}"
        )
    given_clipping = clipping
    adaptive = clipping == "adaptive" or isinstance(privacy_engine, _OpacusPrivacyEngineAdaptiveClipping)
    settings = {name: kwargs.pop(name, default) for name, default in ADAPTIVE_SETTINGS.items()}
    if adaptive:
        if grad_sample_mode != "ghost" or distribution == "fsdp" or physical_batch_size is not None:
            raise ValueError("adaptive clipping adapts the bound in dpgrad's ghost-clipping loss: it needs "
                             "grad_sample_mode='ghost', a model not sharded by FSDP2 and no physical_batch_size")
        if isinstance(max_grad_norm, (list, tuple)) or clipping not in ("adaptive", "flat"):
            raise ValueError(f"adaptive clipping adapts one flat bound: not clipping={given_clipping!r} or a list "
                             "of bounds")
        clipping = given_clipping = "flat"
    elif public_batch_size or any(settings[name] != default for name, default in ADAPTIVE_SETTINGS.items()):
        raise ValueError("public_batch_size and the adaptive settings (target_unclipped_quantile, min_clipbound, "
                         "max_clipbound, clipbound_learning_rate) are for adaptive clipping: give "
                         "clipping='adaptive' or a PrivacyEngineAdaptiveClipping")
    clipping, automatic_gamma = automatic_settings(clipping, automatic_gamma)  # an automatic form's groups
    if clipping not in ("flat", "per_layer", "groups"):
        raise ValueError(
            f"clipping={given_clipping!r} is not supported by dpgrad.opacus.make_private: use 'flat' (one "
            "max_grad_norm over all parameters), 'per_layer' (one per trainable parameter of the optimizer), "
            "'groups' (one per group of clipping_groups), 'automatic', 'automatic_per_layer', "
            "'automatic_groups' (the same with automatic clipping), or 'adaptive'"
        )
    if automatic_gamma is not None and grad_sample_mode != "ghost":
        raise ValueError(f"clipping={given_clipping!r} scales each sample's gradient in the backward pass: it "
                         f"needs grad_sample_mode='ghost', not {grad_sample_mode!r}")
    if (clipping == "groups") != (clipping_groups is not None):
        raise ValueError(
            "clipping='groups' needs clipping_groups (lists of parameters, or a rule from a parameter's name "
            "to its group, e.g. dpgrad.clipping.groups.per_block), and clipping_groups needs clipping='groups'"
        )
    if clipping == "groups":
        if grad_sample_mode != "ghost":
            raise ValueError(f"clipping='groups' clips in the backward pass: it needs grad_sample_mode='ghost', "
                             f"not {grad_sample_mode!r}")
        if not isinstance(max_grad_norm, (list, tuple)):
            raise ValueError(f"clipping='groups' takes one max_grad_norm per group, not {max_grad_norm!r} "
                             "(dpgrad.clipping.groups.even_split splits one total)")
        max_grad_norm = [clipping_bound(b, f"max_grad_norm[{i}]") for i, b in enumerate(max_grad_norm)]
    elif clipping == "flat":
        if isinstance(max_grad_norm, (list, tuple)):
            raise ValueError("flat clipping takes one max_grad_norm, not a list of per-layer bounds: give "
                             "clipping='per_layer' for those")
        max_grad_norm = clipping_bound(max_grad_norm)
    else:
        # Opacus's per-layer clipping: one bound per trainable parameter of the optimizer, in its
        # order (a frozen one has none; trained later, it is refused as in no group).
        optimizer_params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if not isinstance(max_grad_norm, (list, tuple)) or len(max_grad_norm) != len(optimizer_params):
            raise ValueError(
                f"clipping='per_layer' takes one max_grad_norm per trainable parameter of the optimizer "
                f"({len(optimizer_params)}), not {max_grad_norm!r}"
            )
        max_grad_norm = [clipping_bound(b, f"max_grad_norm[{i}]") for i, b in enumerate(max_grad_norm)]
        if grad_sample_mode == "ghost":
            clipping_groups = [[p] for p in optimizer_params]
    if single_backward and grad_sample_mode != "ghost":
        raise ValueError(
            f"single_backward=True clips from per-sample norms: it needs grad_sample_mode='ghost', "
            f"not {grad_sample_mode!r}"
        )
    if physical_batch_size is not None:
        if isinstance(physical_batch_size, bool) or not isinstance(physical_batch_size, int) or physical_batch_size < 1:
            raise ValueError(f"physical_batch_size must be a positive integer, not {physical_batch_size!r}")
        if not poisson_sampling or grad_sample_mode != "ghost" or distribution is not None:
            raise ValueError(
                "physical_batch_size pads and splits Poisson batches for dpgrad's loss wrapper: it "
                "needs poisson_sampling=True and grad_sample_mode='ghost', in one process (with "
                "several, ranks would split their shares into different numbers of batches)"
            )
    if cuda_graph:
        _check_capturable(privacy_engine, optimizer, grad_sample_mode=grad_sample_mode, adaptive=adaptive,
                          distributed=distribution is not None, poisson_sampling=poisson_sampling,
                          physical_batch_size=physical_batch_size, recheck_independence=recheck_independence)
    if noise_generator is not None and privacy_engine.secure_mode:
        raise ValueError("Passing seed is prohibited in secure mode")
    distributed = distribution is not None
    if distribution == "fsdp" and grad_sample_mode != "ghost":
        raise ValueError(
            f"the module is sharded by FSDP2 (fully_shard), which dpgrad clips under "
            f"grad_sample_mode='ghost' only, not {grad_sample_mode!r}"
        )
    _check_optimizer_params(module, optimizer)

    privacy_engine.validate(module=module, optimizer=None, data_loader=None)
    module = _wrap(
        module,
        grad_sample_mode=grad_sample_mode,
        batch_first=batch_first,
        loss_reduction=loss_reduction,
        max_grad_norm=max_grad_norm,
        single_backward=single_backward,
        clipping_groups=clipping_groups,
        check_independence=check_independence,
        automatic_gamma=automatic_gamma,
        recheck_independence=recheck_independence,
    )
    if not wrap_model:
        # The model left as it is: its hooks handed out in place of the wrapper (dpgrad.hooks).
        hooks = (dpgrad_hooks.GradSampleHooksFastGradientClipping if grad_sample_mode == "ghost"
                 else dpgrad_hooks.GradSampleHooks)
        module = hooks.of(module)
    if clipping_groups is not None:
        # Ghost clipping clips in the backward pass: the optimizer only adds noise, scaled to the
        # most a sample moves the gradient by, sqrt(sum C_l^2) (Opacus's per-layer total).
        clipping, max_grad_norm = "flat", module.max_grad_norm
    if poisson_sampling:
        module.forbid_grad_accumulation()

    data_loader = privacy_engine._prepare_data_loader(
        data_loader,
        distributed=distributed,
        poisson_sampling=poisson_sampling,
        batch_first=batch_first,
        rand_on_empty=rand_on_empty,
    )
    if distributed and poisson_sampling:
        _sample_independently(data_loader)
    sample_rate = 1 / len(data_loader)
    expected_batch_size = int(len(data_loader.dataset) * sample_rate)
    if distributed:  # per process, as Opacus has it
        expected_batch_size /= torch.distributed.get_world_size()

    optimizer = privacy_engine._prepare_optimizer(
        optimizer=optimizer,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
        loss_reduction=loss_reduction,
        noise_generator=noise_generator,
        distributed=distributed,
        clipping=clipping,
        # Under FSDP2, Opacus's FSDP optimizer: each rank adds the noise of its own shard.
        grad_sample_mode=("ghost_fsdp" if distribution == "fsdp" else
                          "ghost" if grad_sample_mode == "ghost" else "hooks"),
        **kwargs,
    )
    # The same optimizer, its per-parameter loops batched: in one process; under DDP for adaptive
    # clipping, whose noise is scaled by the bound on the device (Opacus's distributed
    # optimizers stay as they are otherwise).
    batched = {_OpacusDPOptimizerFastGradientClipping: DPOptimizerFastGradientClipping}
    if adaptive:
        batched[_OpacusDistributedDPOptimizerFastGradientClipping] = DistributedDPOptimizerFastGradientClipping
    if type(optimizer) in batched:
        optimizer = batched[type(optimizer)](
            optimizer=optimizer.original_optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=optimizer.generator,
            secure_mode=optimizer.secure_mode,
            **kwargs,
        )
    optimizer.attach_step_hook(privacy_engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))

    if grad_sample_mode == "ghost":
        if physical_batch_size is not None:
            data_loader = FixedShapeBatches(data_loader, physical_batch_size, optimizer)
        if criterion is None:
            criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
        if adaptive:
            from dpgrad.clipping.adaptive import DPLossFastGradientAdaptiveClipping

            world = torch.distributed.get_world_size() if distributed else 1
            criterion = DPLossFastGradientAdaptiveClipping(
                module, optimizer, criterion, loss_reduction=loss_reduction, initial_noise_multiplier=noise_multiplier,
                expected_batch_size=expected_batch_size * world if public_batch_size else None, **settings)
        else:
            criterion = DPLossFastGradientClipping(module, optimizer, criterion, loss_reduction=loss_reduction,
                                                   batches=data_loader if physical_batch_size is not None else None)
        return module, optimizer, criterion, data_loader
    return module, optimizer, data_loader
