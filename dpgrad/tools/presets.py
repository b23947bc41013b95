"""Built-in model presets for the autotune report: GPT-2- and Llama-shaped, random weights.

``build_model(name, device, dtype)`` gives a model for a preset name (``PRESETS``) or, when
Hugging Face ``transformers`` is installed, ``hf:<model_type>`` (``hf:gpt2``, ``hf:llama``):
that architecture's default config with random weights. Nothing is downloaded either way.
Every preset is a :class:`dpgrad.tools.models.TinyTransformer`; as in the models they are shaped
after, the output layer shares the token embedding's weight (except the demo's ``tiny``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig, per_sample_lm_loss

HF_PREFIX = "hf:"

PRESETS: Dict[str, TinyTransformerConfig] = {
    # The demo's model: fast enough to tune on a laptop CPU.
    "tiny": TinyTransformerConfig(),
    # GPT-2 small and medium: 124M and 355M parameters, the output layer tied to the embedding.
    "gpt2-small": TinyTransformerConfig(
        vocab_size=50257, max_seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
        tie_embeddings=True,
    ),
    "gpt2-medium": TinyTransformerConfig(
        vocab_size=50257, max_seq_len=1024, d_model=1024, n_heads=16, n_layers=24, d_ff=4096,
        tie_embeddings=True,
    ),
}

# Presets built through Hugging Face transformers' own configs, true to the models they name:
# name -> (model type, config fields). Llama 3.2 1B: rotary positions, 32 query heads over 8
# key/value heads, SwiGLU, RMSNorm, no biases, tied embeddings; 1,235,814,400 parameters.
HF_PRESETS: Dict[str, tuple] = {
    "llama-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    )),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def model_names() -> str:
    """The accepted names, for help texts and errors."""
    hf = f", {HF_PREFIX}<model_type> (e.g. hf:gpt2, hf:llama)" if transformers_available() else ""
    return ", ".join([*PRESETS, *HF_PRESETS]) + hf


def max_seq_len(name: str) -> Optional[int]:
    """A preset's maximum sequence length (None for hf: models: known once built)."""
    if name in PRESETS:
        return PRESETS[name].max_seq_len
    if name in HF_PRESETS:
        return HF_PRESETS[name][1]["max_position_embeddings"]
    return None


@dataclass
class BuiltModel:
    """A model ready for the report, with what the synthetic batch and the loss need."""

    name: str
    module: nn.Module
    vocab_size: int
    max_seq_len: int
    padding_idx: int
    hf: bool  # Hugging Face models return an output object; the logits are ``.logits``

    def per_sample_loss(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Per-sample next-token loss (B,) of ids (B, T) through ``model`` (``module`` or its wrapper)."""
        out = model(input_ids=ids) if self.hf else model(ids)
        logits = out.logits if self.hf else out
        return per_sample_lm_loss(logits, ids, self.padding_idx)

    def batch_config(self) -> TinyTransformerConfig:
        """A config with this model's vocabulary, for ``dpgrad.tools.models.synthetic_batch``."""
        return TinyTransformerConfig(vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                                     padding_idx=self.padding_idx, d_model=1, n_heads=1)


def check_name(name: str) -> None:
    """Raise ValueError, naming the choices, unless ``name`` is a model ``build_model`` makes."""
    if name in PRESETS:
        return
    if name in HF_PRESETS:
        if not transformers_available():
            raise ValueError(
                f"model {name!r} is built through Hugging Face transformers' config of the model, which is not "
                f"installed: pip install transformers, or use a built-in preset ({', '.join(PRESETS)})"
            )
        return
    if name.startswith(HF_PREFIX):
        if not transformers_available():
            raise ValueError(
                f"model {name!r} needs Hugging Face transformers, which is not installed: "
                f"pip install transformers, or use a built-in preset ({', '.join(PRESETS)})"
            )
        if not name[len(HF_PREFIX):]:
            raise ValueError(f"model {name!r}: name the architecture after '{HF_PREFIX}', e.g. hf:gpt2")
        return
    raise ValueError(f"unknown model {name!r}: choose one of {model_names()}")


def check_hf_config(name: str, overrides: Dict[str, Any]) -> None:
    """Raise ValueError unless every override names a field of the ``hf:`` model's config and
    has the type of that field's default; a size (a field whose default is a positive integer)
    must be a positive integer."""
    if not overrides:
        return
    if not name.startswith(HF_PREFIX) or name in HF_PRESETS:
        raise ValueError(f"config overrides {sorted(overrides)} apply to hf: models only, not the preset {name!r}")
    import transformers

    model_type = name[len(HF_PREFIX):]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"model {name!r}: transformers {transformers.__version__} has no model type {model_type!r}; "
            "use a key of transformers.CONFIG_MAPPING, e.g. hf:gpt2 or hf:llama"
        )
    config_class = transformers.CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    aliases = getattr(config_class, "attribute_map", {}) or {}
    def is_size(field: str, default) -> bool:  # token ids are integers too, and may be 0
        return type(default) is int and default > 0 and not field.endswith(("_id", "_ids"))

    for key, value in overrides.items():
        field = aliases.get(key, key)
        if field not in defaults:
            sizes = sorted(k for k, v in defaults.items() if is_size(k, v))[:8]
            raise ValueError(f"{name} has no config field {key!r}; its size fields include {', '.join(sizes)}")
        default = defaults[field]
        if is_size(field, default) and not (type(value) is int and value > 0):
            raise ValueError(f"config field {key}={value!r} of {name}: a size, pass a positive integer")
        if type(default) is int and type(value) is not int:
            raise ValueError(f"config field {key}={value!r} of {name}: pass an integer")
        if type(default) is float and (type(value) not in (int, float) or value != value or abs(value) == float("inf")):
            raise ValueError(f"config field {key}={value!r} of {name}: pass a finite number")
        if type(default) in (bool, str) and type(value) is not type(default):
            raise ValueError(f"config field {key}={value!r} of {name}: pass a {type(default).__name__}")


