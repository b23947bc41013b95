"""Layers that hold the batch along another dimension than the batch-first model around them,
against float64 per-sample references: per-sample norms within fp32 rel 1e-5 of torch.func in
float64 and ``p.grad`` the clipped sum, in both modes; ``GradSampleModule``'s per-sample
gradients too.

- Layers with samplers on (T, B, ...) (XLNet's layers and the summary after them, Longformer's
  global attention on (G, B, d)), with the layers before them trained or frozen (LoRA's case:
  inputs without an autograd history).
- A layer torch.func takes whole on (S, B, T, d) (Gemma 3n's decoder layers on its streams),
  with a keyword tensor holding a row per sample.

A first batch whose size is also another size of such an input cannot tell where the batch
is: refused, saying to start at another size, and a step at another size settles it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dpgrad
from dpgrad.checks.independence import SampleMixingError
from per_sample_reference import per_sample_grads
from test_shared_layers import check_ghost, check_per_sample_gradients

V, D = 11, 6
MODES = {"single": True, "double": False}


class TimeFirst(nn.Module):
    """Token embeddings (B, T, D) turned time-first, (T, B, D); a segment Embedding on (T, B)
    ids, a LayerNorm and a Linear on (T, B, D); the first token's rows, (1, B, D), through a
    Linear of their own (a global token) and added back; a batch-first head on the mean."""

    def __init__(self, global_token: bool = True):
        super().__init__()
        self.tok, self.seg = nn.Embedding(V, D), nn.Embedding(3, D)
        self.norm, self.ff = nn.LayerNorm(D), nn.Linear(D, D)
        self.glob = nn.Linear(D, D) if global_token else None
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        h = self.tok(ids).transpose(0, 1) + self.seg((ids % 3).t())
        h = self.norm(h)
        h = h + torch.tanh(self.ff(h))
        if self.glob is not None:
            h = h + self.glob(h[:1])
        return self.head(h.transpose(0, 1).mean(1))


def batch(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


def loss_of(out, y):
    return F.cross_entropy(out, y, reduction="none")


def model(frozen: bool, global_token: bool = True) -> nn.Module:
    torch.manual_seed(0)
    m = TimeFirst(global_token)
    if frozen:  # as under LoRA: the layers' inputs have no autograd history
        for layer in (m.tok, m.seg):
            layer.requires_grad_(False)
    return m


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-below"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B,T", [(4, 5), (1, 5), (0, 5), (3, 6)])
def test_time_first_layers_are_exact(B, T, mode, frozen):
    check_ghost(model(frozen), *batch(B, T), MODES[mode])


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-below"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_batch_as_long_as_its_sequences_after_another_is_exact(mode, frozen):
    """T == B: each time-first layer's input could hold the batch on either dimension; a step at
    another batch size showed which."""
    check_ghost(model(frozen), *batch(4, 4), MODES[mode], warmup=batch(3, 4, seed=5))


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-below"])
@pytest.mark.parametrize("global_token", [True, False], ids=["global-token", "no-global-token"])
def test_a_first_batch_as_long_as_its_sequences_is_refused(frozen, global_token):
    """Without an earlier step the time-first inputs are taken batch first: the global token's
    one row is refused as a row broadcast over the batch, or, without it, the independence
    check finds the rows taken for samples to be positions; each says to start at another size."""
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model(frozen, global_token), single_backward=True)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    ids, y = batch(4, 4)
    if global_token:
        raised = pytest.raises(ValueError, match=r"layer 'glob'.*time-first layer's.*run a first step at another")
    else:
        raised = pytest.raises(SampleMixingError, match=r"(?s)layer 'ff'.*time-first inputs.*start with another")
    with raised:
        criterion(wrapped(ids), y).backward()
    assert all(p.grad is None for p in wrapped.parameters())


S = 3  # streams


class Streams(nn.Module):
    """Taken whole (a parameter of its own beside its Linear) on (S, B, T, D): the streams mixed
    by its coefficients, a Linear on them, a per-sample mask (B, T) by keyword. In training it
    clamps the Linear's weight in place first, as Gemma 3n clips its coefficients (the clip
    changes nothing after the first call, but a rerun must not bump the weight's version,
    which a graph kept for the second backward pass checks)."""

    def __init__(self):
        super().__init__()
        self.coef = nn.Parameter(torch.eye(S) + 0.3 * torch.randn(S, S))
        self.proj = nn.Linear(D, D)

    def forward(self, h, mask=None):
        if self.training:
            self.proj.weight.data.clamp_(-0.3, 0.3)
        mixed = torch.einsum("st,tbld->sbld", self.coef, h)
        return (mixed + torch.tanh(self.proj(mixed))) * mask[None, :, :, None]


class StreamsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.block, self.head = nn.Embedding(V, D), Streams(), nn.Linear(D, 3)

    def forward(self, ids):
        x = self.tok(ids)
        h = self.block(torch.stack([x, 2 * x, x.flip(-1)]), mask=(ids != 0).to(x.dtype))
        return self.head(h.mean(0).mean(1))


def streams_model() -> nn.Module:
    torch.manual_seed(3)
    return StreamsModel()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B,T", [(4, 5), (1, 5), (0, 5), (2, 4)])
def test_a_whole_layer_on_streams_is_exact(B, T, mode):
    check_ghost(streams_model(), *batch(B, T), MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_whole_layer_on_as_many_streams_as_samples_after_another_is_exact(mode):
    check_ghost(streams_model(), *batch(S, 5), MODES[mode], warmup=batch(4, 5, seed=5))


@pytest.mark.parametrize("B,T", [(S, 5), (2, 2)], ids=["as-many-as-streams", "as-many-as-tokens"])
def test_a_first_batch_of_a_size_the_input_has_elsewhere_is_refused(B, T):
    """B == S: the input could hold the batch first, and then the mask could hold streams; B ==
    T: it could hold it along dimension 1 or 2."""
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(streams_model(), single_backward=True)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    ids, y = batch(B, T)
    with pytest.raises(ValueError, match=r"(?s)layer 'block'.*(keyword argument 'mask'.*Run a first step at a "
                                         r"batch|another dimension.*run a first step at another batch size)"):
        criterion(wrapped(ids), y).backward()
    assert all(p.grad is None for p in wrapped.parameters())


class TimeFirstAttention(nn.Module):
    """``nn.MultiheadAttention`` as torch builds it by default (batch_first=False) in a batch-first
    model: query, key and value (T, B, D), its key padding mask (B, T) batch first."""

    def __init__(self, need_weights=False):
        super().__init__()
        self.tok, self.att, self.head = nn.Embedding(V, D), nn.MultiheadAttention(D, 2), nn.Linear(D, 3)
        self.need_weights = need_weights

    def forward(self, ids):
        x = self.tok(ids).transpose(0, 1)
        padding = ids == 0
        padding[:, 0] = False  # every sample attends to something
        a, _ = self.att(x, x, x, key_padding_mask=padding, need_weights=self.need_weights)
        return self.head(a.transpose(0, 1).mean(1))


def attention_model() -> nn.Module:
    torch.manual_seed(4)
    return TimeFirstAttention()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B,T", [(4, 5), (1, 5), (3, 6)])
def test_a_time_first_attention_taken_whole_is_exact(B, T, mode):
    """Taken whole (its in-projection is a parameter of its own): its query, key and value are
    split along dimension 1, its padding mask along 0."""
    check_ghost(attention_model(), *batch(B, T), MODES[mode])


def test_a_time_first_attention_returning_its_weights_is_refused_naming_need_weights():
    """Its weights (B, T, S) hold the batch first, its output along dimension 1."""
    torch.manual_seed(4)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(TimeFirstAttention(need_weights=True))
    with pytest.raises(ValueError, match=r"(?s)layer 'att' \(MultiheadAttention\).*along dimension 1.*output "
                                         r"tensor 1.*need_weights=False"):
        wrapped(batch(3, 5)[0])


class CheckpointedTimeFirst(TimeFirst):
    """``TimeFirst`` with its LayerNorm and Linear under non-reentrant activation checkpointing."""

    def forward(self, ids):
        h = self.tok(ids).transpose(0, 1) + self.seg((ids % 3).t())
        h = checkpoint(lambda h: self.norm(h) + torch.tanh(self.ff(self.norm(h))), h, use_reentrant=False)
        h = h + self.glob(h[:1])
        return self.head(h.transpose(0, 1).mean(1))


class CheckpointedStreams(StreamsModel):
    """``StreamsModel`` with its layer taken whole under non-reentrant activation checkpointing."""

    def forward(self, ids):
        x = self.tok(ids)
        h = checkpoint(lambda streams, mask: self.block(streams, mask=mask), torch.stack([x, 2 * x, x.flip(-1)]),
                       (ids != 0).to(x.dtype), use_reentrant=False)
        return self.head(h.mean(0).mean(1))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("checkpointed", [CheckpointedTimeFirst, CheckpointedStreams], ids=["time-first", "streams"])
def test_layers_holding_the_batch_elsewhere_under_checkpointing(checkpointed, mode):
    """The checkpoint's recomputation in the backward pass is no call to record; the reference is
    the same model without checkpointing (torch.func takes no saved-tensor hooks)."""
    torch.manual_seed(0)
    model = checkpointed()
    plain = checkpointed.__mro__[1]()
    plain.load_state_dict(model.state_dict())
    ids, y = batch(4, 5)
    check_ghost(model, ids, y, MODES[mode], ref=per_sample_grads(plain, ids, y, loss_of))


@pytest.mark.parametrize("build", [lambda: model(False), streams_model, attention_model],
                         ids=["time-first", "streams", "time-first-attention"])
def test_per_sample_gradients(build):
    """GradSampleModule: each sample's gradient of every layer, those holding the batch elsewhere
    batch first, (B, *parameter.shape)."""
    check_per_sample_gradients(build(), *batch(4, 5))
