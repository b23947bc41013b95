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
* ``create_accountant(mechanism)`` and ``noise_multiplier(...)``: Opacus's, but the RDP of one
  step at a (sample rate, noise) is computed once per process (``RDPAccountant``, and the RDP
  bound that sizes ``PRVAccountant``'s domain): Opacus's computes it afresh, for every entry of
  the history, at each ``get_epsilon`` (a series per fractional order, tenths of a second each
  time), and the Trainer asks at every log, the budget's search for the steps it allows at each
  of its halvings, and the noise's search for each sigma it tries. The numbers are Opacus's own:
  ``compute_rdp`` is the one step's RDP times the steps, here as there.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
from opacus.accountants import PRVAccountant as OpacusPRVAccountant
from opacus.accountants import RDPAccountant as OpacusRDPAccountant
from opacus.accountants import create_accountant as opacus_create_accountant

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


@functools.lru_cache(maxsize=4096)
def _rdp_of_one_step(sample_rate: float, noise_multiplier: float, orders: Tuple[float, ...]) -> np.ndarray:
    from opacus.accountants.analysis import rdp

    out = rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders))
    out.flags.writeable = False  # shared by every later call
    return out


class RDPAccountant(OpacusRDPAccountant):
    """Opacus's RDP accountant (its history, steps and state dict), the RDP of one step at each
    (sample rate, noise) of its history computed once per process."""

    def get_privacy_spent(self, *, delta: float, alphas: Optional[Sequence[float]] = None) -> Tuple[float, float]:
        from opacus.accountants.analysis import rdp

        if not self.history:
            return 0, 0
        orders = tuple(self.DEFAULT_ALPHAS if alphas is None else alphas)
        spent = sum([_rdp_of_one_step(rate, noise, orders) * steps for noise, rate, steps in self.history])
        epsilon, order = rdp.get_privacy_spent(orders=list(orders), rdp=spent, delta=delta)
        return float(epsilon), float(order)


class PRVAccountant(OpacusPRVAccountant):
    """Opacus's PRV accountant, the RDP bounds that size its domain from ``RDPAccountant``: the
    domain of Opacus's ``_get_domain`` (its ``compute_safe_domain_size``: the largest of the
    whole history's RDP epsilon at delta_error / 4 and each entry's one step at delta_error / (8
    x steps), at least eps_error, plus 3; the mesh for ``eps_error``), each step's RDP computed
    once. That bound is most of the time of Opacus's ``get_epsilon``."""

    def _get_domain(self, prvs, num_self_compositions, eps_error, delta_error):
        from opacus.accountants.analysis.prv.domain import Domain

        total = sum(num_self_compositions)
        rdp = RDPAccountant()
        rdp.history = [(prv.noise_multiplier, prv.sample_rate, steps) for prv, steps in zip(prvs, num_self_compositions)]
        bound = rdp.get_epsilon(delta_error / 4)
        for prv in prvs:
            rdp.history = [(prv.noise_multiplier, prv.sample_rate, 1)]
            bound = max(bound, rdp.get_epsilon(delta=delta_error / (8 * total)))
        half_width = max(bound, eps_error) + 3
        mesh_size = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
        return Domain.create_aligned(-half_width, half_width, mesh_size)


ACCOUNTANTS = {"rdp": RDPAccountant, "prv": PRVAccountant}


def create_accountant(mechanism: str):
    """Opacus's accountant for ``mechanism``; the RDP and PRV ones as ``RDPAccountant`` and
    ``PRVAccountant`` here."""
    return ACCOUNTANTS[mechanism]() if mechanism in ACCOUNTANTS else opacus_create_accountant(mechanism)


def noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                     mechanism: str, epsilon_tolerance: float = 0.01) -> float:
    """Opacus's ``get_noise_multiplier`` (the same search: sigma doubled from 20 until epsilon
    is at most the target, then halved intervals until it is within ``epsilon_tolerance`` below
    it), with ``create_accountant``'s accountant: the same noise, each sigma's RDP computed once."""
    from opacus.accountants.utils import MAX_SIGMA

    accountant = create_accountant(mechanism)
    epsilon_high = float("inf")
    sigma_low, sigma_high = 0, 10
    while epsilon_high > target_epsilon:
        sigma_high = 2 * sigma_high
        accountant.history = [(sigma_high, sample_rate, steps)]
        epsilon_high = accountant.get_epsilon(delta=target_delta)
        if sigma_high > MAX_SIGMA:
            raise ValueError("The privacy budget is too low.")
    while target_epsilon - epsilon_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        accountant.history = [(sigma, sample_rate, steps)]
        epsilon = accountant.get_epsilon(delta=target_delta)
        if epsilon < target_epsilon:
            sigma_high, epsilon_high = sigma, epsilon
        else:
            sigma_low = sigma
    return sigma_high
