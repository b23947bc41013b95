"""The hooked calls whose samples are not one row each (``SplitCalls``, a mixin of
``dpgrad.backward.backward_pass.BackwardPath``): a layer called without the batch, whose output
is shared by all samples (``dpgrad.backward.shared_outputs``), a layer called on the batch's
tokens flattened, (B*T, ...) (``dpgrad.backward.layer_inputs.folded_rows``), and one called on
rows picked from them (``dpgrad.backward.picked_rows``). Each is recorded
as any call is, with its inputs and backprops put in the (B, ...) form every sampler takes."""

from __future__ import annotations

from functools import partial
from typing import List, Optional

import torch
import torch.nn as nn

from dpgrad.backward.layer_inputs import batch_dim_of, batch_to_front, unfold
from dpgrad.backward.picked_rows import PickedRows, picked_rows
from dpgrad.backward.shared_outputs import SharedSite, nested
from dpgrad.samplers import registry
from dpgrad.samplers.functorch import Keywords


class SplitCalls:
    """Calls shared by all samples, or on the tokens flattened, for a ``BackwardPath`` (whose
    state, ``_note_call``, ``_record`` and ``_abort_pass`` they use)."""

    def _shared_call(self, layer: nn.Module, name: str, params: List[nn.Parameter], inputs, out: torch.Tensor,
                     leading: bool) -> torch.Tensor:
        """A call of ``layer`` shared by all samples (``dpgrad.backward.shared_outputs``): recorded
        with its inputs expanded to the batch, its output handed on as shared."""
        self._note_call(layer, name, params)
        self._edges.add(out, layer, inputs, params)
        site = SharedSite(name, out, self._forward_batch, leading)
        keep = registry.KEPT_INPUTS.get(type(layer))
        kept = [site.expand(a) for a in (list(inputs) if keep is None else keep(layer, inputs, out))]
        out.register_hook(partial(self._record_shared, site, layer, params, kept, self._pending))
        return site.shared(out)

    def _folded_call(self, layer: nn.Module, name: str, params: List[nn.Parameter], inputs, out: torch.Tensor,
                     rows: int, output=None):
        """A call of ``layer`` on the batch folded into its first dimension, ``rows`` rows per
        sample: recorded with its inputs and backprops unfolded to (B, rows, ...)."""
        self._note_call(layer, name, params)
        self._edges.add(out, layer, inputs, params)
        batch, n = self._forward_batch, self._forward_batch * rows
        copies = registry.batch_copies(layer)
        if rows % copies:
            raise ValueError(
                f"layer {name!r} ({type(layer).__name__}) takes {copies} copies of the batch's tokens one after the "
                f"other (``register_batch_copies``), but got {n} rows for a batch of {batch}: not a multiple of "
                f"{copies * batch}. Register the number of copies the layer is given.")
        keep = registry.KEPT_INPUTS.get(type(layer))
        kept = [unfold(a, batch, n, copies) for a in (list(inputs) if keep is None or layer in self.functorch_layers
                                                      else keep(layer, inputs, out))]
        if kept and isinstance(kept[-1], Keywords):  # a layer taken whole: its keywords unfolded too
            kept[-1].unfold(batch, n)
        return self._hook_output(layer, kept, out, output, partial(self._record_folded, batch, n, copies, layer,
                                                                   params, kept, self._pending), n)

    def _transposed_call(self, layer: nn.Module, name: str, params: List[nn.Parameter], inputs, out: torch.Tensor,
                         output=None):
        """A call of ``layer`` on the batch along dimension 1, (T, B, ...), in a batch-first model
        (``dpgrad.backward.layer_inputs.batch_dim_of``): recorded with its inputs and backprops
        batch first."""
        self._note_call(layer, name, params)
        self._edges.add(out, layer, inputs, params)
        keep = registry.KEPT_INPUTS.get(type(layer))
        kept = [batch_to_front(a) for a in (list(inputs) if keep is None else keep(layer, inputs, out))]
        return self._hook_output(layer, kept, out, output, partial(self._record_transposed, layer, params, kept,
                                                                   self._pending))

    def _call_batch_dim(self, layer: nn.Module, inputs) -> Optional[int]:
        """The dimension this call of ``layer`` holds the batch along (``batch_dim_of``; None: it
        cannot be told yet)."""
        batch = self._input_batch if self._forward_batch is None else self._forward_batch
        x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
        return batch_dim_of(layer, x, batch, self._input_tokens, self.batch_first, layer in self.functorch_layers,
                            self._batch_dims)

    def _picked(self, layer: nn.Module, inputs, out: torch.Tensor) -> Optional[PickedRows]:
        """The tokens of a call on rows picked from the batch's (``dpgrad.backward.picked_rows``),
        or None."""
        batch = self._forward_batch
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if not self.batch_first or not batch or x is None or x.dim() == 0 or x.grad_fn is None:
            return None
        name, forward_id = self.layer_names[layer], self._edges.forward_id
        picked = picked_rows(x, batch) or self._picked_scopes.find(name, forward_id, x)
        if picked is not None:
            self._picked_scopes.note(layer, name, forward_id, picked, out)
        return picked

    def _picked_call(self, layer: nn.Module, name: str, params: List[nn.Parameter], inputs, out: torch.Tensor,
                     picked: PickedRows, output=None):
        """A call of ``layer`` on rows picked from the batch's tokens: recorded with its inputs
        and backprops put at their tokens, (B, T, ...)."""
        if layer in self.functorch_layers:
            raise ValueError(
                f"layer {name!r} ({type(layer).__name__}) is called on rows picked from the batch's tokens (a module "
                "per expert of a mixture-of-experts block), and has no per-sample gradient sampler: dpgrad takes "
                "apart by sample the picked rows of layers with samplers (nn.Linear, nn.Embedding, norms) only. "
                "Freeze it, or register samplers for its class (dpgrad.register_grad_sampler and "
                "register_norm_sampler).")
        self._note_call(layer, name, params)
        self._edges.add(out, layer, inputs, params)
        keep = registry.KEPT_INPUTS.get(type(layer))
        kept = [picked.spread(a) for a in (list(inputs) if keep is None else keep(layer, inputs, out))]
        return self._hook_output(layer, kept, out, output, partial(self._record_picked, picked, layer, params, kept,
                                                                   self._pending))

    def _record_picked(self, picked: PickedRows, layer: nn.Module, params: List[nn.Parameter], activations: list,
                       calls, grad):
        return self._record(layer, params, activations, calls, picked.spread(grad))

    def _record_transposed(self, layer: nn.Module, params: List[nn.Parameter], activations: list, calls, grad):
        return self._record(layer, params, activations, calls, batch_to_front(grad))

    def _record_folded(self, batch: int, n: int, copies: int, layer: nn.Module, params: List[nn.Parameter],
                       activations: list, calls, grad):
        return self._record(layer, params, activations, calls, unfold(grad, batch, n, copies))

    def _record_shared(self, site: SharedSite, layer: nn.Module, params: List[nn.Parameter], activations: list,
                       calls, grad):
        if nested():  # its per-sample cotangents being taken where it met the batch
            return None
        if self._probing is None and not self.hooks_enabled:
            site.per_sample = None
            return None
        try:
            per_sample = site.take(grad)
        except BaseException:
            self._abort_pass()
            raise
        return self._record(layer, params, activations, calls, per_sample)
