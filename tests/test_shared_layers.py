"""Layers shared by all samples, against float64 per-sample references.

A layer called on an input without the batch (T5's relative attention bias on (T, T) position
buckets, a position table on (1, T) ids, a Linear on a learned token) gives each sample the
gradient of where its output meets that sample's row; subclasses of nn.Embedding with a forward
of their own (BART's scaled word embeddings, its learned positions) are clipped at their
F.embedding calls, subclasses of nn.Linear at their F.linear calls (Phi-MoE's router, drawing
its experts at random).  Every case: per-sample norms within fp32 rel 1e-5 of torch.func in float64,
and ``p.grad`` the clipped sum, in both modes; ``GradSampleModule``'s per-sample gradients too.
What cannot be split by sample is refused, naming the layer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpgrad
from dpgrad.backward.functional_calls import FunctionalCallError
from dpgrad.backward.shared_outputs import SharingError
from dpgrad.checks.independence import SampleMixingError
from per_sample_reference import RTOL, assert_norms_close, assert_tensor_close, per_sample_grads, total_norm

V, D, H = 11, 6, 2
MODES = {"single": True, "double": False}


class RelativeBias(nn.Module):
    """Token embeddings, a bias per (query, key) offset and head from an Embedding on (T, T)
    buckets (T5's), attention with it as the mask, a learned token through a Linear added to
    every position, a shared (D, D) matrix from a Linear on a learned row multiplied in, and a head."""

    def __init__(self, attention: str = "sdpa"):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.rel = nn.Embedding(7, H)
        self.qkv = nn.Linear(D, 3 * D)
        self.token = nn.Parameter(torch.randn(1, 1, D), requires_grad=False)
        self.global_token = nn.Linear(D, D)
        self.row = nn.Parameter(torch.randn(D), requires_grad=False)
        self.mixer = nn.Linear(D, D * D, bias=False)
        self.head = nn.Linear(D, 3)
        self.attention = attention

    def forward(self, ids):
        B, T = ids.shape
        x = self.tok(ids) + self.global_token(self.token)  # (1, 1, D) broadcast over (B, T, D)
        pos = torch.arange(T)
        buckets = (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3  # (T, T), no batch
        bias = self.rel(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, T, T)
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if self.attention == "expand":  # MPNet's: the bias copied to the batch before it meets it
            bias = bias.expand(B, -1, T, T).contiguous()
        elif self.attention == "broadcast_to":
            bias = torch.broadcast_to(bias, (B, H, T, T))
        if self.attention != "in_place":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = q @ k.transpose(-1, -2)
            scores += bias  # in place, on the batch's tensor
            a = scores.softmax(-1) @ v
        x = x + a.transpose(1, 2).reshape(B, T, D)
        x = x @ torch.tanh(self.mixer(self.row)).view(D, D)  # a shared (D, D) matrix meets the batch in matmul
        return self.head(x.mean(1))


def batch(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


def loss_of(out, y):
    return F.cross_entropy(out, y, reduction="none")


def check_ghost(model: nn.Module, ids, y, single: bool, warmup=None, ref=None, seed=None):
    """dpgrad's clipped step against the float64 reference (``ref``, else torch.func's): norms
    and p.grad (after a step on the ``warmup`` batch, whose gradients are dropped, where given;
    the generator seeded with ``seed`` right before the step's forward pass, where given)."""
    ref = per_sample_grads(model, ids, y, loss_of) if ref is None else ref
    ref_norms = total_norm(ref) if ids.shape[0] else torch.zeros(0, dtype=torch.float64)
    C = float(ref_norms.median()) if ids.shape[0] else 1.0
    model = copy.deepcopy(model)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=C, single_backward=single)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    if warmup is not None:
        criterion(wrapped(warmup[0]), warmup[1]).backward()
        wrapped.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    criterion(wrapped(ids), y).backward()
    norms = wrapped.per_sample_gradient_norms
    assert_norms_close(norms, ref_norms, "per-sample norms")
    coef = (C / (norms.double() + 1e-6)).clamp(max=1.0)
    params = dict(model.named_parameters())
    for n, g in ref.items():
        expected = torch.einsum("b,b...->...", coef, g)
        scale = (coef[:, None] * g.flatten(1).abs()).sum(0).max().item() if len(g) else 0.0
        got = params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])
        assert_tensor_close(got, expected, f"clipped {n}.grad", scale)


