"""One training step of a language model: non-private, Opacus ghost clipping, dpgrad double and
single backward, all in the same run on the same weights and batch.

A DP step is forward, the loss wrapper's backward, and Opacus's
``DPOptimizerFastGradientClipping`` step (noise 1.0, C = 1.0); the non-private step is
forward, the mean token loss's backward and the plain optimizer's step. Each sequence is
one sample (``shape=`` of the loss wrappers). Models:
- ``tiny``, ``gpt2-small``: dpgrad's presets (``TinyTransformer``; gpt2-small has GPT-2
  small's shapes and its tied embeddings);
- ``hf-gpt2``: Hugging Face GPT-2 small, full fine-tuning, tied embeddings (Opacus refuses
  tied weights under ghost clipping: its rows say so);
- ``hf-llama-1b-lora16``: a Llama-3.2-1B-shaped Hugging Face model with PEFT LoRA adapters of
  rank 16 on every projection, only the adapters trainable;
- ``hf-gpt2-tiny``, ``hf-llama-tiny-lora16``: the same architectures at two layers, for CPUs.
On a CPU the small cases run in fp32; on a CUDA GPU the real sizes in bf16. The conftest
writes medians, ratios to the non-private step and to Opacus, tokens/s and (on a GPU) peak
memory to benchmarks/results/dp_step_<cpu|cuda>.json.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn as nn

import dpgrad
from dpgrad.models import TinyTransformerConfig, synthetic_batch
from dpgrad.presets import DTYPES, build_model

opacus = pytest.importorskip("opacus")
from opacus.grad_sample import GradSampleModuleFastGradientClipping as OpacusFGC  # noqa: E402
from opacus.optimizers import DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping as OpacusDPLoss  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (model, batch, tokens per sequence, dtype): about 8k tokens a step on the GPU.
CASES = (
    [("gpt2-small", 64, 128, "bf16"), ("gpt2-small", 8, 1024, "bf16"), ("hf-gpt2", 64, 128, "bf16"),
     ("hf-gpt2", 8, 1024, "bf16"), ("hf-llama-1b-lora16", 8, 1024, "bf16")]
    if CUDA
    else [("tiny", 8, 64, "fp32"), ("tiny", 8, 256, "fp32"), ("hf-gpt2-tiny", 8, 64, "fp32"),
          ("hf-llama-tiny-lora16", 8, 64, "fp32")]
)
PROVIDERS = ["non-private", "opacus-ghost", "dpgrad-double", "dpgrad-single"]
ROUNDS = 15 if CUDA else 10
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class BenchModel:
    module: nn.Module
    vocab_size: int
    padding_idx: int
    hf: bool

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if not self.hf:
            return model(ids)
        # One row of positions per sequence (HF's default single row has no per-sample gradient).
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return model(input_ids=ids, position_ids=positions).logits


def _hf(name: str) -> BenchModel:
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if name.startswith("hf-gpt2"):
        tiny = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256) if "tiny" in name else {}
        cfg = transformers.GPT2Config(**tiny, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return BenchModel(transformers.GPT2LMHeadModel(cfg), cfg.vocab_size, 0, hf=True)
    import peft

    if "tiny" in name:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    else:  # Llama 3.2 1B's shape
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0)
    cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=True, **common)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    return BenchModel(model, cfg.vocab_size, 0, hf=True)


_models: Dict[Tuple[str, str], BenchModel] = {}


def _model(name: str, dtype: str) -> BenchModel:
    """One set of random weights per model and dtype: every provider copies it."""
    if (name, dtype) not in _models:
        torch.manual_seed(0)
        if name.startswith("hf-"):
            built = _hf(name)
            built.module.to(device=DEVICE, dtype=DTYPES[dtype])
        else:
            preset = build_model(name, DEVICE, DTYPES[dtype])
            built = BenchModel(preset.module, preset.vocab_size, preset.padding_idx, hf=False)
        _models[(name, dtype)] = built
    return _models[(name, dtype)]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def make_step(provider: str, name: str, batch: int, seq_len: int, dtype: str) -> Callable[[], None]:
    """The step of ``provider``; raises what the provider raises on this model (Opacus refuses
    tied weights under ghost clipping)."""
    built = _model(name, dtype)
    model = copy.deepcopy(built.module)
    vocab = built.vocab_size
    cfg = TinyTransformerConfig(vocab_size=vocab, padding_idx=built.padding_idx, max_seq_len=seq_len + 1,
                                d_model=1, n_heads=1)
    ids = synthetic_batch(cfg, batch, seq_len + 1, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    # Opacus's embedding norm sampler needs contiguous ids (it calls .view on them).
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    criterion = nn.CrossEntropyLoss(ignore_index=built.padding_idx)
    trainable = [p for p in model.parameters() if p.requires_grad]

    if provider == "non-private":
        optimizer = torch.optim.SGD(trainable, lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            criterion(built.logits(model, inputs).reshape(-1, vocab), targets.reshape(-1)).backward()
            optimizer.step()

        return step

    if provider == "opacus-ghost":
        wrapped, loss_cls = OpacusFGC(model, max_grad_norm=1.0, loss_reduction="mean"), OpacusDPLoss
    else:
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(
            model, max_grad_norm=1.0, loss_reduction="mean", single_backward=provider == "dpgrad-single"
        )
        loss_cls = dpgrad.DPLossFastGradientClipping
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(trainable, lr=1e-3),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
        loss_reduction="mean",
    )
    dp_criterion = loss_cls(wrapped, optimizer, criterion, loss_reduction="mean")

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = built.logits(wrapped, inputs)
        dp_criterion(logits.reshape(-1, vocab), targets.reshape(-1), shape=logits.shape[:2]).backward()
        optimizer.step()

    return step


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name, batch, seq_len, dtype", CASES)
def test_dp_step(benchmark, provider, name, batch, seq_len, dtype):
    benchmark.group = f"DP step, {name}, B={batch}, T={seq_len}, {dtype}, {DEVICE.type}"
    benchmark.extra_info.update(bench="dp_step", provider=provider, model=name, batch=batch, seq_len=seq_len,
                                dtype=dtype, tokens=batch * seq_len)
    try:
        step = make_step(provider, name, batch, seq_len, dtype)
    except NotImplementedError as err:
        pytest.skip(f"{provider} does not run on {name}: {err}")

    def synced_step():
        step()
        _sync()

    synced_step()  # warm-up (and, for dpgrad, the autotuner's first look at each shape)
    peak = None
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
        synced_step()
        peak = torch.cuda.max_memory_allocated()
    benchmark.extra_info["peak_memory_bytes"] = peak
    benchmark.pedantic(synced_step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
