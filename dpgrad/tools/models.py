"""A small built-in decoder-only transformer, the default model of the demo and benchmarks.

Built only from layers dpgrad has samplers for (nn.Embedding, nn.Linear, nn.LayerNorm or
nn.RMSNorm) plus parameter-free attention, with random weights: nothing is downloaded. The
config also describes the GPT-2-shaped presets (dpgrad/tools/presets.py) of the autotune report.
``dp_sgd_step`` is the DP-SGD step the demo and the report take with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping


@dataclass(frozen=True)
class TinyTransformerConfig:
    """Shape of a :class:`TinyTransformer`.

    ``norm``: "layer" (nn.LayerNorm) or "rms" (nn.RMSNorm); ``bias``: biases on the Linear
    layers; ``mlp``: "gelu" (up, GELU, down; GPT-2) or "swiglu" (down(silu(gate(x)) * up(x));
    Llama); ``tie_embeddings``: the output layer uses the token embedding's weight (GPT-2).
    The defaults are the demo's model.
    """

    vocab_size: int = 512
    max_seq_len: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    padding_idx: int = 0
    norm: str = "layer"
    bias: bool = True
    mlp: str = "gelu"
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"TinyTransformerConfig(norm={self.norm!r}): use 'layer' or 'rms'")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"TinyTransformerConfig(mlp={self.mlp!r}): use 'gelu' or 'swiglu'")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TinyTransformerConfig: d_model {self.d_model} is not a multiple of n_heads "
                f"{self.n_heads}; choose n_heads dividing d_model"
            )

    def make_norm(self) -> nn.Module:
        return nn.LayerNorm(self.d_model) if self.norm == "layer" else nn.RMSNorm(self.d_model)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, cfg: TinyTransformerConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        # Created in this order whatever the options, so a seed gives the default config the
        # same weights as before the options existed.
        self.ln1 = cfg.make_norm()
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.ln2 = cfg.make_norm()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        heads = [t.reshape(B, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q, k, v)]
        attn = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        if self.gate is not None:
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x + self.down(F.gelu(self.up(h)))


class TinyTransformer(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, cfg: TinyTransformerConfig = TinyTransformerConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.padding_idx)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = cfg.make_norm()
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Contiguous, not expanded: Opacus's embedding norm sampler, which the benchmarks run
        # on this model, cannot take expanded ids.
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def per_sample_lm_loss(logits: torch.Tensor, ids: torch.Tensor, padding_idx: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence, ignoring padding targets: (B,)."""
    B, T, V = logits.shape
    targets = ids[:, 1:]
    token_loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), targets.reshape(-1), reduction="none", ignore_index=padding_idx
    ).view(B, T - 1)
    counts = (targets != padding_idx).sum(dim=1).clamp(min=1)
    return token_loss.sum(dim=1) / counts


def synthetic_batch(cfg: TinyTransformerConfig, batch_size: int, seq_len: int, generator=None) -> torch.Tensor:
    """Learnable token ids (B, T): each sequence counts up from a random start by a stride of
    1 to 4 (wrapping past padding_idx), then is right-padded to a random length."""
    start = torch.randint(0, cfg.vocab_size - 1, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 5, (batch_size, 1), generator=generator)
    ids = (start + stride * torch.arange(seq_len)) % (cfg.vocab_size - 1) + 1
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=generator)
    ids[torch.arange(seq_len).unsqueeze(0) >= lengths.unsqueeze(1)] = cfg.padding_idx
    return ids


def dp_sgd_step(
    model: GradSampleModuleFastGradientClipping,
    optimizer: torch.optim.Optimizer,
    loss_per_sample: torch.Tensor,
    noise_multiplier: float,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One DP-SGD step from a batch's per-sample losses (B,).

    ``model.clipped_backward`` (one backward pass or two, as the wrapper was built) leaves the
    clipped summed gradient ``sum_b c_b g_b`` in ``p.grad``; Gaussian noise of std
    ``noise_multiplier * C`` is added and the sum divided by B, as Opacus's
    DPOptimizerFastGradientClipping does. Returns the per-sample gradient norms.
    """
    optimizer.zero_grad(set_to_none=True)
    model.clipped_backward(loss_per_sample)
    norms = model.per_sample_gradient_norms
    std = noise_multiplier * model.max_grad_norm
    batch_size = max(1, loss_per_sample.shape[0])
    for p in model.parameters():
        if p.grad is not None:
            noise = torch.normal(0.0, std, p.grad.shape, generator=generator, device=p.device) if std > 0 else 0.0
            p.grad.add_(noise).div_(batch_size)
    optimizer.step()
    return norms
