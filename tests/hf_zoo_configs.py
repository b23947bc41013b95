"""Tiny models for the Hugging Face sweep (tests/hf_zoo.py): every architecture of transformers'
auto mappings for three tasks, built from its default config shrunk by one generic rule set,
and its batch.

The shrinker works on the config's dictionary (sub-configs are nested dictionaries with a
``model_type``) and builds the config class again from it, so that what a config derives in its
own ``__init__`` (head sizes, rope dimensions, layer patterns) follows the new sizes. What the
generic rules get wrong for one architecture is set in ``FIXUPS``, one line each.
"""

from __future__ import annotations

import copy
import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from test_hf_models import Case

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
B, T, T_DEC = 4, 8, 6  # the batch: 4 sequences of 8 tokens; 6 decoder tokens
VOCAB = 64
SPECIAL = 16  # token ids below this are special (bos, eos, pad, image tokens...); a batch draws from above
HEADS = 2
HEAD_DIM = 8
HIDDEN = HEADS * HEAD_DIM
LAYERS = 2
LABELS = 3

# key -> its tiny value; for a key not listed, the rules of _shrink_value.
_SIZES = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim", "embedding_size",
                     "hidden_dim", "attention_hidden_size", "lru_width", "true_hidden_size", "d_embed",
                     "encoder_hidden_size", "projector_hidden_size", "text_hidden_size", "pooler_hidden_size",
                     "embedding_dim", "intra_bottleneck_size", "adapter_in_dim", "adapter_out_dim",
                     "adapter_input_size", "hidden_size_per_layer_input", "emb_dim", "d_latents",
                     "ext_pw_out_channel", "depthwise_separable_out_channel", "nemo_conv_channels",
                     "output_channels"], HIDDEN),
    **dict.fromkeys(["intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
                     "ffn_hidden_size", "dff", "dim_ff", "feed_forward_size", "mlp_dim", "intermediate_size_mlp",
                     "d_inner", "dense_intermediate_size"], 2 * HIDDEN),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "shared_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "expert_intermediate_size"], HIDDEN),
    **dict.fromkeys(["num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers", "num_blocks", "num_self_attends_per_block"], LAYERS),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
                     "num_heads", "attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
                     "swa_num_attention_heads", "linear_num_heads", "index_n_heads", "linear_num_value_heads",
                     "num_self_attention_heads", "num_cross_attention_heads"], HEADS),
    **dict.fromkeys(["head_dim", "d_kv", "d_head", "attention_head_dim", "attention_head_size", "kv_channels",
                     "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "swa_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "index_head_dim", "dim_head", "mamba_d_head", "mamba_head_dim",
                     "mamba_headdim", "rotary_dim"], HEAD_DIM),
    **dict.fromkeys(["kv_lora_rank", "q_lora_rank", "o_lora_rank"], 2 * HIDDEN),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_source_positions",
                     "max_target_positions", "max_seq_len", "max_sequence_length", "max_decoder_position_embeddings",
                     "max_encoder_position_embeddings", "max_length"], 64),
    **dict.fromkeys(["n_group", "topk_group", "num_expert_group"], 1),
    **dict.fromkeys(["decoder_sparse_step", "encoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step"], 1),
    **dict.fromkeys(["state_size", "ssm_state_size", "mamba_d_state"], 8),
    # Mamba heads: mamba_n_heads * head_dim = mamba_expand (2) * hidden
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads", "n_mamba_heads"], 2 * HIDDEN // HEAD_DIM),
    **dict.fromkeys(["mamba_n_groups", "mamba_ngroups"], 1),
    "vocab_size": VOCAB, "pretraining_tp": 1, "expert_capacity": 64,
}
# key -> at most this (a model without shared experts or dense first layers keeps none).
_AT_MOST = {
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "moe_k", "top_k"], 2),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    **dict.fromkeys(["first_k_dense_replace", "num_dense_layers"], 1),
}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads", "linear_num_key_heads",
             "multi_query_group_num", "num_query_groups"}
_TOKEN_SUFFIXES = ("_token_id", "_token_ids", "_token_index")
_DROPPED = {"transformers_version", "architectures", "_name_or_path", "id2label", "label2id", "dtype", "torch_dtype"}

