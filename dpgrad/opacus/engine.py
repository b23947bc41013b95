"""``make_private``: ``PrivacyEngine.make_private`` assembled from the engine's own pieces with
the model wrapped by dpgrad, and ``PrivacyEngineAdaptiveClipping``, Opacus's adaptive-clipping
engine whose ``make_private`` is this one. Its arguments are checked in
``dpgrad.opacus.arguments``, its wrapper built in ``dpgrad.opacus.wrapping``, and Opacus's DP
optimizer replaced by dpgrad's batched one (``dpgrad.opacus.optimizers``) here."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from opacus.optimizers import DPOptimizerFastGradientClipping as _OpacusDPOptimizerFastGradientClipping
from opacus.optimizers import FSDPOptimizerFastGradientClipping as _OpacusFSDPOptimizerFastGradientClipping
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping as _OpacusDistributedDPOptimizerFastGradientClipping,
)
from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping as _OpacusPrivacyEngineAdaptiveClipping

from dpgrad.batches import FixedShapeBatches, rank_generator
from dpgrad import hooks as dpgrad_hooks
from dpgrad.loss import DPLossFastGradientClipping
from dpgrad.opacus.arguments import (_check_capturable, _check_optimizer_params, _clipping_settings,
                                     _resolved_mode)
from dpgrad.opacus.optimizers import (DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping,
                                     FSDPOptimizerFastGradientClipping)
from dpgrad.opacus.wrapping import _wrap


class PrivacyEngineAdaptiveClipping(_OpacusPrivacyEngineAdaptiveClipping):
    """Opacus 1.6's ``PrivacyEngineAdaptiveClipping`` whose ``make_private`` is dpgrad's
    (``make_private`` below with this engine: ghost clipping, dpgrad's wrapper and
    ``dpgrad.DPLossFastGradientAdaptiveClipping``). The same keywords: the adaptive ones
    (``target_unclipped_quantile``, ``min_clipbound``, ``max_clipbound``,
    ``clipbound_learning_rate``) and dpgrad's ``public_batch_size``."""

    def make_private(self, **kwargs):
        return make_private(self, **kwargs)


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