def check_seq_len(name: str, seq_len: int, max_seq_len: int) -> None:
    """Raise ValueError unless a model with ``max_seq_len`` positions takes ``seq_len`` tokens."""
    if not 2 <= seq_len <= max_seq_len:
        raise ValueError(
            f"sequence length {seq_len} for model {name!r}: it takes 2 to {max_seq_len} tokens "
            f"(its maximum sequence length); pass a sequence length (--seq-len) in that range"
        )


def build_model(
    name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seq_len: Optional[int] = None,
    **hf_overrides: Any,
) -> BuiltModel:
    """A randomly initialised model for ``name`` on ``device`` in ``dtype``.

    ``seq_len``, when given, is checked against the model's maximum sequence length.
    ``hf_overrides`` go to ``transformers.AutoConfig.for_model`` for ``hf:`` models (e.g.
    ``n_layer=2``). Raises ValueError for an unknown name or a sequence length out of range.
    """
    check_name(name)
    device = torch.device(device)
    if name in PRESETS:
        if hf_overrides:
            raise ValueError(f"config overrides {sorted(hf_overrides)} apply to hf: models only, "
                             f"not to the preset {name!r}")
        cfg = PRESETS[name]
        if seq_len is not None:
            check_seq_len(name, seq_len, cfg.max_seq_len)
        # Built in place: a 1.6B-parameter model initialised on the CPU and then moved would
        # take most of a minute; on the meta device nothing is allocated (parameter counts).
        with device:
            module = TinyTransformer(cfg).to(dtype)
        return BuiltModel(name, module, cfg.vocab_size, cfg.max_seq_len, cfg.padding_idx, hf=False)
    if name in HF_PRESETS:
        if hf_overrides:
            raise ValueError(f"config overrides {sorted(hf_overrides)} apply to hf: models only, "
                             f"not to the preset {name!r}")
        model_type, fields = HF_PRESETS[name]
        return _build_hf(name, device, dtype, seq_len, fields, model_type)
    return _build_hf(name, device, dtype, seq_len, hf_overrides, name[len(HF_PREFIX):])


def _build_hf(name, device, dtype, seq_len, overrides, model_type) -> BuiltModel:
    import transformers

    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"model {name!r}: transformers {transformers.__version__} has no model type {model_type!r}; "
            "use a key of transformers.CONFIG_MAPPING, e.g. hf:gpt2 or hf:llama"
        )
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as exc:  # transformers' own checks of the fields (divisibility, ranges)
        raise ValueError(f"model {name!r}: transformers refused the config {overrides}: {exc}") from exc
    max_len = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "max_seq_len")
                    if getattr(config, k, None)), None) or 2048
    if seq_len is not None:
        check_seq_len(name, seq_len, max_len)
    try:
        with device:
            module = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, ZeroDivisionError, AssertionError) as exc:  # sizes that do not fit together
        raise ValueError(f"model {name!r}: the model cannot be built with {overrides or 'its default config'}: "
                         f"{type(exc).__name__}: {exc}") from exc
    module.to(dtype=dtype)
    pad = config.pad_token_id if isinstance(getattr(config, "pad_token_id", None), int) else 0
    return BuiltModel(name, module, config.vocab_size, max_len, pad, hf=True)


__all__ = ["DTYPES", "HF_PREFIX", "HF_PRESETS", "PRESETS", "BuiltModel", "build_model", "check_hf_config",
           "check_name", "check_seq_len", "max_seq_len", "model_names", "transformers_available"]


def audit_language_model(name: str, seq_len: int, **hf_overrides: Any):
    """``name`` built for ``dpgrad.audit`` (``LanguageModel``): on the CPU in fp32, trained on
    ``dpgrad.tools.models.synthetic_batch`` sequences."""
    from dpgrad.audit.run import LanguageModel
    from dpgrad.tools.models import synthetic_batch

    built = build_model(name, seq_len=seq_len, **hf_overrides)
    return LanguageModel(built.module, built.vocab_size, built.padding_idx, built.hf,
                         lambda n, length, generator: synthetic_batch(built.batch_config(), n, length, generator))
