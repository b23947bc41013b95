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

The guesses and bounds: ``dpgrad.audit.bounds``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .bounds import Audit, audit_scores


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
    clipping: str = "flat"
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
        need(finite(self.noise_multiplier) and self.noise_multiplier > 0,
             f"noise_multiplier = {self.noise_multiplier}: a finite number > 0 (without noise there is no "
             "epsilon to audit)")
        need(finite(self.max_grad_norm) and self.max_grad_norm > 0, f"max_grad_norm = {self.max_grad_norm}: > 0")
        need(finite(self.scale) and self.scale > 1,
             f"scale = {self.scale}: above 1, so that clipping must cut the canaries' gradients")
        need(finite(self.lr) and self.lr > 0, f"lr = {self.lr}: > 0")
        need(finite(self.delta) and 0 < self.delta < 1, f"delta = {self.delta}: in (0, 1)")
        need(finite(self.confidence) and 0 < self.confidence < 1, f"confidence = {self.confidence}: in (0, 1)")
        need(self.clipping in ("flat", "per_layer"), f"clipping = {self.clipping!r}: 'flat' or 'per_layer'")

    def audit_bound(self) -> float:
        """The bound on a canary's audit row: C flat; per layer, the bound is split evenly over
        the model's three parameters (C / sqrt(3) each: the noise, sigma * C, is unchanged)."""
        return self.max_grad_norm if self.clipping == "flat" else self.max_grad_norm / math.sqrt(3)


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
    from opacus.accountants import RDPAccountant

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


class AuditModel(nn.Module):
    """A linear classifier beside the audit embedding (row 0 for ordinary samples, row c + 1
    for canary c); its output is the logits and the sample's audit row side by side."""

    def __init__(self, canaries: int, dim: int, features: int, classes: int = 2):
        super().__init__()
        self.classes = classes
        self.head = nn.Linear(features, classes)
        self.audit = nn.Embedding(canaries + 1, dim)

    def forward(self, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.head(x), self.audit(row)], dim=1)


class AuditLoss(nn.Module):
    """Per sample: cross-entropy for an ordinary sample; ``scale * C * <E[c], u_c>`` for a
    canary (u_c of norm 1: its gradient on row c has norm scale * C)."""

    def __init__(self, classes: int, weight: float, reduction: str = "mean"):
        super().__init__()
        self.classes, self.weight, self.reduction = classes, weight, reduction

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, rows = output[:, :self.classes], output[:, self.classes:]
        label, direction, canary = target[:, 0].long(), target[:, 1:-1], target[:, -1]
        ce = nn.functional.cross_entropy(logits, label, reduction="none")
        return _reduce(torch.where(canary > 0, self.weight * (rows * direction).sum(dim=1), ce), self.reduction)


@dataclass
class LanguageModel:
    """A language model to audit: the module (a Hugging Face model, ``hf``, returns an output
    with ``.logits``; otherwise logits (B, T, V)), its vocabulary and padding id, and
    ``sequences(n, seq_len, generator)``: n training sequences of token ids (n, seq_len)."""

    module: nn.Module
    vocab_size: int
    padding_idx: int
    hf: bool
    sequences: Callable[[int, int, torch.Generator], torch.Tensor]


class AuditedLanguageModel(nn.Module):
    """A language model beside the audit embedding: its output is each sample's logits,
    flattened, and its audit row, side by side (one tensor with the batch first)."""

    def __init__(self, language_model: LanguageModel, canaries: int, dim: int):
        super().__init__()
        self.model, self.hf = language_model.module, language_model.hf
        self.audit = nn.Embedding(canaries + 1, dim)

    def forward(self, ids: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids) if self.hf else self.model(ids)
        logits = out.logits if self.hf else out
        return torch.cat([logits.flatten(1), self.audit(row)], dim=1)


