"""Layers without a sampler of their own, whose per-sample gradients come from torch.func running
their forward again on one sample at a time, against float64 per-sample references: a layer
whose output holds several tensors that carry gradients (computed side by side, as a
hyper-connection's mixing weights are; one from another, as a router's top-k weights from its
scores or an attention's output from its weights), whichever of them the model uses; a layer
vmap cannot batch (rows picked by value, counts read to the host), re-run sample by sample; one
drawing random numbers, refused.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpgrad
from dpgrad.backward.shared_outputs import SharingError
from per_sample_reference import assert_norms_close, assert_tensor_close, per_sample_grads, total_norm

V = 11


class SideBySide(nn.Module):
    """Three outputs from one projection, none computed from another."""

    def __init__(self, d):
        super().__init__()
        self.fn = nn.Parameter(torch.randn(3 * d, d) * 0.3)
        self.base = nn.Parameter(torch.randn(3 * d) * 0.1)

    def forward(self, x):
        a, b, c = (F.linear(x, self.fn) + self.base).split(x.shape[-1], -1)
        return torch.sigmoid(a), torch.tanh(b), c


class Attention(nn.Module):
    """Its output computed from its weights and its own projection: (output, weights)."""

    def __init__(self, d):
        super().__init__()
        self.qk = nn.Parameter(torch.randn(d, d) * 0.3)
        self.v = nn.Parameter(torch.randn(d, d) * 0.3)

    def forward(self, x):
        weights = torch.softmax(x @ self.qk @ x.transpose(-1, -2), -1)
        return weights @ (x @ self.v), weights


class Model(nn.Module):
    def __init__(self, layer: str, use: str):
        super().__init__()
        d = 6
        self.tok, self.head = nn.Embedding(V, d), nn.Linear(d, 3)
        self.inner = SideBySide(d) if layer == "side_by_side" else Attention(d)
        self.use = use

    def forward(self, ids):
        x = self.tok(ids)
        outs = self.inner(x)
        if self.use == "first":
            h = outs[0]
        elif self.use == "all":
            h = sum(o if o.shape == x.shape else o @ x for o in outs)
        else:  # the second alone
            h = outs[1] if outs[1].shape == x.shape else outs[1] @ x
        return self.head(torch.tanh(h).mean(1))


WRAPPERS = {"gsm": (dpgrad.GradSampleModule, {}),
            "fgc": (dpgrad.GradSampleModuleFastGradientClipping, {"use_ghost_clipping": True})}


def check_step(wrapper: str, model: nn.Module, rows: int, seed: int):
    """One step of ``model`` (token ids in, 3 classes out) on ``rows`` samples under the wrapper:
    per-sample gradients, or norms, against float64 torch.func. Returns the wrapper."""
    cls, kwargs = WRAPPERS[wrapper]
    ids = torch.randint(0, V, (rows, 5), generator=torch.Generator().manual_seed(seed))
    y = torch.randint(0, 3, (rows,), generator=torch.Generator().manual_seed(seed + 1))
    ref = per_sample_grads(model, ids, y, lambda out, t: F.cross_entropy(out, t, reduction="none"))
    wrapped = cls(copy.deepcopy(model), loss_reduction="sum", **kwargs)
    F.cross_entropy(wrapped(ids), y, reduction="sum").backward()
    if wrapper == "gsm":
        for n, p in wrapped._module.named_parameters():
            assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")
    else:
        assert_norms_close(wrapped.get_norm_sample(), total_norm(ref))
    return wrapped


@pytest.mark.parametrize("rows", [4, 1, 0])
@pytest.mark.parametrize("use", ["first", "second", "all"])
@pytest.mark.parametrize("layer", ["side_by_side", "attention"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_with_several_outputs(wrapper, layer, use, rows):
    torch.manual_seed(3)
    check_step(wrapper, Model(layer, use), rows, seed=4)


class Head(nn.Module):
    """As BERT's prediction head: its decoder's bias registered on itself too, the decoder's
    weight tied to the embedding. Not a layer of its own: its decoder's uses are the bias's."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.transform = nn.Linear(emb.embedding_dim, emb.embedding_dim)
        self.decoder = nn.Linear(emb.embedding_dim, emb.num_embeddings)
        self.decoder.weight = emb.weight
        self.bias = self.decoder.bias

    def forward(self, h):
        return self.decoder(torch.tanh(self.transform(h)))


class MaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, 6)
        self.head = Head(self.tok)

    def forward(self, ids):
        return self.head(self.tok(ids))


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_a_parameter_registered_twice_on_a_head_tied_to_the_embedding(single):
    """Ghost clipping, both modes: the tied weight's norms with the cross terms of its two uses,
    the head's bias through its decoder."""
    torch.manual_seed(6)
    model = MaskedLM()
    ids = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(8))

    def losses(out, t):
        return F.cross_entropy(out.transpose(1, 2), t, reduction="none").sum(1)

    ref = per_sample_grads(model, ids, y, losses)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(copy.deepcopy(model), loss_reduction="sum",
                                                          single_backward=single)
    wrapped.clipped_backward(losses(wrapped(ids), y))
    assert_norms_close(wrapped.per_sample_gradient_norms, total_norm(ref))


class ReturnsItsBias(nn.Module):
    """Returns its own parameter, which the model adds outside it (GPT-NeoX-Japanese's
    attention and its dense_bias)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * self.scale, self.bias


class AddsTheBias(nn.Module):
    def __init__(self, use="add"):
        super().__init__()
        self.tok, self.inner, self.head = nn.Embedding(V, 6), ReturnsItsBias(6), nn.Linear(6, 3)
        self.use = use

    def forward(self, ids):
        h, bias = self.inner(self.tok(ids))
        if self.use == "add":
            h = h + bias
        elif self.use == "expand_as":  # GPT-NeoX-Japanese's bias_dropout_add(x, bias.expand_as(residual), ...)
            h = h * 0.5 + bias.expand_as(h)
        elif self.use == "cat":
            h = torch.cat([h, bias.expand(1, 1, 6)], dim=1)
        return self.head(h.mean(1))


@pytest.mark.parametrize("rows", [4, 1, 0])
@pytest.mark.parametrize("use", ["add", "expand_as"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_an_output_shared_by_all_samples(wrapper, use, rows):
    """A parameter the layer returns (GPT-NeoX-Japanese's attention and its dense_bias): each
    sample's gradient of it is taken where the model adds it to the batch."""
    torch.manual_seed(8)
    check_step(wrapper, AddsTheBias(use), rows, seed=9)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_an_output_shared_by_all_samples_meeting_the_batch_otherwise_is_refused(wrapper):
    """Concatenated to the batch's rows: it cannot be told apart by sample; refused, naming
    the layer."""
    cls, kwargs = WRAPPERS[wrapper]
    wrapped = cls(AddsTheBias("cat"), loss_reduction="sum", **kwargs)
    ids = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(9))
    with pytest.raises(SharingError, match=r"layer 'inner'.*meets the batch in cat"):
        wrapped(ids)


