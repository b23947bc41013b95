"""Whether the model of ``DPTrainer`` (``dpgrad.hf``) is sharded by FSDP2: by the caller's
``fully_shard`` before the Trainer, or by the Trainer's own FSDP (and which version of FSDP that
is); and a model the caller sharded trained through dpgrad's wrapper alone, without the
DistributedDataParallel that Accelerate would put around it."""

from __future__ import annotations

from dpgrad.backward.fsdp import sharded_modules


class FSDP2Sharding:
    """``DPTrainer``'s view of FSDP2 (a mixin: it uses the trainer's ``_sharding`` and
    ``_wrapped``, and the Trainer's ``args`` and ``model``)."""

    def _fsdp_version(self) -> int:
        plugin = getattr(getattr(self, "accelerator", None), "state", None)
        plugin = getattr(plugin, "fsdp_plugin", None)
        if plugin is not None:
            return int(getattr(plugin, "fsdp_version", 1))
        config = getattr(self.args, "fsdp_config", None) or {}
        return int(config.get("fsdp_version", config.get("version", 1)))

    def _sharded_by_caller(self) -> bool:
        """Whether the caller sharded the model by ``fully_shard`` before the Trainer (the
        Trainer's own FSDP aside); looked up once per model."""
        if self._sharding[0] is not self.model:
            by_caller = bool(sharded_modules(self.model)) and not getattr(self, "is_fsdp_enabled", False)
            self._sharding = (self.model, by_caller)
        return self._sharding[1]

    def _sharded(self) -> bool:
        """Whether the model is sharded by FSDP2: by the caller (``fully_shard`` before the
        Trainer) or by the Trainer's own FSDP (version 2, through Accelerate)."""
        return bool(getattr(self, "is_fsdp_enabled", False)) or self._sharded_by_caller()

    def _wrap_model(self, model, training=True, dataloader=None):
        """A model the caller sharded by ``fully_shard`` is trained through dpgrad's wrapper as it
        is: Accelerate would put DistributedDataParallel around it (its collectives and FSDP2's
        would both reduce). Otherwise the Trainer's own."""
        if training and self._sharded_by_caller():
            return self._wrapped(self.model)
        return super()._wrap_model(model, training, dataloader)