@pytest.mark.parametrize("attention", ["sdpa", "in_place", "expand", "broadcast_to"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B,T", [(4, 5), (1, 5), (0, 5), (3, 3)])
def test_shared_layers_are_exact(B, T, mode, attention):
    """The relative bias, the learned token's Linear and the shared matrix's Linear, each
    called without the batch, at batch sizes 0, 1, several, and equal to T (after a first
    forward pass at another size, which tells the bias's buckets from a batch). The bias meets
    the batch in attention, added in place, or expanded to the batch first."""
    torch.manual_seed(0)
    warmup = batch(2, T, seed=7) if B == T else None
    check_ghost(RelativeBias(attention), *batch(B, T), MODES[mode], warmup=warmup)


def check_per_sample_gradients(model: nn.Module, ids, y) -> dict:
    """GradSampleModule's per-sample gradients, (B, *parameter.shape), against float64 torch.func,
    for every trainable parameter; returns the reference."""
    ref = per_sample_grads(model, ids, y, loss_of)
    wrapped = dpgrad.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    loss_of(wrapped(ids), y).sum().backward()
    trained = {n: p for n, p in wrapped._module.named_parameters() if p.requires_grad}
    assert set(trained) == set(ref)
    for n, p in trained.items():
        assert p.grad_sample.shape == (ids.shape[0], *p.shape)
        assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")
    return ref


def test_shared_layers_per_sample_gradients():
    """GradSampleModule: each sample's gradient of the shared layers."""
    torch.manual_seed(1)
    assert "rel.weight" in check_per_sample_gradients(RelativeBias(), *batch(4, 6))


def test_a_batch_the_size_of_the_buckets_first_is_refused_with_the_reason():
    """When the very first forward pass has as many samples as the buckets' first size, the
    bias layer looks batched; the independence check finds its rows shared and says why."""
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(RelativeBias(), single_backward=True)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    ids, y = batch(4, 4)
    with pytest.raises(SampleMixingError, match=r"(?s)layer 'rel'.*first size equals the batch size by chance"):
        criterion(wrapped(ids), y).backward()


class PositionsFirst(nn.Module):
    """Positions embedded before any layer saw the batch, on (1, T) ids or on (T,) (a table
    without the batch, its first size not the batch's); the model's input shows the batch."""

    def __init__(self, row: bool = True):
        super().__init__()
        self.pos, self.tok, self.head = nn.Embedding(8, D), nn.Embedding(V, D), nn.Linear(D, 3)
        self.row = row

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        return self.head((self.pos(positions[None] if self.row else positions) + self.tok(ids)).mean(1))


@pytest.mark.parametrize("row", [True, False], ids=["(1,T)", "(T,)"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_broadcast_row_before_the_batch_is_seen_is_exact(mode, row):
    for B in (0, 1, 4):
        torch.manual_seed(2)
        check_ghost(PositionsFirst(row), *batch(B, 6), MODES[mode])
    if not row:  # as many samples as positions: the table, seen at another batch size, is remembered
        check_ghost(PositionsFirst(row), *batch(6, 6), MODES[mode], warmup=batch(4, 6, seed=7))


def test_a_table_before_the_batch_is_seen_has_per_sample_gradients():
    """GradSampleModule: B rows of per-sample gradients, not one per position."""
    for B in (0, 1, 3):
        torch.manual_seed(3)
        check_per_sample_gradients(PositionsFirst(row=False), *batch(B, 5))


def test_a_shared_output_returned_by_the_model_is_refused():
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.rel = nn.Embedding(V, D), nn.Embedding(V, D)

        def forward(self, ids):
            return self.tok(ids), self.rel(torch.arange(ids.shape[1]))

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(Returns())
    with pytest.raises(SharingError, match=r"comes from layer 'rel' alone"):
        wrapped(batch(3, 5)[0])


def test_a_shared_output_meeting_the_batch_without_broadcasting_is_refused():
    class Concatenates(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.rel = nn.Embedding(V, D), nn.Embedding(V, D)

        def forward(self, ids):
            return torch.cat([self.rel(torch.arange(1))[None], self.tok(ids)], dim=1)

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(Concatenates())
    with pytest.raises(SharingError, match=r"layer 'rel'.*meets the batch in cat"):
        wrapped(batch(3, 5)[0])


class Scaled(nn.Embedding):
    """An Embedding subclass that scales its output by a buffer (Gemma's scaled word embeddings):
    the buffer is no part of the lookup's per-sample gradients, so it is not refused."""

    def __init__(self, *args, scale=3.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


class Offset(nn.Embedding):
    """Learned positions with an offset, called on (T,) ids (BART's)."""

    def forward(self, ids, position_ids=None):
        positions = torch.arange(ids.shape[1]) if position_ids is None else position_ids
        return F.embedding(positions.unsqueeze(0) + 2, self.weight)


class Tied(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.tok = Scaled(V, D, padding_idx=padding_idx)
        self.pos = Offset(10, D)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids):
        return self.out(self.tok(ids) + self.pos(ids)).mean(1)


def loss_v(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("mode", list(MODES))
def test_embedding_subclasses_are_clipped_at_their_lookups(mode):
    """Scaled word embeddings tied to the output layer (ghost clipping combines the two uses)
    and offset positions: exact, by nn.Embedding's samplers, not torch.func."""
    torch.manual_seed(3)
    model = Tied(padding_idx=0)
    ids = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(5))
    ref = per_sample_grads(model, ids, y, loss_v)
    C = float(total_norm(ref).median())
    copy_ = copy.deepcopy(model)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy_, max_grad_norm=C, single_backward=MODES[mode])
    assert not wrapped._path.functorch_layers
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    criterion(wrapped(ids), y).backward()
    assert_norms_close(wrapped.per_sample_gradient_norms, total_norm(ref))
    coef = (C / (wrapped.per_sample_gradient_norms.double() + 1e-6)).clamp(max=1.0)
    for n, p in copy_.named_parameters():
        expected = torch.einsum("b,b...->...", coef, ref[n])
        assert_tensor_close(p.grad, expected, n, (coef[:, None] * ref[n].flatten(1).abs()).sum(0).max().item())


class Sliced(nn.Embedding):
    """Learned positions read by indexing the weight (Whisper's): a slice of rows, shared by all
    samples, or rows by position ids."""

    def forward(self, ids, position_ids=None):
        return self.weight[:ids.shape[1]] if position_ids is None else self.weight[position_ids]


class Indexed(nn.Module):
    def __init__(self, by_ids: bool, padding_idx=None):
        super().__init__()
        self.tok, self.pos, self.head = Sliced(V, D, padding_idx=padding_idx), Sliced(10, D), nn.Linear(D, 3)
        self.by_ids = by_ids

    def forward(self, ids):
        positions = (torch.arange(ids.shape[1]) + 1).expand(ids.shape) if self.by_ids else None
        return self.head(torch.tanh(self.tok(ids, ids) + self.pos(ids, positions)).mean(1))


@pytest.mark.parametrize("B", [4, 1])
@pytest.mark.parametrize("by_ids", [False, True], ids=["slice", "ids"])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_embedding_subclass_indexing_its_weight_is_clipped_at_its_lookups(mode, by_ids, B):
    """``self.weight[ids]`` and ``self.weight[a:b]`` are F.embedding's lookups of those rows: the
    tokens per sample, the positions (a slice) shared by all samples and broadcast over them."""
    torch.manual_seed(5)
    model = Indexed(by_ids)
    assert not dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model))._path.functorch_layers
    check_ghost(model, *batch(B, 5), MODES[mode])


def test_an_embedding_subclass_indexing_past_its_padding_row_is_refused():
    """Indexing gives the padding row a gradient, which nn.Embedding's samplers would not."""
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(Indexed(by_ids=True, padding_idx=0))
    with pytest.raises(FunctionalCallError, match=r"layer 'tok' \(Sliced.*indexes its weight, a lookup with "
                                                  r"padding_idx=None, where the layer has padding_idx=0"):
        wrapped(batch(2, 3)[0])


def test_an_embedding_subclass_without_a_lookup_is_refused():
    class Selects(nn.Embedding):
        def forward(self, ids):
            return torch.index_select(self.weight, 0, ids.flatten()).view(*ids.shape, -1)

    model = nn.Sequential(Selects(V, D), nn.Linear(D, 2))
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model)
    with pytest.raises(FunctionalCallError, match=r"layer '0' \(Selects.*without calling F.embedding"):
        wrapped(batch(2, 3)[0])


def test_an_embedding_subclass_looking_up_with_other_settings_is_refused():
    class OtherPadding(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight, padding_idx=1)

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(nn.Sequential(OtherPadding(V, D, padding_idx=0)))
    with pytest.raises(FunctionalCallError, match=r"calls F.embedding on its weight, a lookup with padding_idx=1, "
                                                  r"where the layer has padding_idx=0"):
        wrapped(batch(2, 3)[0])


def test_an_embedding_subclass_with_the_base_forward_is_hooked_as_an_embedding():
    class Renamed(nn.Embedding):
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.head = Renamed(V, D, padding_idx=0), nn.Linear(D, 3)

        def forward(self, ids):
            return self.head(self.tok(ids).mean(1))

    torch.manual_seed(4)
    model = Model()
    assert not dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model))._path.functorch_layers
    check_ghost(model, *batch(4, 5), single=True)


