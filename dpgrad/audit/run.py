"""A white-box one-run privacy audit of DP-SGD as dpgrad trains, and its idealised reference.

The canaries are samples of the training data: canary c is included with probability 1/2,
and each step's Poisson batch takes it like any other sample, through the model's forward
pass, dpgrad's hooks and norms, the clipping, the noise and the optimizer
(``dpgrad.opacus.make_private``, Opacus's accountant). The model is a classifier beside an
audit embedding with one row per canary (and a row 0 that no loss term reaches): a canary's
loss is ``scale * C * <E[c], u_c>`` with u_c a random unit vector, so its gradient is a Dirac
on row c of norm ``scale * C``, far above the bound C, and clipping must cut it to C; ordinary
samples train the classifier and leave the audit rows alone. Plain SGD (no momentum, no weight
decay): the sum of row c's updates is its last value less its first, and the score of a canary
is how far its row moved against u_c, ``<E_c(0) - E_c(T), u_c>``. A correct implementation
moves an included canary's row by about ``lr * C / B`` per step it is drawn in, against noise
of ``lr * sigma * C / B`` per step in that direction: exactly the Gaussian mechanism that
``idealised_scores`` simulates without a model.

Under ``path="trainer"`` the same canaries go through ``dpgrad.hf.DPTrainer`` (its Poisson
sampler, physical batches, per-row loss and DP optimizer) with a language model: the loss
DPTrainer clips is each row's next-token cross-entropy, so a canary's row predicts one token
whose logit is ``weight * <E[c] - E_c(0), u_c> - K`` against logits 0 (K large: the gradient is
``-weight * u_c`` to the last bit), and its score is how far its row moved along u_c.

The guesses and bounds: ``dpgrad.audit.bounds``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .bounds import Audit, audit_scores
from .config import CLIPPINGS, PATHS, AuditConfig
from .models import LanguageModel, LogitsOf, SequenceLoss, TrainerAuditModel, sequence_losses
from .training import audit_task, train_private, train_with_trainer, trainer_rows

__all__ = ["AuditConfig", "AuditResult", "CLIPPINGS", "LanguageModel", "PATHS", "accountant_epsilon", "audit",
           "black_box_scores", "idealised_scores", "white_box_scores"]


@dataclass
class AuditResult:
    """What an audit found: the accountant's epsilon, the audited epsilons (Steinke et al.'s
    one-run bound and the f-DP bound), the canaries, guesses and correct guesses that gave
    each, the confidence, and the mechanism audited ("dpgrad" or "idealised")."""

    mechanism: str
    config: Dict[str, object]
    accountant_epsilon: float
    epsilon_one_run: float
    epsilon_fdp: float
    canaries: int
    guesses_one_run: int
    correct_one_run: int
    guesses_fdp: int
    correct_fdp: int
    confidence: float
    choices: int
    scores: List[float] = field(default_factory=list, repr=False)

    def to_json(self) -> Dict[str, object]:
        out = asdict(self)
        out.pop("scores")
        return out


def accountant_epsilon(config: AuditConfig) -> float:
    """Opacus's RDP accountant's epsilon at ``config.delta`` for the audit's sampling rate,
    noise and steps (what ``privacy_engine.get_epsilon`` says of the real run)."""
    from dpgrad.opacus.budget import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(config.noise_multiplier, config.sample_rate, config.steps)]
    return accountant.get_epsilon(config.delta)


def _memberships(config: AuditConfig, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(config.canaries, generator=generator) < 0.5


def idealised_scores(config: AuditConfig) -> Tuple[List[float], List[bool]]:
    """The audit's scores under the Gaussian mechanism itself (no model): an included canary
    adds C to its direction at each step Poisson sampling draws it, every step adds noise of
    standard deviation sigma * C there; scores in the units of ``white_box_scores`` (times
    lr / expected batch size, which changes no guess)."""
    g = torch.Generator().manual_seed(config.seed + 1)
    included = _memberships(config, g)
    counts = torch.binomial(torch.full((config.canaries,), float(config.steps)),
                            torch.full((config.canaries,), config.sample_rate), generator=g) * included
    noise = torch.randn(config.canaries, generator=g, dtype=torch.float64) * math.sqrt(config.steps)
    scores = config.audit_bound() * counts.double() + config.max_grad_norm * config.noise_multiplier * noise
    return scores.tolist(), included.tolist()


def white_box_scores(config: AuditConfig, language_model: Optional[LanguageModel] = None,
                     on_step: Optional[Callable[[], None]] = None) -> Tuple[List[float], List[bool], float]:
    """Trains the audit model with ``dpgrad.opacus.make_private`` (ghost clipping, Poisson
    sampling, Opacus's accountant) and returns the canaries' scores, memberships and the
    accountant's epsilon after the run."""
    g = torch.Generator().manual_seed(config.seed)
    included = _memberships(config, g)
    directions = torch.randn(config.canaries, config.dim, generator=g)
    directions = directions / directions.norm(dim=1, keepdim=True)
    if (language_model is None) != (config.model == "linear"):
        raise ValueError(f"AuditConfig.model is {config.model!r}, and {'no' if language_model is None else 'a'} "
                         "language model was given: give one exactly when the model is not 'linear'")
    if config.path == "trainer":
        return _white_box_through_trainer(config, language_model, g, included, directions, on_step)
    model, criterion, inputs, rows, target = audit_task(config, g, torch.nonzero(included).flatten(), directions,
                                                        language_model)
    start = model.audit.weight.detach().clone()
    engine, expected = train_private(config, model, criterion, torch.utils.data.TensorDataset(inputs, rows, target),
                                     on_step)
    moved = (start - model.audit.weight.detach())[1:]
    scores = (moved * directions).sum(dim=1) * (expected / config.lr)
    return scores.double().tolist(), included.tolist(), engine.get_epsilon(config.delta)


def _white_box_through_trainer(config: AuditConfig, language_model: LanguageModel, g: torch.Generator,
                               included: torch.Tensor, directions: torch.Tensor, on_step=None):
    """``white_box_scores`` through ``DPTrainer`` (``TrainerAuditModel``): a canary's row holds
    an ordinary sequence, its labels -100 but at position 1 (``target``), so that its loss is
    the audit logit's alone."""
    target = 1
    labels = torch.full((config.seq_len,), -100, dtype=torch.long)
    labels[1] = target
    canaries = [{"labels": labels, "audit_row": torch.tensor(c + 1)}
                for c in torch.nonzero(included).flatten().tolist()]
    rows, expected = trainer_rows(config, language_model, g, canaries, {"audit_row": torch.tensor(0)})
    torch.manual_seed(config.seed)
    model = TrainerAuditModel(language_model, directions, config.scale * config.max_grad_norm, target)
    start = model.audit.weight.detach().clone()
    trainer = train_with_trainer(config, model, rows, expected, on_step)
    moved = (model.audit.weight.detach() - start)[1:]
    scores = (moved * directions).sum(dim=1) * (expected / config.lr)
    return scores.double().tolist(), included.tolist(), trainer.privacy_spent()[0]


def black_box_scores(config: AuditConfig, language_model: Optional[LanguageModel] = None,
                     on_step: Optional[Callable[[], None]] = None) -> Tuple[List[float], List[bool], float]:
    """Input canaries scored by the final model alone: canary c is a sample of its own (random
    features and a random label for the linear classifier, a random sequence for a language
    model), in the training data with probability 1/2, trained on like any other; its score is
    minus its loss under the final model (a member is fitted better). Returns the scores, the
    memberships and the accountant's epsilon after the run."""
    if config.clipping != "flat":
        raise ValueError("the black-box audit takes flat clipping only")
    g = torch.Generator().manual_seed(config.seed)
    included = _memberships(config, g)
    m, n = config.canaries, config.samples
    torch.manual_seed(config.seed)
    if language_model is None:
        inputs = torch.randn(n + m, config.features, generator=g)
        labels = torch.randint(0, 2, (n + m,), generator=g)
        model: nn.Module = nn.Linear(config.features, 2)
        criterion: nn.Module = nn.CrossEntropyLoss()

        def losses(mod, x, y):
            return nn.functional.cross_entropy(mod(x), y, reduction="none")
    else:
        # Random sequences: no padding in them, nothing the ordinary sequences teach.
        canaries = torch.randint(0, language_model.vocab_size - 1, (m, config.seq_len), generator=g)
        canaries += (canaries >= language_model.padding_idx).long()
        if config.path == "trainer":
            members = canaries[included]
            rows, expected = trainer_rows(config, language_model, g,
                                          [{"input_ids": c, "labels": c} for c in members], {})
            model = LogitsOf(language_model, flat=False)
            trainer = train_with_trainer(config, model, rows, expected, on_step)
            with torch.no_grad():
                scores = -sequence_losses(model(canaries).logits, canaries, language_model.padding_idx)
            return scores.double().tolist(), included.tolist(), trainer.privacy_spent()[0]
        inputs = torch.cat([language_model.sequences(n, config.seq_len, g), canaries])
        labels = inputs
        model = LogitsOf(language_model)
        criterion = SequenceLoss(language_model)

        def losses(mod, x, y):
            return SequenceLoss(language_model, reduction="none")(mod(x), y)
    members = torch.cat([torch.arange(n), n + torch.nonzero(included).flatten()])
    engine, _ = train_private(config, model, criterion,
                              torch.utils.data.TensorDataset(inputs[members], labels[members]), on_step)
    with torch.no_grad():
        scores = -losses(model, inputs[n:], labels[n:])
    return scores.double().tolist(), included.tolist(), engine.get_epsilon(config.delta)


def audit(config: AuditConfig, mechanism: str = "dpgrad", language_model: Optional[LanguageModel] = None,
          mode: str = "white-box", on_step: Optional[Callable[[], None]] = None) -> AuditResult:
    """The audit of ``mechanism``: "dpgrad" (the real training path, of ``language_model``
    where one is given, else of the linear classifier; ``mode`` "white-box",
    ``white_box_scores``, or "black-box", ``black_box_scores``) or "idealised"
    (``idealised_scores``: the white-box audit of the Gaussian mechanism with the same
    sampling rate, noise, steps and canaries). ``on_step()`` runs after each training step of
    the real path (a progress display)."""
    if mode not in ("white-box", "black-box"):
        raise ValueError(f"mode {mode!r}: use 'white-box' or 'black-box'")
    if mechanism == "dpgrad":
        scores_of = white_box_scores if mode == "white-box" else black_box_scores
        scores, included, epsilon = scores_of(config, language_model, on_step)
    elif mechanism == "idealised":
        scores, included = idealised_scores(config)
        epsilon = accountant_epsilon(config)
    else:
        raise ValueError(f"mechanism {mechanism!r}: use 'dpgrad' or 'idealised'")
    found: Audit = audit_scores(scores, included, config.delta, config.confidence)
    name = f"{mechanism} {mode}" if mechanism == "dpgrad" and mode != "white-box" else mechanism
    return AuditResult(name, asdict(config), epsilon, found.epsilon_one_run, found.epsilon_fdp, config.canaries,
                       found.guesses_one_run.r, found.guesses_one_run.v, found.guesses_fdp.r, found.guesses_fdp.v,
                       config.confidence, found.choices, scores)
