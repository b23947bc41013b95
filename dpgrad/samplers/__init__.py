"""Per-layer samplers, one module per layer type; importing this package registers them."""

from . import conv, embedding, experts, linear, lora_params, norms  # noqa: F401  (registration side effects)
from .functorch import ft_compute_per_sample_gradient, prepare_layer

__all__ = ["ft_compute_per_sample_gradient", "prepare_layer"]
