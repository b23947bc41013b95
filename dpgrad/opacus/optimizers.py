"""Opacus's DP optimizers for ghost clipping with their per-parameter work batched:
``DPOptimizerFastGradientClipping`` (one process) and
``DistributedDPOptimizerFastGradientClipping`` (DDP, the noise added on rank 0), which
``make_private`` (``dpgrad.opacus.engine``) puts in place of Opacus's."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from opacus.optimizers import DPOptimizerFastGradientClipping as _OpacusDPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from dpgrad.backward.autograd_graph import eager_when_compiled


class DPOptimizerFastGradientClipping(_OpacusDPOptimizerFastGradientClipping):
    """Opacus's ``DPOptimizerFastGradientClipping`` with its per-parameter work batched.

    Same arguments, attributes, step skipping (virtual steps), accountant hooks and result as
    Opacus's: ``p.grad`` becomes ``(p.summed_grad + N(0, (noise_multiplier * max_grad_norm)^2))``
    divided by the expected batch size under "mean". Opacus does it with about five operations
    per parameter (a copy of the gradient, a zero tensor, the noise, the sum, the division);
    on a GPU a model with hundreds of parameters then spends more host time in the optimizer
    than in its backward pass. Here:

    - ``p.summed_grad`` is the clipped gradient itself, not a copy (a copy is made only when
      the step is skipped, so that a later ``zero_grad`` cannot clear it);
    - the noise of all parameters of one device and dtype is drawn in one call into one
      buffer, already divided by the expected batch size under "mean" (its standard deviation
      divided), the clipped sums are added to it times the same factor (one multi-tensor
      operation, rounded once), and every ``p.grad`` is a view of that buffer: no pass of its
      own for the division (without noise, the sums are divided as Opacus divides them);
    - a trainable parameter the backward pass did not reach (``p.grad`` None) is given a zero
      sum: it receives noise like every other parameter (Opacus's optimizer fails on it).

    The noise has Opacus's distribution (independent Gaussians, in the gradient's dtype), but a
    seeded ``generator`` gives other draws than Opacus's per-parameter calls. With
    ``secure_mode`` the noise is drawn by Opacus's own code, parameter by parameter.
    """

    def accumulate(self):
        summed, grads = [], []
        for p in self.params:
            if p.summed_grad is None:
                # The gradient itself: pre_step copies it only if the step is skipped.
                p.summed_grad = p.grad if p.grad is not None else torch.zeros_like(p)
            elif p.grad is not None:
                summed.append(p.summed_grad)
                grads.append(p.grad)
        if summed:
            torch._foreach_add_(summed, grads)

    @eager_when_compiled
    def pre_step(self, closure=None) -> bool:
        stepped = super().pre_step(closure)
        if not stepped:
            # A skipped step's sums outlive it: they must not be p.grad, which zero_grad may clear.
            for p in self.params:
                if p.summed_grad is p.grad:
                    p.summed_grad = p.grad.clone()
        return stepped

    def add_noise(self):
        if self.secure_mode:
            return super().add_noise()
        # A tensor under adaptive clipping (dpgrad.clipping.adaptive): the bound stays on the device.
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        params = self.params
        for p in params:
            _check_processed_flag(p.summed_grad)
        groups: Dict[Tuple[torch.device, torch.dtype], List[nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.summed_grad.device, p.summed_grad.dtype), []).append(p)
        # Under "mean" the division of scale_grad, folded in here where noise is drawn.
        divisor = self._divisor()
        folded = divisor != 1 and not (isinstance(std, (int, float)) and std == 0)
        for (device, dtype), group in groups.items():
            sizes = [p.numel() for p in group]
            noise = torch.empty(sum(sizes), device=device, dtype=dtype)
            if isinstance(std, torch.Tensor):
                noise.normal_(0, 1, generator=self.generator).mul_((std / divisor).to(device=device, dtype=dtype))
            elif std == 0:
                noise.zero_()
            else:
                noise.normal_(0, std / divisor, generator=self.generator)
            noisy = [piece.view_as(p) for piece, p in zip(noise.split(sizes), group)]
            torch._foreach_add_(noisy, [p.summed_grad for p in group], alpha=1 / divisor if folded else 1)
            for p, g in zip(group, noisy):
                p.grad = g
        self._scaled = folded
        for p in params:
            _mark_as_processed(p.summed_grad)

    def _divisor(self) -> float:
        """What scale_grad divides the noisy sums by: the expected batch size (times the
        accumulated steps) under "mean", else 1."""
        return self.expected_batch_size * self.accumulated_iterations if self.loss_reduction == "mean" else 1

    def scale_grad(self):
        if self.__dict__.pop("_scaled", False):  # add_noise divided them already
            return
        if self.loss_reduction == "mean":
            torch._foreach_div_([p.grad for p in self.params], self._divisor())


class DistributedDPOptimizerFastGradientClipping(DPOptimizerFastGradientClipping):
    """Opacus's ``DistributedDPOptimizerFastGradientClipping`` (the noise added once, on rank
    0, then the ranks' gradients summed, and averaged under "mean"), with the batched noise of
    ``DPOptimizerFastGradientClipping``, which takes a bound on the device: what adaptive
    clipping under DDP uses. Same arguments."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    def add_noise(self):
        if self.rank == 0:
            super().add_noise()
        else:
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)

    def reduce_gradients(self):
        grads = [p.grad for p in self.params if p.requires_grad]
        for g in grads:
            torch.distributed.all_reduce(g, op=torch.distributed.ReduceOp.SUM)
        if self.loss_reduction == "mean" and grads:
            torch._foreach_div_(grads, self.world_size)

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.pre_step():
            self.reduce_gradients()
            return self.original_optimizer.step()
        return None
