"""Ghost clipping on a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter sharded (a DTensor, the object the optimizer holds) and, around a
sharded module's forward and backward, swaps in an unsharded copy of the whole parameter. So:

- Per-sample norms need no communication: each rank holds its own samples, and a layer's
  norms come from its inputs and backprops alone. What the samplers return is keyed by the
  parameters the layer held when they ran (the copies, or the shards once FSDP has resharded);
  ``canonical`` maps both to the sharded parameter, where ``p._norm_sample`` lives.
- A plain backward (the second pass of double-backward clipping) is FSDP's own: gradients of
  the copies, reduce-scattered into the shards.
- In single-backward mode the clipped sums exist only after the pass (they need every
  layer's norm). ``reduce_scatter`` hands them to FSDP group by group: the sums of one group
  become the gradients of its unsharded copies, FSDP's own post-backward reduce-scatters them
  into the shards (with its mixed precision, its divide factor and its gradient accumulation)
  and frees them, and only then are the next group's sums computed. No gradient is
  all-gathered, and what is held at once is one group's gradients, not the model's.

This drives FSDP2's parameter groups through their post-backward step and the root's final
callback, which are not public API; ``ShardedParameters.of`` checks that they are there and
raises, naming the torch version, where they are not.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn


def fsdp_module_class() -> Optional[type]:
    """``FSDPModule`` (the class ``fully_shard`` mixes into a module), or None without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed support
        return None
    return FSDPModule


