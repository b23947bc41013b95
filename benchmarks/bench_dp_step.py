"""One training step of a language or vision model, every way of doing it, in one run on the same
weights and batch: non-private; Opacus's hooks (per-sample gradients, DPOptimizer); torch.func
(vmap of the per-sample gradients over the whole model, then Opacus's DPOptimizer); Opacus's
ghost clipping; dpgrad's double and single backward, and single backward with per-block and
per-layer clipping.

A DP step is forward, backward and the DP optimizer's step (noise 1.0, C = 1.0): Opacus's
``DPOptimizer`` / ``DPOptimizerFastGradientClipping`` for Opacus's rows, and for dpgrad's the
optimizer ``dpgrad.opacus.make_private`` gives (``dpgrad.opacus.DPOptimizerFastGradientClipping``:
Opacus's, its per-parameter loops batched); the non-private step is forward, the mean token
loss's backward and the plain optimizer's step.
Each sequence is one sample (``shape=`` of the loss wrappers). Models:
- ``tiny``: dpgrad's demo preset (``TinyTransformer``, 0.56M parameters);
- ``hf-gpt2``: Hugging Face GPT-2 small, full fine-tuning, tied embeddings (Opacus refuses
  tied weights under ghost clipping: its rows say so);
- ``hf-gpt2-16k``: GPT-2 small with position embeddings for 16,384 tokens (long context, B=1);
- ``hf-llama-1b``, ``hf-llama-1b-lora16``: a Llama-3.2-1B-shaped Hugging Face model, fully
  fine-tuned, or with PEFT LoRA adapters of rank 16 on every projection (only they train); at
  B=8 T=1024, and fully fine-tuned at B=1 T=8192 (long context);
- ``hf-qwen3-moe-small``: a small Qwen3-MoE (eight layers of 16 experts, top-2 routing, hidden
  size 1024), every parameter trained, experts and router included;
- ``-tiny`` variants of the Hugging Face models: the same architectures at two layers;
- ``-ckpt`` variants: GPT-2 with Hugging Face's non-reentrant activation checkpointing of
  every block, for the non-private step and dpgrad's (the memory checkpointing saves);
- ``wrn-16-4``: the WideResNet-16-4 with GroupNorm of DP image classification on CIFAR-10
  shapes (``dpgrad.tools.vision``; B=256, 32x32 images, ten classes), ``wrn-16-1`` its narrow
  quick-mode variant; ``vit-b16``: Hugging Face's ViT-B/16 (B=32, 224x224), ``vit-tiny`` (two
  layers of width 64, 32x32 images, patches of 8) in quick mode. For these ``seq_len`` is the
  image side and each image is one sample.
Quick mode (the default without CUDA, ``DPGRAD_BENCH_QUICK=1`` otherwise) runs the small
models in fp32; the full suite runs the real sizes in bf16 on a GPU. dtype ``amp``: fp32
weights, the forward pass and the loss under ``torch.autocast`` to bf16 (as the Hugging Face
Trainer's ``bf16=True`` runs them), the backward pass outside it. Peak memory: on a GPU the
most allocated during one step, less what was allocated before the provider copied the model
(the suite's models, kept for every provider to copy), after a garbage collection; on a CPU
the most one step allocates at once beyond what was live when it started (torch.profiler).
A provider that cannot run a model (out of memory, refused) is recorded with the reason.
Each case runs ``DPGRAD_BENCH_REPEATS`` times (3 on a GPU, 1 otherwise), all its providers in
turn each time, ``DPGRAD_BENCH_ROUNDS`` timed steps each (15 on a GPU, 10 otherwise); its row
gives the median of the repeats and lists each repeat's figure (``repeats``), a ratio being
taken within each repeat. ``DPGRAD_BENCH_CASES=cpu`` runs GPT-2 small (B=4, T=128) and
WideResNet-16-4 (B=32) in fp32 instead, non-private and dpgrad's single backward only: the
DP step's own cost, measured on a CPU.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import dataclass
from contextlib import nullcontext
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

import dpgrad
from dpgrad.tools import results
from dpgrad.tools.models import TinyTransformerConfig, synthetic_batch
from dpgrad.tools.presets import DTYPES, build_model

opacus = pytest.importorskip("opacus")
from opacus.grad_sample import GradSampleModule as OpacusGSM  # noqa: E402
from opacus.grad_sample import GradSampleModuleFastGradientClipping as OpacusFGC  # noqa: E402
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping as OpacusDPLoss  # noqa: E402

import dpgrad.opacus  # noqa: E402  (imports Opacus)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (model, batch, tokens per sequence, dtype): about 8k tokens a step on the GPU.
CASES = (
    [("tiny", 8, 64, "fp32"), ("tiny", 8, 256, "fp32"), ("hf-gpt2-tiny", 8, 64, "fp32"),
     ("hf-gpt2-tiny-ckpt", 8, 64, "fp32"), ("hf-llama-tiny", 8, 64, "fp32"), ("hf-llama-tiny-lora16", 8, 64, "fp32"),
     ("hf-llama-tiny-lora16", 8, 64, "amp"), ("hf-llama-tiny", 1, 1024, "fp32"), ("hf-qwen3-moe-tiny", 8, 64, "fp32"),
     ("wrn-16-1", 32, 32, "fp32"),
     ("vit-tiny", 16, 32, "fp32")]
    if results.quick_mode()
    else [("hf-gpt2", 64, 128, "bf16"), ("hf-gpt2", 8, 1024, "bf16"), ("hf-gpt2-ckpt", 8, 1024, "bf16"),
          ("hf-llama-1b", 8, 1024, "bf16"), ("hf-llama-1b-lora16", 8, 1024, "bf16"),
          ("hf-llama-1b-lora16", 8, 1024, "amp"), ("hf-qwen3-moe-small", 8, 1024, "bf16"),
          # Long context, one sequence a step.
          ("hf-llama-1b", 1, 8192, "bf16"), ("hf-gpt2-16k", 1, 16384, "bf16"),
          ("wrn-16-4", 256, 32, "bf16"), ("vit-b16", 32, 224, "bf16")]
)
# DPGRAD_BENCH_CASES=cpu: real models at sizes a CPU steps through in seconds, GPT-2 small at
# B=4 T=128 and WideResNet-16-4 at B=32 in fp32, the non-private step and dpgrad's single
# backward only (flat, per block, per layer): what a DP step costs over the non-private one
# wherever it runs, measured without a GPU.
CPU_CASES = [("hf-gpt2", 4, 128, "fp32"), ("wrn-16-4", 32, 32, "fp32")]
CPU_PROVIDERS = ["non-private", "dpgrad-single", "dpgrad-single-per-block", "dpgrad-single-per-layer"]
CPU_MODELS = os.environ.get("DPGRAD_BENCH_CASES", "") == "cpu"
if CPU_MODELS:
    CASES = CPU_CASES
# make test's untimed pass: each case but the tiny model's longer sequence (the code of T = 64).
UNTIMED = [dict(name=n, batch=b, seq_len=t, dtype=d) for n, b, t, d in CASES if (n, t) != ("tiny", 256)]
# The providers measured with activation checkpointing (Opacus's hooks and torch.func are not).
CHECKPOINTED = ("non-private", "dpgrad-double", "dpgrad-single", "dpgrad-single-per-block", "dpgrad-single-per-layer")
# dpgrad's single backward also with group-wise clipping: one threshold per transformer block
# (dpgrad.clipping.groups.per_block), or per parameter (Opacus's per-layer clipping), the total
# bound split evenly (1.0 in all).
PROVIDERS = ["non-private", "opacus-hooks", "torch-func", "opacus-ghost", "dpgrad-double", "dpgrad-single",
             "dpgrad-single-per-block", "dpgrad-single-per-layer"]
# On a GPU, the non-private step and dpgrad's single backward also each captured in one CUDA
# graph and replayed (torch.cuda.graph; dpgrad.graphed_step), and each under torch.compile:
# their ratios are to each other.
GRAPHED = ["non-private-graph", "dpgrad-single-graph", "non-private-compile", "dpgrad-single-compile"]
if CUDA:
    PROVIDERS += GRAPHED
if CPU_MODELS:
    PROVIDERS = CPU_PROVIDERS
ROUNDS = int(os.environ.get("DPGRAD_BENCH_ROUNDS") or (15 if CUDA else 10))
# The weights' dtype of each case's dtype, and the dtype autocast runs the forward pass in.
WEIGHTS = {"amp": "fp32"}
AUTOCAST = {"amp": torch.bfloat16}
# Each case runs this many times in one run, its providers in turn each time: its figures are
# the median of the repeats, with their spread (a GPU's clocks drift from one minute to the next).
REPEATS = int(os.environ.get("DPGRAD_BENCH_REPEATS") or (3 if CUDA else 1))
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class BenchModel:
    module: nn.Module
    vocab_size: int  # the classes of a vision model
    padding_idx: int
    hf: bool
    vision: bool = False

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if self.vision:
            return model(pixel_values=ids).logits if self.hf else model(ids)
        if not self.hf:
            return model(ids)
        # One row of positions per sequence (HF's default single row has no per-sample gradient).
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return model(input_ids=ids, position_ids=positions).logits


def _vision(name: str) -> BenchModel:
    from dpgrad.tools.vision import WideResNet, vit

    if name.startswith("wrn-"):
        depth, width = (int(v) for v in name[4:].split("-"))
        return BenchModel(WideResNet(depth, width, classes=10), 10, -100, hf=False, vision=True)
    shape = dict(image_size=32, patch_size=8, hidden=64, layers=2, heads=4, mlp=128) if name == "vit-tiny" else {}
    return BenchModel(vit(**shape, classes=10), 10, -100, hf=True, vision=True)


def _hf(name: str) -> BenchModel:
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if name.startswith("hf-gpt2"):
        tiny = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256) if "tiny" in name else {}
        if name.startswith("hf-gpt2-16k"):  # GPT-2 small with position embeddings for 16k tokens
            tiny = dict(n_positions=16384)
        cfg = transformers.GPT2Config(**tiny, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = transformers.GPT2LMHeadModel(cfg).train()
        if name.endswith("-ckpt"):
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:  # transformers 5: non-reentrant by default
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return BenchModel(model, cfg.vocab_size, 0, hf=True)
    if name.startswith("hf-qwen3-moe"):
        return _qwen3_moe(name, common)
    import peft

    if "tiny" in name:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)
    else:  # Llama 3.2 1B's shape
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
    cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=True, **common)
    model = transformers.LlamaForCausalLM(cfg)
    if name.endswith("lora16"):
        lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, lora)
    return BenchModel(model, cfg.vocab_size, 0, hf=True)


def _qwen3_moe(name: str, common: dict) -> BenchModel:
    """A Qwen3-MoE model, every layer a sparse block of top-2 routing over its experts."""
    import transformers

    if "tiny" in name:
        shape = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    else:  # small: 16 experts of width 512 at hidden size 1024, eight layers
        shape = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_experts=16,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                     vocab_size=32000)
    cfg = transformers.Qwen3MoeConfig(**shape, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                      mlp_only_layers=[], max_position_embeddings=2048, tie_word_embeddings=False,
                                      **common)
    return BenchModel(transformers.Qwen3MoeForCausalLM(cfg).train(), cfg.vocab_size, 0, hf=True)


_models: Dict[Tuple[str, str], BenchModel] = {}


def _weights(dtype: str) -> torch.dtype:
    return DTYPES[WEIGHTS.get(dtype, dtype)]


def _forward_context(dtype: str):
    """Where a step's forward pass and loss run: under autocast for ``amp``."""
    return torch.autocast(DEVICE.type, dtype=AUTOCAST[dtype]) if dtype in AUTOCAST else nullcontext()


