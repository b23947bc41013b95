"""The clipped sums of a single-backward pass, and their hand-off to ``p.grad``.

Once a pass's norms are known, each kept group of records gives the clipped sums of its
parameters, ``sum_b c_b g_b``, letting go of its inputs as it is summed; the sums are withheld
on the device (zeros) if the norms' finite check failed, with no host wait, and handed to
``p.grad`` through autograd's own accumulation in one backward call, so that ``p.grad`` is set
or added to as by any backward pass, with no copy, and the hooks others put on parameters run
(DistributedDataParallel reduces the gradients there). On a model sharded by FSDP2 the sums go
to FSDP's reduce-scatter one parameter group at a time (``dpgrad.backward.fsdp``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from dpgrad.backward.autograd_graph import region
from dpgrad.samplers.groups import Coefficients, Group


class ClippedSums:
    """The clipped sums of a ``ClippingPath`` (``path``): of its kept groups
    (``path._kept``), or those its clipping groups' flush took (``path._group_flush.held``)."""

    def __init__(self, path):
        self.path = path
        self._constants: Dict[tuple, torch.Tensor] = {}

    def hand_off(self, coef: Optional[torch.Tensor]) -> None:
        """``p.grad += sum_b c_b g_b`` for every parameter the norm pass reached; ``coef`` (B,):
        the coefficients for the records' backprops (``scale``), None with clipping groups.

        The sums are queued, zeroed on the device if the norms' finite check failed (the host
        learns of it at the next forward pass), and handed to ``p.grad``, through
        autograd's own accumulation, in one backward call (``_ClippedGradients``): ``p.grad``
        is set or added to as by any backward pass, with no copy, and the hooks others put on
        parameters run (DistributedDataParallel reduces the gradients there).
        """
        path = self.path
        if not path._kept and not path._group_flush.held:
            raise RuntimeError(
                "the norm pass reached no hooked layer (hooks disabled after the forward pass?): "
                "nothing to clip"
            )
        if path.sharded is not None:
            with torch.no_grad():
                self.reduce_scatter(coef)
            return
        with torch.no_grad():
            # With clipping groups (no ``coef``) the sums were taken group by group (``GroupFlush``).
            held = [path._group_flush.held if coef is None else self.of_kept(coef)]
        path._group_flush.held = {}
        path._withhold_if_not_finite(held[0].values())
        self.to_grad(held)

    def to_grad(self, held: List[Dict[nn.Parameter, torch.Tensor]]) -> None:
        """Hand the sums in ``held`` (a list holding one dict, emptied here) to ``p.grad``
        through autograd's own accumulation, in one backward call (``_ClippedGradients``). Only
        autograd holds the sums when they reach AccumulateGrad: no copy is made."""
        params = list(held[0])
        if params:
            out = _ClippedGradients.apply(held.pop, params, *params)
            out.backward(self.constant(1.0, out))

    def constant(self, value: float, like: torch.Tensor) -> torch.Tensor:
        """``value`` as a 0-d tensor like ``like``, made once (not an operation every step)."""
        key = (value, like.dtype, like.device)
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return found

    def of_kept(self, coef: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_b c_b g_b`` of every parameter of the kept groups, freeing each group as it
        is summed. ``coef`` (B,): as ``hand_off`` takes them."""
        path = self.path
        groups, path._kept = [group for group, _ in path._kept], []
        sums: Dict[nn.Parameter, torch.Tensor] = {}
        with region("dpgrad.backward.clipped_sums"):
            self.sum_groups(groups, Coefficients(coef, path.clip_groups), sums)
        return sums

    def coefficients(self, coef: torch.Tensor) -> Coefficients:
        """The coefficients of the samples' own losses, ``coef``: (B,), or (G, B) with clipping
        groups, for the records' backprops."""
        path = self.path
        if path.loss_reduction == "mean":
            coef = coef * coef.shape[-1]  # the records' backprops are those of the mean
        return Coefficients(coef, path.clip_groups)

    def scale(self, batch: int) -> float:
        """What the coefficients of the samples' own losses are multiplied by for the clipped
        sums: the batch size under "mean" (the records' backprops are those of the mean)."""
        return float(batch) if self.path.loss_reduction == "mean" else 1.0

    def sum_groups(self, groups: List[Group], coefs: Coefficients, sums: Dict[nn.Parameter, torch.Tensor]) -> None:
        """Add the clipped sums of ``groups`` to ``sums``, emptying the list (each group lets go
        of its inputs as it is summed)."""
        path = self.path
        while groups:
            found = groups.pop().clipped_sums(coefs)
            if path.sharded is not None:  # keyed by FSDP's unsharded copies
                found = list(zip(path.sharded.canonical(p for p, _ in found), (s for _, s in found)))
            for p, s in found:
                sums[p] = s if p not in sums else sums[p] + s

    def reduce_scatter(self, coef: torch.Tensor) -> None:
        """On a model sharded by FSDP2: the clipped sums of one FSDP2 parameter group at a time,
        each handed to FSDP's reduce-scatter before the next is computed (``dpgrad.backward.fsdp``), so
        that no more than one group's full gradients exist at once, each withheld on the device
        (zeros) if the norms' finite check failed."""
        path = self.path
        by_shard: Dict[int, List[Group]] = {}
        for group, shard in path._kept:
            by_shard.setdefault(shard, []).append(group)
        path._kept = []
        coefs = Coefficients(coef, path.clip_groups)
        with region("dpgrad.backward.clipped_sums"):
            for shard in list(by_shard):
                sums: Dict[nn.Parameter, torch.Tensor] = {}
                self.sum_groups(by_shard.pop(shard), coefs, sums)
                path._withhold_if_not_finite(sums.values(), last=False)
                path.sharded.reduce_scatter(shard, sums)
        path._withhold_if_not_finite(())
        path.sharded.finish_backward()


class _ClippedGradients(torch.autograd.Function):
    """A node whose backward hands the parameters their clipped gradients.

    ``compute()`` gives the sums (popped from where they were held), so autograd alone holds
    them when they reach the parameters, and a missing ``p.grad`` takes the tensor itself
    rather than a copy.
    """

    @staticmethod
    def forward(ctx, compute, params, *tensors):
        ctx.compute, ctx.params = compute, params
        return tensors[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        sums = ctx.compute()
        ctx.compute = None
        return (None, None, *(sums.pop(p, None) for p in ctx.params))


__all__ = ["ClippedSums"]
