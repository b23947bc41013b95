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
  the rank with the most (FSDP2's collectives run in every pass), the FSDP optimizer adding
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

``transformers`` is imported here (and, for the checkpoints' directory name, in ``checkpoints``)
only: the rest of dpgrad does not need it.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import transformers
from torch.utils.data import DataLoader

from dpgrad.batches import padded_parts
from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.graphs import GraphedPerShape
from dpgrad.hf.accounting import PrivacyAccounting
from dpgrad.hf.checkpoints import PrivacyCheckpoints
from dpgrad.hf.privacy import PrivacyArguments
from dpgrad.hf.sampling import Indexed, LogicalBatch, PoissonSampler, sampling_generator, sampling_units
from dpgrad.hf.sharding import FSDP2Sharding
from dpgrad.loss import DPLossFastGradientClipping
from dpgrad.opacus.budget import accountant_quiet, create_accountant, default_delta, warn_if_delta_large

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


# The noise and the budget, the checkpoints and the view of FSDP2 are mixins (``accounting``,
# ``checkpoints``, ``sharding``), before the Trainer, whose methods they override.
class DPTrainer(PrivacyAccounting, PrivacyCheckpoints, FSDP2Sharding, transformers.Trainer):
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
        self.target_delta = privacy_args.target_delta or default_delta(len(self._units))
        if self.target_delta >= 1:
            raise ValueError(f"target_delta defaults to N^-1.1, which is {self.target_delta} for N = {len(self._units)} "
                             f"{'users' if privacy_args.user_column else 'rows'}: a delta of 1 guarantees nothing; "
                             "give PrivacyArguments.target_delta")
        if privacy_args.target_delta is not None:
            warn_if_delta_large(self.target_delta, len(self._units))
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

    # ------------------------------------------------------------------ checkpoints, privacy spent
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The Trainer's, but for a model the caller sharded by ``fully_shard``: every rank
        gathers the full state dict (a collective), rank 0 writes it."""
        if not self._sharded_by_caller():
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)

    def privacy_spent(self) -> Tuple[float, float]:
        """``(epsilon, delta)`` spent by the steps taken so far."""
        if not self.accountant.history:
            return 0.0, self.target_delta
        if any(noise == 0 for noise, *_ in self.accountant.history):
            return math.inf, self.target_delta  # a step without noise is not private
        # epsilon is at least 0; the accountants' numerics can go a little below.
        with accountant_quiet(self.privacy_args.accountant):
            return max(0.0, float(self.accountant.get_epsilon(delta=self.target_delta))), self.target_delta

    def steps_taken(self) -> int:
        """The DP steps taken (counted by the accountant)."""
        return sum(n for *_, n in self.accountant.history)

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
        with wrapper.one_batch():  # the physical batches of one Poisson batch: one draw, one step
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
        scaler = getattr(self.accelerator, "scaler", None)  # fp16: the Trainer's GradScaler
        scale = None
        if scaler is not None and scaler.is_enabled():
            # The loss scale on the device (no host read): the unscaled gradients are clipped, and the
            # scaler's step removes it before the noise.
            scale = scaler.scale(torch.ones((), device=losses.device))
        self._wrapper.clipped_backward(losses if scale is None else losses * scale, max_grad_norms=bounds,
                                       loss_scale=scale, optimizer=self._dp_optimizer)
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
