"""Layers called on rows picked from the batch's tokens (dpgrad/backward/picked_rows.py): a
mixture-of-experts block with a module per expert, each expert's MLP run on the tokens routed to
it (``x[top_x]``, ``x.index_select(0, top_x)``, ``x[mask]``) and added back with ``index_add_``,
as hand-written MoE code and Switch Transformers do. Against float64 per-sample gradients of
plain autograd, one sample at a time: norms and clipped ``p.grad`` in both modes, and
GradSampleModule's per-sample gradients element by element.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpgrad
from dpgrad.checks.independence import SampleMixingError
from per_sample_reference import assert_tensor_close, per_sample_grads
from test_shared_layers import MODES, V, batch, check_ghost

D, E = 6, 3


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class PerExpert(nn.Module):
    """Token embeddings, a router (top-2 of E experts, on the tokens flattened), a module per
    expert on the rows routed to it, a head. ``pick``: how the rows are taken."""

    def __init__(self, pick: str = "index", top_k: int = 2, norm: bool = False):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.router = nn.Linear(D, E)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.norm = nn.LayerNorm(D) if norm else None
        self.head = nn.Linear(D, 3)
        self.pick, self.top_k = pick, top_k

    def forward(self, ids):
        x = self.tok(ids)
        Bn, Tn, _ = x.shape
        flat = x.view(-1, D)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if self.pick == "index":
                rows = flat[token]
            elif self.pick == "index_select":
                rows = flat.index_select(0, token)
            elif self.pick == "mask":  # a boolean mask in token order (top-k experts are distinct)
                rows = flat[(chosen == e).any(-1)]
            else:  # Switch Transformers': hidden[None, top_x].reshape(-1, d)
                rows = flat[None, token].reshape(-1, D)
            if self.norm is not None:
                rows = self.norm(rows)
            out.index_add_(0, token, expert(rows) * weights[token, slot, None])
        return self.head(torch.tanh(out.view(Bn, Tn, D) + x).mean(1))


@pytest.mark.parametrize("B", [4, 1, 0])
@pytest.mark.parametrize("pick", ["index", "index_select", "mask", "switch"])
@pytest.mark.parametrize("mode", list(MODES))
def test_experts_on_picked_rows_are_exact(mode, pick, B):
    torch.manual_seed(1)
    check_ghost(PerExpert(pick), *batch(B, 5, seed=2), MODES[mode])


def test_a_norm_inside_the_expert_and_the_per_sample_gradients():
    """A LayerNorm on the picked rows before the expert; GradSampleModule's (B, ...) gradients."""
    torch.manual_seed(3)
    model = PerExpert("index", norm=True)
    ids, y = batch(4, 6, seed=4)
    ref = per_sample_grads(model, ids, y, lambda out, t: F.cross_entropy(out, t, reduction="none"))
    wrapped = dpgrad.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    F.cross_entropy(wrapped(ids), y, reduction="sum").backward()
    checked = 0
    for n, p in wrapped._module.named_parameters():
        assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")
        checked += n.startswith("experts.")
    assert checked == E * 4


class Exactly(PerExpert):
    """Expert 0 gets exactly B tokens (the first of each sample), expert 1 the rest: a pick of
    as many rows as the batch has samples, in no sample's order."""

    def __init__(self):
        super().__init__(top_k=1)

    def forward(self, ids):
        x = self.tok(ids)
        Bn, Tn, _ = x.shape
        flat = x.view(-1, D)
        first = torch.arange(Bn) * Tn
        first = first.flip(0)  # the samples' rows reversed
        rest = torch.tensor([t for t in range(Bn * Tn) if t % Tn])
        gate = self.router(flat).sigmoid()
        out = torch.zeros_like(flat)
        for e, token in ((0, first), (1, rest)):
            out.index_add_(0, token, self.experts[e](flat[token]) * gate[token, e, None])
        return self.head(torch.tanh(out.view(Bn, Tn, D)).mean(1))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_pick_of_as_many_rows_as_samples_is_not_taken_for_the_batch(mode):
    torch.manual_seed(5)
    check_ghost(Exactly(), *batch(4, 5, seed=6), MODES[mode])


def test_a_layer_without_samplers_on_picked_rows_is_refused():
    class Gated(nn.Module):  # trainable parameters of its own: torch.func's, which takes no picked rows
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(D))

        def forward(self, x):
            return x * self.scale

    model = PerExpert("index")
    model.experts[0].fc1 = nn.Sequential(Gated(), nn.Linear(D, 8))
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model)
    with pytest.raises(ValueError, match=r"layer 'experts.0.fc1.0' \(Gated\) is called on rows picked from the "
                                         r"batch's tokens.*Freeze it, or register samplers"):
        wrapped(batch(4, 5)[0])


class Twice(PerExpert):
    """Each token through expert 0 twice in one call, one pick per slot of its top 2 (a token
    routed to one expert twice), the two outputs weighted apart."""

    def forward(self, ids):
        flat = self.tok(ids).view(-1, D)
        token = torch.arange(flat.shape[0]).repeat(2)
        weight = torch.tensor([0.5, 1.5]).repeat_interleave(flat.shape[0])[:, None]
        out = torch.zeros_like(flat).index_add(0, token, self.experts[0](flat[token]) * weight)
        return self.head(torch.tanh(out.view(*ids.shape, D)).mean(1))


@pytest.mark.parametrize("B", [4, 1])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_token_picked_twice_by_one_call(mode, B):
    """Each pick gets a slot of its own: a sample's rows are all its picks."""
    torch.manual_seed(7)
    check_ghost(Twice(), *batch(B, 5, seed=8), MODES[mode])


def test_rows_picked_from_a_time_major_flatten_are_refused():
    """Token i is taken as sample i // T's: a time-major source breaks that, and the
    independence check says so."""

    class TimeMajor(PerExpert):
        def forward(self, ids):
            x = self.tok(ids)
            flat = x.transpose(0, 1).reshape(-1, D)  # (T*B, D): token i is sample i % B's
            token = torch.arange(0, flat.shape[0], 2)
            out = torch.zeros_like(flat).index_add(0, token, self.experts[0](flat[token]))
            return self.head(out.view(ids.shape[1], ids.shape[0], D).transpose(0, 1).mean(1))

    model = TimeMajor()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    ids, y = batch(4, 5)
    with pytest.raises(SampleMixingError, match="experts.0"):
        criterion(wrapped(ids), y).backward()


def switch_transformers():
    """Switch Transformers: an MLP module per expert on the tokens routed to it (capacity
    counted per sequence), in the encoder and the decoder; no jitter on the router's input
    (random in training, it would differ between the step and the reference)."""
    transformers = pytest.importorskip("transformers")
    from test_hf_models import seq2seq

    torch.manual_seed(12)
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=40, d_model=16, d_kv=4, d_ff=16, expert_capacity=8, num_layers=2, num_sparse_encoder_layers=1,
        num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=2, num_experts=4, dropout_rate=0.0,
        router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return seq2seq(transformers.SwitchTransformersForConditionalGeneration(cfg))


@pytest.mark.parametrize("mode", list(MODES))
def test_switch_transformers_is_exact(mode):
    from test_hf_models import check

    model = check(switch_transformers(), MODES[mode])
    experts = [n for n, p in model.named_parameters() if ".experts.expert_" in n and p.grad is not None]
    assert len(experts) >= 2 * 4  # the experts that got tokens, in both blocks
