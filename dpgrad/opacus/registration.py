"""``register_with_opacus``: dpgrad's samplers put into Opacus's own registries, so that
Opacus's wrappers use them, and ``OpacusRegistration``, the handle that puts Opacus's back."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, Type

import torch.nn as nn
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)

from dpgrad.samplers import registry

# Layer types whose samplers register_with_opacus hands to Opacus by default.
DEFAULT_LAYERS: Tuple[Type[nn.Module], ...] = tuple(
    cls for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, getattr(nn, "RMSNorm", None)) if cls is not None
)

_MISSING = object()


class OpacusRegistration:
    """What ``register_with_opacus`` replaced in Opacus's registries, and how to put it back.

    ``replaced`` maps ``(registry name, layer type)`` to Opacus's previous sampler (None where
    there was none). Call ``unregister()`` (idempotent) or use the object as a context manager.
    """

    def __init__(self, changes: List[Tuple[str, Dict, Type[nn.Module], object]]):
        self._changes = changes
        self.active = True

    @property
    def replaced(self) -> Dict[Tuple[str, Type[nn.Module]], Optional[object]]:
        return {(name, cls): (None if old is _MISSING else old) for name, _, cls, old in self._changes}

    def unregister(self) -> None:
        """Restore Opacus's registries as they were before ``register_with_opacus``."""
        if not self.active:
            return
        for _, table, cls, old in reversed(self._changes):
            if old is _MISSING:
                table.pop(cls, None)
            else:
                table[cls] = old
        self.active = False

    def __enter__(self) -> "OpacusRegistration":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()

    def __repr__(self) -> str:
        names = sorted({f"{name}[{cls.__name__}]" for name, _, cls, _ in self._changes})
        return f"OpacusRegistration(active={self.active}, entries={names})"


def register_with_opacus(layers: Iterable[Type[nn.Module]] = DEFAULT_LAYERS) -> OpacusRegistration:
    """Make Opacus's own wrappers use dpgrad's samplers for ``layers``.

    Opacus 1.6 keeps one grad-sampler dict, shared by ``GradSampleModule`` and
    ``GradSampleModuleFastGradientClipping`` (``GradSampleHooks.GRAD_SAMPLERS``), and one
    norm-sampler dict (``GradSampleHooksFastGradientClipping.NORM_SAMPLERS``). For each layer
    type, dpgrad's grad sampler and norm sampler, where dpgrad has one, replace Opacus's.
    Among other things this gives correct per-sample gradients and norms for an
    ``nn.Embedding`` with ``padding_idx`` (Opacus counts the padding positions).

    Returns:
        An ``OpacusRegistration``; its ``unregister()`` restores Opacus's samplers.

    Example::

        with dpgrad.opacus.register_with_opacus():
            model, optimizer, data_loader = PrivacyEngine().make_private(...)
            train(model)  # Opacus's wrapper, dpgrad's samplers
    """
    tables = [
        ("GRAD_SAMPLERS", GradSampleHooks.GRAD_SAMPLERS, registry.GRAD_SAMPLERS),
        ("NORM_SAMPLERS", GradSampleHooksFastGradientClipping.NORM_SAMPLERS, registry.NORM_SAMPLERS),
    ]
    changes = []
    for cls in layers:
        for name, opacus_table, ours in tables:
            if cls in ours:
                changes.append((name, opacus_table, cls, opacus_table.get(cls, _MISSING)))
                opacus_table[cls] = ours[cls]
    return OpacusRegistration(changes)
