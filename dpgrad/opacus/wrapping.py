"""The dpgrad wrapper ``make_private`` puts around the model, by ``grad_sample_mode``, with the
clipping it resolved; a module that already is a dpgrad wrapper is reused only if it is the
one this call would build."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping, GradSampleModuleFastGradientClippingFSDP
from dpgrad.grad_sample_module import GradSampleModule

# grad_sample_mode -> the dpgrad wrapper that make_private builds.
_WRAPPERS = {
    "ghost": GradSampleModuleFastGradientClipping,
    "hooks": GradSampleModule,
    "functorch": GradSampleModule,
}


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
