"""The layers a backward path hooks (``HookedLayers``, a mixin of
``dpgrad.backward.backward_pass.BackwardPath``): which layers get a hook and which parameters
each one's per-sample gradients cover, the hooks put on and taken off, and the layout kept in
step with the model (hooked anew when its modules, its parameters or which of them train
change, refused when they change between a forward pass and its backward pass)."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.nn.utils.parametrize import is_parametrized as parametrized

from dpgrad.backward.functional_calls import FunctionalHooks
from dpgrad.samplers import registry
from dpgrad.kernels.backend import name_layers
from dpgrad.backward.fsdp import sharded_modules
from dpgrad.checks.guarantee import structure_version, watch_modules, watch_structure
from dpgrad.checks.model_checks import own_trainable, uses_child_parameters, validate
from dpgrad.samplers import ft_compute_per_sample_gradient, prepare_layer


class HookedLayers:
    """The model's layers as a ``BackwardPath`` hooks them (its ``GRAD_SAMPLERS``, settings and
    pass state are the path's): checked, hooked (``attach``, ``detach``), named, and hooked anew
    when the model changes (``_sync_with_model``, at each forward pass)."""

    def _check(self, model: nn.Module) -> Set[str]:
        """Check the model's layers (raising, before anything is touched, for what cannot be
        clipped); the names of the layers skipped under strict=False."""
        registry.resolve(model)
        errors = validate(model, strict=self.strict, sampled=lambda m: not self.whole(m))
        self._check_layers(model)
        return {e.args[1] for e in errors}

    def _check_layers(self, model: nn.Module) -> None:
        """A path's own checks of the model; nothing here."""

    def attach(self, root: nn.Module) -> None:
        """Hook the model and give its trainable parameters dpgrad's fields; ``root`` is the
        module whose trainable parameters the guarantee covers (the wrapper: the model's and
        any it holds itself)."""
        self.root = root
        watch_structure()
        self._param_names = {p: n for n, p in self.model.named_parameters()}
        self._init_fields()
        self.handles[:] = self._hook()
        self.hooks_enabled = True
        self._sync_with_model(rescan=False)

    def detach(self) -> None:
        """Remove every hook ``attach`` put on the model."""
        self.hooks_enabled = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for layer in getattr(self, "functorch_layers", ()):
            layer.__dict__.pop("ft_compute_sample_grad", None)

    def _init_fields(self) -> None:
        for p in self.model.parameters():
            if p.requires_grad:
                p.__dict__.setdefault("grad_sample", None)
                p.__dict__.setdefault("_forward_counter", 0)

    def layers_to_hook(self, module: nn.Module, prefix: str = "", seen: Optional[set] = None
                       ) -> Iterator[Tuple[str, nn.Module]]:
        """Layers with own trainable parameters, and modules that are one layer with their
        children's (``registry.register_whole``, ``uses_child_parameters``); a layer without a registered sampler is
        handled whole by torch.func, so its children are not visited. A layer registered
        under several names (one module in two containers) is yielded once: two hooks
        would count each of its uses twice."""
        seen = set() if seen is None else seen
        if module in seen:
            return
        seen.add(module)
        # One layer with its children's parameters: a registered wrapper (peft's ParamWrapper), a
        # parametrized module (its parametrizations' parameters, torch.nn.utils.parametrize), or
        # a module computing with a child's weight itself rather than calling the child.
        unit = registry.taken_whole(module) is not None or parametrized(module) or (
            bool(prefix) and uses_child_parameters(module))
        if own_trainable(module) or (unit and any(p.requires_grad for p in module.parameters())):
            yield prefix, module
            if unit or type(module) not in self.GRAD_SAMPLERS:
                return
        for name, child in module.named_children():
            yield from self.layers_to_hook(child, f"{prefix}.{name}" if prefix else name, seen)

    def whole(self, layer: nn.Module) -> bool:
        """Whether the layer's per-sample gradients come from torch.func, for it whole."""
        return self.force_functorch or type(layer) not in self.GRAD_SAMPLERS or registry.samplers_unmet(layer)

    def _hook(self) -> list:
        """Hook every layer with trainable parameters of its own, and the model itself (at
        the start of each forward pass, and at its end for the guarantee's check)."""
        model = self.model
        self.layer_names: Dict[nn.Module, str] = {}
        self.functorch_layers: Set[nn.Module] = set()
        self._own_params: Dict[nn.Module, Tuple[nn.Parameter, ...]] = {}
        handles = []
        for name, layer in self.layers_to_hook(model):
            if name in self._skipped:
                continue
            whole = self.whole(layer)
            if whole:
                prepare_layer(layer, batch_first=self.batch_first)
                self.functorch_layers.add(layer)
            self.layer_names[layer] = name
            self._own_params[layer] = tuple(layer.parameters(recurse=whole or registry.taken_whole(layer) is not None))
            function = None if whole else registry.functional_call(type(layer))
            if whole:  # its keyword arguments are looked at (torch.func runs it again on what it got)
                handles.append(layer.register_forward_hook(self._on_whole_call, with_kwargs=True))
                if next(layer.buffers(), None) is not None:  # and whether its forward changes its buffers
                    handles.append(layer.register_forward_pre_hook(self._before_whole_call))
            elif function is None:
                handles.append(layer.register_forward_hook(self._on_layer_call))
            else:  # hooked at its calls of the function (dpgrad.backward.functional_calls)
                handles += FunctionalHooks(layer, name, function, self._on_layer_call, self._recording).register()
        name_layers(self.layer_names)
        _warn_swallowed([(self.layer_names[m], m) for m in self.functorch_layers], self.GRAD_SAMPLERS)
        # One parameter, looked up at each forward pass: a model whose parameters were replaced
        # without a registration (sharded by fully_shard after wrapping) would get per-sample
        # state on others.
        self._probe = None
        if self.sharded is None:
            self._probe = next(((layer, n, p) for layer in self.layer_names
                                for n, p in layer.named_parameters(recurse=False)), None)
        # The hooked layers that hold each parameter (for messages).
        self._owners: Dict[nn.Parameter, List[nn.Module]] = {}
        for layer, params in self._own_params.items():
            for p in params:
                self._owners.setdefault(p, []).append(layer)
        # Parameters no hook sees (skipped layers and their children): no per-sample values.
        self.unhooked = {p for p in model.parameters() if p not in self._owners}
        # Those of layers skipped under strict=False, refused where their norms are asked for.
        self._skipped_params = {p for name, m in model.named_modules() if name in self._skipped
                                for p in m.parameters()}
        handles.append(model.register_forward_pre_hook(self._on_model_call, with_kwargs=True))
        handles.append(model.register_forward_hook(self._on_model_output))
        return handles

    def _recording(self) -> bool:
        """Whether a layer's call now is recorded for a backward pass."""
        return self.hooks_enabled and not self.inert and torch.is_grad_enabled() and not self.independence.rerunning

    def _sync_with_model(self, rescan: bool = True) -> None:
        """Hook the model anew (``_rescan``) if its modules or parameters, or which parameters
        train, changed since the last look: gradual unfreezing, a head added after wrapping.
        Costs a look at each parameter's ``requires_grad``; the modules are looked at again
        only after a module or a parameter was registered into one of them (``structure_version``)."""
        changed = False
        version = structure_version()
        if version != self._seen_version:
            layout = (tuple(self.root.modules()), tuple(self.root.parameters()))
            if not all(_same_objects(a, b) for a, b in zip(layout, self._seen_layout)):
                self._seen_layout, changed = layout, True
                watch_modules(layout[0])
            self._seen_version = version
        params = self._seen_layout[1]
        flags = [p.requires_grad for p in params]
        if changed or flags != self._seen_flags:
            if rescan:
                self._rescan()
                flags = [p.requires_grad for p in params]
            self._seen_flags = flags
            self._checked = {p for p, trains in zip(params, flags) if trains} - self._skipped_params

    def _rescan(self) -> None:
        """Take the model as it is now: checked and hooked anew (after gradual unfreezing, or a
        layer added after wrapping). Raises, as at construction, for a layer that cannot be
        clipped, leaving the hooks as they were."""
        model = self.model
        if self.sharded is None and sharded_modules(model):
            raise RuntimeError(
                "the model was sharded by fully_shard after it was wrapped, and per-sample state "
                "would land on parameters nothing reads. Shard the model first, then wrap it."
            )
        self._skipped = self._check(model)
        self._param_names = {p: n for n, p in model.named_parameters()}
        self._init_fields()
        if self.handles:
            for handle in self.handles:
                handle.remove()
            self.handles[:] = self._hook()
        self._verified.clear()
        self.independence.clear()
        self._scan_version += 1

    def layer_params(self, layer: nn.Module) -> List[nn.Parameter]:
        """The layer's trainable parameters, as its per-sample gradients see them."""
        return [p for p in self._own_params[layer] if p.requires_grad]

    def param_name(self, p: nn.Parameter) -> str:
        return self._param_names.get(p, "?")

    def layer_label(self, layer: nn.Module) -> str:
        """How messages name a layer: by its qualified name, the wrapped model itself by its class."""
        name = self.layer_names.get(layer, "?")
        return f"layer '{name}'" if name else f"the wrapped model itself ({type(layer).__name__})"

    def grad_sampler(self, layer: nn.Module) -> Callable:
        if layer in self.functorch_layers:
            return ft_compute_per_sample_gradient
        return self.GRAD_SAMPLERS[type(layer)]

    def _check_probe(self) -> None:
        if self._probe is None:
            return
        layer, name, p = self._probe
        if layer._parameters.get(name) is not p:
            raise RuntimeError(
                f"parameter '{self.layer_names[layer]}.{name}' is no longer the one this wrapper "
                "hooked: the model's parameters were replaced after wrapping (sharded by "
                "fully_shard, or assigned anew), and per-sample state would land on parameters "
                "nothing reads. Shard or change the model first, then wrap it."
            )

    def _check_trainable_since_forward(self) -> None:
        """Raise, before anything reaches a gradient, if a parameter was frozen or made
        trainable after the last forward pass: its per-sample state and autograd's graph follow
        the forward pass, what would be clipped and summed follows ``requires_grad`` now."""
        params = self._seen_layout[1]
        if self._seen_flags is None or all(p.requires_grad == was for p, was in zip(params, self._seen_flags)):
            return
        changed = [f"'{self.param_name(p)}' ({'trainable' if p.requires_grad else 'frozen'} now)"
                   for p, was in zip(params, self._seen_flags) if p.requires_grad != was]
        self._pass_forwards.add(self._edges.forward_id)
        self._abort_pass()
        raise RuntimeError(
            f"parameters {', '.join(changed)} changed requires_grad between the forward pass and its "
            "backward pass: the forward pass decided which gradients autograd computes, and they would "
            "be clipped as the parameters are now. Freeze or unfreeze parameters before the forward "
            "pass (then the wrapper takes the model as it is). Nothing has reached p.grad from this pass."
        )