def sequence_losses(logits: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """Each sequence's mean next-token cross-entropy over its tokens that are not padding, (B,)."""
    tokens = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    counted = ids[:, 1:] != padding_idx
    return (tokens * counted).sum(dim=1) / counted.sum(dim=1).clamp(min=1)


def _reduce(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()


class AuditLanguageLoss(nn.Module):
    """Per sample: the next-token loss for an ordinary sequence; ``weight * <E[c], u_c>`` for a
    canary (its sequence's own loss left out, so its gradient is the Dirac alone)."""

    def __init__(self, vocab_size: int, seq_len: int, padding_idx: int, weight: float, reduction: str = "mean"):
        super().__init__()
        self.vocab_size, self.seq_len, self.padding_idx = vocab_size, seq_len, padding_idx
        self.weight, self.reduction = weight, reduction

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n = self.seq_len * self.vocab_size
        logits = output[:, :n].reshape(output.shape[0], self.seq_len, self.vocab_size)
        ids, direction, canary = target[:, :self.seq_len].long(), target[:, self.seq_len:-1], target[:, -1]
        lm = sequence_losses(logits, ids, self.padding_idx)
        audit_term = self.weight * (output[:, n:] * direction).sum(dim=1)
        return _reduce(torch.where(canary > 0, audit_term, lm), self.reduction)


def _audit_task(config: AuditConfig, g: torch.Generator, ids: torch.Tensor, directions: torch.Tensor,
                language_model: Optional[LanguageModel]):
    """The model, its loss and its training samples (inputs, audit rows, targets): ``n``
    ordinary samples, then the included canaries ``ids``."""
    n, k = config.samples, len(ids)
    rows = torch.zeros(n + k, dtype=torch.long)
    rows[n:] = ids + 1
    u = torch.zeros(n + k, config.dim)
    u[n:] = directions[ids]
    flag = torch.zeros(n + k, 1)
    flag[n:] = 1.0
    weight = config.scale * config.max_grad_norm
    torch.manual_seed(config.seed)
    if language_model is None:
        x = torch.randn(n + k, config.features, generator=g)
        x[n:] = 0.0
        labels = torch.randint(0, 2, (n + k, 1), generator=g).float()
        model = AuditModel(config.canaries, config.dim, config.features)
        return model, AuditLoss(model.classes, weight), x, rows, torch.cat([labels, u, flag], dim=1)
    sequences = language_model.sequences(n + k, config.seq_len, g)
    model = AuditedLanguageModel(language_model, config.canaries, config.dim)
    loss = AuditLanguageLoss(language_model.vocab_size, config.seq_len, language_model.padding_idx, weight)
    return model, loss, sequences, rows, torch.cat([sequences.float(), u, flag], dim=1)


def _train_private(config: AuditConfig, model: nn.Module, criterion: nn.Module, dataset) -> Tuple[object, float]:
    """``config.steps`` steps of DP-SGD (plain SGD at ``config.lr``) on ``dataset`` through
    ``dpgrad.opacus.make_private``: ghost clipping, Poisson sampling at ``config.sample_rate``,
    Opacus's RDP accountant. Each dataset row is (model inputs..., target). Returns the privacy
    engine and the expected batch size."""
    import opacus

    import dpgrad.opacus

    # make_private's Poisson sampling draws at 1 / len(loader): batches that make it the audit's rate.
    per_epoch = max(1, round(1 / config.sample_rate))
    if abs(1 / per_epoch - config.sample_rate) > 1e-12:
        raise ValueError(f"sample_rate {config.sample_rate}: the audit takes 1 / k for an integer k")
    loader = torch.utils.data.DataLoader(dataset, batch_size=math.ceil(len(dataset) / per_epoch))
    if len(loader) != per_epoch:
        raise ValueError(f"{len(dataset)} samples cannot be split into "
                         f"{per_epoch} batches: use more canaries or samples, or a larger sample rate")
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    engine = opacus.PrivacyEngine(accountant="rdp")
    per_layer = [config.audit_bound()] * len(list(model.parameters()))
    bounds = config.max_grad_norm if config.clipping == "flat" else per_layer
    module, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=config.noise_multiplier,
        max_grad_norm=bounds, clipping=config.clipping, criterion=criterion, grad_sample_mode="ghost",
        single_backward=config.single_backward, noise_generator=torch.Generator().manual_seed(config.seed + 3))
    done = 0
    while done < config.steps:  # the loader draws a Poisson batch each step; steps are counted here
        for *inputs, target in loader:
            optimizer.zero_grad(set_to_none=True)
            criterion(module(*inputs), target).backward()
            optimizer.step()
            done += 1
            if done == config.steps:
                break
    return engine, len(dataset) / per_epoch


def white_box_scores(config: AuditConfig, language_model: Optional[LanguageModel] = None
                     ) -> Tuple[List[float], List[bool], float]:
    """Trains the audit model with ``dpgrad.opacus.make_private`` (ghost clipping, Poisson
    sampling, Opacus's accountant) and returns the canaries' scores, memberships and the
    accountant's epsilon after the run."""
    g = torch.Generator().manual_seed(config.seed)
    included = _memberships(config, g)
    directions = torch.randn(config.canaries, config.dim, generator=g)
    directions = directions / directions.norm(dim=1, keepdim=True)
    if language_model is not None and config.clipping != "flat":
        raise ValueError("per-layer clipping is audited on the linear model only (no language model)")
    model, criterion, inputs, rows, target = _audit_task(config, g, torch.nonzero(included).flatten(), directions,
                                                         language_model)
    start = model.audit.weight.detach().clone()
    engine, expected = _train_private(config, model, criterion, torch.utils.data.TensorDataset(inputs, rows, target))
    moved = (start - model.audit.weight.detach())[1:]
    scores = (moved * directions).sum(dim=1) * (expected / config.lr)
    return scores.double().tolist(), included.tolist(), engine.get_epsilon(config.delta)


def black_box_scores(config: AuditConfig, language_model: Optional[LanguageModel] = None
                     ) -> Tuple[List[float], List[bool], float]:
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
        inputs = torch.cat([language_model.sequences(n, config.seq_len, g), canaries])
        labels = inputs
        model = _LogitsOf(language_model)
        criterion = _SequenceLoss(language_model)

        def losses(mod, x, y):
            return _SequenceLoss(language_model, reduction="none")(mod(x), y)
    members = torch.cat([torch.arange(n), n + torch.nonzero(included).flatten()])
    engine, _ = _train_private(config, model, criterion, torch.utils.data.TensorDataset(inputs[members],
                                                                                        labels[members]))
    with torch.no_grad():
        scores = -losses(model, inputs[n:], labels[n:])
    return scores.double().tolist(), included.tolist(), engine.get_epsilon(config.delta)


class _SequenceLoss(nn.Module):
    """``sequence_losses`` of a language model's flattened logits (``_LogitsOf``), reduced."""

    def __init__(self, language_model: LanguageModel, reduction: str = "mean"):
        super().__init__()
        self.vocab_size, self.padding_idx = language_model.vocab_size, language_model.padding_idx
        self.reduction = reduction

    def forward(self, output: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = output.reshape(output.shape[0], ids.shape[1], self.vocab_size)
        return _reduce(sequence_losses(logits, ids, self.padding_idx), self.reduction)


class _LogitsOf(nn.Module):
    """A language model's logits, flattened per sequence (the audit loss's layout, no audit row)."""

    def __init__(self, language_model: LanguageModel):
        super().__init__()
        self.model, self.hf = language_model.module, language_model.hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids) if self.hf else self.model(ids)
        return (out.logits if self.hf else out).flatten(1)


def audit(config: AuditConfig, mechanism: str = "dpgrad", language_model: Optional[LanguageModel] = None,
          mode: str = "white-box") -> AuditResult:
    """The audit of ``mechanism``: "dpgrad" (the real training path, of ``language_model``
    where one is given, else of the linear classifier; ``mode`` "white-box",
    ``white_box_scores``, or "black-box", ``black_box_scores``) or "idealised"
    (``idealised_scores``: the white-box audit of the Gaussian mechanism with the same
    sampling rate, noise, steps and canaries)."""
    if mode not in ("white-box", "black-box"):
        raise ValueError(f"mode {mode!r}: use 'white-box' or 'black-box'")
    if mechanism == "dpgrad":
        scores_of = white_box_scores if mode == "white-box" else black_box_scores
        scores, included, epsilon = scores_of(config, language_model)
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