def sharded_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` that ``fully_shard`` sharded."""
    cls = fsdp_module_class()
    if cls is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def _param_groups(state) -> list:
    """An FSDP state's parameter groups: one, or several for ``fully_shard([a, b])``."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"dpgrad's FSDP2 support does not recognise this torch's FSDP internals ({what}; torch "
        f"{torch.__version__}): it drives FSDP2's parameter groups, checked with torch 2.13. "
        "Use torch.nn.parallel.DistributedDataParallel, or a torch whose FSDP2 dpgrad supports."
    )


class ShardedParameters:
    """The FSDP2 parameter groups of a model, seen from dpgrad's ghost-clipping wrapper.

    ``group_of[layer]``: the index of the parameter group that owns a hooked layer's trainable
    parameters (every layer's are owned by one group: checked by ``of``).
    """

    def __init__(self, groups: List[Tuple[str, object]], owner: Dict[nn.Parameter, Tuple[int, object]],
                 group_of: Dict[nn.Module, int], states: list):
        self._groups = groups
        self._owner = owner  # sharded parameter -> (group index, FSDPParam)
        self._states = states
        self.group_of = group_of
        self._copies: Dict[torch.Tensor, nn.Parameter] = {}  # unsharded copy -> sharded parameter

    @classmethod
    def of(cls, model: nn.Module, layers: Dict[str, nn.Module], whole: Dict[nn.Module, bool],
           param_names: Dict[torch.Tensor, str]) -> Optional["ShardedParameters"]:
        """The groups of ``model`` if ``fully_shard`` sharded it or a submodule, else None.

        ``layers``: the hooked layers by name; ``whole[layer]``: whether the layer's per-sample
        gradients would come from torch.func. Raises, before anything is changed, for what
        cannot be exact under FSDP2: a trainable parameter no ``fully_shard`` owns, a layer
        whose parameters two groups own, a tied parameter two ``fully_shard`` calls took
        (untied by them), layers clipped through torch.func, and FSDP2 internals other than
        those dpgrad drives."""
        sharded = sharded_modules(model)
        if not sharded:
            return None
        groups, owner, states, origins = [], {}, [], {}
        for name, module in sharded:
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                raise _unsupported("FSDPModule._get_fsdp_state is missing")
            state = get_state()
            states.append(state)
            for group in _param_groups(state):
                for attr in ("fsdp_params", "post_backward"):
                    if not hasattr(group, attr):
                        raise _unsupported(f"FSDPParamGroup.{attr} is missing")
                for fp in group.fsdp_params:
                    owner[fp.sharded_param] = (len(groups), fp)
                    # One parameter taken by two fully_shard calls (tied weights sharded apart)
                    # becomes two: the tie is gone (FSDP refuses it at the first forward pass).
                    origin = getattr(fp, "_orig_param_uid", None)
                    if origin is not None and origin in origins:
                        first, where = origins[origin]
                        raise NotImplementedError(
                            f"parameters '{param_names.get(first.sharded_param, '?')}' and "
                            f"'{param_names.get(fp.sharded_param, '?')}' were one tied parameter, sharded "
                            f"by two fully_shard calls (on '{where}' and on '{name or 'the root'}'), "
                            "which unties it. Shard the layers that share a parameter in one "
                            "fully_shard call, e.g. leave a tied embedding and output layer to the root's."
                        )
                    if origin is not None:
                        origins[origin] = (fp, name or "the root")
                groups.append((name or "the root", group))
        if not all(hasattr(s, "_root_post_backward_final_callback") for s in states):
            raise _unsupported("FSDPState._root_post_backward_final_callback is missing")
        group_of: Dict[nn.Module, int] = {}
        for name, layer in layers.items():
            params = [p for p in layer.parameters(recurse=whole[layer]) if p.requires_grad]
            if not params:
                continue
            if whole[layer]:
                raise NotImplementedError(
                    f"layer '{name}' ({type(layer).__name__}) has no registered grad sampler, so its "
                    "per-sample gradients would come from torch.func with its parameters, which FSDP2 "
                    "has resharded by then. Register a grad sampler for it "
                    "(dpgrad.register_grad_sampler), freeze it, or use DistributedDataParallel."
                )
            unowned = [param_names.get(p, "?") for p in params if p not in owner]
            if unowned:
                raise NotImplementedError(
                    f"parameters {unowned} of layer '{name}' are not sharded by any fully_shard call, "
                    "so nothing would reduce their clipped gradients over the ranks. Shard the "
                    "root as well (fully_shard(model) after the blocks), then wrap."
                )
            found = {owner[p][0] for p in params}
            if len(found) > 1:
                raise NotImplementedError(
                    f"the parameters of layer '{name}' belong to different fully_shard calls "
                    f"({sorted(groups[i][0] for i in found)}): shard each layer's parameters together"
                )
            group_of[layer] = found.pop()
        return cls(groups, owner, group_of, states)

    # ------------------------------------------------------------------ parameters
    def canonical(self, params: Iterable[torch.Tensor]) -> List[nn.Parameter]:
        """The sharded parameter of each of ``params`` (an unsharded copy or the parameter)."""
        out = []
        for p in params:
            found = self._copies.get(p)
            if found is None:
                if p in self._owner:
                    found = p
                else:  # a copy FSDP made since the last look (it makes one per parameter, once)
                    self._copies = {fp._unsharded_param: sharded for sharded, (_, fp) in self._owner.items()
                                    if hasattr(fp, "_unsharded_param")}
                    found = self._copies.get(p, p)
            out.append(found)
        return out

    def canonical_keys(self, found: dict) -> dict:
        """``found`` with its parameter keys made canonical."""
        return dict(zip(self.canonical(found), found.values()))

    # ------------------------------------------------------------------ gradients
    def reduce_scatter(self, group: int, sums: Dict[nn.Parameter, torch.Tensor]) -> None:
        """Add ``sums`` (sharded parameter -> its full clipped gradient) to the gradients of the
        unsharded copies of one group's parameters and run that group's post-backward: FSDP
        reduce-scatters them into the shards' gradients and frees them."""
        fsdp_group = self._groups[group][1]
        for p, s in sums.items():
            fp = self._owner[p][1]
            copy = fp._unsharded_param
            s = s if s.dtype == copy.dtype else s.to(copy.dtype)
            copy.grad = s if copy.grad is None else copy.grad + s
        sums.clear()  # FSDP alone holds them now: it frees each once it has reduced it
        fsdp_group.post_backward()

    def finish_backward(self) -> None:
        """What FSDP does at the end of a backward pass: wait for the reduce-scatters and put
        every group back to idle (each root's final callback)."""
        for state in self._states:
            if getattr(state, "_is_root", False):
                state._root_post_backward_final_callback()
