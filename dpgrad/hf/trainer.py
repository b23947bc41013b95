"""Private fine-tuning with the Hugging Face ``Trainer``: ``PrivacyArguments`` and ``DPTrainer``.

``DPTrainer`` is a ``transformers.Trainer`` whose every optimizer step is a DP-SGD step:

- the logical batch is Poisson-sampled: every row (or, with ``user_column``, every user with
  all of their rows) is taken with probability ``q = expected / N`` on its own, the expected
  batch size being ``per_device_train_batch_size * gradient_accumulation_steps * world_size``;
  an epoch is ``1 / q`` steps, as Opacus's DP data loader has it;
- under DDP (``torchrun``), rank ``r`` draws the rows (users) ``r, r + world, ...`` with its own
  generator (seeded from ``seed`` and the rank), runs its share as physical batches of its own
  (ranks need not run as many), and the distributed DP optimizer adds the noise once, on rank 0,
  and sums the ranks' clipped gradients (DDP's own reduction is not used: each physical batch
  goes through the module inside DistributedDataParallel);
- the logical batch runs as physical batches of exactly ``physical_batch_size`` rows (default
  ``per_device_train_batch_size``), the last padded with copies whose loss weighs exactly zero,
  through dpgrad's ghost-clipping wrapper (one backward pass per physical batch with
  ``single_backward``); the clipped gradients accumulate, and the optimizer (dpgrad's batched
  Opacus ``DPOptimizerFastGradientClipping``) adds the noise once and steps once;
- with ``PrivacyArguments(cuda_graph=True)`` each physical batch's forward pass and clipped
  backward is replayed from a CUDA graph (``dpgrad.graphs.GraphedPerShape``: one per batch
  shape, captured after two eager passes), the noise and the optimizer's step eager, in the
  Trainer's loop;
- each row of a causal language model is one sample: its loss is the mean over its predicted
  tokens (labels of -100 ignored); with ``user_column`` a user of ``n`` rows in the batch has
  each row clipped to ``C / n``, so the user moves the gradient by at most ``C``;
- the noise is ``noise_multiplier``, or the smallest that keeps ``target_epsilon`` over the
  planned steps; Opacus's accountant ("prv" or "rdp") counts every step, ``epsilon`` is in the
  Trainer's logs, ``privacy_spent()`` returns ``(epsilon, delta)`` (epsilon at least 0), and a
  step that would take epsilon past ``target_epsilon`` is not taken: training stops there;
- each checkpoint holds the privacy state (``dpgrad_privacy.json``: the accountant's steps, the
  noise, the sampling, the sampler's generator), and a run resumed from it goes on spending the
  same budget from the same stream of batches; with ``model_init`` every ``train()``'s model gets
  a private optimizer and the same accountant. The Trainer's
  ``grad_norm`` (the norm of the gradient before its noise, which is not private) is not logged;
- a model sharded by FSDP2 (``fully_shard`` by the caller before the Trainer, or the Trainer's
  FSDP in its version 2) is trained as under DDP, each rank running as many physical batches as
  the rank with the most (FSDP2's collectives run in every pass), Opacus's FSDP optimizer adding
  each shard's noise; a model the caller sharded is not given to Accelerate (which would put DDP
  around it), and its checkpoints hold the gathered weights and each rank's optimizer state.

It refuses what would break the guarantee or the accounting (``DPTrainer.__init__``): a
sampler other than its own (``train_sampling_strategy`` other than "random", an overridden
``_get_train_sampler`` or ``get_train_dataloader``), DeepSpeed, FSDP in its version 1, several
GPUs in one process (DataParallel), reentrant activation checkpointing, LOMO optimizers, an optimizer holding
parameters that are not the model's, a dataset without a length or without rows, a default delta
of 1 (one row or user), a checkpoint without a sound privacy state, a ``compute_loss_func``
(the loss clipped is each row's mean token cross-entropy, label-smoothed by
``label_smoothing_factor``), and TRL's ``packing``, ``padding_free``, ``loss_type`` other than
"nll" and ``activation_offloading`` (TRL's ``SFTTrainer`` goes after ``DPTrainer`` in a subclass:
``class DPSFTTrainer(DPTrainer, trl.SFTTrainer)``). The Trainer's own clipping of the summed
gradient (``max_grad_norm``, 1.0 by default) is turned off, with a log line, in a copy of the
caller's ``TrainingArguments``.

``transformers`` is imported here only: the rest of dpgrad does not need it.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import math
import os
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import transformers
from torch.utils.data import DataLoader

from dpgrad.batches import padded_parts
from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.backward.fsdp import sharded_modules
from dpgrad.graphs import GraphedPerShape
from dpgrad.hf.privacy import PRIVACY_FORMAT, PRIVACY_STATE, PrivacyArguments, privacy_state_problem
from dpgrad.hf.sampling import Indexed, LogicalBatch, PoissonSampler, sampling_generator, sampling_units
from dpgrad.loss import DPLossFastGradientClipping

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


_OWN_LOSS = ("DPTrainer trains on each row's mean token cross-entropy (label_smoothing_factor applies), which "
             "it computes per sample: {} would not be the loss it clips")


def _refuse_trl_settings(args) -> None:
    """Refuse, before TRL's ``SFTTrainer`` (when it comes after ``DPTrainer`` in a subclass)
    acts on them, the settings of its ``SFTConfig`` that per-sample clipping cannot honour."""
    if getattr(args, "packing", False) or getattr(args, "padding_free", False):
        raise ValueError("DPTrainer clips each row as one sample: packing (or padding_free) puts several examples "
                         "into one row, whose clipping would not bound each example; set packing=False and "
                         "padding_free=False")
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type != "nll":
        raise ValueError(_OWN_LOSS.format(f"loss_type={loss_type!r}"))
    if getattr(args, "activation_offloading", False):
        raise ValueError("DPTrainer does not support TRL's activation_offloading: set it to False (activation "
                         "checkpointing, non-reentrant, is supported)")


class _Budget(transformers.TrainerCallback):
    """Stops training after the last step the privacy budget allows."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._next_step_overspends():
            control.should_training_stop = True
        return control


