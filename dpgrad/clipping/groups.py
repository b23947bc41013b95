"""Per-layer and group-wise clipping: which clipping group each trainable parameter is in, and
each group's threshold.

Flat clipping bounds each sample's whole gradient by one ``max_grad_norm`` C. Group-wise
clipping splits the trainable parameters into groups ``g`` with thresholds ``C_g`` and clips
each sample's gradient of each group on its own::

    c_{b,g} = min(1, C_g / (|grad_g(loss_b)| + 1e-6)),   p.grad = sum_b c_{b,g(p)} grad_p(loss_b)

so a sample moves the summed gradient by at most ``sqrt(sum_g C_g^2)``: the noise is scaled
to that total (``total_bound``), as Opacus's per-layer optimizer does. Per-layer clipping
(Opacus's ``clipping="per_layer"``) is the case of one group per parameter.

Groups are given as lists of parameters, or by a rule on parameter names (a function from a
parameter's qualified name to its group's label, e.g. ``per_block``). Every trainable
parameter must be in exactly one group; a parameter reached under several names (tied
weights) must get one group from all of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from dpgrad.clipping.coefficients import clipping_bound, clipping_coefficients

CLIPPINGS = ("flat", "per_layer", "groups")
# A transformer block in a parameter's qualified name: "...h.3.", "...layers.11.", "...blocks.0.".
BLOCK = re.compile(r"^(.*?\b(?:h|layers|layer|blocks|block)\.\d+)\.")


def per_block(name: str) -> str:
    """The group rule "one group per transformer block": the block's prefix of a parameter's
    qualified name (``transformer.h.3`` for ``transformer.h.3.attn.c_attn.weight``; Hugging Face's
    GPT-2, Llama, BERT and ViT layouts), and "other" for what is in no block (embeddings, the
    final norm, the output layer)."""
    found = BLOCK.match(name)
    return found.group(1) if found else "other"


def even_split(total: float, groups: int) -> List[float]:
    """``groups`` equal thresholds whose ``total_bound`` is ``total``: ``total / sqrt(groups)`` each."""
    total = clipping_bound(total)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive integer, not {groups!r}")
    return [total / math.sqrt(groups)] * groups


def total_bound(bounds: Sequence[float]) -> float:
    """The most one sample moves the gradient by under thresholds ``bounds``: ``sqrt(sum C_g^2)``,
    the bound the noise is scaled to."""
    return math.sqrt(math.fsum(b * b for b in bounds))


GroupSpec = Union[None, Sequence[Sequence[nn.Parameter]], Callable[[str], object]]


class ClipGroups:
    """The clipping groups of a model's trainable parameters: ``index[p]`` (the group of ``p``),
    ``bounds`` (one threshold per group), ``labels`` (a name per group) and ``total`` (the
    noise's bound, ``total_bound(bounds)``).

    Args:
        model: the module (before wrapping).
        clipping: "per_layer" (one group per trainable parameter, in ``model.parameters()``
            order) or "groups" (``groups``).
        max_grad_norm: one threshold per group, in the groups' order (for a rule, the order in
            which ``model.named_parameters()`` first reaches each label).
        groups: for "groups", lists of parameters or a rule ``name -> label``.
        gamma: automatic clipping's gamma (``C_g / (norm + gamma)``); None for Opacus's
            ``min(1, C_g / (norm + 1e-6))``.
    """

    def __init__(self, model: nn.Module, clipping: str, max_grad_norm, groups: GroupSpec = None,
                 gamma: Optional[float] = None):
        trainable = [p for p in model.parameters() if p.requires_grad]
        if clipping == "per_layer":
            if groups is not None:
                raise ValueError("clipping='per_layer' makes one group per parameter: give clipping_groups only "
                                 "with clipping='groups'")
            members = [[p] for p in trainable]
            names = dict((p, n) for n, p in model.named_parameters())
            labels = [names[p] for p in trainable]
        elif clipping == "groups":
            if groups is None:
                raise ValueError("clipping='groups' needs clipping_groups: lists of parameters, or a rule from a "
                                 "parameter's name to its group (e.g. dpgrad.clipping.groups.per_block)")
            labels, members = (_by_rule(model, groups) if callable(groups) else _by_lists(model, groups))
        else:
            raise ValueError(f"clipping={clipping!r}: use one of {', '.join(CLIPPINGS)}")
        if isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool):
            raise ValueError(f"clipping={clipping!r} takes one max_grad_norm per group ({len(members)} here), not "
                             f"one number; dpgrad.clipping.groups.even_split(C, {len(members)}) splits one total C")
        bounds = [clipping_bound(b, f"max_grad_norm[{i}]") for i, b in enumerate(max_grad_norm)]
        if len(bounds) != len(members):
            what = "trainable parameters" if clipping == "per_layer" else "groups"
            raise ValueError(f"{len(bounds)} max_grad_norm values for {len(members)} {what}: give one per group")
        self.labels, self.bounds, self.members, self.gamma = labels, bounds, members, gamma
        self.index: Dict[nn.Parameter, int] = {p: g for g, ps in enumerate(members) for p in ps}
        self.total = total_bound(bounds)
        self._names = {p: n for n, p in model.named_parameters()}
        self._bounds: Dict[torch.device, torch.Tensor] = {}
        self._rows: Dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.bounds)

    def group_of(self, p: nn.Parameter, name: str = "") -> int:
        """The group of a trainable parameter; ValueError naming it (``name``: its name in the
        model as it is now) if it is in none: made trainable, or added, after the groups were given."""
        g = self.index.get(p)
        if g is None:
            name = name or self._names.get(p, f"of shape {tuple(p.shape)}")
            raise ValueError(f"trainable parameter '{name}' is in no clipping group (made trainable, or added, "
                             "after the model was wrapped?): its gradient could not be clipped. Wrap the model "
                             "again with groups that include it, or freeze it")
        return g

    def bounds_like(self, x: torch.Tensor) -> torch.Tensor:
        """The thresholds (G, 1) on x's device, in fp32, made once."""
        found = self._bounds.get(x.device)
        if found is None:
            found = self._bounds[x.device] = torch.tensor(self.bounds, dtype=torch.float32, device=x.device).view(-1, 1)
        return found

    def rows(self, params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
        """The groups of ``params`` as an index tensor on ``device``, made once per list."""
        key = (device, *map(id, params))
        found = self._rows.get(key)
        if found is None:
            found = self._rows[key] = torch.tensor([self.group_of(p) for p in params], device=device)
        return found

    def squares(self, params: Sequence[nn.Parameter], rows: torch.Tensor) -> torch.Tensor:
        """Each group's per-sample squared norm (G, B) from its parameters' norms ``rows`` (P, B)."""
        squares = torch.zeros(len(self.bounds), rows.shape[1], dtype=rows.dtype, device=rows.device)
        return squares.index_add_(0, self.rows(params, rows.device), rows.square())

    def norms(self, params: Sequence[nn.Parameter], rows: torch.Tensor) -> torch.Tensor:
        """Each group's per-sample norm (G, B) from its parameters' norms ``rows`` (P, B)."""
        return self.squares(params, rows).sqrt()

    def coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """``min(1, C_g / (norm + 1e-6))`` (G, B) from the groups' norms (G, B); with ``gamma``
        (automatic clipping), ``C_g / (norm + gamma)``."""
        return clipping_coefficients(norms, self.bounds_like(norms), self.gamma)


def _by_lists(model: nn.Module, groups) -> tuple:
    names = {p: n for n, p in model.named_parameters()}
    members: List[List[nn.Parameter]] = []
    seen: Dict[nn.Parameter, int] = {}
    if isinstance(groups, (dict, str, nn.Module)):
        raise ValueError(f"clipping_groups takes a list of lists of parameters (one list per group) or a rule on "
                         f"names, not a {type(groups).__name__}")
    for g, group in enumerate(groups):
        if isinstance(group, (torch.Tensor, nn.Module)) or not isinstance(group, Iterable):
            raise ValueError(f"clipping_groups[{g}] is a {type(group).__name__}: clipping_groups takes lists of "
                             "parameters (one list per group)")
        params = list(group)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"clipping_groups[{g}] holds a {type(p).__name__}, not a parameter of the model")
            if p not in names:
                raise ValueError(f"clipping_groups[{g}] holds a parameter of shape {tuple(p.shape)} that is not the "
                                 "model's")
            if p in seen and seen[p] != g:
                raise ValueError(f"parameter '{names[p]}' is in clipping groups {seen[p]} and {g}: a parameter "
                                 "(tied weights included) must be in one group")
            seen[p] = g
        members.append(params)  # frozen ones too: made trainable later, they have their group
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in seen]
    if missing:
        raise ValueError(f"trainable parameters {missing} are in no clipping group: put each trainable parameter "
                         "in one group (or freeze it)")
    return [f"group {g}" for g in range(len(members))], members


def _by_rule(model: nn.Module, rule: Callable[[str], object]) -> tuple:
    label_of: Dict[nn.Parameter, object] = {}
    name_of: Dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        label = rule(name)
        if p in label_of and label_of[p] != label:
            raise ValueError(f"parameter '{name_of[p]}' is tied to '{name}', and the rule puts them in different "
                             f"groups ({label_of[p]!r} and {label!r}): tied parameters must share a group")
        label_of.setdefault(p, label)
        name_of.setdefault(p, name)
    order: Dict[object, List[nn.Parameter]] = {}
    for p, label in label_of.items():
        order.setdefault(label, []).append(p)
    return [str(label) for label in order], list(order.values())
