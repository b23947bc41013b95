"""What one training step asks of the host: aten operations dispatched, and host waits.

On a GPU a step whose kernels are fast can still be slow because the host cannot issue them
fast enough: every aten operation costs the host microseconds (Python, the dispatcher, a
kernel launch), and an operation that makes the host wait for the device (reading a value
back, sizing an output by the data) drains the queue of work issued ahead, so the GPU idles
until the host catches up. Both are properties of the code, not of the device: the same step
dispatches the same operations on a CPU, so they are counted here deterministically, and
``tests/test_host_overhead.py`` holds dpgrad's wrappers to bounds on them without a GPU.

- ``DispatchCounts``: a ``TorchDispatchMode`` counting every operation that reaches the
  dispatcher's Python key (views included: each one costs the host as much as a small
  kernel), by name, and those among them that wait for the device (``waits_for_device``).
- The models and steps measured, shared by ``bench_host_overhead.py`` and the test:
  ``build_model`` (two-layer Hugging Face models, random weights, built from configs) and
  ``make_step`` (the non-private step, and dpgrad's double- and single-backward DP steps).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import dpgrad
from dpgrad.clipping.adaptive import DPLossFastGradientAdaptiveClipping
from dpgrad.clipping.groups import even_split, per_block
from bench_dp_step import LORA_TARGETS, BenchModel, _hf
from dpgrad.tools.models import TinyTransformerConfig, synthetic_batch
from dpgrad.tools.presets import DTYPES

aten = torch.ops.aten

MODELS = ("hf-gpt2-2l", "hf-llama-2l-lora16")
PROVIDERS = ("non-private", "dpgrad-double", "dpgrad-single")
# How dpgrad's steps clip: one bound; one per parameter; one per transformer block
# (``dpgrad.clipping.groups.per_block``); automatic; adaptive (on the expected batch size).
CLIPPINGS = ("flat", "per_layer", "per_block", "automatic", "adaptive")
# Quick mode's models are bench_dp_step's two-layer "-tiny" configs, as they are.
TINY = {"hf-gpt2-2l": "hf-gpt2-tiny", "hf-llama-2l-lora16": "hf-llama-tiny-lora16"}
# Steps run before anything is counted or timed: dpgrad's first step tunes its kernels for
# each layer shape, and a step's lazily built state (caches, tuned choices) must be in place.
WARMUP_STEPS = 2

# The host reads a value of the tensor back (item(), bool(), float(), torch.equal).
_READ_BACK = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal}
# The output's size depends on the data, so the host learns it from the device before it can
# allocate the output. nonzero_static is absent: its size is given.
_DATA_SIZED = {aten.nonzero, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.masked_select}
# Indexing by a boolean mask turns the mask into indices with a nonzero of its own.
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def waits_for_device(func, args, kwargs) -> bool:
    """Whether the operation ``func(*args, **kwargs)`` makes the host wait for the device
    (on a GPU; on a CPU the same calls are counted, so the count does not depend on one)."""
    packet = func.overloadpacket
    if packet in _READ_BACK or packet in _DATA_SIZED:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if packet in _INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    # A blocking copy from the device to host memory waits for the work that writes its source.
    if func is aten._to_copy.default:
        return args[0].device.type != "cpu" and _is_cpu(kwargs.get("device")) and not kwargs.get("non_blocking")
    if func is aten.copy_.default:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return args[0].device.type == "cpu" and args[1].device.type != "cpu" and not non_blocking
    return False


class DispatchCounts(TorchDispatchMode):
    """Counts, while active, the aten operations dispatched (``ops``, and ``names``: a Counter
    by overload name) and those that wait for the device (``syncs``, ``sync_names``).

    Operations that others run inside their own implementation are not seen (the mode is off
    while an operation runs), so a composite operation counts once, as the host pays for it.
    The autograd engine carries the mode into the backward pass.
    """

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.names: Counter = Counter()
        self.sync_names: Counter = Counter()
        # Tensors made from host data in this step (torch.tensor, a list used as an index).
        self._from_host: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # a profiler range's marker: no computation, no launch
            return func(*args, **kwargs)
        name = str(func)
        self.ops += 1
        self.names[name] += 1
        if waits_for_device(func, args, kwargs) or self._indexes_by_host_data(func, args):
            self.syncs += 1
            self.sync_names[name] += 1
        out = func(*args, **kwargs)
        if func is aten.lift_fresh.default:
            self._from_host[id(out)] = out
        return out

    def _indexes_by_host_data(self, func, args) -> bool:
        """Indexing by a tensor made from host data in the step (``x[[0, 2]]``): on a GPU the
        index is copied from pageable memory to the device, and that copy waits for the queue.
        (On a CPU the same call is made, so it is counted the same.)"""
        if func.overloadpacket not in _INDEXING:
            return False
        return any(isinstance(i, torch.Tensor) and self._from_host.get(id(i)) is i for i in args[1] or ())


def count(run: Callable[[], None]) -> DispatchCounts:
    """The counts of one call of ``run``."""
    with DispatchCounts() as counts:
        run()
    return counts


def cuda_syncs(run: Callable[[], None]) -> int:
    """Synchronisations of the device that CUDA's sync debug mode reports during one ``run``:
    the waits the dispatch count cannot see (inside an operation, or in the caching allocator)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def _two_layers_full_width(name: str) -> BenchModel:
    """bench_dp_step's real-size configs (GPT-2 small; Llama-3.2-1B's shape) with two layers."""
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if name == "hf-gpt2-2l":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return BenchModel(transformers.GPT2LMHeadModel(cfg), cfg.vocab_size, 0, hf=True)
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                                   **common)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return BenchModel(peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora), cfg.vocab_size, 0, hf=True)


