"""dpgrad: fast differentially private training (DP-SGD) for PyTorch.

Drop-in replacements for Opacus's wrappers: ``GradSampleModule`` (per-sample gradients) and
``GradSampleModuleFastGradientClipping`` (per-sample gradient norms, ghost clipping).
"""

from . import samplers  # noqa: F401  (registers the built-in samplers)
from .fast_gradient_clipping import GradSampleModuleFastGradientClipping
from .grad_sample_module import GradSampleModule
from .registry import GRAD_SAMPLERS, NORM_SAMPLERS, register_grad_sampler, register_norm_sampler

__version__ = "0.1.0"

__all__ = [
    "GRAD_SAMPLERS",
    "NORM_SAMPLERS",
    "GradSampleModule",
    "GradSampleModuleFastGradientClipping",
    "register_grad_sampler",
    "register_norm_sampler",
]
