"""The model left as it is: Opacus 1.6's ``GradSampleHooks`` and
``GradSampleHooksFastGradientClipping`` (``make_private(wrap_model=False)``).

dpgrad's wrappers put every hook on the model itself (its layers, and its own pre- and
post-forward hooks, which begin and end a pass when the model is called directly); the wrapper
module only holds it. A hooks object holds a wrapper built on the model but hands out the model:
the caller trains ``model`` itself, which keeps its class (``isinstance(model,
LlamaForCausalLM)``), its attributes and its ``state_dict`` keys (no ``_module.`` prefix). The
hooks object answers what the wrapper answers (``get_norm_sample``, ``get_clipping_coef``,
``per_sample_gradient_norms``, ``max_grad_norm``, ``enable_hooks``/``disable_hooks``,
``cleanup``, ``clipped_backward``...), ``_module`` is the model, and ``cleanup()`` takes every
hook and per-parameter field off it again. Everything the wrapper does holds: the guarantee,
tied weights, LoRA, accumulation, per-block clipping, DDP and FSDP2 (hooks on the
``DistributedDataParallel`` or the sharded model, which the caller calls).
"""

from __future__ import annotations

import torch.nn as nn

from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.grad_sample_module import GradSampleModule


class _Hooks:
    """A wrapper built on ``m`` that the caller does not call: ``m`` is called instead."""

    _wrapper_class: type = GradSampleModule

    def __init__(self, m: nn.Module, **kwargs):
        if isinstance(m, GradSampleModule):
            raise ValueError(f"the model is already wrapped ({type(m).__name__}): give the model itself")
        self.__dict__["_wrapper"] = self._wrapper_class(m, **kwargs)

    @classmethod
    def of(cls, wrapper: GradSampleModule) -> "_Hooks":
        """The hooks object of a wrapper already built (``make_private(wrap_model=False)``)."""
        if not isinstance(wrapper, cls._wrapper_class):
            raise TypeError(f"{cls.__name__} holds a {cls._wrapper_class.__name__}, not a {type(wrapper).__name__}")
        hooks = object.__new__(cls)
        hooks.__dict__["_wrapper"] = wrapper
        return hooks

    @property
    def wrapper(self):
        """The wrapper holding the hooks (not to be called: call the model)."""
        return self.__dict__["_wrapper"]

    def __getattr__(self, name):
        wrapper = self.__dict__.get("_wrapper")
        if wrapper is None:  # a copy being made (copy.deepcopy, pickle) asks before it holds one
            raise AttributeError(name)
        return getattr(wrapper, name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_wrapper"], name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._module!r})"


class GradSampleHooks(_Hooks):
    """Opacus 1.6's ``GradSampleHooks``: ``dpgrad.GradSampleModule``'s hooks on the model
    itself (same keywords), per-sample gradients in ``p.grad_sample`` after a backward pass of
    the model's own loss."""

    _wrapper_class = GradSampleModule


class GradSampleHooksFastGradientClipping(_Hooks):
    """Opacus 1.6's ``GradSampleHooksFastGradientClipping``:
    ``dpgrad.GradSampleModuleFastGradientClipping``'s hooks on the model itself (same keywords,
    every clipping and ``single_backward`` included); ``dpgrad.DPLossFastGradientClipping``
    takes it in place of the wrapper."""

    _wrapper_class = GradSampleModuleFastGradientClipping


__all__ = ["GradSampleHooks", "GradSampleHooksFastGradientClipping"]
