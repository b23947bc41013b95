"""Groups: what the finish step of a backward pass (``dpgrad.backward.clipping_path``) works on.

The records of one pass, ``(layer, activations, backprops)`` with the batch first, are grouped
by layer type and ``Group.key``: records with equal keys (same shapes, dtypes, trainable
parameters) are served by one group, which takes the per-sample squared gradient norms of all
their parameters in a few batched operations, and later their clipped sums. A layer type
without a group class of its own is served one record at a time by its samplers
(``SamplerGroup`` from its norm and clipped-sum samplers, ``GradSampleGroup`` from its grad
sampler). The backprops are those of the loss as reduced: a scale (the batch size under
``loss_reduction="mean"``) is the caller's, applied to the (B,) results and to ``coef``.

Nothing here knows about hooks.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from dpgrad.samplers import registry
from dpgrad.kernels.reference import accumulation_dtype, coefficients_in

class Record(NamedTuple):
    """One hooked call of a layer in a backward pass: its inputs (the activations) and the
    gradient of the loss at its output (the backprops), batch first in a finish step."""

    layer: nn.Module
    inputs: list
    backprops: torch.Tensor


def record_bytes(record: Record) -> int:
    """What a record's tensors (its inputs and backprops) take."""
    return sum(t.numel() * t.element_size() for t in (record.backprops, *record.inputs) if isinstance(t, torch.Tensor))


ParamTensors = List[Tuple[nn.Parameter, torch.Tensor]]

# A group's inputs are concatenated into one batched operation up to this many elements: below
# it launches and dispatch dominate; above it the copy would cost more than the launches saved.
STACK_ELEMENTS = 1 << 22


def stackable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether several records' tensors should be concatenated into one batched operation."""
    return len(tensors) > 1 and sum(t.numel() for t in tensors) <= STACK_ELEMENTS


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along the batch (a single one as it is)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of each x[i] of (N, ...), accumulated in fp32 (fp64 for fp64): (N,)."""
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), dtype=accumulation_dtype(x))


def trainable(layer: nn.Module) -> Tuple[bool, bool]:
    """Whether the layer's weight and its bias train (False for one it does not have)."""
    weight = getattr(layer, "weight", None) is not None and layer.weight.requires_grad
    bias = getattr(layer, "bias", None) is not None and layer.bias.requires_grad
    return weight, bias


def weights_then_biases(layers: Sequence[nn.Module]) -> List[nn.Parameter]:
    """The trainable weights of layers of one kind, then their trainable biases: a group's
    parameters in the order of its norm rows."""
    weight, bias = trainable(layers[0])
    return [layer.weight for layer in layers if weight] + [layer.bias for layer in layers if bias]