# Per-model corrections of the generic rules: {model_type: {key: value}}, applied to the config
# at the top and to every sub-config of that model type.
FIXUPS: Dict[str, dict] = {
    "dory": {"layer_types": None, "num_hidden_layers": 3,  # input + recurrent + output layers
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "laurel_rank": 4},
    "layoutlmv3": {"coordinate_size": 2, "shape_size": 4},  # 4 * coordinate + 2 * shape = hidden
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # its default has none
    "lilt": {"hidden_size": 24},  # divisible by 6 (its box embedding) and its shrink ratio 4
    "mamba2": {"num_heads": 4, "n_groups": 1},  # num_heads * head_dim = expand * hidden
    "markuplm": {"max_depth": 4},  # an embedding per level of the xpath
    "mistral4": {"head_dim": 2 * HEAD_DIM},  # qk_nope_head_dim + qk_rope_head_dim
    "perceiver": {"num_latents": 8, "_label_trainable_num_channels": HIDDEN},
    # in training, the axial position shape multiplies to the sequence length (8)
    "reformer": {"axial_pos_shape": [2, 4], "axial_pos_embds_dim": [8, 8], "attn_layers": ["local", "local"],
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": HIDDEN, "kv_channels": HEAD_DIM,
               "num_query_groups": HEADS, "hybrid_layer_ids": [1], "layers_block_type": ["mamba", "hybrid"]},
}
# Per-task settings: {(model_type, task): {key: value}}.
TASK_FIXUPS: Dict[Tuple[str, str], dict] = {
    ("reformer", "causal-lm"): {"is_decoder": True},
}


def entries(tasks=None) -> List[Tuple[str, str, str]]:
    """(model_type, task, model class name) of every architecture of the auto mappings."""
    from transformers.models.auto import modeling_auto

    out = []
    for task, mapping in TASKS.items():
        if tasks is None or task in tasks:
            out += [(m, task, cls) for m, cls in getattr(modeling_auto, mapping).items()]
    return out


def _token_ids(d: dict, found: set) -> None:
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            _token_ids(value, found)
        elif key.endswith(_TOKEN_SUFFIXES):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    found.add(v)


def token_map(d: dict) -> Dict[int, int]:
    """Every special token id -> an id below SPECIAL: kept where it is below, else the next free."""
    found = set()
    _token_ids(d, found)
    kept = {v for v in found if v < SPECIAL}
    free = iter(v for v in range(SPECIAL) if v not in kept)
    return {v: v if v < SPECIAL else next(free, SPECIAL - 1) for v in sorted(found)}


def _shrink_value(key: str, value, old: dict, tokens: Dict[int, int]):
    if isinstance(value, bool):
        return value
    if key.endswith(_TOKEN_SUFFIXES):
        if isinstance(value, (list, tuple)):
            return [tokens.get(v, v) for v in value]
        return tokens.get(value, value) if isinstance(value, int) else value
    if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "layerdrop", "jitter", "drop_path")):
        return 0.0
    if key in _KV_HEADS and (isinstance(value, int) or value is None):
        heads = next((old[k] for k in ("num_attention_heads", "n_head", "num_heads") if k in old), None)
        return HEADS if value in (heads, None) else 1
    if key.endswith("_embed_dim") and isinstance(value, int):  # side embeddings (shape, pronunciation, speaker)
        return HIDDEN
    if ("vocab" in key or key.endswith("_buckets")) and key not in _SIZES and isinstance(value, int):
        return min(value, VOCAB)  # entity, character, hash, per-layer-input vocabularies
    if key in _AT_MOST and (isinstance(value, int) or value is None):
        return _AT_MOST[key] if value is None else min(value, _AT_MOST[key])
    if key in _SIZES:
        if isinstance(value, int) or (value is None and _SIZES[key] == HEAD_DIM and "head" in key):
            return _SIZES[key]  # an unset head size: some configs fail to derive it
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return [_SIZES[key]] * len(value)  # one size per layer
        if value is None and key == "vocab_size":
            return VOCAB
    return value


def shrink(d: dict, tokens: Optional[Dict[int, int]] = None) -> dict:
    """The config dictionary ``d`` shrunk: sizes, layers, heads, vocabulary, positions, experts,
    dropouts (0), special token ids (below SPECIAL); its sub-configs the same way."""
    tokens = token_map(d) if tokens is None else tokens
    layers = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(d.get(k), int)), None)
    out = {}
    for key, value in d.items():
        if key in _DROPPED:
            continue
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink(value, tokens)
            continue
        if isinstance(value, list) and layers and len(value) == layers > LAYERS and key != "eos_token_id":
            value = [value[0], value[-1]]  # a per-layer pattern: its first and last kinds
        if key == "rope_parameters" and isinstance(value, dict):
            out[key] = _shrink_rope(value)
        elif key == "per_layer_config" and isinstance(value, dict):  # overrides of layers that are gone
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
        elif key == "attention_window":  # local attention pads the sequence to the window
            out[key] = [4] * len(value) if isinstance(value, list) else 4
        elif key == "use_cache":
            out[key] = False
        elif key in ("mlp_only_layers", "moe_layers_to_skip"):
            out[key] = []
        else:
            out[key] = _shrink_value(key, value, d, tokens)
    if {"qk_nope_head_dim", "qk_rope_head_dim"} <= set(out) and "qk_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    out.update(FIXUPS.get(d.get("model_type"), {}))
    return out


