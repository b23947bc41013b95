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
                 "target_epsilon": self.privacy_args.target_epsilon, "user_column": self.privacy_args.user_column,
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
        self._refuse_other_settings(path, state)
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
        if logger.isEnabledFor(logging.INFO):  # the accountant's epsilon takes a while (PRV: seconds)
            logger.info("DPTrainer: resumed from %s after %d DP steps (epsilon %.4g)", checkpoint,
                        self.steps_taken(), self.privacy_spent()[0])

    def _refuse_other_settings(self, path: str, state: dict) -> None:
        """ValueError, before any step, if this run's privacy settings are not the checkpoint's
        run's: a resumed run is that run going on, spending its budget at its noise. Another
        noise, sampling rate, accountant, delta or unit of privacy (``user_column``) would count
        the earlier steps as they were not taken; another ``target_epsilon`` would go unheeded
        (the noise is the checkpoint's, chosen for its own target); another clipping bound
        would train on as another run, with the noise scaled to another bound. ``max_steps``
        may change: under ``target_epsilon`` the budget still ends the run."""
        privacy = self.privacy_args
        mine = {"accountant": privacy.accountant, "sample_rate": self.sample_rate,
                "target_delta": self.target_delta, "world_size": self.world_size,
                "max_grad_norm": privacy.max_grad_norm}
        # Checkpoints saved before these were recorded can be checked on the rest only.
        for key in ("target_epsilon", "user_column"):
            if key in state:
                mine[key] = getattr(privacy, key)
        if privacy.noise_multiplier is not None:  # under target_epsilon, the noise is the checkpoint's
            mine["noise_multiplier"] = privacy.noise_multiplier
        for key, value in mine.items():
            theirs = state[key]
            if _same(theirs, value):
                continue
            hint = _HINTS.get(key, f"the same PrivacyArguments ({key}={theirs!r})")
            if key == "target_delta" and privacy.target_delta is None:
                hint = ("the same target_delta: the default is N^-1.1 (it was 1 / N before): pass "
                        f"PrivacyArguments(target_delta={theirs!r}) to resume that run")
            if key == "target_epsilon":
                if theirs is None:
                    hint = f"the same PrivacyArguments (noise_multiplier={state['noise_multiplier']!r})"
                theirs, value = _budget(theirs, state["noise_multiplier"]), _budget(value, privacy.noise_multiplier)
            else:
                theirs, value = repr(theirs), repr(value)
            raise ValueError(
                f"{path}: the checkpoint's run had {key} {theirs}, this one has {value}: a resumed run goes on "
                f"spending the checkpoint's budget with its settings. Resume with {hint}, or start a new run "
                "without resume_from_checkpoint (if it trains on from this checkpoint's weights, its epsilon adds "
                "to what the checkpoint's run spent)")
        if privacy.target_epsilon is not None and "target_epsilon" not in state:
            raise ValueError(
                f"{path}: the checkpoint does not record its run's target_epsilon (it was saved before DPTrainer "
                f"recorded it), so this run's target_epsilon={privacy.target_epsilon!r} cannot be checked against "
                f"the budget its noise was chosen for: resume with PrivacyArguments(noise_multiplier="
                f"{state['noise_multiplier']!r}) (its noise; max_steps then ends the run), or start a new run")


# What sets each checked value, besides PrivacyArguments.
_HINTS = {
    "sample_rate": "the same dataset, batch size (per_device_train_batch_size x gradient_accumulation_steps "
                   "x processes) and PrivacyArguments",
    "world_size": "as many processes",
}


def _budget(target_epsilon, noise_multiplier) -> str:
    """A run's target_epsilon in words: none where the noise was given."""
    return repr(target_epsilon) if target_epsilon is not None else f"none (noise_multiplier={noise_multiplier!r})"


def _same(theirs, mine) -> bool:
    """The checkpoint's value is this run's (floats as they were computed, up to rounding)."""
    if isinstance(theirs, (int, float)) and isinstance(mine, (int, float)) and not isinstance(mine, bool):
        return theirs == mine or math.isclose(theirs, mine, rel_tol=1e-12)
    return theirs == mine
