"""The one registry of per-layer samplers.

A grad sampler computes per-sample gradients and a norm sampler per-sample gradient norms;
both have Opacus's signature ``fn(layer, activations, backprops) -> {parameter: tensor}``,
with ``activations`` the list of the layer's inputs and ``backprops`` the gradient of each
sample's loss w.r.t. the layer output, batch first.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Type, Union

import torch.nn as nn

Sampler = Callable
GRAD_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
NORM_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}


def _classes(target: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    return list(target) if isinstance(target, Sequence) else [target]


def register_grad_sampler(target_class_or_classes: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    """Decorator: register ``fn(layer, activations, backprops)`` as the grad sampler of a layer type.

    The function returns ``{parameter: per-sample gradient of shape (B, *parameter.shape)}``.
    """

    def decorator(fn: Sampler) -> Sampler:
        for cls in _classes(target_class_or_classes):
            GRAD_SAMPLERS[cls] = fn
        return fn

    return decorator


def register_norm_sampler(target_class_or_classes: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    """Decorator: register ``fn(layer, activations, backprops)`` as the norm sampler of a layer type.

    The function returns ``{parameter: per-sample gradient L2 norm of shape (B,)}`` without
    materialising per-sample gradients; it is used under ghost clipping.
    """

    def decorator(fn: Sampler) -> Sampler:
        for cls in _classes(target_class_or_classes):
            NORM_SAMPLERS[cls] = fn
        return fn

    return decorator
