"""Adaptive clipping under ghost clipping: a drop-in for Opacus 1.6's
``opacus.utils.adaptive_clipping`` (``DPLossFastGradientAdaptiveClipping``,
``PrivacyEngineAdaptiveClipping``).

The bound C follows a target quantile q of the per-sample gradient norms (Andrew, Thakkar,
McMahan and Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021):
at each step, from the norms the norm pass computed and before any sample is clipped,

    unclipped = #{b : norm_b <= C} + N(0, (B / 20)^2),   C <- clamp(C * exp(-lr * (unclipped / B - q)),
                                                                   min_clipbound, max_clipbound)

and the samples are clipped to the new C. The noisy count costs privacy: the gradient's noise
multiplier is lowered to ``(sigma^-2 - (2 * B / 20)^-2)^(-1/2)`` (the optimizer's
``_adjusted_noise_multiplier``; the accountant keeps counting ``sigma``), as Opacus does
(Theorem 1 of the paper). B is the drawn batch size, as in Opacus, whose own comment notes
that under Poisson sampling it is private and leaks; ``expected_batch_size`` (dpgrad's
keyword) uses the expected batch size instead, public, which closes that leak.

Unlike Opacus's, the bound stays on the device: the count, its noise and the new bound are
device tensors (the noise drawn with Opacus's call, ``torch.normal(0, B / 20, size=(1,))``, on
the norms' device), the wrapper clips to it and the optimizer scales its noise by it, with no
``.item()``. In one process the drawn B is known on the host (the number of losses); under
DDP the ranks' counts and batch sizes are summed in one ``all_reduce`` and, with the drawn
batch size, the global B is read back to the host for the noise multiplier (one sync per
step: ``expected_batch_size`` avoids it). dpgrad's single backward takes the bound from the
norms it already has, between the norm pass and the clipped sums; the double backward does
the same between its two passes. One backward per step: each step's count is paid for once, so
a second backward onto gradients not yet stepped (micro-batches) is refused (Opacus's clears
the earlier gradients instead).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from dpgrad.backward.autograd_graph import eager_when_compiled
from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.loss import DPLossFastGradientClipping, DPTensorFastGradientClipping, clipping_wrapper


def _number(value, what: str, low: float = 0.0, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value < low or (low_open and value == low) or value > high:
        raise ValueError(f"{what} must be a finite number {'>' if low_open else '>='} {low}"
                         f"{'' if high == math.inf else f' and <= {high}'}, not {value!r}")
    return float(value)


class AdaptiveBound:
    """The adaptive rule and its settings (Opacus's names and defaults); ``update`` takes one
    step of it."""

    def __init__(self, target_unclipped_quantile: float = 0.5, min_clipbound: float = 1,
                 max_clipbound: float = 1e8, clipbound_learning_rate: float = 0.2,
                 initial_noise_multiplier: float = 1.0, expected_batch_size: Optional[float] = None):
        self.target_unclipped_quantile = _number(target_unclipped_quantile, "target_unclipped_quantile", 0.0, 1.0)
        self.min_clipbound = _number(min_clipbound, "min_clipbound", low_open=True)
        self.max_clipbound = _number(max_clipbound, "max_clipbound", self.min_clipbound)
        self.clipbound_learning_rate = _number(clipbound_learning_rate, "clipbound_learning_rate")
        self.initial_noise_multiplier = _number(initial_noise_multiplier, "initial_noise_multiplier")
        self.expected_batch_size = None if expected_batch_size is None else _number(
            expected_batch_size, "expected_batch_size", low_open=True)
        if self.expected_batch_size is not None:
            self.noise_multiplier(self.expected_batch_size)  # refused now if too small
        self.counted = False  # whether this step's count was taken (cleared when the optimizer steps)

    def watch(self, optimizer) -> None:
        """Clear ``counted`` whenever ``optimizer`` (its inner optimizer, for Opacus's) steps."""
        inner = getattr(optimizer, "original_optimizer", optimizer)

        def stepped(*_):
            self.counted = False

        inner.register_step_post_hook(stepped)

    def noise_multiplier(self, batch_size: float) -> float:
        """The gradient's noise multiplier once the count's noise (std ``batch_size / 20``) is
        paid for (Andrew et al., Theorem 1; the 2 from recentring the count's bit)."""
        sigma = self.initial_noise_multiplier
        if batch_size <= 10 * sigma:
            raise ValueError(f"adaptive clipping needs a batch larger than 10 * noise_multiplier = {10 * sigma:g}, "
                             f"not {batch_size:g}: the count's noise would take all of the privacy budget (with "
                             "Poisson sampling a drawn batch can be small: public_batch_size=True counts over the "
                             "expected batch size instead)")
        if sigma == 0:
            return 0.0
        return (sigma ** -2 - (2.0 * batch_size / 20.0) ** -2) ** -0.5

    def update(self, norms: torch.Tensor, bound, distributed: bool = False):
        """The new bound (a 0-d fp32 tensor on the norms' device) from the per-sample ``norms``
        and the current ``bound``, and the gradient's noise multiplier for this step. Under DDP
        the count's noise is drawn on rank 0 alone and summed with the counts, so that every
        rank gets the same bound."""
        count = (norms <= bound).sum().to(torch.float32)
        batch_size = norms.shape[0] if self.expected_batch_size is None else self.expected_batch_size
        if not distributed:
            noise = torch.normal(mean=0.0, std=batch_size / 20.0, size=(1,), device=norms.device)
        else:
            dist = torch.distributed
            first = dist.get_rank() == 0
            if self.expected_batch_size is None:
                both = torch.stack([count, torch.tensor(float(batch_size), device=count.device)])
                dist.all_reduce(both, op=dist.ReduceOp.SUM)
                count, batch_size = both[0], int(both[1].item())  # the one host read of the drawn size
                noise = torch.normal(mean=0.0, std=batch_size / 20.0, size=(1,), device=norms.device) if first \
                    else torch.zeros(1, device=norms.device)
                dist.all_reduce(noise, op=dist.ReduceOp.SUM)
            else:
                noise = torch.normal(mean=0.0, std=batch_size / 20.0, size=(1,), device=norms.device) if first \
                    else torch.zeros(1, device=norms.device)
                both = torch.cat([count.view(1), noise])
                dist.all_reduce(both, op=dist.ReduceOp.SUM)
                count, noise = both[0], both[1:]
        sigma = self.noise_multiplier(batch_size)
        fraction = (count + noise) / batch_size
        bound = torch.as_tensor(bound, dtype=torch.float32, device=norms.device)
        new = bound * torch.exp(-self.clipbound_learning_rate * (fraction - self.target_unclipped_quantile))
        return new.clamp(min=self.min_clipbound, max=self.max_clipbound).reshape(()), sigma


class DPTensorFastGradientAdaptiveClipping(DPTensorFastGradientClipping):
    """Per-sample losses whose ``backward()`` updates the bound from their norms, then adds the
    samples' gradients clipped to it to ``p.grad`` (Opacus's signature)."""

    @staticmethod
    def __new__(cls, module, optimizer, loss_per_sample: torch.Tensor, loss_reduction: str = "mean", *args,
                weights: Optional[torch.Tensor] = None, **kwargs):
        return DPTensorFastGradientClipping.__new__(cls, module, optimizer, loss_per_sample, loss_reduction, weights)

    def __init__(self, module, optimizer, loss_per_sample: torch.Tensor, loss_reduction: str = "mean",
                 target_unclipped_quantile: float = 0.5, min_clipbound: float = 1, max_clipbound: float = 1e8,
                 clipbound_learning_rate: float = 0.2, initial_noise_multiplier: float = 1.0,
                 rule: Optional[AdaptiveBound] = None, weights: Optional[torch.Tensor] = None):
        super().__init__(module, optimizer, loss_per_sample, loss_reduction, weights)
        self.rule = rule or AdaptiveBound(target_unclipped_quantile, min_clipbound, max_clipbound,
                                          clipbound_learning_rate, initial_noise_multiplier)

    def _with(self, loss_per_sample: torch.Tensor) -> "DPTensorFastGradientAdaptiveClipping":
        return DPTensorFastGradientAdaptiveClipping(self.module, self.optimizer, loss_per_sample,
                                                    self.loss_reduction, rule=self.rule, weights=self.weights)

    @eager_when_compiled
    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
        if gradient is not None or create_graph or inputs is not None:
            raise ValueError("the clipped backward of dpgrad's loss takes no gradient, create_graph or inputs")
        wrapper = clipping_wrapper(self.module)
        if not isinstance(wrapper, GradSampleModuleFastGradientClipping):
            raise TypeError("dpgrad's adaptive clipping takes dpgrad's GradSampleModuleFastGradientClipping; with "
                            "Opacus's own wrapper use opacus.utils.adaptive_clipping")
        if wrapper.clipping != "flat":
            raise ValueError(f"adaptive clipping adapts one flat bound: the wrapper clips {wrapper.clipping!r}")
        if self.rule.counted:
            raise ValueError("adaptive clipping counts the unclipped samples once per step, and the noise of that "
                             "count is paid for once: a second backward before optimizer.step() is refused (do "
                             "not accumulate micro-batches, or run a backward whose gradients are thrown away)")
        distributed = _distributed(self.module, wrapper)

        def bound_from_norms(norms: torch.Tensor) -> torch.Tensor:
            bound, sigma = self.rule.update(norms, wrapper.max_grad_norm, distributed)
            # The wrapper clips to the bound and the optimizer scales its noise by it; the
            # accountant keeps the initial noise multiplier (Opacus's _adjusted_noise_multiplier).
            wrapper.adapt_max_grad_norm(bound)
            self.optimizer.max_grad_norm = bound
            self.optimizer._adjusted_noise_multiplier = sigma
            self.rule.counted = True  # until the optimizer steps
            return bound

        wrapper.clipped_backward(self.loss_per_sample, bound_from_norms=bound_from_norms, loss_scale=self.loss_scale,
                                 optimizer=self.optimizer)


def _distributed(module, wrapper) -> bool:
    """Whether the step runs under DistributedDataParallel (torch's or Opacus's), around dpgrad's
    wrapper or inside it."""
    from torch.nn.parallel import DistributedDataParallel

    found = [module, wrapper._module]
    while isinstance(getattr(found[-1], "module", None), torch.nn.Module):
        found.append(found[-1].module)
    return any(isinstance(m, DistributedDataParallel) or type(m).__name__ ==
               "DifferentiallyPrivateDistributedDataParallel" for m in found)


class DPLossFastGradientAdaptiveClipping(DPLossFastGradientClipping):
    """Opacus 1.6's ``DPLossFastGradientAdaptiveClipping`` (same signature) for dpgrad's
    wrapper: the criterion's per-sample losses wrapped so that ``backward()`` adapts the bound
    and clips to it (see the module docstring).

    Args:
        module, optimizer, criterion, loss_reduction: as ``DPLossFastGradientClipping``.
        target_unclipped_quantile: the fraction of samples the bound should leave unclipped.
        min_clipbound, max_clipbound: the bound's range.
        clipbound_learning_rate: the step of the bound's geometric update.
        initial_noise_multiplier: the noise multiplier the accountant counts (the optimizer's).
        expected_batch_size: dpgrad's own: count over this public batch size instead of the
            drawn one (None, Opacus's), closing the leak of the drawn size under Poisson
            sampling and the host sync under DDP.
    """

    def __init__(self, module, optimizer, criterion, loss_reduction: str = "mean",
                 target_unclipped_quantile: float = 0.5, min_clipbound: float = 1, max_clipbound: float = 1e8,
                 clipbound_learning_rate: float = 0.2, initial_noise_multiplier: float = 1.0,
                 expected_batch_size: Optional[float] = None, batches=None):
        if batches is not None:
            raise ValueError("adaptive clipping takes one backward pass per step: not physical batches (a Poisson "
                             "batch split in several would count its samples several times)")
        super().__init__(module, optimizer, criterion, loss_reduction, batches)
        self.rule = AdaptiveBound(target_unclipped_quantile, min_clipbound, max_clipbound, clipbound_learning_rate,
                                  initial_noise_multiplier, expected_batch_size)
        self.rule.watch(optimizer)
        bound = clipping_wrapper(module).max_grad_norm
        if not self.rule.min_clipbound <= bound <= self.rule.max_clipbound:
            raise ValueError(f"the initial max_grad_norm {bound} is outside [min_clipbound, max_clipbound] = "
                             f"[{self.rule.min_clipbound}, {self.rule.max_clipbound}]")

    # Opacus's attribute names, read and written on the rule.
    target_unclipped_quantile = property(lambda self: self.rule.target_unclipped_quantile)
    min_clipbound = property(lambda self: self.rule.min_clipbound)
    max_clipbound = property(lambda self: self.rule.max_clipbound)
    clipbound_learning_rate = property(lambda self: self.rule.clipbound_learning_rate)
    initial_noise_multiplier = property(lambda self: self.rule.initial_noise_multiplier)

    @eager_when_compiled
    def __call__(self, *args, **kwargs) -> DPTensorFastGradientAdaptiveClipping:
        plain = super().__call__(*args, **kwargs)
        return DPTensorFastGradientAdaptiveClipping(self.module, self.optimizer, plain.loss_per_sample,
                                                    self.loss_reduction, rule=self.rule, weights=plain.weights)


__all__ = ["AdaptiveBound", "DPLossFastGradientAdaptiveClipping", "DPTensorFastGradientAdaptiveClipping"]