def _shrink_rope(rope: dict) -> dict:
    rope = dict(rope)
    if isinstance(rope.get("mrope_section"), list):  # sums to head_dim / 2
        n = len(rope["mrope_section"])
        half = HEAD_DIM // 2
        rope["mrope_section"] = [half - (n - 1)] + [1] * (n - 1) if n > 1 else [half]
    return rope


def tiny_config(model_type: str, task: str, model_class=None):
    """The default config of ``model_type`` shrunk, with num_labels and a pad token for seq-cls;
    where ``model_class`` takes one of its sub-configs (a causal LM of a multimodal model's text
    config), that sub-config."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    d = shrink(default.to_dict())
    d.update(TASK_FIXUPS.get((model_type, task), {}))
    if d.get("is_encoder_decoder") and d.get("decoder_start_token_id") is None:
        d["decoder_start_token_id"] = d.get("pad_token_id") or 0
    if task == "seq-cls":
        d["num_labels"] = LABELS
        _set_pad(d)
    config = type(default)(**{k: v for k, v in d.items() if k != "model_type"})
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        subs = [getattr(config, k, None) for k, v in d.items() if isinstance(v, dict) and "model_type" in v]
        config = next((c for c in subs if isinstance(c, wanted)), config)
        if task == "seq-cls":
            config.num_labels = LABELS
    return config


def _set_pad(d: dict) -> None:
    """A pad token id where the config (or its text config) has none: a classifier over a decoder
    finds each row's last token by it."""
    used = set()
    _token_ids(d, used)
    pad = next(v for v in range(SPECIAL) if v not in used)
    for sub in [d] + [v for v in d.values() if isinstance(v, dict) and "model_type" in v]:
        if sub.get("pad_token_id") is None:
            sub["pad_token_id"] = pad


def pad_token_id(config) -> int:
    """The config's pad token id, or its text config's; 0 where neither has one."""
    for c in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
        pad = getattr(c, "pad_token_id", None) if c is not None else None
        if isinstance(pad, int) and pad >= 0:
            return pad
    return 0


_MODALITIES = ("pixel_values", "input_features", "input_values", "audio_values", "pixel_values_videos",
               "audio_input_ids", "input_audio_embeds", "flattened_patches", "image_embeds", "speech")


def required_inputs(model_class, task: str) -> Optional[str]:
    """What the forward of ``model_class`` needs besides token ids for ``task``, as "needs ...",
    or None: a first argument other than input_ids, or no decoder_input_ids for seq2seq."""
    params = [p for p in inspect.signature(model_class.forward).parameters if p != "self"]
    modal = [p for p in params if p in _MODALITIES]
    if "input_ids" not in params:
        return f"needs {params[0] if params else 'inputs'}"
    if task == "seq2seq" and "decoder_input_ids" not in params:
        return f"needs {modal[0] if modal else 'decoder_input_ids'} (not a text encoder-decoder)"
    return None


def modal_inputs(model_class) -> List[str]:
    """The non-text inputs the forward of ``model_class`` accepts."""
    return [p for p in inspect.signature(model_class.forward).parameters if p in _MODALITIES]


# ------------------------------------------------------------------ the model, its batch, plain autograd on them
MAX_PARAMETERS = 500_000
# After building: what a model needs before its first forward pass.
BUILD_FIXUPS = {"xmod": lambda m: m.set_default_language(m.config.languages[0] if m.config.languages else "en_XX")}