class ShortConv(nn.Module):
    """Computes with its child's weight itself, never calling the child (hybrid models' short
    convolutions: ``causal_conv1d_fn(x, self.conv.weight.squeeze(1), self.conv.bias)``)."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.conv = nn.Conv1d(d, d, 3, groups=d, padding=2)

    def forward(self, x):
        h = self.proj(x).transpose(1, 2)
        h = F.conv1d(h, self.conv.weight, self.conv.bias, padding=2, groups=h.shape[1])[..., :x.shape[1]]
        return h.transpose(1, 2)


class Scaler(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def scaled(self, x):
        return x * self.gain


class CallsAMethod(nn.Module):
    """Calls a method of its child other than its forward (Gemma 3n's AltUp)."""

    def __init__(self, d):
        super().__init__()
        self.scaler = Scaler(d)

    def forward(self, x):
        return torch.tanh(self.scaler.scaled(x))


class ReadsTheDtype(nn.Module):
    """Reads its child's weight for its dtype, calls the child: the child is its own layer."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype))


class Around(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.tok, self.inner, self.head = nn.Embedding(V, 6), inner, nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.inner(self.tok(ids))).mean(1))


class Axial(nn.Module):
    """Reformer's axial position embeddings: factors held in an nn.ParameterList (which cannot
    be called), broadcast over the batch and concatenated."""

    def __init__(self, d):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(1, 5, d // 2) * 0.3),
                                         nn.Parameter(torch.randn(1, 5, d - d // 2) * 0.3)])

    def forward(self, x):
        return x + torch.cat([w.expand(x.shape[0], -1, -1)[:, :x.shape[1]] for w in self.weights], -1)


@pytest.mark.parametrize("inner", [ShortConv, CallsAMethod, ReadsTheDtype, Axial])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_module_computing_with_its_childs_parameters(wrapper, inner):
    """Taken whole with its children where it uses a child's parameters otherwise than by
    calling it (a ParameterList's, which cannot be called); where it only reads a child's
    dtype, the child stays a layer of its own."""
    torch.manual_seed(10)
    wrapped = check_step(wrapper, Around(inner(6)), 4, seed=11)
    layers = wrapped._path.layer_names.values()
    assert ("inner" in layers) == (inner is not ReadsTheDtype), sorted(layers)


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def parametrized(kind: str) -> nn.Module:
    """A Linear whose weight (or bias) torch.nn.utils.parametrize computes from parameters of
    its own; weight_norm's magnitudes moved off the weight's norms, where its per-sample norm
    would equal the computed weight's."""
    from torch.nn.utils import parametrizations, parametrize

    layer = nn.Linear(6, 6)
    if kind == "weight_norm":
        parametrizations.weight_norm(layer)
        with torch.no_grad():
            layer.parametrizations.weight.original0.mul_(torch.linspace(0.5, 3.0, 6)[:, None])
    elif kind == "symmetric":
        parametrize.register_parametrization(layer, "weight", Symmetric())
    else:  # spectral_norm, in eval mode (in training mode its power iteration changes its buffers)
        parametrizations.spectral_norm(layer).eval()
    return layer


@pytest.mark.parametrize("kind", ["weight_norm", "symmetric", "spectral_norm"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_parametrized_layer_is_taken_whole(wrapper, kind):
    """Per-sample gradients of the parametrization's own parameters (not of the weight it
    computes), the layer and its parametrizations one layer."""
    torch.manual_seed(12)
    wrapped = check_step(wrapper, Around(parametrized(kind)), 4, seed=13)
    inner = wrapped._module.inner
    assert inner in wrapped._path.functorch_layers and wrapped._path.layer_names[inner] == "inner"


class Recurrent(nn.Module):
    """Opacus's DPLSTM (Linear layers per gate, which dpgrad clips per sample), batch first."""

    def __init__(self, d):
        super().__init__()
        from opacus.layers import DPLSTM

        self.rnn = DPLSTM(d, d, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_opacus_dp_lstm_in_place_of_torch_s_is_exact(wrapper):
    """What the refusal of nn.LSTM names instead (tests/test_errors.py)."""
    pytest.importorskip("opacus")
    torch.manual_seed(14)
    check_step(wrapper, Around(Recurrent(6)), 3, seed=15)


G = 6  # the gated layer's width


class Gammas(nn.Module):
    """Trainable parameters of its own (taken whole by torch.func), called on (B, T, d) with
    the tokens' gates flattened, (B*T, k), by keyword (Inkling's shared experts), and a
    positional (T,) table shared by all samples besides a (B, T) mask."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, G, G) * 0.3)

    def forward(self, x, table, mask, gammas=None):
        h = torch.einsum("btd,kde->kbte", x, self.weight)  # (k, B, T, d)
        g = gammas.reshape(-1, 2, 1).transpose(0, 1).reshape(2, *x.shape[:2], 1)
        return (h * g).sum(0) * table[:, None] * mask[..., None]


class GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.gate, self.mix, self.head = nn.Embedding(V, G), nn.Linear(G, 2), Gammas(), nn.Linear(G, 3)

    def forward(self, ids):
        x = self.tok(ids)
        gammas = self.gate(x.reshape(-1, G)).softmax(-1)  # (B*T, 2)
        table = torch.linspace(0.5, 1.5, ids.shape[1])
        mask = (ids % 3 != 0).to(x.dtype)
        return self.head(torch.tanh(self.mix(x, table, mask, gammas=gammas)).mean(1))


@pytest.mark.parametrize("rows", [4, 1, 0])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_given_the_tokens_flattened_and_a_shared_table(wrapper, rows):
    """The keyword of B*T rows is split as each sample's T tokens; the positional (T,) table is
    given whole to every sample, the (B, T) mask split by sample."""
    torch.manual_seed(6)
    check_step(wrapper, GatedModel(), rows, seed=7)


class ByValue(nn.Module):
    """Rows routed by their values to one of two experts (``nonzero``, as a hand-written
    mixture-of-experts layer does), or grouped by expert with counts read to the host (JetMoE's
    ``expert_size.tolist()`` and ``split``): vmap cannot batch either."""

    def __init__(self, d, counts: bool):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, d, d) * 0.3)
        self.counts = counts

    def forward(self, x):
        if self.counts:
            flat = x.reshape(-1, x.shape[-1])
            pick = (flat[:, 0] > 0).long()
            order = pick.argsort(stable=True)
            sizes = torch.bincount(pick, minlength=2).tolist()
            out = torch.cat([part @ self.experts[e] for e, part in enumerate(flat[order].split(sizes))])
            return out[order.argsort()].view_as(x)
        out = torch.zeros_like(x)
        for e in range(2):
            rows = (x[..., 0] > 0).eq(bool(e)).nonzero(as_tuple=True)
            out = out.index_put(rows, x[rows] @ self.experts[e])
        return out


class Noisy(nn.Module):
    """Noise drawn in its forward (after rows routed by value, which vmap cannot batch, where
    ``routed``): a second run would draw other numbers."""

    def __init__(self, d, p: float, routed: bool = False):
        super().__init__()
        self.w, self.p = nn.Parameter(torch.randn(d, d) * 0.3), p
        self.routed = ByValue(d, counts=False) if routed else None

    def forward(self, x):
        x = x if self.routed is None else self.routed(x)
        return F.dropout(x @ self.w, self.p, self.training)


@pytest.mark.parametrize("rows", [4, 1, 0])
@pytest.mark.parametrize("counts", [False, True], ids=["nonzero", "tolist"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_vmap_cannot_batch_is_run_sample_by_sample(wrapper, counts, rows):
    torch.manual_seed(9)
    check_step(wrapper, Around(ByValue(6, counts)), rows, seed=2)


@pytest.mark.parametrize("routed", [False, True], ids=["batched", "sample-by-sample"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_drawing_random_numbers_is_refused_and_without_draws_exact(wrapper, routed):
    """Dropout in training draws (refused, naming the layer, whether vmap or the loop runs it
    again); at p = 0 it draws nothing."""
    torch.manual_seed(10)
    check_step(wrapper, Around(Noisy(6, 0.0, routed)), 4, seed=3)
    cls, kwargs = WRAPPERS[wrapper]
    wrapped = cls(Around(Noisy(6, 0.5, routed)), loss_reduction="sum", **kwargs)
    ids = torch.randint(0, V, (3, 5))
    with pytest.raises(RuntimeError, match=r"(?s)layer 'inner' \(Noisy\).*draws random numbers.*requires_grad_"):
        F.cross_entropy(wrapped(ids), torch.zeros(3, dtype=torch.long), reduction="sum").backward()


class ScaledBlock(nn.Module):
    """A parameter of its own beside two Linears: torch.func takes the block whole, Linears and all."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x * self.scale)))


def test_a_layer_taken_whole_with_layers_inside_is_warned_of():
    """Once for the model, naming the layer, why, and how many layers it swallows; exact all
    the same. One with no such layer inside (axial positions' ParameterList) is not warned of."""
    torch.manual_seed(12)
    with pytest.warns(UserWarning, match=r"dpgrad: torch.func takes these layers whole.*'inner' \(ScaledBlock: "
                                         r"parameters of its own, \['scale'\]; 2 layers inside\).*small submodule"):
        check_step("fgc", Around(ScaledBlock(6)), 4, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dpgrad.GradSampleModuleFastGradientClipping(Around(Axial(6)))
    assert not [w for w in caught if "dpgrad:" in str(w.message)]


class Latents(nn.Module):
    """Perceiver's latents: given the batch size alone, they make the batch's rows."""

    def __init__(self, n, d):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n, d))

    def forward(self, batch_size: int):
        return self.latents.expand(batch_size, -1, -1)


class Perceiving(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.tok, self.latents, self.head = nn.Embedding(V, d), Latents(3, d), nn.Linear(d, 3)

    def forward(self, ids):
        x = self.tok(ids)
        q = self.latents(batch_size=ids.shape[0])
        attended = torch.softmax(q @ x.transpose(1, 2), -1) @ x  # each sample's latents attend to its tokens
        return self.head(torch.tanh(attended + q).mean(1))


@pytest.mark.parametrize("rows", [4, 1, 0])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_layer_given_no_tensor_that_makes_the_batch_s_rows(wrapper, rows):
    """Each sample's gradient of the latents is that of its own rows of their output."""
    torch.manual_seed(13)
    check_step(wrapper, Perceiving(), rows, seed=5)


class Table(nn.Module):
    """Given nothing, returns its (T, d) table, shared by all samples (not the batch's rows)."""

    def __init__(self, t, d):
        super().__init__()
        self.table = nn.Parameter(torch.randn(t, d))

    def forward(self):
        return self.table * 1.0


def test_a_table_the_size_of_the_batch_is_not_taken_for_its_rows():
    """B == T: the table's rows are positions, not samples; refused, naming the layer."""
    class Positions(nn.Module):
        def __init__(self, d=6):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(V, d), Table(4, d), nn.Linear(d, 3)

        def forward(self, ids):
            return self.head(torch.tanh(self.tok(ids) + self.pos()).mean(1))

    wrapped = dpgrad.GradSampleModuleFastGradientClipping(Positions())
    with pytest.raises(ValueError, match=r"layer 'pos' \(Table\) got no tensor among its positional inputs.*hold "
                                         r"that nn.Parameter in the module that combines it"):
        wrapped(torch.randint(0, V, (4, 4)))


class ReadsPositions(nn.Module):
    """Taken whole (a parameter of its own), given the batch (B, T, d) and, by keyword, a
    position table of 10 rows shared by all samples, of which it reads the first T."""

    def __init__(self, d=G):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, x, table=None):
        return x * self.scale * table[: x.shape[1]]


class PositionsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.mix, self.head = nn.Embedding(V, G), ReadsPositions(), nn.Linear(G, 3)
        self.register_buffer("table", torch.randn(10, G))

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.tok(ids), table=self.table)).mean(1))


