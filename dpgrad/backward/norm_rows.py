"""The per-sample gradient norms of a pass's records, one row per parameter.

The finish step of a backward pass through the clipping path (``dpgrad.backward.clipping_path``)
and the records served early (``dpgrad.backward.group_flush``) take their norms here: the records
grouped by the pass's finish plan (``dpgrad.backward.finish_plan``), each group's norms in a few
batched operations, rows of one (P, B) matrix. A parameter used more than once (an input
embedding tied to the output layer, a layer called twice) gets the exact norm of its summed
per-sample gradient, ``sqrt(sum_i |g_i|^2 + 2 sum_{i<j} <g_i, g_j>)``: each use's norm from its
norm sampler, each cross term from the uses' factors (``registry.register_factor_sampler``),
never a per-sample gradient.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dpgrad.backward.autograd_graph import in_region
from dpgrad.kernels import reference
from dpgrad.samplers.groups import Record


class NormRows:
    """The norms of a ``ClippingPath``'s records (see the module docstring): a mixin of the
    path, which holds the finish plans (``planner``), the shared parameters (``shared``), the
    FSDP2 parameter groups (``sharded``) and the index tensors made once (``_row_indices``)."""

    def per_sample_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Norm rows (P, B) of the recorded backprops as those of each sample's own, unscaled
        loss: times B under "mean" (the backprops of the mean loss), divided by a pass's loss
        scale."""
        factor = rows.shape[1] if self.loss_reduction == "mean" else 1
        if self._loss_scale is not None:
            return rows * (factor / self._loss_scale)
        return rows * factor if factor != 1 else rows

    @in_region("dpgrad.norms")
    def _norm_rows(self, records: List[Record], memory_bound: bool = False
                   ) -> Tuple[List[nn.Parameter], Optional[torch.Tensor], list]:
        """The pass's parameters (each once), their per-sample gradient norms (P, B), and the
        groups made (with their FSDP2 group), by the pass's plan (``Planner.plan``): each
        group's norms, then, for a parameter used by several records, the norm of its summed
        gradient. ``memory_bound``: records served early to free memory (``EarlyNorms``), a
        layer clipped from its per-sample gradients wherever they are smaller than its record."""
        if not records:
            return [], None, []
        plan = self.planner.plan(records, memory_bound)
        groups = [(planned.make([records[i] for i in planned.indices]), planned.shard) for planned in plan.groups]
        params, pieces = [], []
        for group, _ in groups:
            ps, rows = group.norms()
            params += ps
            pieces += rows
        if self.sharded is not None:  # the samplers saw FSDP's unsharded copies
            params = self.sharded.canonical(params)
        if not params:
            return [], None, groups
        rows = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(len(params), -1)
        if plan.combined is None:
            plan.combined = len(params) != len(set(params))
        if plan.combined:
            params, rows = self._combine_uses(params, rows, [records[i] for i in plan.by_norm])
        return params, rows, groups

    def _combine_uses(self, params, rows, shared_records: List[Record]):
        """One row per parameter: a parameter with several uses gets the norm of its summed
        gradient, ``sqrt(sum_i |g_i|^2 + 2 sum_{i<j} <g_i, g_j>)``, the cross terms from the
        uses' factors (never a per-sample gradient)."""
        index: Dict[nn.Parameter, List[int]] = {}
        for i, p in enumerate(params):
            index.setdefault(p, []).append(i)
        factors: Dict[nn.Parameter, list] = {}
        for layer, inputs, backprops in shared_records:
            mine = [p for p in self.layer_params(layer) if p in self.shared and len(index.get(p, ())) > 1]
            if mine:
                found = self.FACTOR_SAMPLERS[type(layer)](layer, inputs, backprops)
                if self.sharded is not None:
                    found = self.sharded.canonical_keys(found)
                for p in mine:
                    factors.setdefault(p, []).append(found[p])
        once = [i for p, rows_of in index.items() if len(rows_of) == 1 for i in rows_of]
        out_params = [params[i] for i in once]
        combined = []
        for p, rows_of in index.items():
            if len(rows_of) == 1:
                continue
            sq = rows.index_select(0, self._row_index(rows_of, rows.device)).square().sum(0)
            uses = factors[p]
            for i in range(len(uses)):
                for j in range(i + 1, len(uses)):
                    # torch's own kernels on every backend (triton_ops re-exports reference's).
                    sq = torch.add(sq, reference.outer_sum_inner(*uses[i], *uses[j]).to(sq.dtype), alpha=2)
            # Rounding can take the square of an exact zero (opposite uses) slightly below it.
            combined.append(sq.clamp_min(0).sqrt())
            out_params.append(p)
        kept = rows.index_select(0, self._row_index(once, rows.device))
        return out_params, torch.cat([kept, torch.stack(combined)])

    def _row_index(self, rows: List[int], device: torch.device) -> torch.Tensor:
        """``rows`` as an index tensor on ``device``, made once: indexing by a Python list
        copies the list to the device at every call, which on a GPU waits for the queue."""
        key = (tuple(rows), device)
        found = self._row_indices.get(key)
        if found is None:
            found = self._row_indices[key] = torch.tensor(rows, dtype=torch.int64, device=device)
        return found


__all__ = ["NormRows"]
