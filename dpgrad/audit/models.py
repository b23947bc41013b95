"""The models and losses of the audit: the linear classifier and a language model beside the
audit embedding (one row per canary), the canaries' Dirac losses, and the forms in which
``dpgrad.opacus.make_private`` and ``dpgrad.hf.DPTrainer`` take them."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn


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
        return reduce_losses(torch.where(canary > 0, self.weight * (rows * direction).sum(dim=1), ce), self.reduction)


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

    def fresh(self) -> nn.Module:
        """A copy of the module for one audit: each audit trains its own, from the same
        weights, and leaves ``module`` as it was."""
        return copy.deepcopy(self.module)


class AuditedLanguageModel(nn.Module):
    """A language model beside the audit embedding: its output is each sample's logits,
    flattened, and its audit row, side by side (one tensor with the batch first)."""

    def __init__(self, language_model: LanguageModel, canaries: int, dim: int):
        super().__init__()
        self.model, self.hf = language_model.fresh(), language_model.hf
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


def reduce_losses(losses: torch.Tensor, reduction: str) -> torch.Tensor:
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
        return reduce_losses(torch.where(canary > 0, audit_term, lm), self.reduction)


class SequenceLoss(nn.Module):
    """``sequence_losses`` of a language model's flattened logits (``LogitsOf``), reduced."""

    def __init__(self, language_model: LanguageModel, reduction: str = "mean"):
        super().__init__()
        self.vocab_size, self.padding_idx = language_model.vocab_size, language_model.padding_idx
        self.reduction = reduction

    def forward(self, output: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = output.reshape(output.shape[0], ids.shape[1], self.vocab_size)
        return reduce_losses(sequence_losses(logits, ids, self.padding_idx), self.reduction)


class LogitsOf(nn.Module):
    """A language model's logits: flattened per sequence (the audit loss's layout, no audit
    row), or as ``DPTrainer`` calls a model (``flat=False``: ``forward(input_ids,
    position_ids)`` returns ``.logits``, (B, T, V))."""

    def __init__(self, language_model: LanguageModel, flat: bool = True):
        super().__init__()
        self.model, self.hf, self.flat = language_model.fresh(), language_model.hf, flat

    def forward(self, input_ids: torch.Tensor, position_ids=None, **_):
        out = self.model(input_ids=input_ids, position_ids=position_ids) if self.hf else self.model(input_ids)
        logits = out.logits if self.hf else out
        return logits.flatten(1) if self.flat else SimpleNamespace(logits=logits)


class TrainerAuditModel(nn.Module):
    """A language model beside the audit embedding as ``DPTrainer`` calls it:
    ``forward(input_ids, audit_row, position_ids)`` returns ``.logits`` (B, T, V), the language
    model's, except at a canary's first position (``audit_row`` > 0), where they are 0 but for
    the ``target`` token's, ``weight * <E[c] - E_c(0), u_c> - K``: with K far above anything
    the audit rows reach, that token's probability is 0 in fp32 and the gradient of the row's
    loss on E[c] is exactly ``-weight * u_c``."""

    K = 1.0e4

    def __init__(self, language_model: LanguageModel, directions: torch.Tensor, weight: float, target: int):
        super().__init__()
        self.model, self.hf, self.weight, self.target = language_model.fresh(), language_model.hf, weight, target
        self.audit = nn.Embedding(directions.shape[0] + 1, directions.shape[1])
        self.register_buffer("directions", torch.cat([torch.zeros(1, directions.shape[1]), directions]))
        self.register_buffer("start", self.audit.weight.detach().clone())

    def forward(self, input_ids: torch.Tensor, audit_row: torch.Tensor, position_ids=None, **_):
        out = self.model(input_ids=input_ids, position_ids=position_ids) if self.hf else self.model(input_ids)
        logits = out.logits if self.hf else out
        moved = ((self.audit(audit_row) - self.start[audit_row]) * self.directions[audit_row]).sum(dim=1)
        audit_logits = torch.zeros_like(logits[:, 0])
        audit_logits[:, self.target] = self.weight * moved.to(logits.dtype) - self.K
        first = torch.where((audit_row > 0)[:, None], audit_logits, logits[:, 0])
        return SimpleNamespace(logits=torch.cat([first[:, None], logits[:, 1:]], dim=1))
