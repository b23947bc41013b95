"""The one-run privacy audit (``dpgrad.audit``) over several noise multipliers and numbers of
canaries: the accountant's epsilon and the audited lower bounds (Steinke et al.'s one-run bound
and the f-DP bound, 95% confidence) of dpgrad's training (single and double backward, through
``dpgrad.opacus.make_private``) and of the idealised Gaussian mechanism with the same sampling
rate, noise, steps and canaries. Each figure is the median (p20, p80) over twenty runs
(different canaries and memberships; five under ``DPGRAD_BENCH_QUICK=1``, as ``make report``
runs it); a correct implementation audits like the idealised mechanism and at or below the
accountant. The audit model is small and runs on the CPU: the same figures on every machine,
in about two minutes. The test suite's pass (timing disabled) runs one seed of one case
(``UNTIMED``).
``benchmarks/audit_papers.py`` sets the audit beside figures papers report."""

from __future__ import annotations

import os
import statistics

import pytest

from dpgrad.tools import results

pytest.importorskip("opacus")
from dpgrad.audit.run import AuditConfig, audit  # noqa: E402

# Noise multipliers: accountant epsilons from about 7 to 0.5 at 100 steps, rate 0.1, delta 1e-5,
# with 1000 canaries; and 250 and 4000 canaries at two of them.
NOISES = [1.0, 1.5, 2.0, 3.0, 5.0]
CASES = [(noise, 1000) for noise in NOISES] + [(noise, m) for noise in (1.0, 3.0) for m in (250, 4000)]
# make test's untimed pass (one seed each): one noise multiplier and number of canaries, every
# provider; the others run the same code.
UNTIMED = [dict(noise=1.0, canaries=1000)]
SETTING = dict(samples=1000, steps=100, sample_rate=0.1)
PROVIDERS = {"dpgrad-single": ("dpgrad", True), "dpgrad-double": ("dpgrad", False), "idealised": ("idealised", True)}


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("noise, canaries", CASES)
def test_audit(bench, noise, canaries, provider):
    shape = dict(noise_multiplier=noise, canaries=canaries, steps=SETTING["steps"], sample_rate=SETTING["sample_rate"])
    bench.describe("audit", "audit", shape, provider, time_metric="accountant_epsilon")
    mechanism, single = PROVIDERS[provider]
    seeds = 1 if bench.benchmark_fixture.disabled else 5 if os.environ.get("DPGRAD_BENCH_QUICK") == "1" else 20
    found = [audit(AuditConfig(noise_multiplier=noise, canaries=canaries, single_backward=single, seed=seed, **SETTING),
                   mechanism) for seed in range(seeds)]
    for name in ("accountant_epsilon", "epsilon_one_run", "epsilon_fdp"):
        values = sorted(getattr(r, name) for r in found)
        q = statistics.quantiles(values, n=5) if len(values) > 1 else [values[0]] * 4
        bench.metrics[name] = results.metric(name, statistics.median(values), q[0], q[3])
    # A correct run never audits above its epsilon.
    assert max(max(r.epsilon_one_run, r.epsilon_fdp) for r in found) <= found[0].accountant_epsilon