E = 3


class NoisyRouter(nn.Linear):
    """Phi-MoE's router: logits from ``super().forward``, then each token's expert drawn at
    random in training (Gumbel noise, drawn in fp32: the same draws in a float64 copy)."""

    def forward(self, x):
        logits = super().forward(x)
        noise = -torch.empty(logits.shape).exponential_().log().to(logits.dtype) if self.training else 0
        pick = (logits + noise).argmax(-1, keepdim=True)
        return logits.softmax(-1).gather(-1, pick), pick


class Routed(nn.Module):
    """Tokens, a router (``router``: a Linear subclass), E experts' outputs from one Linear of
    which each token keeps its pick's, weighted by its routing score, and a head."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.tok, self.router = nn.Embedding(V, D), router
        self.experts, self.head = nn.Linear(D, E * D), nn.Linear(D, 3)

    def forward(self, ids):
        x = self.tok(ids)
        score, pick = self.router(x)
        chosen = self.experts(x).unflatten(-1, (E, D)).gather(-2, pick[..., None].expand(*pick.shape, D)).squeeze(-2)
        return self.head((x + score * chosen).mean(1))


def batched_reference(model: nn.Module, ids, y, seed: int):
    """Per-sample float64 gradients by autograd, a backward pass per sample's loss through one
    forward pass of the whole batch, the generator seeded with ``seed`` first (dpgrad's draws)."""
    model64 = copy.deepcopy(model).double()
    torch.manual_seed(seed)
    losses = loss_of(model64(ids), y)
    params = {n: p for n, p in model64.named_parameters() if p.requires_grad}
    grads = [torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True) for loss in losses]
    return {n: torch.stack([g[i] if g[i] is not None else torch.zeros_like(p) for g in grads])
            if grads else torch.zeros(0, *p.shape, dtype=torch.float64) for i, (n, p) in enumerate(params.items())}