def _batched(optimizer, kwargs: dict, *, noise_multiplier: float, max_grad_norm, expected_batch_size,
             loss_reduction: str):
    """The DP optimizer the engine prepared for ghost clipping, as dpgrad's (``kwargs``: the
    keywords it was built with): the same arguments, its step as ``dpgrad.opacus.optimizers.StepOnce``
    takes it, its per-parameter loops batched in one process and under DDP."""
    ours = {_OpacusDPOptimizerFastGradientClipping: DPOptimizerFastGradientClipping,
            _OpacusDistributedDPOptimizerFastGradientClipping: DistributedDPOptimizerFastGradientClipping,
            _OpacusFSDPOptimizerFastGradientClipping: FSDPOptimizerFastGradientClipping}
    if type(optimizer) in ours:
        optimizer = ours[type(optimizer)](
            optimizer=optimizer.original_optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=optimizer.generator,
            secure_mode=optimizer.secure_mode,
            **kwargs,
        )
    return optimizer


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
    ``DPOptimizerFastGradientClipping`` of ``dpgrad.opacus``, with the same arguments), its
    accountant (hooked on ``optimizer.step``) and, under
    ghost clipping, dpgrad's ``DPLossFastGradientClipping`` (Opacus's signature; its backward
    computes no weight gradient it throws away). So ``privacy_engine.get_epsilon`` accounts
    for training done with the returned objects.

    A ``module`` in ``torch.nn.parallel.DistributedDataParallel`` (or Opacus's DPDDP) is
    trained distributed, as Opacus does it: dpgrad's wrapper goes around it, each process
    draws its own share of the Poisson batches (with a generator of its own: see
    ``_sample_independently``), and the distributed optimizer (dpgrad's, batched) adds the
    noise once, on rank 0, before summing over the processes. The norm pass of ghost clipping
    computes no parameter gradients, so DistributedDataParallel reduces nothing until the
    clipped gradients exist.

    A ``module`` sharded by FSDP2 (``fully_shard`` on its blocks and its root) is trained
    the same way under ``grad_sample_mode="ghost"`` (``dpgrad.backward.fsdp``): the clipped sums reach
    the sharded gradients through FSDP's reduce-scatter, and Opacus's
    ``FSDPOptimizerFastGradientClipping`` (dpgrad's subclass) adds the noise: each rank draws it for the whole
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
    distribution, grad_sample_mode = _resolved_mode(module, grad_sample_mode)
    adaptive, settings, clipping, max_grad_norm, clipping_groups, automatic_gamma = _clipping_settings(
        privacy_engine, optimizer, kwargs, clipping=clipping, max_grad_norm=max_grad_norm,
        clipping_groups=clipping_groups, automatic_gamma=automatic_gamma, public_batch_size=public_batch_size,
        grad_sample_mode=grad_sample_mode, distribution=distribution, physical_batch_size=physical_batch_size)
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
        # Under FSDP2, the FSDP optimizer: each rank adds the noise of its own shard.
        grad_sample_mode=("ghost_fsdp" if distribution == "fsdp" else
                          "ghost" if grad_sample_mode == "ghost" else "hooks"),
        **kwargs,
    )
    optimizer = _batched(optimizer, kwargs, noise_multiplier=noise_multiplier,
                         max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
                         loss_reduction=loss_reduction)
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


def make_private_with_epsilon(
    privacy_engine,
    *,
    module: nn.Module,
    optimizer,
    data_loader,
    target_epsilon: float,
    target_delta: float,
    epochs: int,
    max_grad_norm,
    epsilon_tolerance: float = 0.01,
    **kwargs,
):
    """``PrivacyEngine.make_private_with_epsilon`` with the model wrapped by dpgrad.

    The noise multiplier is the one Opacus's ``make_private_with_epsilon`` computes: the
    smallest that the engine's accountant says reaches ``(target_epsilon, target_delta)``
    (within ``epsilon_tolerance`` below the target) after ``epochs`` passes over
    ``data_loader``, at Opacus's sample rate ``1 / len(data_loader)``. Then
    ``make_private(privacy_engine, ..., noise_multiplier=that)``: every other keyword
    (``criterion``, ``grad_sample_mode``, ``single_backward``, ``clipping``, ...) is
    ``make_private``'s, with its defaults. ``privacy_engine.get_epsilon(target_delta)`` after
    ``epochs * len(data_loader)`` steps is then at most ``target_epsilon``.

    As in Opacus, a warning when the accountant has recorded steps already (the noise is
    planned from none), and a ValueError for a budget or a number of epochs that is not
    positive. A warning also when ``target_delta`` is at least ``1 / len(dataset)``: a
    mechanism that published one sample at random would meet such a delta.
    """
    import warnings

    from dpgrad.opacus.budget import accountant_quiet, noise_multiplier, warn_if_delta_large

    if not target_epsilon > 0 or not 0 < target_delta < 1:
        raise ValueError(f"the budget needs target_epsilon > 0 and 0 < target_delta < 1, not "
                         f"({target_epsilon!r}, {target_delta!r})")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, not {epochs!r}")
    if len(privacy_engine.accountant) > 0:
        warnings.warn("make_private_with_epsilon with privacy budget already spent: the noise is planned for "
                      "the new steps alone, so the whole training spends more than target_epsilon", stacklevel=2)
    rows = len(getattr(data_loader, "dataset", ()) or ())
    warn_if_delta_large(target_delta, rows)
    mechanism = privacy_engine.accountant.mechanism()
    sample_rate = 1 / len(data_loader)
    with accountant_quiet(mechanism):
        noise = noise_multiplier(
            target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate,
            steps=int(epochs / sample_rate), mechanism=mechanism, epsilon_tolerance=epsilon_tolerance,
        )
    return make_private(privacy_engine, module=module, optimizer=optimizer, data_loader=data_loader,
                        noise_multiplier=noise, max_grad_norm=max_grad_norm, **kwargs)
