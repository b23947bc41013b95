"""Optional integration with an installed Opacus (1.6): use dpgrad with ``PrivacyEngine``.

Three ways in:

* ``make_private(engine, ...)``: like ``PrivacyEngine.make_private``, but the model is wrapped
  by dpgrad's ``GradSampleModule`` / ``GradSampleModuleFastGradientClipping`` and, under ghost
  clipping, the loss by dpgrad's ``DPLossFastGradientClipping`` (``single_backward=True`` for
  one backward pass); the data loader and the privacy accounting are Opacus's, and so is the
  optimizer, batched under ghost clipping (``DPOptimizerFastGradientClipping`` below).
  ``make_private_with_epsilon(engine, ...)`` takes a budget in place of the noise multiplier,
  as ``PrivacyEngine.make_private_with_epsilon`` does.
* ``DPOptimizerFastGradientClipping``: Opacus's DP optimizer for ghost clipping (same
  arguments, accounting and noise), with its per-parameter loops done as a few batched
  operations; ``make_private`` returns it under ghost clipping in one process.
* ``register_with_opacus()``: put dpgrad's samplers for Linear, Embedding, LayerNorm and
  RMSNorm into Opacus's registries, so that Opacus's own wrappers use them. Returns a handle
  that undoes it (``.unregister()`` or ``with``).

``make_private``, ``make_private_with_epsilon`` and ``PrivacyEngineAdaptiveClipping`` are in
``engine`` (their checks of the arguments in ``arguments``, the wrapper in ``wrapping``), the DP
optimizers in ``optimizers``, ``register_with_opacus`` in ``registration``; all of them are
importable from here.

This package imports Opacus and is never imported by ``dpgrad/__init__.py``; import it only
where Opacus is installed (``pip install dpgrad[opacus]``).
"""

from dpgrad.opacus.engine import PrivacyEngineAdaptiveClipping, make_private, make_private_with_epsilon
from dpgrad.opacus.optimizers import (DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping,
                                     FSDPOptimizerFastGradientClipping)
from dpgrad.opacus.registration import OpacusRegistration, register_with_opacus

# Importable from here too: the default settings.
from dpgrad.opacus.arguments import ADAPTIVE_SETTINGS  # noqa: F401
from dpgrad.opacus.registration import DEFAULT_LAYERS  # noqa: F401

__all__ = ["DPOptimizerFastGradientClipping", "DistributedDPOptimizerFastGradientClipping",
           "FSDPOptimizerFastGradientClipping", "OpacusRegistration",
           "PrivacyEngineAdaptiveClipping", "make_private", "make_private_with_epsilon", "register_with_opacus"]
