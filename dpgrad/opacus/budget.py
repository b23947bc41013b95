"""The privacy budget's default delta, its warning, and the accountants' calls without the
warning that does not apply: shared by ``make_private_with_epsilon`` and ``DPTrainer``.

* ``default_delta(n)`` is ``n ** -1.1``: below ``1 / n`` by a factor that grows with ``n``
  (the rule of Li et al., 2022, for private fine-tuning).
* ``warn_if_delta_large(delta, n)`` warns when ``delta >= 1 / n``: a mechanism that
  published one of ``n`` samples outright would meet such a delta.
* ``accountant_quiet(mechanism)``: Opacus's PRV accountant bounds its domain with an RDP
  bound, which warns that its "optimal order is the largest alpha"; the warning is about that
  inner bound, not the epsilon PRV reports, so it is silenced for PRV (not for RDP, whose
  epsilon it is about).
"""

from __future__ import annotations

import contextlib
import warnings

DELTA_EXPONENT = 1.1
RDP_ALPHA_WARNING = "Optimal order is the largest alpha"


def default_delta(samples: int) -> float:
    """``samples ** -1.1``: the delta used when none is given (``samples`` rows, or users)."""
    return float(samples) ** -DELTA_EXPONENT


def warn_if_delta_large(delta: float, samples: int, stacklevel: int = 2) -> None:
    """Warn when ``delta`` is at least ``1 / samples``."""
    if samples and delta >= 1 / samples:
        warnings.warn(f"target_delta={delta:g} is at least 1/N for N={samples} samples: a mechanism that "
                      f"published one sample outright would meet it; take target_delta well below 1/N "
                      f"(for instance N^-{DELTA_EXPONENT:g} = {default_delta(samples):.2g})",
                      stacklevel=stacklevel + 1)


@contextlib.contextmanager
def accountant_quiet(mechanism: str):
    """Run an accountant's calls without RDP's alpha-range warning when ``mechanism`` is
    ``"prv"`` (it concerns the PRV accountant's inner domain bound only)."""
    with warnings.catch_warnings():
        if mechanism == "prv":
            warnings.filterwarnings("ignore", message=RDP_ALPHA_WARNING)
        yield
