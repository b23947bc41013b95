"""``make_private``'s arguments, checked and resolved before it builds anything: how the model
is distributed and the wrapper's mode, the clipping (flat, per layer, groups, automatic or
adaptive) with its bounds, the parameters the optimizer holds, and what ``cuda_graph=True``
refuses. Each raises the ``ValueError`` that ``make_private`` documents."""

from __future__ import annotations

from itertools import chain
from typing import Optional

import torch.nn as nn
from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping as _OpacusPrivacyEngineAdaptiveClipping

from dpgrad.backward.fsdp import sharded_modules
from dpgrad.clipping.coefficients import clipping_bound
from dpgrad.fast_gradient_clipping import automatic_settings
from dpgrad.opacus.wrapping import _WRAPPERS

# The adaptive rule's keywords (Opacus's), with their defaults.
ADAPTIVE_SETTINGS = {"target_unclipped_quantile": 0.5, "min_clipbound": 1, "max_clipbound": 1e8,
                     "clipbound_learning_rate": 0.2}


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


def _resolved_mode(module: nn.Module, grad_sample_mode: str):
    """``(distribution, grad_sample_mode)``: how ``module`` is distributed (``_distribution``)
    and the wrapper's mode, Opacus's "ghost_fsdp" read as "ghost" on a sharded model (on another,
    refused, as is a mode dpgrad has no wrapper for)."""
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
    return distribution, grad_sample_mode


def _clipping_settings(privacy_engine, optimizer, kwargs: dict, *, clipping: str, max_grad_norm, clipping_groups,
                       automatic_gamma: Optional[float], public_batch_size: bool, grad_sample_mode: str,
                       distribution: Optional[str], physical_batch_size: Optional[int]):
    """``make_private``'s clipping, checked: ``(adaptive, settings, clipping, max_grad_norm,
    clipping_groups, automatic_gamma)``, whether the clipping is adaptive, the adaptive rule's
    keywords (taken out of ``kwargs``, the optimizer's keywords, with their defaults), and the
    clipping as the wrapper takes it: "flat", "per_layer" or "groups", the bounds checked, under
    "ghost" per-layer clipping as one group per parameter, automatic clipping's gamma or None."""
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
    return adaptive, settings, clipping, max_grad_norm, clipping_groups, automatic_gamma


def _check_optimizer_params(module: nn.Module, optimizer) -> None:
    model_parameters = set(module.parameters())
    for p in chain.from_iterable(group["params"] for group in optimizer.param_groups):
        if p not in model_parameters:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                "parameter of the module: build the optimizer from module.parameters()"
            )


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