class Coefficients:
    """The clipping coefficients of a pass, (B,), and the forms of them groups use, each made
    once per pass: in a tensor's accumulation dtype and device, or in its own dtype, or as L
    rows, one per parameter (for a batched product).

    With clipping groups (``dpgrad.clipping.groups``) they are a table (K, B), a row per group,
    and ``groups`` maps each parameter to its row: a group of records takes the coefficients of
    parameters of one clipping group with ``of``, or a row for each parameter with ``rows`` and
    ``layer_rows`` (a group whose layers may be in several: ``Group.mixed_clip_groups``)."""

    def __init__(self, coef: torch.Tensor, groups=None):
        self._coef = coef
        self._groups = groups
        self._made: dict = {}

    def _form(self, key: tuple, make: Callable[[], torch.Tensor]):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def of(self, params: Sequence[nn.Parameter]) -> "Coefficients":
        """The coefficients of ``params``, which are in one clipping group (all of them without
        groups)."""
        if self._groups is None:
            return self
        rows = {self._groups.group_of(p) for p in params}
        if len(rows) != 1:
            raise RuntimeError(f"parameters of clipping groups {sorted(rows)} batched into one clipped sum")
        row = rows.pop()
        return self._form(("of", row), lambda: Coefficients(self._coef[row]))

    def split(self, params: Sequence[nn.Parameter]) -> List[List[nn.Parameter]]:
        """``params`` by clipping group (one part without groups)."""
        if self._groups is None:
            return [list(params)]
        parts: dict = {}
        for p in params:
            parts.setdefault(self._groups.group_of(p), []).append(p)
        return list(parts.values())

    def like(self, x: torch.Tensor) -> torch.Tensor:
        """(B,) in x's accumulation dtype, on x's device."""
        acc = accumulation_dtype(x)
        return self._form(("like", acc, x.device), lambda: self._coef.to(device=x.device, dtype=acc))

    def rounded_like(self, x: torch.Tensor) -> torch.Tensor:
        """(B,) in x's own dtype (rounded down in half precision: ``coefficients_in``)."""
        return self._form(("rounded", x.dtype, x.device), lambda: coefficients_in(self.like(x), x.dtype))

    def rounded_column(self, x: torch.Tensor) -> torch.Tensor:
        """``rounded_like`` as (B, 1, 1), to scale (B, T, n) operands."""
        return self._form(("rounded_column", x.dtype, x.device), lambda: self.rounded_like(x).view(-1, 1, 1))

    def layer_rows(self, params: Sequence[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
        """(L, B): the coefficients of L parameters, a row each, in x's accumulation dtype on its
        device (without clipping groups one row expanded, not copied, made once per pass)."""
        return self._form(("layer_rows", *map(id, params), accumulation_dtype(x), x.device),
                          lambda: self.rows(params, x).view(len(params), -1))

    def shared(self, params: Sequence[nn.Parameter], others: Sequence[nn.Parameter]) -> bool:
        """Whether ``params[i]`` and ``others[i]`` take the same coefficients for every i (in
        one clipping group each, or no groups)."""
        return self._groups is None or all(
            self._groups.group_of(p) == self._groups.group_of(q) for p, q in zip(params, others))

    def sample_rows(self, params: Sequence[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
        """(L*B, 1, 1): ``layer_rows`` with a row per (parameter, sample), to scale L stacked
        batches of backprops (L*B, T, p) in one product (without clipping groups made once per
        pass for each L, whatever the parameters)."""
        key = ("sample_rows", len(params)) if self._groups is None else ("sample_rows", *map(id, params))
        return self._form((*key, accumulation_dtype(x), x.device),
                          lambda: self.layer_rows(params, x).reshape(-1, 1, 1))

    def each(self, params: Sequence[nn.Parameter], x: torch.Tensor) -> Sequence[torch.Tensor]:
        """``layer_rows`` as L tensors (B,) (without clipping groups, ``like(x)`` L times)."""
        if self._groups is None:
            return (self.like(x),) * len(params)
        return self.layer_rows(params, x).unbind(0)

    def rows(self, params: Sequence[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
        """(L, 1, B): the coefficients of L parameters as the left operand of L batched products."""
        L = len(params)
        if self._groups is None:
            return self._form(("rows", L, accumulation_dtype(x), x.device),
                              lambda: self.like(x).view(1, 1, -1).expand(L, 1, self._coef.shape[-1]))
        table = self._coef.to(device=x.device, dtype=accumulation_dtype(x))
        return table.index_select(0, self._groups.rows(params, x.device)).view(L, 1, -1)


def clipped_sums_of(params: Sequence[nn.Parameter], coef: Coefficients, grads: torch.Tensor) -> ParamTensors:
    """``sum_b coef_b g_b`` for L parameters whose per-sample gradients are ``grads`` (L*B, ...),
    one block of B rows per parameter: (parameter, sum) pairs, accumulated in fp32 (fp64) by one
    batched product, each sum in its parameter's shape and dtype (cast once for the group when
    they share a dtype)."""
    x = grads.view(len(params), -1, math.prod(grads.shape[1:]))
    sums = torch.bmm(coef.rows(params, x), x.to(accumulation_dtype(x))).view(len(params), *grads.shape[1:])
    dtypes = {p.dtype for p in params}
    if len(dtypes) == 1:
        sums = sums.to(dtypes.pop())
    out = []
    for p, s in zip(params, sums.unbind(0)):
        s = s if s.shape == p.shape else s.view(p.shape)
        out.append((p, s if s.dtype == p.dtype else s.to(p.dtype)))
    return out


class Group:
    """Records of layers of one type whose inputs have the same shapes (equal ``key``).

    ``mixed_clip_groups``: whether its clipped sums take each parameter's own coefficients
    (``Coefficients.rows``), so that with clipping groups layers of one shape in different
    groups are batched together (a transformer's blocks clipped per block: one launch per
    shape); False, the default (a group registered by a user), keeps each group's records in a
    batch of their own, whose coefficients ``Coefficients.of`` gives."""

    mixed_clip_groups = False

    def __init__(self, records: List[Record]):
        self.records = records

    @classmethod
    def key(cls, layer: nn.Module, activations: list, backprops: torch.Tensor) -> Optional[Hashable]:
        """What records must share to be batched together; None: the record is a group alone."""
        return None

    def norms(self) -> Tuple[List[nn.Parameter], List[torch.Tensor]]:
        """The trainable parameters, one per (parameter, record), and their per-sample gradient
        norms: 1-D pieces that, concatenated, hold B norms per parameter in that order, fp32
        (fp64 for fp64 inputs). (The caller concatenates every group's pieces at once.)
        """
        raise NotImplementedError

    def clipped_sums(self, coef: Coefficients) -> ParamTensors:
        """``sum_b coef_b * g_b`` for every (parameter, record) of ``norms``, in the
        parameter's dtype. Called once, after ``norms``; the group then lets go of its inputs.
        ``coef``: the coefficients, in the forms the group needs."""
        raise NotImplementedError


class SamplerGroup(Group):
    """One record, through its layer type's norm and clipped-sum samplers."""

    def norms(self):
        (layer, activations, backprops), = self.records
        norms = registry.NORM_SAMPLERS[type(layer)](layer, activations, backprops)
        params = [p for p in norms if p.requires_grad]
        return params, [norms[p].to(accumulation_dtype(norms[p])) for p in params]

    def clipped_sums(self, coef):
        (layer, activations, backprops), = self.records
        self.records = []
        sampler = registry.CLIPPED_SUM_SAMPLERS[type(layer)]
        # One call per clipping group among the layer's parameters (one without groups).
        parts = coef.split([p for p in layer.parameters(recurse=False) if p.requires_grad])
        out = []
        for part in parts:
            sums = sampler(layer, activations, backprops, coef.of(part).like(backprops))
            mine = {id(q) for q in part}  # by identity: ``in`` would compare tensors by value
            out += [(p, s) for p, s in sums.items() if p.requires_grad and (len(parts) == 1 or id(p) in mine)]
        return out


class GradSampleGroup(Group):
    """Records whose per-sample gradients are summed per parameter before their norms are
    taken (a parameter used more than once without a factor sampler has no other exact
    norm): each record's grad sampler (``sampler_for(layer)``), the norms of the sums, and
    ``coef @ g`` as the clipped sums."""

    def __init__(self, records: List[Record], sampler_for: Callable[[nn.Module], Callable]):
        super().__init__(records)
        self._sampler_for = sampler_for
        self._grads: dict = {}

    def norms(self):
        grads: dict = {}
        for layer, activations, backprops in self.records:
            for p, g in self._sampler_for(layer)(layer, activations, backprops).items():
                if p.requires_grad:
                    grads[p] = g if p not in grads else grads[p] + g
        self.records, self._grads = [], grads
        return list(grads), [row_norms(g) for g in grads.values()]

    def clipped_sums(self, coef):
        grads, self._grads = self._grads, {}
        out = []
        for p, g in grads.items():
            acc = accumulation_dtype(g)
            s = torch.mv(g.flatten(1).to(acc).t(), coef.of([p]).like(g))
            out.append((p, (s if s.shape == p.shape else s.view(p.shape)).to(p.dtype)))
        return out


def group_records(records: List[Record], at: Sequence[int], group_class: Callable[[nn.Module], Optional[type]],
                  default: Callable[[List[Record]], Group], clip_key: Optional[Callable[[nn.Module], Hashable]] = None,
                  ) -> List[Tuple[Callable[[List[Record]], Group], Tuple[int, ...]]]:
    """``records[i]`` for i in ``at``, grouped: by ``group_class(layer)`` and its key where there
    is one (and, with clipping groups, by ``clip_key(layer)``, the groups of the layer's
    parameters, unless the class takes mixed groups), else one ``default`` group per record.
    Each group as (what makes it from its records, their indices in ``records``): a plan that
    serves every pass of the same shapes."""
    keyed: dict = {}
    singles = []
    for i in at:
        rec = records[i]
        cls = group_class(rec[0])
        key = cls.key(*rec) if cls is not None else None
        if key is None:
            singles.append((cls if cls is not None else default, (i,)))
        else:
            apart = clip_key is not None and not cls.mixed_clip_groups
            keyed.setdefault((cls, key, clip_key(rec[0]) if apart else None), []).append(i)
    return [(cls, tuple(idx)) for (cls, *_), idx in keyed.items()] + singles
