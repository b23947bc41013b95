"""Lower bounds on epsilon from the guesses of a one-run privacy audit.

m canaries are each included in the training data independently with probability 1/2. After
training, an auditor scores every canary and guesses: "in" for the k+ highest scores, "out"
for the k- lowest, abstaining on the rest (r = k+ + k- guesses, v of them correct). If the
training was (epsilon, delta)-DP, few correct guesses are likely; many correct guesses falsify
the claim, at a confidence, for every epsilon up to a bound: the audited epsilon, a lower bound
on the privacy the run actually has.

- ``epsilon_one_run``: Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training
  Run" (NeurIPS 2023), Theorem 3 with delta > 0: the number of correct guesses is dominated by
  a Binomial(r, e^eps / (1 + e^eps)), plus a delta term, ``p_value_one_run``.
- ``epsilon_one_run_fdp``: Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential Privacy
  in One Run" (ICML 2025): the claim tested is the Gaussian trade-off curve of the mechanism
  that is exactly (epsilon, delta)-DP (``gaussian_mu``), whose whole curve constrains the
  guesses, a tighter bound from the same guesses.

Both hold at the given confidence for one choice of (k+, k-) made before the scores are seen;
``audit_scores`` tries several and pays for it (a Bonferroni correction). Pure Python: no
dependency beyond the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import List, Optional, Sequence, Tuple

_NORMAL = NormalDist()


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def binomial_tails(n: int, p: float) -> List[float]:
    """``tails[k] = P[Binomial(n, p) >= k]`` for k = 0..n+1 (summed from the top, in log space)."""
    if p <= 0.0:
        return [1.0] + [0.0] * (n + 1)
    if p >= 1.0:
        return [1.0] * (n + 1) + [0.0]
    log_p, log_q = math.log(p), math.log1p(-p)
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q
            for k in range(n + 1)]
    top = max(logs)
    tails = [0.0] * (n + 2)
    acc = 0.0
    for k in range(n, -1, -1):
        acc += math.exp(logs[k] - top)
        tails[k] = min(1.0, acc * math.exp(top))
    tails[0] = 1.0
    return tails


def p_value_one_run(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The probability of at least ``v`` correct guesses out of ``r`` (m canaries) under an
    (epsilon, delta)-DP mechanism (Steinke et al. 2023, Theorem 3): ``beta + 2 m delta alpha``
    with ``beta = P[Binomial(r, q) >= v]``, ``q = e^eps / (1 + e^eps)`` (the accuracy of
    epsilon-DP randomised response), and ``alpha = max_{1 <= i <= v} (P[Binomial(r, q) >= v - i]
    - beta) / i``."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    tails = binomial_tails(r, _logistic(epsilon))
    beta = tails[v]
    if delta == 0 or v == 0:
        return beta
    alpha = max((tails[v - i] - beta) / i for i in range(1, v + 1))
    return min(1.0, beta + 2 * m * delta * alpha)


def _largest_rejected(rejects, upper: float = 64.0) -> float:
    """The largest epsilon in [0, upper] for which ``rejects(epsilon)`` holds, given that it
    holds for every smaller one (0 where it holds for none), to 1e-6."""
    if not rejects(0.0):
        return 0.0
    if rejects(upper):
        return upper
    lo, hi = 0.0, upper
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return lo


def epsilon_one_run(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """Steinke et al.'s audited epsilon: the largest epsilon whose (epsilon, delta)-DP claim the
    guesses reject at ``confidence`` (``p_value_one_run`` at most ``1 - confidence``)."""
    significance = 1.0 - confidence
    return _largest_rejected(lambda eps: p_value_one_run(m, r, v, eps, delta) <= significance)


def gaussian_delta(mu: float, epsilon: float) -> float:
    """The delta at ``epsilon`` of the mu-Gaussian trade-off curve (Dong, Roth and Su 2022):
    ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``."""
    if mu <= 0:
        return 0.0
    return _NORMAL.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * _NORMAL.cdf(-epsilon / mu - mu / 2)


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The mu of the Gaussian mechanism that is exactly (epsilon, delta)-DP (delta increases
    with mu): the trade-off curve ``G_mu`` an (epsilon, delta) claim stands for in the f-DP
    audit."""
    if delta <= 0:
        raise ValueError("the Gaussian curve of an (epsilon, 0) claim is degenerate: give delta > 0")
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, epsilon) < delta:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            return math.inf
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gaussian_delta(mid, epsilon) < delta else (lo, mid)
    return (lo + hi) / 2


