"""The training runs of the audit: its dataset and model, the clipping arguments, DP-SGD through
``dpgrad.opacus.make_private`` and through ``dpgrad.hf.DPTrainer``."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .config import GAMMA, AuditConfig
from .models import AuditedLanguageModel, AuditLanguageLoss, AuditLoss, AuditModel, LanguageModel


def audit_task(config: AuditConfig, g: torch.Generator, ids: torch.Tensor, directions: torch.Tensor,
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


def clipping_arguments(config: AuditConfig, model: nn.Module) -> Dict[str, object]:
    """``make_private``'s clipping arguments for ``config.clipping`` (``AuditConfig.audit_bound``):
    flat or automatic, C; per layer, C / sqrt(2) for the audit embedding and the rest of C^2 split evenly over
    the model's other parameters; per block, the same over groups, the audit embedding one and
    ``dpgrad.clipping.groups.per_block``'s blocks of the model the others."""
    from dpgrad.clipping.groups import per_block

    C = config.max_grad_norm
    if config.clipping == "flat":
        return dict(max_grad_norm=C)
    if config.clipping == "automatic":
        return dict(clipping="automatic", max_grad_norm=C, automatic_gamma=GAMMA)
    if config.clipping == "per_layer":
        others = [p for p in model.parameters() if p.requires_grad and p is not model.audit.weight]
        return dict(clipping="per_layer", max_grad_norm=[config.audit_bound() if p is model.audit.weight
                                                         else C / math.sqrt(2 * len(others))
                                                         for p in model.parameters() if p.requires_grad])

    def rule(name: str) -> str:
        return "audit embedding" if name == "audit.weight" else per_block(name.removeprefix("model."))

    labels = list(dict.fromkeys(rule(n) for n, p in model.named_parameters() if p.requires_grad))
    bounds = [config.audit_bound() if label == "audit embedding" else C / math.sqrt(2 * (len(labels) - 1))
              for label in labels]
    return dict(clipping="groups", clipping_groups=rule, max_grad_norm=bounds)


def train_private(config: AuditConfig, model: nn.Module, criterion: nn.Module, dataset,
                  on_step: Optional[Callable[[], None]] = None) -> Tuple[object, float]:
    """``config.steps`` steps of DP-SGD (plain SGD at ``config.lr``) on ``dataset`` through
    ``dpgrad.opacus.make_private``: ghost clipping, Poisson sampling at ``config.sample_rate``,
    Opacus's RDP accountant. Each dataset row is (model inputs..., target); ``on_step()`` runs
    after each step (a progress display). Returns the privacy engine and the expected batch size."""
    import opacus

    import dpgrad.opacus

    # make_private's Poisson sampling draws at 1 / len(loader): batches that make it the audit's rate.
    per_epoch = max(1, round(1 / config.sample_rate))
    loader = torch.utils.data.DataLoader(dataset, batch_size=math.ceil(len(dataset) / per_epoch))
    if len(loader) != per_epoch:
        raise ValueError(f"{len(dataset)} samples cannot be split into "
                         f"{per_epoch} batches: use more canaries or samples, or a larger sample rate")
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    engine = opacus.PrivacyEngine(accountant="rdp")
    module, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=config.noise_multiplier,
        **clipping_arguments(config, model), criterion=criterion, grad_sample_mode="ghost",
        single_backward=config.single_backward, noise_generator=torch.Generator().manual_seed(config.seed + 3))
    done = 0
    while done < config.steps:  # the loader draws a Poisson batch each step; steps are counted here
        for *inputs, target in loader:
            optimizer.zero_grad(set_to_none=True)
            criterion(module(*inputs), target).backward()
            optimizer.step()
            done += 1
            if on_step is not None:
                on_step()
            if done == config.steps:
                break
    return engine, len(dataset) / per_epoch


def trainer_rows(config: AuditConfig, language_model: LanguageModel, g: torch.Generator,
                 canaries: List[Dict[str, torch.Tensor]], ordinary: Dict[str, torch.Tensor]) -> Tuple[list, float]:
    """DPTrainer's dataset: ``config.samples`` ordinary sequences (and a few more, so that the
    expected batch ``N * sample_rate`` is a whole number: DPTrainer samples at expected / N),
    each a row of ``input_ids``, ``labels`` (the sequence, -100 at its padding) and the
    ``ordinary`` columns; then a row per canary, on a sequence of its own, with the canary's
    columns over those. Returns the rows and the expected batch size."""
    per_epoch = max(1, round(1 / config.sample_rate))
    n = config.samples + (-(config.samples + len(canaries))) % per_epoch
    ids = language_model.sequences(n + len(canaries), config.seq_len, g)
    labels = ids.masked_fill(ids == language_model.padding_idx, -100)  # padding is not predicted
    rows = [{"input_ids": ids[i], "labels": labels[i], **ordinary} for i in range(n)]
    rows += [{"input_ids": ids[n + j], **canary} for j, canary in enumerate(canaries)]
    return rows, len(rows) / per_epoch


def train_with_trainer(config: AuditConfig, model: nn.Module, rows: list, expected: float,
                       on_step: Optional[Callable[[], None]] = None):
    """``config.steps`` DP steps of ``dpgrad.hf.DPTrainer`` on ``rows``: plain SGD at
    ``config.lr`` (constant), Opacus's RDP accountant at ``config.delta``; ``on_step()`` after
    each step. Returns the trainer."""
    import tempfile

    import transformers

    from dpgrad.hf import DPTrainer, PrivacyArguments

    def collate(batch):
        return {key: torch.stack([torch.as_tensor(row[key]) for row in batch]) for key in batch[0]}

    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with tempfile.TemporaryDirectory() as directory:
        args = transformers.TrainingArguments(
            output_dir=directory, per_device_train_batch_size=round(expected), max_steps=config.steps,
            learning_rate=config.lr, max_grad_norm=0.0, seed=config.seed, report_to=[], save_strategy="no",
            logging_strategy="no",
            remove_unused_columns=False, use_cpu=True, disable_tqdm=True)
        privacy = PrivacyArguments(noise_multiplier=config.noise_multiplier, max_grad_norm=config.max_grad_norm,
                                   accountant="rdp", target_delta=config.delta,
                                   single_backward=config.single_backward)
        trainer = DPTrainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                            optimizers=(optimizer, constant), privacy_args=privacy)
        if on_step is not None:
            class Steps(transformers.TrainerCallback):
                def on_step_end(self, args, state, control, **kwargs):
                    on_step()

            trainer.add_callback(Steps())
        trainer.train()
    if trainer.steps_taken() != config.steps:
        raise RuntimeError(f"DPTrainer took {trainer.steps_taken()} DP steps, not {config.steps}")
    return trainer