@pytest.mark.parametrize("B", [4, 1, 0])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_linear_subclass_drawing_at_random_is_clipped_at_its_f_linear_call(mode, B):
    """torch.func cannot run the router again per sample (its draws, under vmap); hooked at
    F.linear, its logits' per-sample gradients are exact, and so is the rest of the model."""
    torch.manual_seed(6)
    model = Routed(NoisyRouter(D, E))
    assert not dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model))._path.functorch_layers
    ids, y = batch(B, 5, seed=B)
    check_ghost(model, ids, y, MODES[mode], ref=batched_reference(model, ids, y, seed=11), seed=11)


def test_a_linear_subclass_per_sample_gradients():
    torch.manual_seed(7)
    model = Routed(NoisyRouter(D, E))
    ids, y = batch(4, 6)
    ref = batched_reference(model, ids, y, seed=3)
    wrapped = dpgrad.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    torch.manual_seed(3)
    loss_of(wrapped(ids), y).sum().backward()
    for n, p in wrapped._module.named_parameters():
        assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")


class Transposed(nn.Linear):
    """Falcon's: the product written out, F.linear never called (torch.func takes it whole)."""

    def forward(self, x):
        logits = x @ self.weight.T + self.bias
        return logits.softmax(-1).max(-1, keepdim=True).values, logits.argmax(-1, keepdim=True)