class NotBuilt(Exception):
    """The architecture could not be built or run without dpgrad: not dpgrad's to fix."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".strip().rstrip(":")


def build(model_type: str, task: str, class_name: str) -> Tuple[nn.Module, object]:
    """The tiny model in float32 (seed 0), training mode, and its config."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise NotBuilt(f"transformers has no class {class_name}")
    needs = required_inputs(cls, task)
    if needs:
        raise NotBuilt(needs)
    try:
        config = tiny_config(model_type, task, cls)
        with torch.device("meta"):  # counted before any memory is taken
            size = sum(p.numel() for p in cls(config).parameters())
    except Exception as exc:  # noqa: BLE001 - any failure to build is the model's or the shrinker's
        raise NotBuilt(f"build: {first_line(exc)}") from exc
    if size > MAX_PARAMETERS:
        raise NotBuilt(f"the tiny config still has {size} parameters: a size the shrinker does not know")
    try:
        torch.manual_seed(0)
        model = cls(config).float().train()
        BUILD_FIXUPS.get(model_type, lambda m: None)(model)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the model's or the shrinker's
        raise NotBuilt(f"build: {first_line(exc)}") from exc
    return model, config


def _logits(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def make_case(model: nn.Module, task: str, config) -> Case:
    """The batch of ``task`` (B=4, T=8, right padding on rows 0 and 2) around ``model``."""
    g = torch.Generator().manual_seed(0)
    vocab = min(getattr(config, "vocab_size", None) or VOCAB, VOCAB)
    pad = pad_token_id(config)
    ids = torch.randint(SPECIAL, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2 % B, 3:] = 0
    ids[mask == 0] = pad
    if task == "seq-cls":
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if isinstance(eos, int) and eos >= 0:  # encoder-decoder classifiers read each row's last eos
            ids[torch.arange(B), mask.sum(1) - 1] = eos
        y = torch.randint(0, LABELS, (B,), generator=g)

        def class_logits(m, rows):
            return _logits(m(input_ids=ids[rows], attention_mask=mask[rows]))

        return Case(model, lambda m, rows: ((class_logits(m, rows), y[rows]), None),
                    lambda m, rows, reduction="mean": F.cross_entropy(class_logits(m, rows), y[rows], reduction="none"))
    if task == "seq2seq":
        targets = torch.randint(SPECIAL, vocab, (B, T_DEC), generator=g)
        dec_mask = torch.ones(B, T_DEC, dtype=torch.long)
        dec_mask[0, 4:] = 0
        dec_mask[2, 2:] = 0
        labels = targets.masked_fill(dec_mask == 0, -100)
        start = getattr(config, "decoder_start_token_id", None)
        start = pad if start is None else start
        dec_ids = torch.cat([torch.full((B, 1), start), targets[:, :-1]], 1)
        dec_ids[:, 1:][dec_mask[:, :-1] == 0] = pad

        def logits_of(m, rows):
            return _logits(m(input_ids=ids[rows], attention_mask=mask[rows], decoder_input_ids=dec_ids[rows]))
    else:
        labels = ids.masked_fill(mask == 0, -100)[:, 1:]

        def logits_of(m, rows):
            return _logits(m(input_ids=ids[rows], attention_mask=mask[rows]))[:, :-1]

    def forward(m, rows):
        logits = logits_of(m, rows)
        return (logits.reshape(-1, logits.shape[-1]), labels[rows].reshape(-1)), logits.shape[:2]

    def per_sample_loss(m, rows, reduction="mean"):
        token = F.cross_entropy(logits_of(m, rows).transpose(1, 2), labels[rows], reduction="none")
        return token.sum(1) / ((labels[rows] != -100).sum(1) if reduction == "mean" else 1)

    return Case(model, forward, per_sample_loss)


def with_lora(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with peft's LoRA adapters on every linear layer (r=4); the B's drawn
    nonzero so that the A's gradients are not all zero."""
    import peft

    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(copy.deepcopy(model), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.2)
    return model


def unreached(case: Case) -> set:
    """The trainable parameters plain autograd leaves without a gradient on the whole batch (a
    vision tower under a text-only batch, an expert no token was routed to)."""
    case.per_sample_loss(case.model, slice(None)).sum().backward()
    out = {n for n, p in case.model.named_parameters() if p.requires_grad and p.grad is None}
    case.model.zero_grad(set_to_none=True)
    return out


def eager_experts(case: Case) -> Case:
    """The case on a copy of its model whose mixture-of-experts layers run transformers' eager
    loop over the experts (the same function; the grouped matmul has no float64 kernel)."""
    model = copy.deepcopy(case.model)
    for m in model.modules():
        if getattr(getattr(m, "config", None), "_experts_implementation", None) not in (None, "eager") \
                and hasattr(m, "set_experts_implementation"):
            m.set_experts_implementation("eager")
    return Case(model, case.forward, case.per_sample_loss)
