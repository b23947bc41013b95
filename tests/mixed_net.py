"""The random models of the model-level tests, shared by the wrappers' tests.

``Net`` mixes nn.Embedding (with padding_idx), nn.Linear on 2-, 3- and 4-D inputs,
nn.LayerNorm, nn.RMSNorm, frozen parameters and layers dpgrad has no sampler for (the
torch.func fallback); ``model_cases`` draws such models with hypothesis.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

from dpgrad.backward import finish_plan
from per_sample_reference import norm_error_ratio, tensor_error_ratio


@contextmanager
def clipped_from_norms():
    """Every layer that has a norm sampler clipped from its norms ("ghost"), however small its
    per-sample gradients. dpgrad takes the per-sample gradients of layers as small as these
    test models' instead (``finish_plan.TINY_GRAD_SAMPLE_ELEMENTS``); without this, the
    model-level tests would not reach the norm and clipped-sum kernels, or the cross terms of
    tied parameters."""
    with mock.patch.multiple(finish_plan, GRAD_SAMPLE_MEMORY_FRACTION=0.0, TINY_GRAD_SAMPLE_ELEMENTS=-1):
        yield


class Affine(nn.Module):
    """A layer dpgrad has no sampler for: torch.func computes its per-sample gradients."""

    def __init__(self, h: int):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.5 * torch.randn(h))
        self.shift = nn.Parameter(0.3 * torch.randn(h))

    def forward(self, x):
        return x * self.scale + torch.tanh(x) * self.shift


class Gated(nn.Module):
    """Own parameter and a child Linear: torch.func takes the whole layer, child included."""

    def __init__(self, h: int):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(h))
        self.lin = nn.Linear(h, h)

    def forward(self, x):
        return self.lin(x) * torch.sigmoid(self.gate) + x


@dataclass(frozen=True)
class NetConfig:
    V: int = 11
    d: int = 8
    k: int = 2
    q: int = 6
    r: int = 4
    c: int = 4
    padding_idx: Optional[int] = 0
    norm1: Optional[str] = "layer"  # on the (B, T, d) embeddings
    norm2: Optional[str] = "rms"  # on the (B, T, k, r) 4-D activations
    affine: bool = True
    gated: bool = True
    bias: bool = True
    batch_first: bool = True


def _norm(kind: Optional[str], shape):
    if kind == "layer":
        # Not the default eps, so a sampler that ignores the layer's eps is caught.
        return nn.LayerNorm(shape, eps=1e-3)
    if kind == "layer_nobias":
        return nn.LayerNorm(shape, bias=False)
    if kind == "rms":
        # eps=None would mean finfo(dtype).eps, which differs in the float64 reference copy.
        return nn.RMSNorm(shape, eps=1e-6)
    return None


class Net(nn.Module):
    """Embedding -> [norm] -> Linear (3-D) -> [Affine] -> [Gated] -> Linear (4-D) -> [norm]
    -> mean over tokens -> Linear (2-D; (1, B, *) under batch_first=False) -> logits (B, c)."""

    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.k * cfg.q
        self.emb = nn.Embedding(cfg.V, cfg.d, padding_idx=cfg.padding_idx)
        self.norm1 = _norm(cfg.norm1, cfg.d)
        self.lin1 = nn.Linear(cfg.d, h, bias=cfg.bias)
        self.affine = Affine(h) if cfg.affine else None
        self.gated = Gated(h) if cfg.gated else None
        self.lin2 = nn.Linear(cfg.q, cfg.r, bias=cfg.bias)
        self.norm2 = _norm(cfg.norm2, (cfg.k, cfg.r) if cfg.norm2 == "layer" else cfg.r)
        self.head = nn.Linear(cfg.k * cfg.r, cfg.c)

    def forward(self, ids):
        cfg = self.cfg
        x = self.emb(ids)
        if self.norm1 is not None:
            x = self.norm1(x)
        x = torch.tanh(self.lin1(x))
        if self.affine is not None:
            x = self.affine(x)
        if self.gated is not None:
            x = self.gated(x)
        x = self.lin2(x.unflatten(-1, (cfg.k, cfg.q)))
        if self.norm2 is not None:
            x = self.norm2(x)
        x = x.flatten(-2).mean(dim=1 if cfg.batch_first else 0)
        if cfg.batch_first:
            return self.head(x)
        return self.head(x.unsqueeze(0)).squeeze(0)


def make_batch(cfg: NetConfig, B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.V, (B, T), generator=g)
    if cfg.padding_idx is not None and B * T:
        ids[torch.rand(B, T, generator=g) < 0.3] = cfg.padding_idx
        if B > 1:
            ids[-1] = cfg.padding_idx  # an all-padding sample
    y = torch.randint(0, cfg.c, (B,), generator=g)
    return (ids if cfg.batch_first else ids.t().contiguous()), y


def per_sample_loss(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def reduce(losses, loss_reduction):
    return losses.mean() if loss_reduction == "mean" else losses.sum()


def build(cfg: NetConfig, seed: int, freeze=()) -> Net:
    torch.manual_seed(seed)
    model = Net(cfg)
    params = dict(model.named_parameters())
    for name in freeze:
        if name in params:
            params[name].requires_grad_(False)
        else:
            for n, p in params.items():
                if n.startswith(name + "."):
                    p.requires_grad_(False)
    return model


FREEZES = {
    "none": (),
    "weight": ("lin1.weight",),
    "bias": ("head.bias", "lin2.bias"),
    "layer": ("lin2", "norm1"),
    "embedding": ("emb",),
    "functorch_parts": ("affine.shift", "gated.lin"),
}


PARAM_NAMES = [n for n, _ in Net(NetConfig(norm1="layer", norm2="layer")).named_parameters()]



@st.composite
def model_cases(draw, wrappers):
    """A random Net, its frozen parameters, a batch shape, a seed, and one of ``wrappers``."""
    # fp32 must match float64 to 1e-5 wherever the model is well-conditioned; these bounds
    # keep out models where it is not, whatever dpgrad does:
    # - every feature dimension >= 2: a per-sample gradient that is a single product
    #   (d = q = r = 1, T = 1) carries the whole rounding error of one fp32 dot product that
    #   happens to cancel;
    # - norms over >= 4 (RMSNorm) or >= 6 (LayerNorm) values: their backward projects out y
    #   (and the mean), and fp32 cancels when little is left.
    d = draw(st.integers(2, 8))
    k, q, r = draw(st.integers(1, 3)), draw(st.integers(2, 5)), draw(st.integers(2, 5))
    V = draw(st.integers(2, 16))
    norm1 = draw(st.sampled_from([None] + (["rms"] if d >= 4 else []) + (["layer", "layer_nobias"] if d >= 6 else [])))
    norm2 = draw(st.sampled_from([None] + (["rms"] if r >= 4 else []) + (["layer"] if k * r >= 6 else [])))
    cfg = NetConfig(
        V=V,
        d=d,
        k=k,
        q=q,
        r=r,
        c=draw(st.integers(2, 5)),
        padding_idx=draw(st.one_of(st.none(), st.integers(0, V - 1))),
        norm1=norm1,
        norm2=norm2,
        affine=draw(st.booleans()),
        gated=draw(st.booleans()),
        bias=draw(st.booleans()),
        batch_first=draw(st.booleans()),
    )
    freeze = draw(st.frozensets(st.sampled_from(PARAM_NAMES), max_size=4))
    return dict(
        cfg=cfg,
        freeze=freeze,
        B=draw(st.integers(0, 6)),
        T=draw(st.integers(1, 5)),
        wrapper=draw(st.sampled_from(wrappers)),
        loss_reduction=draw(st.sampled_from(["sum", "mean"])),
        seed=draw(st.integers(0, 2**16)),
    )


def fp32_budget_used_by_autograd(model: nn.Module, x, y, ref, batch_first: bool) -> float:
    """The largest share of the fp32 tolerance that plain PyTorch autograd itself uses, one
    sample at a time and without dpgrad, on this model and batch (<= 1 passes).

    A per-sample gradient that is small only because fp32 terms cancel (a per-parameter norm
    far below the others) carries rounding error from the forward and backward passes that
    dpgrad receives as input, so no per-sample algorithm can match float64 there. This tells
    such draws apart from bugs: measured, not assumed.
    """
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    used = 0.0
    for b in range(y.shape[0]):
        model.zero_grad()
        xb = x[b : b + 1] if batch_first else x[:, b : b + 1]
        per_sample_loss(model(xb), y[b : b + 1]).sum().backward()
        grads = {n: params[n].grad for n in ref}
        for n, g in grads.items():
            if g is None:
                continue
            used = max(used, tensor_error_ratio(g, ref[n][b], scale=ref[n].abs().max().item()))
            used = max(used, norm_error_ratio(g.norm().reshape(1), ref[n][b].norm().reshape(1)))
    return used