class DPTrainer(transformers.Trainer):
    """``transformers.Trainer`` with differentially private steps (see the module docstring).

    Args:
        privacy_args: ``PrivacyArguments``.
        *args, **kwargs: as for ``transformers.Trainer``. ``per_device_train_batch_size *
            gradient_accumulation_steps`` is the expected logical batch size.
    """

    def __init__(self, *args, privacy_args: PrivacyArguments, **kwargs):
        if not isinstance(privacy_args, PrivacyArguments):
            raise TypeError(f"privacy_args must be a dpgrad.hf.PrivacyArguments, not {type(privacy_args).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_trl_settings(training_args)
        if training_args is not None:  # changed below (accumulation, clipping): the caller's stays as it was
            if "args" in kwargs:
                kwargs["args"] = copy.copy(training_args)
            else:
                args = (args[0], copy.copy(training_args), *args[2:])
        super().__init__(*args, **kwargs)
        self.privacy_args = privacy_args
        self._refuse_what_breaks_the_guarantee()
        args = self.args
        self.world_size, self.rank = args.world_size, args.process_index
        self.expected_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size
        self.physical_batch_size = privacy_args.physical_batch_size or args.per_device_train_batch_size
        if args.max_grad_norm and args.max_grad_norm > 0:
            logger.warning("DPTrainer: TrainingArguments.max_grad_norm=%s turned off: per-sample clipping to "
                           "max_grad_norm=%s (PrivacyArguments) replaces it", args.max_grad_norm,
                           privacy_args.max_grad_norm)
            args.max_grad_norm = 0.0
        # One Trainer step is one logical batch; its physical batches are accumulated here.
        args.gradient_accumulation_steps = 1
        dataset = self.train_dataset
        self._units, self._shares = sampling_units(dataset, privacy_args.user_column)
        if not self._units:
            raise ValueError("DPTrainer: the training dataset is empty")
        self.sample_rate = min(1.0, self.expected_batch_size / len(self._units))
        self.target_delta = privacy_args.target_delta or 1 / len(self._units)
        if self.target_delta >= 1:
            raise ValueError(f"target_delta defaults to 1 / N, which is {self.target_delta} for N = {len(self._units)} "
                             f"{'users' if privacy_args.user_column else 'rows'}: a delta of 1 guarantees nothing; "
                             "give PrivacyArguments.target_delta")
        from opacus.accountants import create_accountant

        self.accountant = create_accountant(privacy_args.accountant)
        self.noise_multiplier = privacy_args.noise_multiplier
        self.allowed_steps: Optional[int] = None  # with target_epsilon: the steps the budget allows
        self._wrapper: Optional[GradSampleModuleFastGradientClipping] = None
        self._loss: Optional[DPLossFastGradientClipping] = None
        self._dp_optimizer = None
        self._generator = sampling_generator(args.seed, self.rank, self.world_size)
        self._sampler: Optional[PoissonSampler] = None
        self._sharding: Tuple[Optional[nn.Module], bool] = (None, False)  # (model, sharded by the caller)
        self._graphed: Optional[GraphedPerShape] = None  # cuda_graph: the physical passes' graphs
        if privacy_args.cuda_graph and self.world_size > 1:
            raise ValueError("PrivacyArguments(cuda_graph=True) under distributed training: the ranks' collectives "
                             "are not captured yet; leave cuda_graph False")
        self.add_callback(_Budget(self))

    # ------------------------------------------------------------------ refusals
    def _refuse_what_breaks_the_guarantee(self) -> None:
        args = self.args
        strategy = getattr(args, "train_sampling_strategy", "random")
        if strategy != "random" or getattr(args, "group_by_length", False):
            raise ValueError(f"DPTrainer samples every logical batch by Poisson sampling, which the privacy "
                             f"accounting assumes; train_sampling_strategy={strategy!r} (group_by_length) would "
                             "replace it: leave it at 'random'")
        for name in ("_get_train_sampler", "get_train_dataloader"):
            if getattr(type(self), name) is not getattr(DPTrainer, name):
                raise ValueError(f"{type(self).__name__} overrides {name}: DPTrainer's batches must come from its "
                                 "own Poisson sampler, which the privacy accounting assumes")
        if getattr(args, "deepspeed", None) or getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("DPTrainer does not support DeepSpeed: its engine takes the backward pass and the "
                             "optimizer step, where per-sample clipping and the noise must happen. To shard a "
                             "model over several GPUs, use FSDP2: the Trainer's fsdp with fsdp_config "
                             "{'fsdp_version': 2}, or a model sharded by torch's fully_shard")
        if (getattr(args, "fsdp", None) or getattr(self, "is_fsdp_enabled", False)) and self._fsdp_version() != 2:
            raise ValueError("DPTrainer takes the Trainer's FSDP in its version 2 only (fsdp_config "
                             "{'fsdp_version': 2}: FSDP2's fully_shard, whose sharded gradients dpgrad clips); "
                             "FSDP1 flattens the parameters, which per-sample clipping cannot see through")
        if args.n_gpu > 1:
            raise ValueError(f"DPTrainer runs one device per process, not {args.n_gpu} GPUs in one (DataParallel, "
                             "whose module replicas the per-sample hooks do not see): launch one process per GPU "
                             "with torchrun (DDP)")
        if self.compute_loss_func is not None:
            raise ValueError(_OWN_LOSS.format("a compute_loss_func"))
        kwargs = args.gradient_checkpointing_kwargs or {}
        if args.gradient_checkpointing and kwargs.get("use_reentrant", False):
            raise ValueError("DPTrainer needs non-reentrant activation checkpointing (use_reentrant=False): a "
                             "reentrant checkpoint hides its layers' inputs from the per-sample hooks")
        if args.gradient_checkpointing:
            args.gradient_checkpointing_kwargs = {**kwargs, "use_reentrant": False}
        if str(getattr(args, "optim", "")).lower().endswith("lomo"):
            raise ValueError(f"optim={args.optim}: LOMO optimizers update the weights inside the backward pass, "
                             "before the gradients can be clipped and noised; use another optimizer")
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("DPTrainer needs a dataset with a length and indexable rows (Poisson sampling "
                             "draws each row independently): not an IterableDataset")
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer)

    def _fsdp_version(self) -> int:
        plugin = getattr(getattr(self, "accelerator", None), "state", None)
        plugin = getattr(plugin, "fsdp_plugin", None)
        if plugin is not None:
            return int(getattr(plugin, "fsdp_version", 1))
        config = getattr(self.args, "fsdp_config", None) or {}
        return int(config.get("fsdp_version", config.get("version", 1)))

    def _sharded_by_caller(self) -> bool:
        """Whether the caller sharded the model by ``fully_shard`` before the Trainer (the
        Trainer's own FSDP aside); looked up once per model."""
        if self._sharding[0] is not self.model:
            by_caller = bool(sharded_modules(self.model)) and not getattr(self, "is_fsdp_enabled", False)
            self._sharding = (self.model, by_caller)
        return self._sharding[1]

    def _sharded(self) -> bool:
        """Whether the model is sharded by FSDP2: by the caller (``fully_shard`` before the
        Trainer) or by the Trainer's own FSDP (version 2, through Accelerate)."""
        return bool(getattr(self, "is_fsdp_enabled", False)) or self._sharded_by_caller()

    def _check_optimizer(self, optimizer) -> None:
        own = {id(p) for p in self.model.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not the "
                                     "model's: DPTrainer can only make private an optimizer over the model's "
                                     "parameters")

    # ------------------------------------------------------------------ data
    def _get_train_sampler(self, train_dataset=None):
        """This rank's Poisson sampler, over its share of the units (every unit in one process)."""
        self._sampler = PoissonSampler(self._units[self.rank::self.world_size], self.sample_rate, self._generator)
        return self._sampler

    def get_train_dataloader(self) -> DataLoader:
        """Logical batches (``LogicalBatch``, uncollated) of Poisson-sampled rows; collated later,
        a physical batch at a time. Not passed to accelerate, which would re-shard its batches."""
        dataset = self.train_dataset
        sampler = self._get_train_sampler(dataset)
        shares = self._shares

        def logical(rows_and_indices):
            indices = [i for _, i in rows_and_indices]
            return LogicalBatch([r for r, _ in rows_and_indices], indices, [shares[i] for i in indices])

        return DataLoader(Indexed(dataset), batch_sampler=sampler, collate_fn=logical,
                          num_workers=self.args.dataloader_num_workers)

    # ------------------------------------------------------------------ optimizer, noise, accountant
    def create_optimizer(self, model=None):
        """The Trainer's optimizer, made private (dpgrad's batched Opacus DP optimizer) with the
        noise for the planned steps (``state.max_steps``) and the accountant's step hook."""
        super().create_optimizer(model)
        self._make_private(self.state.max_steps)
        return self.optimizer

    def _make_private(self, steps: int) -> None:
        """The optimizer made private, unless it is already (a later ``train()`` of the same
        model): a new one (``model_init`` builds a new model for each ``train()``) gets the same
        noise and the same accountant, whose steps count against the budget."""
        from opacus.accountants.utils import get_noise_multiplier

        if self._dp_optimizer is not None and self._dp_optimizer in (self.optimizer,
                                                                     getattr(self.optimizer, "optimizer", None)):
            return  # as it is, or inside accelerate's wrapper
        self._check_optimizer(self.optimizer)
        privacy = self.privacy_args
        if privacy.target_epsilon is not None:
            if self.noise_multiplier is None:
                self.noise_multiplier = get_noise_multiplier(
                    target_epsilon=privacy.target_epsilon, target_delta=self.target_delta,
                    sample_rate=self.sample_rate, steps=steps, accountant=privacy.accountant)
            self.allowed_steps = self._allowed_steps(steps)
        if self.world_size > 1 and self._sharded():
            # FSDP2: each rank adds the noise of its own shards (Opacus's FSDP optimizer, as
            # make_private uses it); the sharded gradients were reduce-scattered by FSDP.
            from opacus.optimizers import FSDPOptimizerFastGradientClipping as optimizer_class
        elif self.world_size > 1:
            # Noise on rank 0 only, then the ranks' sums added (Opacus's distributed optimizer,
            # as make_private uses it): its expected batch size is per rank, as Opacus has it.
            from opacus.optimizers import DistributedDPOptimizerFastGradientClipping as optimizer_class
        else:
            from dpgrad.opacus import DPOptimizerFastGradientClipping as optimizer_class

        optimizer = optimizer_class(
            self.optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=privacy.max_grad_norm,
            expected_batch_size=self.expected_batch_size / self.world_size, loss_reduction="mean")
        optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=self.sample_rate))
        self.optimizer = self._dp_optimizer = optimizer
        if self._wrapper is not None:  # its loss wrapper knows the optimizer: made anew at the next step
            self._wrapper.remove_hooks()
            self._wrapper = None
        logger.info("DPTrainer: noise multiplier %.4f, sample rate %.6g, %d planned steps, delta %.3g",
                    self.noise_multiplier, self.sample_rate, steps, self.target_delta)

    # ------------------------------------------------------------------ checkpoints
    def _privacy_file(self, directory: str) -> str:
        return os.path.join(directory, f"{PRIVACY_STATE}-rank{self.rank}.json" if self.world_size > 1
                            else f"{PRIVACY_STATE}.json")

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, and with it the privacy spent (the accountant's steps, the
        noise, the sampling) and the Poisson sampler's generator: a run resumed from it goes on
        spending the same budget and drawing fresh batches."""
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        directory = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(directory, exist_ok=True)
        state = {"format": PRIVACY_FORMAT, "accountant": self.privacy_args.accountant,
                 "history": [list(entry) for entry in self.accountant.history],
                 "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                 "target_delta": self.target_delta, "max_grad_norm": self.privacy_args.max_grad_norm,
                 "world_size": self.world_size, "rank": self.rank,
                 "generator": base64.b64encode(self._resume_state().numpy().tobytes()).decode("ascii")}
        with open(self._privacy_file(directory), "w") as f:
            json.dump(state, f, indent=1)

    def _resume_state(self) -> torch.Tensor:
        """The sampler's generator state a resumed run starts from: where it stands, at the end
        of an epoch; in the middle of one, where that epoch began, since the Trainer, resuming,
        draws and drops the epoch's batches already taken (``skip_first_batches``), and then
        goes on with exactly the uninterrupted run's next draws."""
        sampler = self._sampler
        if sampler is not None and sampler.epoch_start is not None and self.state.global_step % sampler.steps:
            return sampler.epoch_start
        return self._generator.get_state()

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The Trainer's, but for a model the caller sharded by ``fully_shard``: every rank
        gathers the full state dict (a collective), rank 0 writes it."""
        if not self._sharded_by_caller():
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """For a model the caller sharded, each rank's optimizer state (its shards') in a file of
        its own; otherwise the Trainer's."""
        if not self._sharded_by_caller():
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)  # each rank writes here, whichever comes first
        torch.save(self.optimizer.state_dict(), os.path.join(output_dir, f"optimizer-rank{self.rank}.pt"))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """For a model the caller sharded, the checkpoint's full weights put into every rank's
        shards; otherwise the Trainer's."""
        if not self._sharded_by_caller():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = load_file(os.path.join(resume_from_checkpoint, "model.safetensors"))
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is not None and self._sharded_by_caller():
            self.optimizer.load_state_dict(torch.load(os.path.join(checkpoint, f"optimizer-rank{self.rank}.pt"),
                                                      weights_only=False))
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=False))
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._load_privacy_state(checkpoint)

    def _load_privacy_state(self, checkpoint: str) -> None:
        """What ``_save_checkpoint`` saved, checked against this run's settings: the accountant's
        steps, the noise (under ``target_epsilon``, the budget's), the generator's state."""
        path = self._privacy_file(checkpoint)
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"checkpoint {checkpoint} holds no privacy state ({os.path.basename(path)}): the "
                             "privacy spent before it is unknown, so DPTrainer cannot resume from it") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable privacy state ({exc})") from exc
        problem = privacy_state_problem(state)
        if problem is not None:
            raise ValueError(f"{path}: {problem}")
        mine = {"accountant": self.privacy_args.accountant, "sample_rate": self.sample_rate,
                "target_delta": self.target_delta, "world_size": self.world_size}
        for key, value in mine.items():
            if state[key] != value and not (isinstance(value, float) and math.isclose(state[key], value, rel_tol=1e-12)):
                raise ValueError(f"{path}: the checkpoint's run had {key} {state[key]!r}, this one has {value!r}: "
                                 "resume with the same dataset, batch size, privacy arguments and processes")
        try:
            generator = torch.frombuffer(bytearray(base64.b64decode(state["generator"], validate=True)),
                                         dtype=torch.uint8)
            self._generator.set_state(generator.clone())
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"{path}: the sampler's generator state cannot be restored ({exc})") from exc
        self.accountant.history = [tuple(entry) for entry in state["history"]]
        if self.privacy_args.target_epsilon is not None:  # the budget was planned with this noise
            self.noise_multiplier = self._dp_optimizer.noise_multiplier = state["noise_multiplier"]
            self.allowed_steps = self._allowed_steps(self.state.max_steps)
        logger.info("DPTrainer: resumed from %s after %d DP steps (epsilon %.4g)", checkpoint, self.steps_taken(),
                    self.privacy_spent()[0])

    def privacy_spent(self) -> Tuple[float, float]:
        """``(epsilon, delta)`` spent by the steps taken so far."""
        if not self.accountant.history:
            return 0.0, self.target_delta
        if any(noise == 0 for noise, *_ in self.accountant.history):
            return math.inf, self.target_delta  # a step without noise is not private
        # epsilon is at least 0; the accountants' numerics can go a little below.
        return max(0.0, float(self.accountant.get_epsilon(delta=self.target_delta))), self.target_delta

    def _epsilon_after(self, steps: int) -> float:
        """epsilon after the steps taken and ``steps`` more at this run's noise and rate."""
        accountant = type(self.accountant)()
        accountant.history = list(self.accountant.history) + [(self.noise_multiplier, self.sample_rate, steps)]
        return float(accountant.get_epsilon(delta=self.target_delta))

    def _allowed_steps(self, planned: int) -> int:
        """The steps in all (those taken included) ``target_epsilon`` allows, at most
        ``planned``: all of them when the noise was chosen for them (within Opacus's 1%
        tolerance), fewer if they would spend more (a resumed run planning more steps)."""
        target = self.privacy_args.target_epsilon * 1.01
        taken = self.steps_taken()
        low, high = 0, max(planned - taken, 0)  # the most more steps: epsilon grows with them
        if self._epsilon_after(high) <= target:
            return taken + high
        while low < high:
            middle = (low + high + 1) // 2
            if self._epsilon_after(middle) <= target:
                low = middle
            else:
                high = middle - 1
        return taken + low

    def steps_taken(self) -> int:
        """The DP steps taken (counted by the accountant)."""
        return sum(n for *_, n in self.accountant.history)

    def _next_step_overspends(self) -> bool:
        return self.allowed_steps is not None and self.steps_taken() + 1 > self.allowed_steps

    def _get_grad_norm(self, model, grad_norm=None):
        """None: the norm of the clipped sum before its noise is not private, so it is neither
        computed nor logged."""
        return None

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        logs = dict(logs)
        logs["epsilon"] = self.privacy_spent()[0]
        super().log(logs, start_time)

    def _wrap_model(self, model, training=True, dataloader=None):
        """A model the caller sharded by ``fully_shard`` is trained through dpgrad's wrapper as it
        is: Accelerate would put DistributedDataParallel around it (its collectives and FSDP2's
        would both reduce). Otherwise the Trainer's own."""
        if training and self._sharded_by_caller():
            return self._wrapped(self.model)
        return super()._wrap_model(model, training, dataloader)

    # ------------------------------------------------------------------ the step
    def _wrapped(self, model: nn.Module) -> GradSampleModuleFastGradientClipping:
        """dpgrad's wrapper around ``model`` and its per-sequence loss (each row's mean over its
        predicted tokens, labels -100 ignored), made once."""
        if self._wrapper is None or self._wrapper._module is not model:
            if self._wrapper is not None:
                self._wrapper.remove_hooks()
            self._wrapper = GradSampleModuleFastGradientClipping(
                model, max_grad_norm=self.privacy_args.max_grad_norm, loss_reduction="mean",
                single_backward=self.privacy_args.single_backward,
                check_independence=self.privacy_args.check_independence,
                recheck_independence=self.privacy_args.recheck_independence)
            criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX, label_smoothing=self.args.label_smoothing_factor)
            self._loss = DPLossFastGradientClipping(self._wrapper, self._dp_optimizer, criterion, "mean")
        return self._wrapper

    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One DP step's backward: the logical batch's physical batches, each clipped, their
        clipped gradients summed in ``p.grad`` (the optimizer then adds the noise once)."""
        if not isinstance(inputs, LogicalBatch):
            raise ValueError("DPTrainer got a batch that its Poisson sampler did not make (a custom "
                             "get_train_dataloader?): the privacy accounting would not hold")
        optimizer = self._dp_optimizer
        optimizer.zero_grad(set_to_none=True)  # every step starts from nothing
        if self._next_step_overspends():
            optimizer.signal_skip_step(do_skip=True)  # no noise, no step, not counted
            self.control.should_training_stop = True
            logger.warning("DPTrainer: the privacy budget (epsilon %s) is spent; stopping before step %d",
                           self.privacy_args.target_epsilon, self.state.global_step + 1)
            return torch.zeros((), device=self.args.device)
        if isinstance(model, GradSampleModuleFastGradientClipping):  # a model sharded by the caller
            model = model._module
        if isinstance(model, nn.parallel.DistributedDataParallel):
            # The distributed DP optimizer sums the ranks' clipped gradients once, after the noise:
            # DDP's forward (which would have its hooks reduce every physical batch, in lock step
            # between ranks) is not used.
            model = model.module
        model.train()
        wrapper = self._wrapped(model)
        size, bound = self.physical_batch_size, self.privacy_args.max_grad_norm
        users = self.privacy_args.user_column is not None
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        total = torch.zeros((), device=self.args.device)
        # Physical batches padded as dpgrad.batches pads them: the padding's losses weigh zero.
        parts = list(padded_parts(list(zip(inputs.rows, inputs.shares)), size, (self.train_dataset[0], 0.0)))
        if self.world_size > 1 and self._sharded():
            # FSDP2's collectives run in every forward and backward pass: every rank runs as many
            # physical batches as the rank with the most, the extra ones padding alone.
            count = torch.tensor([len(parts)], device=self.args.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            parts += [next(padded_parts([], size, (self.train_dataset[0], 0.0)))] * (int(count.item()) - len(parts))
        run = self._physical_pass
        if self.privacy_args.cuda_graph:
            if self._graphed is None or self._graphed.module is not wrapper:
                self._graphed = GraphedPerShape(self._physical_pass, module=wrapper)
            run = self._graphed
        for part, real in parts:
            batch = self._prepare_inputs(collator([row for row, _ in part]))
            # The padding's rows weigh zero. A user's n rows are each clipped to C / n; every row
            # to C without users.
            weights = torch.arange(size, device=self.args.device) < real
            bounds = [share * bound for _, share in part] if users else None
            total = total + run(batch, weights, bounds).to(total.device)
        return total / max(len(inputs), 1)

    def _physical_pass(self, batch: Dict[str, torch.Tensor], weights: torch.Tensor, bounds) -> torch.Tensor:
        """One physical batch's forward pass and clipped backward (its clipped gradients added
        to ``p.grad``): the sum of its rows' losses, each weighed by ``weights`` (0 for the
        padding), each clipped to its bound in ``bounds`` (None: ``max_grad_norm``)."""
        with self.compute_loss_context_manager():
            losses = self._per_sample_losses(self._wrapper, batch)
        losses = losses * weights.to(losses.dtype)
        self._wrapper.clipped_backward(losses, max_grad_norms=bounds)
        return losses.detach().sum()

    def _per_sample_losses(self, wrapper, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's causal-LM loss: the mean over its predicted tokens (labels -100 ignored) of
        the cross-entropy (label-smoothed by ``label_smoothing_factor``); ``compute_loss`` serves
        evaluation only."""
        batch = dict(batch)
        labels = batch.pop("labels", None)
        if labels is None:
            raise ValueError("DPTrainer needs labels in each batch (a causal LM's input ids, -100 where "
                             "ignored: e.g. DataCollatorForLanguageModeling(mlm=False))")
        batch.pop(self.privacy_args.user_column or "", None)
        ids = batch.get("input_ids")
        if ids is not None and "position_ids" not in batch:
            # One row of positions per sample: HF's default single row has no per-sample gradient.
            batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logits = wrapper(**batch).logits
        shifted, targets = logits[:, :-1], labels[:, 1:].to(logits.device)
        return self._loss(shifted.reshape(-1, shifted.shape[-1]).float(), targets.reshape(-1),
                          shape=shifted.shape[:2]).loss_per_sample


__all__ = ["PrivacyArguments", "DPTrainer", "PoissonSampler", "LogicalBatch"]
