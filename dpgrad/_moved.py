"""The module paths of earlier versions, kept working: ``import dpgrad.clipping_groups`` (or
``from dpgrad.registry import register_grad_sampler``) gives the module at its new place
(``dpgrad.clipping.groups``, ``dpgrad.samplers.registry``): the same module object, loaded
when first asked for."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# Earlier path -> the module's place now.
MOVED = {f"dpgrad.{old}": f"dpgrad.{new}" for old, new in {
    "autograd_graph": "backward.autograd_graph",
    "backward_pass": "backward.backward_pass",
    "clipped_sums": "backward.clipped_sums",
    "clipping_path": "backward.clipping_path",
    "finish_plan": "backward.finish_plan",
    "group_flush": "backward.group_flush",
    "layer_inputs": "backward.layer_inputs",
    "fsdp": "backward.fsdp",
    "guarantee": "checks.guarantee",
    "independence": "checks.independence",
    "independence_check": "checks.independence_check",
    "forward_probe": "checks.forward_probe",
    "model_checks": "checks.model_checks",
    "adaptive": "clipping.adaptive",
    "clipping_groups": "clipping.groups",
    "coefficients": "clipping.coefficients",
    "hf_privacy": "hf.privacy",
    "hf_sampling": "hf.sampling",
    "registry": "samplers.registry",
    "backend": "kernels.backend",
}.items()}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an earlier path and loads it as the module at its new place."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets this spec on the module next
        return module

    def exec_module(self, module):
        # Loaded at its new place already: only its own spec is given back.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Moved())  # before the path finders: the earlier paths hold no modules now
