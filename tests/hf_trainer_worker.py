"""What each process of test_hf_trainer.py's DDP tests runs (spawned; gloo on CPU), and the
tiny models and rows the tests share."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import transformers

from dpgrad.hf import DPTrainer, PrivacyArguments

SEQ = 10


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)


def rows(n=24, users=None, seed=0):
    """Sequences with some padding at the end (labels -100, attention 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, 64, (SEQ,), generator=g)
        keep = SEQ - i % 3
        mask = (torch.arange(SEQ) < keep).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        row = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if users is not None:
            row["user"] = users[i]
        out.append(row)
    return out


def training_args(tmp_path, **kw):
    kw = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 1, "learning_rate": 0.5,
          "optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0, "report_to": [],
          "save_strategy": "no", "use_cpu": True, "logging_steps": 1, "seed": 3, "disable_tqdm": True, **kw}
    return transformers.TrainingArguments(output_dir=str(tmp_path), **kw)


class Recording(DPTrainer):
    """DPTrainer recording each logical batch it trains on (its row indices, ``drawn``) and the
    type of the model it steps (``stepped``: the Trainer's wrapper, under DDP)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drawn: list = []
        self.stepped = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.drawn.append(list(inputs.indices))
        self.stepped = type(model).__name__
        return super().training_step(model, inputs, num_items_in_batch)


def _as_rank(rank: int, world: int) -> None:
    """This process as rank ``rank`` of ``world``, as torchrun starts it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _model(sharded: bool) -> nn.Module:
    """The workers' GPT-2; with ``sharded``, sharded by FSDP2 (``fully_shard`` on its blocks and
    its root), as the caller does it under torchrun."""
    model = gpt2()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    return model


def _weights(model: nn.Module) -> dict:
    """The model's weights, gathered where they are sharded."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().numpy()
            for n, p in model.named_parameters()}


def ddp_step(rank: int, world: int, noise: float, out: str, sharded: bool = False) -> dict:
    """One DPTrainer step under DDP (the Trainer's own, as under torchrun; with ``sharded``, on
    the model sharded by FSDP2 instead): this rank's logical batch, its physical batches, and the
    weights after the step."""
    _as_rank(rank, world)
    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
    model = _model(sharded)
    privacy = PrivacyArguments(noise_multiplier=noise, max_grad_norm=0.05, physical_batch_size=2)
    args = training_args(f"{out}/{'fsdp' if sharded else ''}{rank}", per_device_train_batch_size=4,
                         gradient_accumulation_steps=1, seed=5)
    t = Recording(model=model, args=args, train_dataset=rows(), privacy_args=privacy)
    t.train()
    (indices,) = t.drawn
    return {"indices": indices, "model": t.stepped, "world_size": t.world_size,
            "sample_rate": t.sample_rate, "expected_batch_size": t.expected_batch_size,
            "optimizer": type(t._dp_optimizer).__name__, "epsilon": t.privacy_spent()[0],
            "params": _weights(model)}


def ddp_resume(rank: int, world: int, out: str, sharded: bool = False) -> dict:
    """Under DDP (with ``sharded``, FSDP2), a run of 4 steps saving at step 3, the end of the
    first epoch (into one output directory, as under torchrun), then a run resumed from that
    checkpoint: the draws of each, and its accountant's steps and weights at the end."""
    _as_rank(rank, world)
    privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=2, accountant="rdp")
    prefix = f"{out}/{'fsdp-' if sharded else ''}"
    got = {}
    for run, save, resume in (("first", "steps", None), ("resumed", "no", f"{prefix}first/checkpoint-3")):
        torch.manual_seed(0 if resume is None else 1)  # the resumed run must load the checkpoint's weights
        model = _model(sharded)
        args = training_args(f"{prefix}{run}", per_device_train_batch_size=4, gradient_accumulation_steps=1,
                             seed=5, max_steps=4, save_strategy=save, save_steps=3)
        t = Recording(model=model, args=args, train_dataset=rows(), privacy_args=privacy)
        t.train(resume_from_checkpoint=resume)
        got[run] = {"drawn": t.drawn, "history": list(t.accountant.history), "params": _weights(model)}
    got["files"] = sorted(os.listdir(f"{prefix}first/checkpoint-3"))
    return got


SCENARIOS = {"ddp_step": ddp_step, "ddp_resume": ddp_resume}