def _same_objects(a: tuple, b: tuple) -> bool:
    """Whether two tuples hold the same objects (tensors compared by identity, not value)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _warn_swallowed(layers: List[Tuple[str, nn.Module]], samplers: dict) -> None:
    """Warn, once for the model, where torch.func takes a layer whole with two or more trainable
    layers inside it that have samplers of their own (a base model holding a parameter of its
    own): each step then runs them all again per sample, slower and with more memory."""
    found = []
    for name, layer in sorted(layers, key=lambda item: item[0]):
        inside = [m for m in layer.modules() if m is not layer and type(m) in samplers and own_trainable(m)]
        if len(inside) >= 2:
            own = [n for n, p in layer.named_parameters(recurse=False) if p.requires_grad]
            why = f"parameters of its own, {own}" if own else "computes with its children's parameters or methods"
            found.append(f"'{name or 'the model'}' ({type(layer).__name__}: {why}; {len(inside)} layers inside)")
    if not found:
        return
    listed = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    warnings.warn(
        f"dpgrad: torch.func takes these layers whole, with the layers inside them that have samplers of their own: "
        f"{listed}. Each step runs their forwards again one sample at a time, slower and with more memory than those "
        "samplers. To keep them, move a layer's own parameters into a small submodule that holds them alone (called "
        "in its forward), or freeze them.", stacklevel=4)
