"""DP fine-tuning of a Hugging Face causal language model with Opacus's PrivacyEngine and dpgrad.

Run (from the repository root, after `make test` or `make report` has made .venv):

    .venv/bin/python examples/finetune_lm.py --model gpt2          # full fine-tuning, tied embeddings
    .venv/bin/python examples/finetune_lm.py --model llama-lora    # LoRA adapters only, rank 16

`--size tiny` (the default without CUDA) builds a two-layer config that trains on a CPU in
seconds; `--size real` builds GPT-2 small (124M) or a Llama-3.2-1B-like model (1.2B, LoRA
rank 16 on every projection) in bf16 for a GPU. Weights are random (from a config: nothing is
downloaded) and the data are synthetic sequences that count up from a random start, padded
at the end, so the loss has something to learn. Each sequence is one privacy unit: the loss
is the mean over its tokens (`shape=`), padding ignored through the attention mask and
labels of -100. dpgrad's wrapper runs one backward pass per step (`single_backward=True`);
Opacus samples the batches (Poisson), adds the noise and counts epsilon.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch
import torch.nn as nn
import transformers
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

import dpgrad.opacus
from dpgrad.tools.cli_common import number_in
from dpgrad.tools.models import TinyTransformerConfig, synthetic_batch

PAD = 0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(model: str, size: str) -> nn.Module:
    """A randomly initialised model; LoRA adapters only are trainable for llama-lora."""
    transformers.logging.set_verbosity_error()
    if model == "gpt2":
        tiny = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
        cfg = transformers.GPT2Config(**(tiny if size == "tiny" else {}), resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=PAD)
        return transformers.GPT2LMHeadModel(cfg)  # the LM head is tied to the token embedding
    import peft

    if size == "tiny":
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    else:  # Llama 3.2 1B's shape
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0)
    cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1,
                                   pad_token_id=PAD)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)


def dataset(vocab_size: int, n: int, seq_len: int) -> TensorDataset:
    cfg = TinyTransformerConfig(vocab_size=vocab_size, padding_idx=PAD, d_model=1, n_heads=1)
    return TensorDataset(synthetic_batch(cfg, n, seq_len, generator=torch.Generator().manual_seed(0)))


def main(model: str = "gpt2", size: str = "tiny", steps: int = 30, batch_size: int = 32, seq_len: int = 16,
         noise_multiplier: float = 0.5, max_grad_norm: float = 1.0, lr: Optional[float] = None,
         quiet: bool = False) -> dict:
    """Train for ``steps`` steps; returns the first and last losses and the epsilon spent."""
    lr = lr or (1e-2 if model == "llama-lora" else 3e-3)  # adapters start at zero: a larger step
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if size == "real" and device.type == "cuda" else torch.float32
    net = build(model, size).to(device=device, dtype=dtype)
    vocab = net.config.vocab_size
    data = dataset(vocab, 64 * batch_size, seq_len)
    engine = PrivacyEngine()
    net, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine,
        module=net,
        optimizer=torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr),
        data_loader=DataLoader(data, batch_size=batch_size),
        criterion=nn.CrossEntropyLoss(ignore_index=-100),
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        single_backward=True,
    )
    if not quiet:
        trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
        print(f"{model} ({size}): {trainable / 1e6:.2f}M trainable parameters, {device}, {dtype}")
    losses, step, start = [], 0, time.perf_counter()
    while step < steps:
        for (ids,) in loader:
            if len(ids) == 0:  # Poisson sampling can draw an empty batch
                continue
            ids = ids.to(device)
            mask = (ids != PAD).long()
            labels = ids.masked_fill(mask == 0, -100)[:, 1:]
            # One row of positions per sequence: HF's default single row would be shared by
            # the whole batch, and its gradient could not be split per sample.
            positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
            optimizer.zero_grad()
            logits = net(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]
            loss = criterion(logits.reshape(-1, vocab), labels.reshape(-1), shape=logits.shape[:2])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if not quiet and (step % 10 == 0 or step == steps):
                print(f"step {step:4d}  loss {losses[-1]:.4f}  epsilon {engine.get_epsilon(1e-5):.2f}  "
                      f"{(time.perf_counter() - start) / step:.3f} s/step")
            if step == steps:
                break
    k = max(1, min(5, steps // 3))
    return {"first_loss": sum(losses[:k]) / k, "last_loss": sum(losses[-k:]) / k,
            "epsilon": engine.get_epsilon(1e-5)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama-lora"], default="gpt2",
                        help="full fine-tuning of GPT-2 (tied embeddings), or rank-16 LoRA on a Llama (default gpt2)")
    parser.add_argument("--size", choices=["tiny", "real"], default="real" if torch.cuda.is_available() else "tiny",
                        help="a two-layer config for a CPU, or the real widths in bf16 for a GPU "
                             "(default real on CUDA, tiny otherwise)")
    parser.add_argument("--steps", type=number_in(int, 1), default=30, help="training steps (default 30)")
    parser.add_argument("--batch-size", type=number_in(int, 1), default=32,
                        help="expected samples per step under Poisson sampling (default 32)")
    parser.add_argument("--seq-len", type=number_in(int, 2), default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--noise-multiplier", type=number_in(float, 0), default=0.5,
                        help="noise standard deviation over the clipping bound (default 0.5)")
    args = parser.parse_args()
    main(args.model, args.size, args.steps, args.batch_size, args.seq_len, args.noise_multiplier)
