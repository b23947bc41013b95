"""The one registry of per-layer samplers.

A grad sampler computes per-sample gradients and a norm sampler per-sample gradient norms;
both have Opacus's signature ``fn(layer, activations, backprops) -> {parameter: tensor}``,
with ``activations`` the list of the layer's inputs and ``backprops`` the gradient of each
sample's loss w.r.t. the layer output, batch first. Two more kinds serve ghost clipping:
- a clipped-sum sampler, ``fn(layer, activations, backprops, coef) -> {parameter: sum_b
  coef_b * gradient_b}``, gives the clipped gradient of a layer from the same inputs without
  per-sample gradients; the single-backward mode needs one for every layer it clips from
  norms alone;
- a factor sampler, ``fn(layer, activations, backprops) -> {parameter: (left, right)}``,
  writes each per-sample gradient as a sum of outer products ``sum_t left_b[t] ⊗ right_b[t]``
  (``left`` (B, T, n), or token ids (B, T) standing for one-hot rows); with it the norm of a
  parameter used more than once (tied weights, a layer called twice) is exact, cross terms
  included (``dpgrad.kernels.reference.outer_sum_inner``).

The finish step of a backward pass (``dpgrad.backward.clipping_path``) works on groups of layers of one
type with equal shapes (``dpgrad.samplers.groups.Group``). A layer type may register a group
class that batches its layers (``register_norm_group`` for layers clipped from their norms,
``register_grad_sample_group`` for layers clipped from their per-sample gradients); without
one, its layers are taken one at a time through the samplers above.

What the hooks keep of a layer's call for its samplers is its inputs, unless the layer type
registers a function that keeps something else (``register_kept_inputs``): a tensor its forward
computed from them that autograd saved anyway, where autograd would free the inputs themselves
(Hugging Face's Llama RMSNorm: its normalised input, not the residual stream).

A layer class from another package (``transformers.pytorch_utils.Conv1D``) is registered by
its dotted path, so that dpgrad never imports that package: ``resolve(model)`` enters such
classes in the tables once a model holding them is wrapped.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Type, Union

import torch.nn as nn
from torch.nn.utils.parametrize import is_parametrized

from dpgrad.backward.fsdp import fsdp_module_class

Sampler = Callable
GRAD_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
NORM_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
CLIPPED_SUM_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
FACTOR_SAMPLERS: Dict[Type[nn.Module], Sampler] = {}
NORM_GROUPS: Dict[Type[nn.Module], type] = {}
GRAD_SAMPLE_GROUPS: Dict[Type[nn.Module], type] = {}
KEPT_INPUTS: Dict[Type[nn.Module], Callable] = {}
BATCH_COPIES: Dict[Type[nn.Module], Callable[[nn.Module], int]] = {}
TABLES = (GRAD_SAMPLERS, NORM_SAMPLERS, CLIPPED_SUM_SAMPLERS, FACTOR_SAMPLERS, NORM_GROUPS, GRAD_SAMPLE_GROUPS,
          KEPT_INPUTS, BATCH_COPIES)

# Changes whenever a table does: what is planned from the tables (a backward pass's finish
# plan, dpgrad.backward.clipping_path) is planned again.
version = 0

# "package.module.Class" -> [(table, sampler)], for classes dpgrad does not import.
_BY_PATH: Dict[str, List[Tuple[Dict[Type[nn.Module], Sampler], Sampler]]] = {}

Target = Union[Type[nn.Module], str, Sequence[Union[Type[nn.Module], str]]]


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _targets(target: Target) -> list:
    if isinstance(target, (str, type)):
        return [target]
    return list(target)


def _register(table: Dict[Type[nn.Module], Sampler], target: Target):
    def decorator(fn: Sampler) -> Sampler:
        global version
        version += 1
        for cls in _targets(target):
            if isinstance(cls, str):
                _BY_PATH.setdefault(cls, []).append((table, fn))
            else:
                table[cls] = fn
        return fn

    return decorator


# Layer types whose samplers a subclass of theirs takes too, with the function that computes
# their output from their parameters: a subclass that does more in its forward (Hugging Face's
# scaled word embeddings, learned position tables) is hooked at that function's calls on its
# weight (``dpgrad.backward.functional_calls``).
FUNCTIONAL_CALLS: Dict[Type[nn.Module], Callable] = {}
# Of those, the types whose subclasses with a forward of their own take their samplers only
# where that forward names the function or its base's forward (``super().forward``): another
# forward computes the output some other way (Falcon's ``input @ self.weight.T``), which
# torch.func, taking the layer whole, follows.
CALLED_BY_NAME: Set[Type[nn.Module]] = set()
# Functions with the signatures of builtin ones there, which inspect cannot read.
SIGNATURES: Dict[Callable, Callable] = {}
# The subclasses entered so, each with its base.
INHERITED: Dict[Type[nn.Module], Type[nn.Module]] = {}


# Layer types told by what a module holds, not by its class (Hugging Face's grouped experts,
# one class per model): (predicate on the module, the type whose samplers its class takes).
STRUCTURAL: List[Tuple[Callable[[nn.Module], bool], Type[nn.Module]]] = []
# The classes entered from STRUCTURAL, with the predicate that entered each.
_STRUCTURED: Dict[type, Callable[[nn.Module], bool]] = {}


# Modules that are one layer with their children's parameters, by dotted class path: wrappers
# that use their children's parameters as weights of another layer rather than calling the
# children (peft's ParamWrapper: LoRA on a parameter, ``W + B A``, as on a mixture-of-experts
# router or experts). Each comes with the forward torch.func runs again per sample in place of
# the module's own where it takes one whole (where no STRUCTURAL samplers take it).
WHOLE_FORWARDS: Dict[str, Callable] = {}


def register_whole(path: str):
    """Decorator on ``forward(module, *args, **kwargs)``: modules of the class at dotted
    ``path`` are one layer with their children, recomputed by torch.func with that function."""
    def decorator(fn: Callable) -> Callable:
        WHOLE_FORWARDS[path] = fn
        return fn

    return decorator


def taken_whole(module: nn.Module) -> Optional[Callable]:
    """The forward torch.func runs for ``module`` if it is one layer with its children
    (``register_whole``), else None."""
    return WHOLE_FORWARDS.get(class_path(type(module))) if WHOLE_FORWARDS else None


def samplers_unmet(module: nn.Module) -> bool:
    """Whether ``module``'s class took samplers that this module does not meet, and torch.func
    takes it whole: from a ``STRUCTURAL`` predicate it does not meet (another instance did), or
    from a ``FUNCTIONAL_CALLS`` base while it holds parameters of its own that the base's
    function is not given (Dory's LM head, an nn.Linear subclass with a ``logit_scale``), or
    parametrized (``torch.nn.utils.parametrize``: its weight computed from parameters of its
    parametrizations, which the samplers would not see)."""
    if is_parametrized(module):
        return True
    predicate = _STRUCTURED.get(type(module))
    if predicate is not None:
        return not predicate(module)
    base = INHERITED.get(type(module))
    if base is None:
        return False
    takes = signature(FUNCTIONAL_CALLS[base]).parameters
    return any(name not in takes for name, _ in module.named_parameters(recurse=False))


@functools.lru_cache(maxsize=None)
def signature(function: Callable) -> inspect.Signature:
    """``function``'s signature; a builtin's (F.linear) is its entry in ``SIGNATURES``."""
    return inspect.signature(SIGNATURES.get(function, function))


def register_structure(predicate: Callable[[nn.Module], bool]):
    """Decorator on a layer type (a class used as the registry's key): a module's class without
    samplers of its own takes that type's where ``predicate(module)`` holds."""
    def decorator(template: Type[nn.Module]) -> Type[nn.Module]:
        STRUCTURAL.append((predicate, template))
        return template

    return decorator


def resolve(model: nn.Module) -> None:
    """Enter in the tables the classes registered by dotted path that ``model`` uses, the
    classes FSDP2's ``fully_shard`` made of registered ones (``FSDPLinear`` from ``Linear``),
    subclasses of a ``FUNCTIONAL_CALLS`` type that have no samplers of their own, and the
    classes of modules a ``STRUCTURAL`` predicate recognises."""
    global version
    for cls in {type(m) for m in model.modules()}:
        origin = _unsharded_class(cls)
        for table, fn in _BY_PATH.get(class_path(origin), ()):
            if origin not in table:
                table[origin] = fn
                version += 1
        base = _functional_base(origin)
        if base is not None:
            INHERITED[origin] = base
            _inherit(origin, base)
        if origin is not cls:
            _inherit(cls, origin)
            if base is not None:  # hooked at the function's calls as its origin is
                INHERITED[cls] = base
    for m in model.modules():
        cls = type(m)
        if cls not in GRAD_SAMPLERS:
            match = next(((predicate, t) for predicate, t in STRUCTURAL if predicate(m)), None)
            if match is not None:
                _STRUCTURED[cls] = match[0]
                _inherit(cls, match[1])


def _inherit(cls: type, origin: type) -> None:
    global version
    for table in TABLES:
        if origin in table and cls not in table:
            table[cls] = table[origin]
            version += 1


def _functional_base(cls: type) -> "Type[nn.Module] | None":
    """The ``FUNCTIONAL_CALLS`` type ``cls`` derives from, where no sampler was registered for
    ``cls`` itself (or it was entered from that type before)."""
    if cls in INHERITED:
        return INHERITED[cls]
    if cls in GRAD_SAMPLERS or cls in FUNCTIONAL_CALLS:
        return None
    base = next((base for base in cls.__mro__[1:] if base in FUNCTIONAL_CALLS), None)
    if base in CALLED_BY_NAME and cls.forward is not base.forward and not _names(cls.forward, FUNCTIONAL_CALLS[base]):
        return None
    return base


def _names(forward: Callable, function: Callable) -> bool:
    """Whether ``forward``'s code names ``function`` (``F.linear``) or calls ``super().forward``."""
    code = getattr(forward, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return function.__name__ in names or {"super", "forward"} <= names


def functional_call(cls: type) -> "Callable | None":
    """The function at whose calls a layer of type ``cls`` is hooked, or None where its own
    forward is hooked: a subclass with its base's samplers whose forward is its own."""
    base = INHERITED.get(cls)
    if base is None or cls.forward is base.forward or GRAD_SAMPLERS.get(cls) is not GRAD_SAMPLERS.get(base):
        return None
    return FUNCTIONAL_CALLS[base]


def _unsharded_class(cls: type) -> type:
    """The class ``fully_shard`` derived ``cls`` from (it makes ``FSDP<Name>(FSDPModule,
    <Name>)`` of a module it shards), else ``cls``."""
    sharded = fsdp_module_class()
    bases = cls.__bases__
    if sharded is not None and len(bases) == 2 and bases[0] is sharded:
        return bases[1]
    return cls


def register_grad_sampler(target_class_or_classes: Target):
    """Decorator: register ``fn(layer, activations, backprops)`` as the grad sampler of a layer type.

    The function returns ``{parameter: per-sample gradient of shape (B, *parameter.shape)}``.
    A layer type is a class, its dotted path as a string, or a sequence of them.
    """
    return _register(GRAD_SAMPLERS, target_class_or_classes)


def register_norm_sampler(target_class_or_classes: Target):
    """Decorator: register ``fn(layer, activations, backprops)`` as the norm sampler of a layer type.

    The function returns ``{parameter: per-sample gradient L2 norm of shape (B,)}`` without
    materialising per-sample gradients; it is used under ghost clipping.
    """
    return _register(NORM_SAMPLERS, target_class_or_classes)


def register_clipped_sum_sampler(target_class_or_classes: Target):
    """Decorator: register ``fn(layer, activations, backprops, coef)`` as the clipped-sum sampler
    of a layer type.

    ``coef`` is (B,); the function returns ``{parameter: sum_b coef_b * per-sample gradient_b}``
    of the parameter's shape and dtype, without materialising per-sample gradients. With a
    norm sampler it lets the single-backward mode clip the layer from its inputs and backprops.
    """
    return _register(CLIPPED_SUM_SAMPLERS, target_class_or_classes)


def register_factor_sampler(target_class_or_classes: Target):
    """Decorator: register ``fn(layer, activations, backprops)`` as the factor sampler of a layer type.

    The function returns ``{parameter: (left, right)}`` with the per-sample gradient equal to
    ``sum_t left_b[t] ⊗ right_b[t]`` (reshaped to the parameter's shape): ``left`` (B, T, n)
    or integer ids (B, T) for one-hot rows (an id below 0 for none), ``right`` (B, T, m).
    Ghost clipping needs one to combine the uses of a parameter used more than once.
    """
    return _register(FACTOR_SAMPLERS, target_class_or_classes)


def register_norm_group(target_class_or_classes: Target):
    """Decorator: register a ``dpgrad.samplers.groups.Group`` subclass that takes the norms
    and clipped sums of several layers of a type at once, for layers clipped from their norms
    (those with a norm sampler, under ghost clipping)."""
    return _register(NORM_GROUPS, target_class_or_classes)


def register_grad_sample_group(target_class_or_classes: Target):
    """Decorator: register a ``dpgrad.samplers.groups.Group`` subclass that computes the
    per-sample gradients of several layers of a type at once, for layers clipped from their
    per-sample gradients."""
    return _register(GRAD_SAMPLE_GROUPS, target_class_or_classes)


def served_by(cls: type, module: str) -> bool:
    """Whether every sampler and group in force for the layer type ``cls`` comes from ``module``
    (none replaced by a user's own): a kept-inputs function keeps something else than the
    inputs only for the samplers it was written for."""
    return all(getattr(table[cls], "__module__", None) == module for table in TABLES
               if table is not KEPT_INPUTS and table is not BATCH_COPIES and cls in table)


def register_kept_inputs(target_class_or_classes: Target):
    """Decorator: register ``fn(layer, inputs, output) -> list`` as what the hooks keep of a
    call of a layer type for its samplers, in place of the list of its inputs, called at the
    end of the call (a forward hook). The layer type's samplers and group must take what it
    returns; it returns ``list(inputs)`` where it has nothing better, and where the samplers
    in force for the layer type are not the ones it was written for (a user's own)."""
    return _register(KEPT_INPUTS, target_class_or_classes)


def register_batch_copies(target_class_or_classes: Target):
    """Decorator: register ``fn(layer) -> int`` for a layer type called on the batch's tokens
    flattened and repeated, ``fn(layer)`` copies one after the other ((K*B*T, d): Llama 4's
    experts, each expert given every token): row r is sample (r mod B*T) // T's. The hooks hand
    its samplers the call unfolded to (B, K, T, ...)."""
    return _register(BATCH_COPIES, target_class_or_classes)


def batch_copies(layer: nn.Module) -> int:
    """The copies of the batch a call of ``layer`` on the tokens flattened holds (1 by default)."""
    fn = BATCH_COPIES.get(type(layer))
    return 1 if fn is None else fn(layer)
