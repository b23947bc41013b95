"""The one registry of per-layer samplers.

A grad sampler computes per-sample gradients and a norm sampler per-sample gradient norms;
both have Opacus's signature ``fn(layer, activations, backprops) -> {parameter: tensor}``,
with ``activations`` the list of the layer's inputs and ``backprops`` the gradient of each
sample's loss w.r.t. the layer output, batch first. A clipped-sum sampler,
``fn(layer, activations, backprops, coef) -> {parameter: sum_b coef_b * gradient_b}``, gives
the clipped gradient of a layer from the same inputs, without per-sample gradients; the
single-backward mode needs one for every layer it clips from norms alone.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Type, Union

import torch.nn as nn

Sampler = Callable
GRAD_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
NORM_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
CLIPPED_SUM_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}


def _classes(target: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    return list(target) if isinstance(target, Sequence) else [target]


def _register(table: Dict[Type[nn.Module], Sampler], target_class_or_classes):
    def decorator(fn: Sampler) -> Sampler:
        for cls in _classes(target_class_or_classes):
            table[cls] = fn
        return fn

    return decorator


def register_grad_sampler(target_class_or_classes: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    """Decorator: register ``fn(layer, activations, backprops)`` as the grad sampler of a layer type.

    The function returns ``{parameter: per-sample gradient of shape (B, *parameter.shape)}``.
    """
    return _register(GRAD_SAMPLERS, target_class_or_classes)


def register_norm_sampler(target_class_or_classes: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    """Decorator: register ``fn(layer, activations, backprops)`` as the norm sampler of a layer type.

    The function returns ``{parameter: per-sample gradient L2 norm of shape (B,)}`` without
    materialising per-sample gradients; it is used under ghost clipping.
    """
    return _register(NORM_SAMPLERS, target_class_or_classes)


def register_clipped_sum_sampler(target_class_or_classes: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
    """Decorator: register ``fn(layer, activations, backprops, coef)`` as the clipped-sum sampler
    of a layer type.

    ``coef`` is (B,); the function returns ``{parameter: sum_b coef_b * per-sample gradient_b}``
    of the parameter's shape and dtype, without materialising per-sample gradients. With a
    norm sampler it lets the single-backward mode clip the layer from its inputs and backprops.
    """
    return _register(CLIPPED_SUM_SAMPLERS, target_class_or_classes)