def build_model(name: str, quick: bool, device: torch.device, dtype: str) -> BenchModel:
    """``name`` (one of ``MODELS``) with random weights, the same on every call: tiny widths
    in quick mode, the real ones otherwise; always two layers."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    torch.manual_seed(0)
    built = _hf(TINY[name]) if quick else _two_layers_full_width(name)
    built.module.to(device=device, dtype=DTYPES[dtype])
    return built


@dataclass
class Step:
    """One training step of a provider: ``run()``; ``wrapped``: dpgrad's wrapper (None for
    the non-private step)."""

    run: Callable[[], None]
    wrapped: Optional[nn.Module] = None

    @property
    def hooked_layers(self) -> int:
        """The layers the wrapper hooks (0 without one): the unit of its per-layer overhead."""
        return 0 if self.wrapped is None else len(self.wrapped._path.layer_names)


def make_step(provider: str, built: BenchModel, batch: int, seq_len: int, device: torch.device,
              check_independence: bool = True, clipping: str = "flat") -> Step:
    """``provider``'s step on a copy of ``built``'s weights and a fixed synthetic batch
    (dpgrad's with its independence check on or off: ``check_independence``, and clipped as
    ``clipping`` says: one of ``CLIPPINGS``).

    Every provider runs the same plain SGD: a DP optimizer's clipping check and noise add the
    same few operations per parameter whoever computed the clipped gradient, so they would
    only blur the wrappers' own overhead.
    """
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}: one of {', '.join(PROVIDERS)}")
    model = copy.deepcopy(built.module)
    vocab, pad = built.vocab_size, built.padding_idx
    cfg = TinyTransformerConfig(vocab_size=vocab, padding_idx=pad, max_seq_len=seq_len + 1, d_model=1, n_heads=1)
    ids = synthetic_batch(cfg, batch, seq_len + 1, generator=torch.Generator().manual_seed(1)).to(device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    criterion = nn.CrossEntropyLoss(ignore_index=pad)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    if provider == "non-private":
        def step():
            optimizer.zero_grad(set_to_none=True)
            criterion(built.logits(model, inputs).reshape(-1, vocab), targets.reshape(-1)).backward()
            optimizer.step()

        return Step(step)

    if clipping not in CLIPPINGS:
        raise ValueError(f"unknown clipping {clipping!r}: one of {', '.join(CLIPPINGS)}")
    options = dict(max_grad_norm=1.0)
    if clipping == "per_layer":
        trained = [p for p in model.parameters() if p.requires_grad]
        options = dict(clipping="per_layer", max_grad_norm=even_split(1.0, len(trained)))
    elif clipping == "per_block":
        blocks = len({per_block(name) for name, p in model.named_parameters() if p.requires_grad})
        options = dict(clipping="groups", clipping_groups=per_block, max_grad_norm=even_split(1.0, blocks))
    elif clipping == "automatic":
        options = dict(clipping="automatic", max_grad_norm=1.0)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        model, loss_reduction="mean", single_backward=provider == "dpgrad-single",
        check_independence=check_independence, **options,
    )
    if clipping == "adaptive":
        dp_criterion = DPLossFastGradientAdaptiveClipping(wrapped, optimizer, criterion, loss_reduction="mean",
                                                          initial_noise_multiplier=0.5, expected_batch_size=batch)
    else:
        dp_criterion = dpgrad.DPLossFastGradientClipping(wrapped, optimizer, criterion, loss_reduction="mean")

    def dp_step():
        optimizer.zero_grad(set_to_none=True)
        logits = built.logits(wrapped, inputs)
        dp_criterion(logits.reshape(-1, vocab), targets.reshape(-1), shape=logits.shape[:2]).backward()
        optimizer.step()

    return Step(dp_step, wrapped)
