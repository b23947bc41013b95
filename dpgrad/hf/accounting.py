"""The privacy accounting of ``DPTrainer`` (``dpgrad.hf``): its optimizer made private (dpgrad's
batched Opacus DP optimizer, or its distributed or FSDP one) with the noise for the planned
steps and the accountant's step hook, the steps ``target_epsilon`` allows, and epsilon in the
Trainer's logs (the norm of the gradient before its noise, which is not private, left out)."""

from __future__ import annotations

import logging
from typing import Dict, Optional

from dpgrad.opacus.budget import accountant_quiet, noise_multiplier

logger = logging.getLogger(__name__)


class PrivacyAccounting:
    """``DPTrainer``'s noise, accountant and budget (a mixin: it uses the trainer's
    ``privacy_args``, ``accountant``, noise and sampling, ``steps_taken``, ``privacy_spent``,
    ``_check_optimizer``, ``_sharded`` and ``_wrapper``)."""

    def _make_private(self, steps: int) -> None:
        """The optimizer made private, unless it is already (a later ``train()`` of the same
        model): a new one (``model_init`` builds a new model for each ``train()``) gets the same
        noise and the same accountant, whose steps count against the budget."""
        if self._dp_optimizer is not None and self._dp_optimizer in (self.optimizer,
                                                                     getattr(self.optimizer, "optimizer", None)):
            return  # as it is, or inside accelerate's wrapper
        self._check_optimizer(self.optimizer)
        privacy = self.privacy_args
        if privacy.target_epsilon is not None:
            if self.noise_multiplier is None:
                with accountant_quiet(privacy.accountant):
                    self.noise_multiplier = noise_multiplier(
                        target_epsilon=privacy.target_epsilon, target_delta=self.target_delta,
                        sample_rate=self.sample_rate, steps=steps, mechanism=privacy.accountant)
            self.allowed_steps = self._allowed_steps(steps)
        if self.world_size > 1 and self._sharded():
            # FSDP2: each rank adds the noise of its own shards (Opacus's FSDP optimizer taking its
            # step as dpgrad's do, as make_private uses it); the sharded gradients were reduce-scattered.
            from dpgrad.opacus import FSDPOptimizerFastGradientClipping as optimizer_class
        elif self.world_size > 1:
            # Noise on rank 0 only, then the ranks' sums added (dpgrad's distributed optimizer, as
            # make_private uses it): its expected batch size is per rank, as Opacus has it.
            from dpgrad.opacus import DistributedDPOptimizerFastGradientClipping as optimizer_class
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

    def _epsilon_after(self, steps: int) -> float:
        """epsilon after the steps taken and ``steps`` more at this run's noise and rate, from the
        very history the accountant will then hold: its ``step`` adds a step of the last entry's
        noise and rate to that entry, and the same steps as two entries are another computation
        (PRV's convolutions, RDP's sums) whose rounding can put them on the other side of the
        target than the epsilon that ``noise_multiplier`` and ``privacy_spent`` compute."""
        history = list(self.accountant.history)
        noise, rate = self.noise_multiplier, self.sample_rate
        if steps and history and tuple(history[-1][:2]) == (noise, rate):
            history[-1] = (noise, rate, history[-1][2] + steps)
        elif steps:
            history.append((noise, rate, steps))
        if not history:
            return 0.0
        accountant = type(self.accountant)()
        accountant.history = history
        with accountant_quiet(self.privacy_args.accountant):
            return float(accountant.get_epsilon(delta=self.target_delta))

    def _allowed_steps(self, planned: int) -> int:
        """The steps in all (those taken included) that keep epsilon at most ``target_epsilon``,
        at most ``planned``: all of them when the noise was chosen for them (``noise_multiplier``
        returns a noise whose planned steps spend at most the target, computed as
        ``_epsilon_after`` computes it), fewer if they would spend more (a resumed run planning
        more steps than the checkpoint's run)."""
        target = self.privacy_args.target_epsilon
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