def _model(name: str, dtype: str) -> BenchModel:
    """One set of random weights per model and dtype: every provider copies it."""
    if (name, dtype) not in _models:
        torch.manual_seed(0)
        if name.startswith(("wrn-", "vit-")):
            built = _vision(name)
            built.module.to(device=DEVICE, dtype=_weights(dtype))
        elif name.startswith("hf-"):
            built = _hf(name)
            built.module.to(device=DEVICE, dtype=_weights(dtype))
        else:
            preset = build_model(name, DEVICE, _weights(dtype))
            built = BenchModel(preset.module, preset.vocab_size, preset.padding_idx, hf=False)
        _models[(name, dtype)] = built
    return _models[(name, dtype)]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


# The time to warm up and capture (or compile) each such case's step (ms), by case.
_capture_ms: Dict[tuple, float] = {}


def make_step(provider: str, name: str, batch: int, seq_len: int, dtype: str) -> Callable[[], None]:
    """The step of ``provider``; raises what the provider raises on this model (Opacus refuses
    tied weights under ghost clipping)."""
    if provider in GRAPHED:
        start = time.perf_counter()
        step = _graphed_step(provider, name, batch, seq_len, dtype)
        _sync()
        _capture_ms[(provider, name, batch, seq_len, dtype)] = (time.perf_counter() - start) * 1e3
        return step
    built = _model(name, dtype)
    model = copy.deepcopy(built.module)
    vocab = built.vocab_size
    inputs, targets = _batch(built, batch, seq_len, dtype)
    criterion = nn.CrossEntropyLoss(ignore_index=built.padding_idx)
    trainable = [p for p in model.parameters() if p.requires_grad]

    if provider == "non-private":
        optimizer = torch.optim.SGD(trainable, lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with _forward_context(dtype):
                loss = criterion(built.logits(model, inputs).reshape(-1, vocab), targets.reshape(-1))
            loss.backward()
            optimizer.step()

        return step

    if provider in ("opacus-hooks", "torch-func"):
        return _per_sample_gradient_step(provider, built, model, inputs, targets, criterion, trainable, batch,
                                         dtype)
    if provider == "opacus-ghost":
        wrapped, loss_cls = OpacusFGC(model, max_grad_norm=1.0, loss_reduction="mean"), OpacusDPLoss
        optimizer_cls = DPOptimizerFastGradientClipping
    else:
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(
            model, loss_reduction="mean", single_backward=provider.startswith("dpgrad-single"),
            **_clipping(provider, model))
        loss_cls = dpgrad.DPLossFastGradientClipping
        optimizer_cls = dpgrad.opacus.DPOptimizerFastGradientClipping
    optimizer = optimizer_cls(
        torch.optim.SGD(trainable, lr=1e-3),
        noise_multiplier=1.0,
        max_grad_norm=wrapped.max_grad_norm,  # the total of the groups' thresholds: 1.0
        expected_batch_size=batch,
        loss_reduction="mean",
    )
    dp_criterion = loss_cls(wrapped, optimizer, criterion, loss_reduction="mean")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with _forward_context(dtype):
            logits = built.logits(wrapped, inputs)
            # A sequence's tokens are one sample (shape=); an image is one row already.
            shape = None if built.vision else logits.shape[:2]
            loss = dp_criterion(logits.reshape(-1, vocab), targets.reshape(-1), shape=shape)
        # Not held through the backward pass, as the non-private step holds no reference to
        # them: B*T*V (2 GB in bf16 for Llama at B=8 T=1024) would count as the DP step's memory.
        del logits
        loss.backward()
        optimizer.step()

    step.wrapped, step.optimizer = wrapped, optimizer
    return step


def _graphed_step(provider: str, name: str, batch: int, seq_len: int, dtype: str) -> Callable[[], None]:
    """The step of ``provider`` without "-graph" ("-compile"), captured in a CUDA graph after
    its warm-up steps, as its replay (under torch.compile, compiled by its first steps)."""
    eager = make_step(provider.rsplit("-", 1)[0], name, batch, seq_len, dtype)
    if provider.endswith("-compile"):
        compiled = torch.compile(eager)
        for _ in range(3):
            compiled()
        return compiled
    if provider == "dpgrad-single-graph":
        graphed = dpgrad.graphed_step(eager, module=eager.wrapped, optimizer=eager.optimizer, warmup=2)
        for _ in range(3):  # two eager steps, then the capture (and its first replay)
            graphed()
        return graphed
    stream = torch.cuda.Stream()  # torch's recipe: warm up on a side stream, then capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            eager()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    graph.replay()
    return graph.replay


def _batch(built: BenchModel, batch: int, seq_len: int, dtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a step: next-token ids of ``batch`` sequences, or ``batch`` random
    images of side ``seq_len`` and their labels."""
    generator = torch.Generator().manual_seed(1)
    if built.vision:
        images = torch.randn(batch, 3, seq_len, seq_len, generator=generator)
        labels = torch.randint(0, built.vocab_size, (batch,), generator=generator)
        return images.to(device=DEVICE, dtype=_weights(dtype)), labels.to(DEVICE)
    cfg = TinyTransformerConfig(vocab_size=built.vocab_size, padding_idx=built.padding_idx, max_seq_len=seq_len + 1,
                                d_model=1, n_heads=1)
    ids = synthetic_batch(cfg, batch, seq_len + 1, generator=generator).to(DEVICE)
    # Opacus's embedding norm sampler needs contiguous ids (it calls .view on them).
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _clipping(provider: str, model: nn.Module) -> dict:
    """The wrapper's clipping arguments of a dpgrad provider: flat C = 1, or C = 1 split evenly
    over the blocks or the parameters."""
    from dpgrad.clipping.groups import even_split, per_block

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if provider.endswith("-per-block"):
        blocks = len({per_block(n) for n in names})
        return dict(clipping="groups", clipping_groups=per_block, max_grad_norm=even_split(1.0, blocks))
    if provider.endswith("-per-layer"):
        return dict(clipping="per_layer", max_grad_norm=even_split(1.0, len(names)))
    return dict(max_grad_norm=1.0)


def _per_sample_gradient_step(provider, built, model, inputs, targets, criterion, trainable, batch, dtype):
    """Opacus's DP-SGD from per-sample gradients: by its hooks, or by one vmap over the model."""
    vocab = built.vocab_size
    if provider == "opacus-hooks":
        wrapped = OpacusGSM(model, loss_reduction="mean")

        def backward():
            with _forward_context(dtype):
                loss = criterion(built.logits(wrapped, inputs).reshape(-1, vocab), targets.reshape(-1))
            loss.backward()
    else:
        wrapped = model
        frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        buffers = dict(model.named_buffers())

        def sample_loss(params, ids, target):
            state = {**frozen, **buffers, **dict(zip(names, params))}
            logits = built.logits(lambda *a, **k: functional_call(model, state, a, k), ids[None])
            return criterion(logits.reshape(-1, vocab), target.reshape(-1))

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

        def backward():
            with _forward_context(dtype):  # the gradients are taken inside the vmap
                grads = per_sample(tuple(p.detach() for p in trainable), inputs, targets)
            for p, g in zip(trainable, grads):
                p.grad_sample = g

    optimizer = DPOptimizer(torch.optim.SGD(trainable, lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=batch, loss_reduction="mean")

    def step():
        optimizer.zero_grad(set_to_none=True)
        backward()
        optimizer.step()

    return step


# Why a provider did not run a case: its later repeats are not tried again.
_missed: Dict[tuple, str] = {}


# The order they run in: each case, its repeats, the providers.
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("name, batch, seq_len, dtype", CASES)
def test_dp_step(bench, provider, repeat, name, batch, seq_len, dtype):
    bench.describe("dp_step", "dp_step", dict(model=name, batch=batch, seq_len=seq_len, dtype=dtype), provider,
                   time_metric="step_time")
    case = (provider, name, batch, seq_len, dtype)
    if case in _missed:
        bench.skip(_missed[case])
    # What earlier providers left (a wrapped model in a reference cycle, its optimizer state)
    # must not count in this provider's peak memory.
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    if name.endswith("-ckpt") and provider not in CHECKPOINTED:
        bench.skip("not run: measured with activation checkpointing for the non-private step and dpgrad only")
    try:
        _try_step(bench, case)
    except pytest.skip.Exception:
        _missed[case] = bench.status
        raise


def _try_step(bench, case) -> None:
    provider, name, batch, seq_len, dtype = case
    try:
        _model(name, dtype)
        # The suite's models, kept for the providers to copy, are not this step's memory.
        before = torch.cuda.memory_allocated() if CUDA else 0
        step = make_step(provider, name, batch, seq_len, dtype)

        def synced_step():
            step()
            _sync()

        synced_step()  # warm-up (and, for dpgrad, the autotuner's first look at each shape)
    except NotImplementedError as err:
        bench.skip(f"refused: {err}".splitlines()[0][:200])
    except torch.cuda.OutOfMemoryError:
        bench.skip("out of memory")
    except (RuntimeError, TypeError) as err:  # torch.func cannot trace every model, nor Opacus's hooks call it
        bench.skip(f"error: {err}".splitlines()[0][:200])
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
        synced_step()
        bench.metrics["peak_memory"] = results.metric("peak_memory", torch.cuda.max_memory_allocated() - before)
        if case in _capture_ms:
            bench.metrics["capture_time"] = results.metric("capture_time", _capture_ms[case])
    else:
        bench.metrics["peak_memory"] = results.metric("peak_memory", results.peak_allocated(synced_step))
    if bench.benchmark_fixture.disabled:
        # Untimed runs (--benchmark-disable: make test's pass over the suites) stop here, having
        # run the step twice: its first step and a later one.
        bench.end_untimed()
        return
    results.warm_up(synced_step)  # until two steps in a row agree within 10%
    bench.benchmark_fixture.pedantic(synced_step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