def _fdp_rejects(m: int, r: int, v: int, mu: float, significance: float) -> bool:
    """Whether ``v`` correct guesses out of ``r`` (m canaries) reject, at ``significance``, that
    every canary's inclusion is mu-GDP (Mahloujifar et al., the bound on the probability of v
    correct guesses under an f-DP mechanism built up one correct guess at a time): the masses
    of correct and incorrect guesses that an f-DP mechanism could support, starting from what
    the observation needs, are grown by the trade-off curve's inverse, correct guess by
    correct guess; the claim is rejected if they still do not reach the guesses made."""
    if v == 0:
        return False
    if math.isinf(mu):
        return False
    shift = mu

    def curve_inverse(x: float) -> float:
        # G_mu's blow-up: the least type II error mass consistent with type I mass x.
        if x <= 0.0:
            return 0.0
        if x >= 1.0:
            return 1.0
        return _NORMAL.cdf(_NORMAL.inv_cdf(x) - shift)

    correct = significance * v / m
    wrong = significance * (r - v) / m
    for i in range(v - 1, -1, -1):
        grown = max(wrong, curve_inverse(correct))
        if grown == wrong:
            break
        correct = min(1.0, correct + (i / (r - i)) * (grown - wrong))
        wrong = grown
    return correct + wrong > r / m


def epsilon_one_run_fdp(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """Mahloujifar et al.'s audited epsilon: the largest epsilon such that the guesses reject
    the Gaussian trade-off curve of an (epsilon, delta)-DP mechanism at ``confidence``."""
    significance = 1.0 - confidence
    return _largest_rejected(lambda eps: _fdp_rejects(m, r, v, gaussian_mu(max(eps, 1e-9), delta), significance))


def expected_correct(m: int, guesses: int, sigma: float) -> float:
    """The expected correct guesses among ``guesses`` (half "in" for the highest scores, half
    "out" for the lowest) of m canaries, each in with probability 1/2 and scored ``in + N(0,
    sigma^2)``: the idealised one-step Gaussian mechanism of Mahloujifar et al.'s Table 1 (in
    the limit of many canaries, where the fraction guessed is the threshold's tail)."""
    def tail(x: float) -> float:
        return 1.0 - _NORMAL.cdf(x)

    lo, hi = -50.0, 50.0
    for _ in range(200):  # the threshold above which scores are the top guesses / 2
        t = (lo + hi) / 2
        lo, hi = (t, hi) if 0.5 * (tail((t - 1) / sigma) + tail(t / sigma)) > guesses / m / 2 else (lo, t)
    return guesses * tail((t - 1) / sigma) / (tail((t - 1) / sigma) + tail(t / sigma))


@dataclass
class Guesses:
    """What an auditor's guesses came to: m canaries, r guesses (k_in "in", k_out "out"), v correct."""

    m: int
    r: int
    v: int
    k_in: int
    k_out: int


def guesses(scores: Sequence[float], included: Sequence[bool], k_in: int, k_out: int) -> Guesses:
    """Guess "in" for the ``k_in`` highest scores and "out" for the ``k_out`` lowest."""
    m = len(scores)
    if len(included) != m or k_in + k_out > m or k_in < 0 or k_out < 0:
        raise ValueError(f"{m} scores, {len(included)} memberships, {k_in} + {k_out} guesses")
    order = sorted(range(m), key=lambda i: scores[i])
    correct = sum(1 for i in order[m - k_in:] if included[i]) + sum(1 for i in order[:k_out] if not included[i])
    return Guesses(m, k_in + k_out, correct, k_in, k_out)


@dataclass
class Audit:
    """An audit's outcome: the audited epsilons (Steinke et al.'s and the f-DP one) with the
    guesses that gave each, at ``confidence`` (each over ``choices`` choices of guesses)."""

    epsilon_one_run: float
    epsilon_fdp: float
    guesses_one_run: Guesses
    guesses_fdp: Guesses
    confidence: float
    choices: int


def guess_counts(m: int) -> List[Tuple[int, int]]:
    """The (k_in, k_out) an audit of m canaries tries: equal numbers of "in" and "out" guesses,
    from a few to all (fixed in advance, so the correction for trying them is known)."""
    counts = sorted({max(1, round(m * f / 2)) for f in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)})
    return [(k, k) for k in counts if 2 * k <= m]


def audit_scores(scores: Sequence[float], included: Sequence[bool], delta: float, confidence: float = 0.95,
                 counts: Optional[List[Tuple[int, int]]] = None) -> Audit:
    """Both audited epsilons from canary ``scores`` (higher: more likely in) and whether each
    canary was ``included``, the best over the ``counts`` of guesses tried, each at the
    confidence ``1 - (1 - confidence) / len(counts)`` (Bonferroni), so the result holds at
    ``confidence``."""
    counts = counts or guess_counts(len(scores))
    each = 1 - (1 - confidence) / len(counts)
    best = {"one_run": (-1.0, None), "fdp": (-1.0, None)}
    for k_in, k_out in counts:
        g = guesses(scores, included, k_in, k_out)
        for name, bound in (("one_run", epsilon_one_run), ("fdp", epsilon_one_run_fdp)):
            eps = bound(g.m, g.r, g.v, delta, each)
            if eps > best[name][0]:
                best[name] = (eps, g)
    return Audit(best["one_run"][0], best["fdp"][0], best["one_run"][1], best["fdp"][1], confidence, len(counts))
