"""The settings of a one-run privacy audit (``AuditConfig``), checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass


CLIPPINGS = ("flat", "per_layer", "per_block", "automatic")
# Automatic clipping's gamma in the audit (make_private's default).
GAMMA = 0.01
PATHS = ("make_private", "trainer")


@dataclass
class AuditConfig:
    """One audit: m canaries among n ordinary samples, ``steps`` steps of Poisson sampling at
    ``sample_rate``, noise multiplier and bound, the canaries' gradient norm as a multiple of
    the bound (``scale``), (epsilon, delta) at ``delta``, and the guesses' ``confidence``."""

    canaries: int = 1000
    samples: int = 1000
    steps: int = 100
    sample_rate: float = 0.1
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    scale: float = 100.0
    dim: int = 16
    features: int = 8
    lr: float = 1.0
    delta: float = 1e-5
    confidence: float = 0.95
    single_backward: bool = True
    # "flat", "per_layer", "per_block" or "automatic" (see ``audit_bound``).
    clipping: str = "flat"
    # The training path: "make_private" (dpgrad.opacus.make_private) or "trainer" (dpgrad.hf.DPTrainer).
    path: str = "make_private"
    # "linear": a linear classifier on random features; otherwise the name of the language
    # model given to ``audit`` (its sequences of ``seq_len`` tokens, its next-token loss).
    model: str = "linear"
    seq_len: int = 16
    seed: int = 0

    def __post_init__(self):
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"AuditConfig: {what}")

        def finite(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("canaries", "samples", "steps", "dim", "features", "seq_len", "seed"):
            need(isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool),
                 f"{name} must be an integer, not {getattr(self, name)!r}")
        need(self.canaries >= 2, f"canaries = {self.canaries}: at least 2 (half are left out)")
        need(self.samples >= 0 and self.steps >= 1 and self.dim >= 1 and self.features >= 1 and self.seq_len >= 2,
             "samples >= 0, steps >= 1, dim >= 1, features >= 1 and seq_len >= 2")
        need(finite(self.sample_rate) and 0 < self.sample_rate <= 1, f"sample_rate = {self.sample_rate}: in (0, 1]")
        need(abs(1 / max(1, round(1 / self.sample_rate)) - self.sample_rate) <= 1e-12,
             f"sample_rate = {self.sample_rate}: the audit takes 1 / k for an integer k (1, 0.5, 0.25, 0.1, ...), "
             "the rate of Poisson sampling over k batches")
        need(finite(self.noise_multiplier) and self.noise_multiplier > 0,
             f"noise_multiplier = {self.noise_multiplier}: a finite number > 0 (without noise there is no "
             "epsilon to audit)")
        need(finite(self.max_grad_norm) and self.max_grad_norm > 0, f"max_grad_norm = {self.max_grad_norm}: > 0")
        need(finite(self.scale) and self.scale > 1,
             f"scale = {self.scale}: above 1, so that clipping must cut the canaries' gradients")
        need(finite(self.lr) and self.lr > 0, f"lr = {self.lr}: > 0")
        need(finite(self.delta) and 0 < self.delta < 1, f"delta = {self.delta}: in (0, 1)")
        need(finite(self.confidence) and 0 < self.confidence < 1, f"confidence = {self.confidence}: in (0, 1)")
        need(self.clipping in CLIPPINGS, f"clipping = {self.clipping!r}: one of {', '.join(CLIPPINGS)}")
        need(self.path in PATHS, f"path = {self.path!r}: one of {', '.join(PATHS)}")
        if self.path == "trainer":
            need(self.model != "linear", "path = 'trainer' audits a language model (DPTrainer trains causal "
                 "language models): give one")
            need(self.clipping == "flat", f"path = 'trainer' clips flat (DPTrainer has one max_grad_norm), not "
                 f"{self.clipping!r}")

    def audit_bound(self) -> float:
        """What a canary's audit row moves by when drawn: C flat; per layer or per block, the
        audit embedding's own bound C / sqrt(2), the model's parameters (per layer) or blocks
        (per block) sharing the other half of C^2 evenly, so the bound the noise is scaled to,
        sqrt(sum C_g^2), is C; automatic clipping (gamma ``GAMMA``), the canary's gradient of
        norm ``scale * C`` scaled to ``C * scale * C / (scale * C + gamma)``, just below C."""
        C = self.max_grad_norm
        if self.clipping == "automatic":
            return C * (self.scale * C) / (self.scale * C + GAMMA)
        return C if self.clipping == "flat" else C / math.sqrt(2)
