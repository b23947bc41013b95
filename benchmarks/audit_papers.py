"""dpgrad's audit beside figures that papers report for one-run audits, in their settings.

- Keinan, Shenfeld and Ligett, "How Well Can Differential Privacy Be Audited in One Run?"
  (NeurIPS 2025), Section 6.2: DP-SGD with Dirac gradient canaries, 1000 canaries, 100 steps
  at sample rate 1/10, epsilon 2 at delta 1e-5 (RDP), 50 "in" and 50 "out" guesses, 95%
  confidence: a mean bound of 0.49 (+-0.01) over 200 runs. Here: the idealised mechanism over
  200 seeds and dpgrad's training (make_private, single backward; the linear audit model, 1000
  ordinary samples) over ``--seeds`` seeds, the same guesses.
- Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential Privacy in One Run" (ICML 2025),
  Table 1: the Gaussian mechanism, 10^5 canaries, the expected correct guesses of the best
  number of guesses, delta 1e-5: Steinke et al.'s bound and theirs. Here: both bounds of
  ``dpgrad.audit.bounds`` on the same expected guesses.

``python benchmarks/audit_papers.py [--seeds N]`` prints the table (CPU, about a minute).
"""

from __future__ import annotations

import argparse
import statistics

from dpgrad.audit import bounds
from dpgrad.audit.run import AuditConfig, accountant_epsilon, idealised_scores, white_box_scores

KEINAN = dict(canaries=1000, samples=1000, steps=100, sample_rate=0.1, noise_multiplier=2.4231)
MAHLOUJIFAR = {0.5: (9.99, 4.99, 8.16), 1.0: (4.37, 2.61, 3.61), 2.0: (1.99, 1.33, 1.59)}


def keinan(seeds: int) -> None:
    eps = accountant_epsilon(AuditConfig(**KEINAN))
    rows = {}
    for name, runs in (("idealised", 200), ("dpgrad", seeds)):
        found = []
        for seed in range(runs):
            config = AuditConfig(seed=seed, **KEINAN)
            scores, included = idealised_scores(config) if name == "idealised" else white_box_scores(config)[:2]
            found.append(bounds.audit_scores(scores, included, 1e-5, 0.95, counts=[(50, 50)]).epsilon_one_run)
        rows[name] = (statistics.mean(found), statistics.stdev(found) / len(found) ** 0.5, runs)
    print(f"Keinan et al. 2025 setting: accountant epsilon {eps:.2f}; one-run bound, mean (standard error) over runs")
    print("  paper: 0.49 (0.01) over 200")
    for name, (mean, err, runs) in rows.items():
        print(f"  {name}: {mean:.2f} ({err:.2f}) over {runs}")


def mahloujifar() -> None:
    m = 10 ** 5
    print("Mahloujifar et al. 2025, Table 1 (10^5 canaries): theoretical, Steinke et al., f-DP | ours: one-run, f-DP")
    for sigma, (theory, steinke, theirs) in MAHLOUJIFAR.items():
        one_run = fdp = 0.0
        for r in (100, 150, 200, 300, 400, 500, 700, 1000, 1500, 2000, 5000, 10000):
            v = int(bounds.expected_correct(m, r, sigma))
            one_run = max(one_run, bounds.epsilon_one_run(m, r, v, 1e-5))
            fdp = max(fdp, bounds.epsilon_one_run_fdp(m, r, v, 1e-5))
        print(f"  sigma {sigma}: {theory}, {steinke}, {theirs} | {one_run:.2f}, {fdp:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="dpgrad runs in Keinan et al.'s setting (default 100)")
    keinan(parser.parse_args().seeds)
    mahloujifar()