def steps_of_positions(wrapper: str, sizes, refused=()):
    """Steps of ``PositionsModel`` at T = 5 under one wrapper, at the batch sizes ``sizes``
    (those in ``refused`` expected to be refused for an unreproduced recomputation); the last
    against float64 torch.func."""
    torch.manual_seed(8)
    model = PositionsModel()
    cls, kwargs = WRAPPERS[wrapper]
    wrapped = cls(copy.deepcopy(model), loss_reduction="sum", **kwargs)
    for rows in sizes:
        ids = torch.randint(1, V, (rows, 5), generator=torch.Generator().manual_seed(rows))
        y = torch.randint(0, 3, (rows,), generator=torch.Generator().manual_seed(rows + 1))
        wrapped.zero_grad(set_to_none=True)
        if rows in refused:
            refused = ()
            with pytest.raises(ValueError, match=r"(?s)layer 'mix' .*does not give what it gave in the forward "
                                                 r"pass.*run a first step at another batch size"):
                F.cross_entropy(wrapped(ids), y, reduction="sum").backward()
            continue
        F.cross_entropy(wrapped(ids), y, reduction="sum").backward()
    ref = per_sample_grads(model, ids, y, lambda out, t: F.cross_entropy(out, t, reduction="none"))
    if wrapper == "gsm":
        for n, p in wrapped._module.named_parameters():
            assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")
    else:
        assert_norms_close(wrapped.get_norm_sample(), total_norm(ref))


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_table_as_long_as_the_batch_s_tokens_after_another_batch_size_is_given_whole(wrapper):
    """At B = 2, T = 5 the table's 10 rows are as many as the batch's tokens: split, each sample
    would read its own 5 rows of it. A first step at 3 samples showed the table with the same
    shape it has now, so it holds no batch and each sample reads its first 5 rows."""
    steps_of_positions(wrapper, (3, 2))


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_table_as_long_as_the_batch_s_tokens_at_the_first_step_is_refused_then_exact(wrapper):
    """At a first step of B = 2, T = 5 the table's 10 rows look like the batch's tokens: split so,
    the layer run again on one sample at a time does not give what it gave in the forward pass,
    and the step is refused, naming the layer and the way out; a step at 3 samples tells the
    table apart, and the step at 2 is exact after it."""
    steps_of_positions(wrapper, (2, 3, 2), refused=(2,))