class LogitScaled(NoisyRouter):
    """Dory's LM head: a parameter of its own beside the weight (torch.func takes it whole)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.rand(E) + 0.5)

    def forward(self, x):
        logits = super(NoisyRouter, self).forward(x) * self.scale
        return logits.softmax(-1).max(-1, keepdim=True).values, logits.argmax(-1, keepdim=True)


class Renamed(nn.Linear):
    pass


class RenamedRouter(Renamed):
    def forward(self, x):
        logits = super().forward(x)
        return logits.softmax(-1).max(-1, keepdim=True).values, logits.argmax(-1, keepdim=True)


@pytest.mark.parametrize("router,whole", [(Transposed, True), (LogitScaled, True), (RenamedRouter, False)],
                         ids=["transposed", "own-parameter", "base-forward"])
@pytest.mark.parametrize("mode", list(MODES))
def test_linear_subclasses_are_exact_hooked_or_whole(mode, router, whole):
    """A subclass whose forward does not call F.linear, or that holds a parameter F.linear is
    not given, is taken whole by torch.func; a subclass of a subclass with the base's forward
    (``Renamed``) is a Linear, and so is one whose forward calls it."""
    torch.manual_seed(8)
    model = Routed(router(D, E))
    layers = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model))._path.functorch_layers
    assert [type(m) for m in layers] == ([router] if whole else [])
    check_ghost(model, *batch(4, 5), MODES[mode])
    assert not dpgrad.GradSampleModule(nn.Sequential(Renamed(D, 2)))._path.functorch_layers


def test_a_linear_subclass_dropping_its_bias_is_refused():
    class NoBias(nn.Linear):
        def forward(self, x):
            return F.linear(x, self.weight)

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(nn.Sequential(NoBias(D, 2)))
    with pytest.raises(FunctionalCallError, match=r"layer '0' \(NoBias, an nn.Linear subclass\) calls F.linear on its "
                                                  r"weight with no bias, where the layer has one"):
        wrapped(torch.randn(2, 3, D))


def test_a_linear_subclass_computing_without_f_linear_is_refused():
    class Sometimes(nn.Linear):
        def forward(self, x):
            return super().forward(x) if x.shape[0] > 2 else x @ self.weight.T + self.bias

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(nn.Sequential(Sometimes(D, 2)))
    wrapped(torch.randn(3, 2, D))
    with pytest.raises(FunctionalCallError, match=r"layer '0' \(Sometimes, a subclass of nn.Linear with a forward of "
                                                  r"its own\) computed its output without calling F.linear"):
        wrapped(torch.randn(2, 2, D))


class WithToken(nn.Embedding):
    """T5Gemma2's word embeddings: a learned row of its own written over the lookup wherever the
    ids hold one token (a parameter beside the weight, a boolean mask: torch.func takes the
    layer whole, sample by sample)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token = nn.Parameter(torch.randn(self.embedding_dim))

    def forward(self, ids):
        out = super().forward(ids) * 2.0
        out[ids == 1] = self.token
        return out


class TiedWithToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.out = WithToken(V, D), nn.Linear(D, V, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.tok(ids))).mean(1)


@pytest.mark.parametrize("B", [4, 1])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_embedding_taken_whole_tied_to_the_output_layer(mode, B):
    """The tied output layer, which ghost clipping would clip from its norms, is clipped from its
    per-sample gradients, summed with the embedding's (torch.func's) for their shared weight."""
    torch.manual_seed(12)
    model = TiedWithToken()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model))
    assert [type(m) for m in wrapped._path.functorch_layers] == [WithToken]
    assert [type(m) for m in wrapped._path.by_grad_sample] == [nn.Linear]
    ids = torch.randint(0, V, (B, 6), generator=torch.Generator().manual_seed(B))
    ids[:, 0] = 1
    y = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(9))
    ref = per_sample_grads(model, ids, y, loss_v)
    C = float(total_norm(ref).median())
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=C,
                                                          single_backward=MODES[mode])
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    criterion(wrapped(ids), y).backward()
    norms = wrapped.per_sample_gradient_norms
    assert_norms_close(norms, total_norm(ref))
    coef = (C / (norms.double() + 1e-6)).clamp(max=1.0)
    for n, p in wrapped._module.named_parameters():
        expected = torch.einsum("b,b...->...", coef, ref[n])
        assert_tensor_close(p.grad, expected, n, (coef[:, None] * ref[n].flatten(1).abs()).sum(0).max().item())


@pytest.mark.parametrize("sub", [Scaled, NoisyRouter], ids=["embedding", "linear"])
def test_a_subclass_sharded_by_fsdp_is_hooked_at_its_function_calls(sub):
    """fully_shard makes ``FSDP<Name>(FSDPModule, <Name>)`` of a module it shards: that class is
    hooked at the function's calls as its origin is (at its own forward, a scaled embedding's
    per-sample gradients would take the scale in)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from dpgrad.samplers import registry
    sharded = type(f"FSDP{sub.__name__}", (fsdp.FSDPModule, sub), {})
    model = nn.Module()
    model.layer = sub(V, D)
    model.layer.__class__ = sharded
    registry.resolve(model)
    function = F.embedding if issubclass(sub, nn.Embedding) else F.linear
    assert registry.functional_call(sharded) is function is registry.functional_call(sub)
