"""dpgrad: fast differentially private training (DP-SGD) for PyTorch.

Drop-in replacements for Opacus's wrappers: ``GradSampleModule`` (per-sample gradients) and
``GradSampleModuleFastGradientClipping`` (per-sample gradient norms, ghost clipping; its
``...FSDP`` twin for models sharded by FSDP2), and for its loss wrapper
``DPLossFastGradientClipping`` (one backward pass with ``single_backward=True``) and Opacus
1.6's adaptive ``DPLossFastGradientAdaptiveClipping`` (``dpgrad.clipping.adaptive``); its hooks objects
``GradSampleHooks`` and ``GradSampleHooksFastGradientClipping`` leave the model unwrapped
(``dpgrad.hooks``).
"""

from .supported_versions import warn_if_unsupported

warn_if_unsupported()  # first: an unsupported torch may break the imports below

from . import _moved, samplers  # noqa: F401  (the earlier module paths; the built-in samplers registered)
from .clipping.adaptive import DPLossFastGradientAdaptiveClipping, DPTensorFastGradientAdaptiveClipping
from .fast_gradient_clipping import GradSampleModuleFastGradientClipping, GradSampleModuleFastGradientClippingFSDP
from .grad_sample_module import GradSampleModule
from .graphs import GraphedStep, graphed_step
from .checks.guarantee import UnclippedGradientError
from .hooks import GradSampleHooks, GradSampleHooksFastGradientClipping
from .checks.independence import SampleMixingError
from .loss import DPLossFastGradientClipping, DPTensorFastGradientClipping
from .samplers.registry import (
    CLIPPED_SUM_SAMPLERS,
    GRAD_SAMPLERS,
    NORM_SAMPLERS,
    register_clipped_sum_sampler,
    register_grad_sampler,
    register_norm_sampler,
)

from .version import __version__  # noqa: F401

__all__ = [
    "CLIPPED_SUM_SAMPLERS",
    "DPLossFastGradientAdaptiveClipping",
    "DPLossFastGradientClipping",
    "DPTensorFastGradientAdaptiveClipping",
    "DPTensorFastGradientClipping",
    "GRAD_SAMPLERS",
    "NORM_SAMPLERS",
    "GradSampleHooks",
    "GradSampleHooksFastGradientClipping",
    "GradSampleModule",
    "GradSampleModuleFastGradientClipping",
    "GradSampleModuleFastGradientClippingFSDP",
    "GraphedStep",
    "SampleMixingError",
    "UnclippedGradientError",
    "graphed_step",
    "register_clipped_sum_sampler",
    "register_grad_sampler",
    "register_norm_sampler",
]
