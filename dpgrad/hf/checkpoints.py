"""What ``DPTrainer`` (``dpgrad.hf``) adds to the Trainer's checkpoints and takes back from them:
the privacy state (the accountant's steps, the noise, the sampling and the Poisson sampler's
generator, where a resumed run's draws start), one file per process beside the Trainer's,
checked against the resumed run's settings; and, for a model the caller sharded by
``fully_shard``, the full weights put back into every rank's shards and each rank's optimizer
state in a file of its own (``DPTrainer.save_model`` gathers the weights it saves). The privacy
state's file name, format and soundness are in ``dpgrad.hf.privacy``."""

from __future__ import annotations

import base64
import json
import logging
import math
import os

import torch

from dpgrad.hf.privacy import PRIVACY_FORMAT, PRIVACY_STATE, privacy_state_problem

logger = logging.getLogger(__name__)


class PrivacyCheckpoints:
    """``DPTrainer``'s checkpoints (a mixin: it uses the trainer's ``privacy_args``,
    ``accountant``, ``_generator``, ``_sampler``, ``_dp_optimizer``, noise and sampling,
    ``steps_taken``, ``privacy_spent``, ``_allowed_steps`` and ``_sharded_by_caller``)."""

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
                hint = ("; the default target_delta is N^-1.1 (it was 1 / N before): pass "
                        f"PrivacyArguments(target_delta={state[key]!r}) to resume that run"
                        if key == "target_delta" and self.privacy_args.target_delta is None else "")
                raise ValueError(f"{path}: the checkpoint's run had {key} {state[key]!r}, this one has {value!r}: "
                                 f"resume with the same dataset, batch size, privacy arguments and processes{hint}")
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
