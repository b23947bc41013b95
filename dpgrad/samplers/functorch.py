"""Per-sample gradients of any layer through ``torch.func`` (vmap of grad).

Used for layers with trainable parameters but no registered grad sampler, and for every
layer under ``force_functorch=True``. The layer's forward is re-run on one sample at a time,
vectorised by vmap, on a parameter-free copy of the layer.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from dpgrad.kernels.backend import first_line, layer_name


def _meta_copy(layer: nn.Module) -> nn.Module:
    """A deep copy of ``layer`` whose parameters live on the meta device (no weight copies)."""
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in layer.parameters()
    }
    clone = copy.deepcopy(layer, memo)
    # Hooks of the live layer must not run inside the functional re-computation.
    for m in clone.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    return clone


class Keywords:
    """A call's keyword arguments other than tensors, kept last among its inputs: the forward
    is run again with them."""

    __slots__ = ("values",)

    def __init__(self, values: dict):
        self.values = values


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


# What ``FunctionalGradients.follow`` leaves as the copy has it: its own parameters on the meta
# device, its submodules, and itself.
_STRUCTURE = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                        "ft_compute_sample_grad"))


class FunctionalGradients:
    """``(params, activations, backprops) -> {name: (B, ...)}``: per-sample gradients of one
    layer through torch.func, on a parameter-free copy of it (so a copy or a pickle of the
    layer takes this along without its weights). ``params`` maps the layer's parameter names to
    tensors; gradients are returned for those that require grad."""

    def __init__(self, layer: nn.Module, batch_first: bool = True):
        self.stateless = _meta_copy(layer)
        # Each sample is fed back with a batch dimension of one, where the layer expects it.
        self.batch_dim = 0 if batch_first else 1

    def follow(self, layer: nn.Module) -> None:
        """Give the copy the live layer's state other than its parameters, buffers, submodules
        and hooks, as it is now (an attribute set after wrapping, train or eval mode): the
        per-sample gradients are those of the forward pass that ran, not of the layer as it was
        when copied."""
        live = list(layer.modules())
        copies = list(self.stateless.modules())
        if len(live) != len(copies):  # submodules changed without a new hooking
            self.stateless = _meta_copy(layer)
            return
        for mine, theirs in zip(copies, live):
            for key, value in theirs.__dict__.items():
                if key not in _STRUCTURE and "hook" not in key:
                    mine.__dict__[key] = value

    def __call__(self, params: Dict[str, torch.Tensor], activations: List, backprops: torch.Tensor):
        keywords = {}
        if activations and isinstance(activations[-1], Keywords):
            keywords, activations = activations[-1].values, activations[:-1]
        names = [n for n, p in params.items() if p.requires_grad]
        frozen = {n: p.detach() for n, p in params.items() if not p.requires_grad}
        if backprops.shape[0] == 0:
            # vmap over an empty batch fails in some layers' backward (nn.Embedding's).
            return {n: params[n].new_zeros((0, *params[n].shape)) for n in names}
        stateless, batch_dim = self.stateless, self.batch_dim

        def sample_loss(trainable, acts, bp):
            inputs = tuple(a.unsqueeze(batch_dim) if isinstance(a, torch.Tensor) else a for a in acts)
            out = functional_call(stateless, {**frozen, **dict(zip(names, trainable))}, inputs, keywords)
            return (_first_tensor(out) * bp.unsqueeze(batch_dim)).sum()

        in_dims = (None, tuple(0 if isinstance(a, torch.Tensor) else None for a in activations), 0)
        trainable = tuple(params[n].detach() for n in names)
        grads = vmap(grad(sample_loss), in_dims=in_dims)(trainable, tuple(activations), backprops)
        return dict(zip(names, grads))


def prepare_layer(layer: nn.Module, batch_first: bool = True) -> None:
    """Attach ``layer.ft_compute_sample_grad`` (a ``FunctionalGradients``). Raises
    NotImplementedError for layers with buffers."""
    if len(list(layer.buffers())) > 0:
        raise NotImplementedError(
            f"{type(layer).__name__} has buffers; their state is shared across samples, so "
            "per-sample gradients are undefined"
        )
    layer.ft_compute_sample_grad = FunctionalGradients(layer, batch_first)


def ft_compute_per_sample_gradient(
    layer: nn.Module, activations: List, backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Grad sampler for any layer: ``{parameter: (B, *parameter.shape)}`` via torch.func."""
    if not hasattr(layer, "ft_compute_sample_grad"):
        prepare_layer(layer)
    params = dict(layer.named_parameters())
    acts = [
        a.to(backprops.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in activations
    ]
    compute = layer.ft_compute_sample_grad
    compute.follow(layer)
    try:
        grads = compute(params, acts, backprops)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        if "vmap" not in str(exc):
            raise
        raise RuntimeError(
            f"layer {layer_name(layer)} has no per-sample gradient sampler, so torch.func computes its "
            f"per-sample gradients by running its forward on one sample at a time under vmap, and that "
            f"forward cannot run so ({first_line(exc)}): it depends on the values of its inputs (it picks "
            "rows by index, with nonzero, where or .item(), as a hand-written mixture-of-experts layer does; "
            "transformers' grouped experts have dpgrad's samplers). "
            "Freeze the layer (requires_grad_(False)) and train the others (or adapters such as LoRA), or "
            "register a grad sampler for its type (dpgrad.register_grad_sampler)."
        ) from exc
    return {params[name]: g for name, g in grads.items()}
