"""Mixture-of-experts models fully fine-tuned, against float64 references.

Hugging Face's MoE blocks flatten the batch's tokens (B*T rows) for the router and the experts,
whose weights are 3-D parameters ((E, 2I, d) up projections, (E, d, I) down projections). The
hooks unfold such calls to (B, T, ...); the router's per-sample gradients come from torch.func,
the experts' from dpgrad's experts samplers over (expert, sample) segments. Checked: the
segment kernels against a brute-force float64 sum, Qwen3-MoE, Mixtral and Qwen2-MoE (shared
experts and their gate) in both modes, per-sample gradients, per-block clipping, a batch of
one, a Linear on flattened tokens (batches of several, one and none), a fold in the wrong
order refused by the independence check, a layer taken whole whose output flattens the batch
(DeepSeek's router), and PEFT's LoRA on the routers and experts ("all-linear").
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import dpgrad  # noqa: E402
from dpgrad.checks.independence import SampleMixingError  # noqa: E402
from dpgrad.clipping.groups import per_block  # noqa: E402
from dpgrad.kernels import reference  # noqa: E402
from mixed_net import clipped_from_norms  # noqa: E402
from per_sample_reference import assert_norms_close, assert_tensor_close, per_sample_grads, total_norm  # noqa: E402
from test_hf_models import MODES, B, T, V, causal_lm, check, reference as microbatch_reference  # noqa: E402


def _moe(cls, seed, device="cpu", config_class=None, **extra):
    torch.manual_seed(seed)
    common = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=V,
                  max_position_embeddings=T, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    config = getattr(transformers, config_class or f"{cls}Config")(**{**common, **extra})
    # The float64 reference needs the experts' eager loop (grouped_mm takes no float64).
    config._experts_implementation = "eager"
    return causal_lm(getattr(transformers, f"{cls}ForCausalLM")(config), position_ids=False, device=device)


def qwen3_moe(device="cpu"):
    return _moe("Qwen3Moe", 5, device, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                num_experts_per_tok=2, head_dim=8, norm_topk_prob=True, tie_word_embeddings=False)


def mixtral():
    return _moe("Mixtral", 6, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, head_dim=8)


def qwen2_moe():
    """Shared experts (an MLP on the flattened tokens) and their sigmoid gate besides the routed ones."""
    return _moe("Qwen2Moe", 7, intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                num_experts=4, num_experts_per_tok=2)


def llama4():
    """Llama 4: every token through every expert (E copies of the batch's tokens one after the
    other, each scaled by its expert's sigmoid routing score, zero off the top k), ``bmm`` on
    (E, B*T, d); a router subclassing nn.Linear; a shared expert."""
    case = _moe("Llama4", 8, config_class="Llama4TextConfig", intermediate_size=8, intermediate_size_mlp=16,
                num_local_experts=4, num_experts_per_tok=2, head_dim=8, attention_chunk_size=T)
    with torch.no_grad():  # transformers leaves gate_up_proj at zero: nothing would reach the router
        for m in case.model.modules():
            if type(m).__name__ == "Llama4TextExperts":
                nn.init.normal_(m.gate_up_proj, std=0.3)
    return case


def longcat_flash():
    """LongCat-Flash: zero-computation experts (the identity, numbered after the routed ones,
    whose rows of ``gate_up_proj`` go unused) beside four routed experts, a router with a score
    bias; its layer (``num_layers``) two attention blocks and two MLPs around the MoE block."""
    return _moe("LongcatFlash", 9, num_layers=1, ffn_hidden_size=16, expert_ffn_hidden_size=8, n_routed_experts=4,
                zero_expert_num=2, moe_topk=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8,
                qk_nope_head_dim=4, qk_rope_head_dim=4, head_dim=4, v_head_dim=8, routed_scaling_factor=1.0)


CASES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "qwen2_moe": qwen2_moe, "llama4": llama4,
         "longcat_flash": longcat_flash}


def _pairs(S, E, Bn, p, q, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    left, right = torch.randn(S, p, generator=g, dtype=dtype), torch.randn(S, q, generator=g, dtype=dtype)
    return left, right, torch.randint(0, E, (S,), generator=g), torch.randint(0, Bn, (S,), generator=g)


def _brute(left, right, expert, sample, E, Bn):
    """(B, E, p, q) per-sample gradients, pair by pair, in float64."""
    shape = (Bn, E, left.shape[1]) + (() if right is None else (right.shape[1],))
    out = torch.zeros(shape, dtype=torch.float64)
    for s in range(left.shape[0]):
        term = left[s].double() if right is None else torch.outer(left[s].double(), right[s].double())
        out[sample[s], expert[s]] += term
    return out


@pytest.mark.parametrize("S,p,q", [(40, 3, 5), (7, 16, 12), (0, 4, 4)], ids=["direct", "gram", "empty"])
@pytest.mark.parametrize("bias", [False, True])
def test_expert_segments_against_a_brute_force_sum(S, p, q, bias):
    """Norms (by both forms: many pairs per expert take the per-sample sums, few the Gram
    matrices), clipped sums and per-sample gradients, fp32 within fp32 accumulation of float64."""
    E, Bn = 3, 4
    left, right, expert, sample = _pairs(S, E, Bn, p, q, seed=S + p)
    right = None if bias else right
    want = _brute(left, right, expert, sample, E, Bn)
    sq = reference.experts_sq_norms(left.float(), None if right is None else right.float(), expert, sample, E, Bn)
    assert sq.dtype == torch.float32 and sq.shape == (Bn,)
    assert_norms_close(sq.sqrt(), want.flatten(1).norm(dim=1), "segment norms")
    coef = torch.rand(Bn, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    summed = reference.experts_clipped_sum(left, right, expert, coef[sample], E, torch.float64)
    assert_tensor_close(summed, torch.einsum("b,b...->...", coef, want), "clipped sum")
    per = reference.experts_grad_sample(left, right, expert, sample, E, Bn, torch.float64)
    assert_tensor_close(per, want, "per-sample gradients")


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_recomputation_one_gemm_against_a_gemm_per_expert(monkeypatch, transposed):
    """The experts' recomputation as one grouped GEMM (CUDA's path, no host sync) and as a GEMM
    per expert give the same rows: experts without pairs, biases, both weight layouts."""
    from dpgrad.samplers import experts as X

    g = torch.Generator().manual_seed(4)
    E, S, q, p = 4, 13, 8, 12
    expert = torch.randint(0, E - 1, (S,), generator=g)  # the last expert gets no pair
    expert[expert == 1] = 0  # nor does expert 1
    order = torch.argsort(expert, stable=True)
    ends = torch.searchsorted(expert[order], torch.arange(1, E + 1), out_int32=True)
    x = torch.randn(S, q, generator=g)
    weight = torch.randn(E, q, p, generator=g) if transposed else torch.randn(E, p, q, generator=g)
    bias = torch.randn(E, p, generator=g)
    want = torch.stack([x[s] @ (weight[e] if transposed else weight[e].T) + bias[e] for s, e in enumerate(expert)])
    for grouped in (False, True):
        monkeypatch.setattr(X, "_grouped_mm_fits", lambda rows, w, grouped=grouped: grouped)
        got = X._grouped_linear(x, weight, bias, order, ends, transposed)
        assert_tensor_close(got.double(), want.double(), f"grouped={grouped}")


def _ghost(from_norms: bool):
    """Every layer clipped from its norms (the experts' norm and clipped-sum samplers), or as
    dpgrad picks (layers as small as these from their per-sample gradients)."""
    return clipped_from_norms() if from_norms else contextlib.nullcontext()


@pytest.mark.parametrize("from_norms", [False, True], ids=["auto", "norms"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_moe_models_are_exact(name, mode, from_norms):
    """Every parameter trains: router, routed experts (3-D), shared experts, attention, norms."""
    with _ghost(from_norms):
        model = check(CASES[name](), MODES[mode])
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(m.down_proj.grad is not None for m in experts)


def checked_grad_samples(case, which) -> int:
    """GradSampleModule's per-sample gradients of the parameters ``which(name)`` picks, each
    against the microbatch reference, element by element: how many were checked."""
    ref = microbatch_reference(case, loss_reduction="sum")
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModule(model, loss_reduction="sum")
    case.per_sample_loss(wrapped, slice(None), "sum").sum().backward()
    checked = 0
    for n, p in model.named_parameters():
        if p.requires_grad and which(n):
            assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")
            checked += 1
    return checked


@pytest.mark.parametrize("name", ["qwen3_moe", "llama4", "longcat_flash"])
def test_experts_per_sample_gradients(name):
    """GradSampleModule: (B, E, 2I, d) and (B, E, d, I) per-sample gradients of the experts
    (Llama 4's (B, E, d, 2I) and (B, E, I, d)), and the router's."""
    checked = checked_grad_samples(CASES[name](), lambda n: "experts" in n or "gate.weight" in n or "router" in n)
    assert checked == (1 if name == "longcat_flash" else 2) * 3  # per MoE block: gate_up_proj, down_proj, the router


def _by_parameter(name: str) -> str:
    return name


@pytest.mark.parametrize("from_norms", [False, True], ids=["auto", "norms"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("grouping", ["per_block", "per_layer"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "llama4", "longcat_flash"])
def test_moe_group_clipping(name, grouping, mode, from_norms):
    """One clipping group per decoder layer (experts and router with their block), or per
    parameter (an expert module's two 3-D weights clipped apart): each group's per-sample
    norm, and p.grad the sum of each group's clipped gradients."""
    case = CASES[name]()
    rule = per_block if grouping == "per_block" else _by_parameter
    ref = microbatch_reference(case)
    groups = {}
    for n in ref:
        groups.setdefault(rule(n), []).append(n)
    norms = {g: torch.stack([ref[n].flatten(1).square().sum(1) for n in names]).sum(0).sqrt()
             for g, names in groups.items()}
    bounds = {g: float(v.median()) for g, v in norms.items()}
    model = copy.deepcopy(case.model)
    order = list(dict.fromkeys(rule(n) for n, p in model.named_parameters() if p.requires_grad))
    kw = dict(clipping="per_layer") if grouping == "per_layer" else dict(clipping="groups", clipping_groups=per_block)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        model, max_grad_norm=[bounds[g] for g in order], single_backward=MODES[mode], **kw)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    with _ghost(from_norms):
        args, shape = case.forward(wrapped, slice(None))
        criterion(*args, shape=shape).backward()
    got = wrapped.per_sample_group_norms
    for i, g in enumerate(order):
        assert_norms_close(got[i], norms[g], f"group {g}")
    params = dict(model.named_parameters())
    for g, names in groups.items():
        coef = (bounds[g] / (got[order.index(g)].double() + 1e-6)).clamp(max=1.0)
        for n in names:
            expected = torch.einsum("b,b...->...", coef, ref[n])
            scale = (coef[:, None] * ref[n].flatten(1).abs()).sum(0).max().item()
            assert_tensor_close(params[n].grad, expected, f"clipped {n}.grad", scale)


@pytest.mark.parametrize("name", ["qwen3_moe", "llama4", "longcat_flash"])
def test_moe_batch_of_one(name):
    """(Transformers' attention cannot run an empty batch; the flattened Linear below takes one.)"""
    rows = 1
    case = CASES[name]()
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, single_backward=True)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    args, shape = case.forward(wrapped, slice(0, rows))
    criterion(*args, shape=shape).backward()
    assert wrapped.per_sample_gradient_norms.shape == (rows,)
    if rows:
        ref = microbatch_reference(case)
        assert_norms_close(wrapped.per_sample_gradient_norms, total_norm({n: g[:1] for n, g in ref.items()}))


class Folded(nn.Module):
    """A Linear on the tokens flattened, batch-major (as MoE blocks do), or time-major."""

    def __init__(self, time_major=False):
        super().__init__()
        self.tok, self.mix, self.head = nn.Embedding(V, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.time_major = time_major

    def forward(self, ids):
        x = self.tok(ids)
        Bn, Tn, d = x.shape
        if self.time_major:
            flat = x.transpose(0, 1).reshape(-1, d)
            x = self.mix(flat).view(Tn, Bn, d).transpose(0, 1)
        else:
            x = self.mix(x.view(-1, d)).view(Bn, Tn, d)
        return self.head(torch.tanh(x).mean(1))


def check_per_sample_gradients(model: nn.Module, rows: int, seed: int) -> None:
    """GradSampleModule's per-sample gradients of ``model`` (token ids in, 3 classes out) on
    ``rows`` samples against float64 torch.func."""
    ids = torch.randint(0, V, (rows, 5), generator=torch.Generator().manual_seed(seed))
    y = torch.randint(0, 3, (rows,), generator=torch.Generator().manual_seed(seed + 1))
    ref = per_sample_grads(model, ids, y, lambda out, t: F.cross_entropy(out, t, reduction="none"))
    wrapped = dpgrad.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    F.cross_entropy(wrapped(ids), y, reduction="sum").backward()
    for n, p in wrapped._module.named_parameters():
        if p.requires_grad:
            assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen_embedding"])
@pytest.mark.parametrize("rows", [B, 1, 0])
def test_a_linear_on_flattened_tokens_is_exact(rows, frozen):
    """Also where nothing before it trains (its input has no autograd history, as an MoE
    block's first router under LoRA): the model input's (B, T) gives the fold."""
    torch.manual_seed(8)
    model = Folded()
    model.tok.requires_grad_(not frozen)
    check_per_sample_gradients(model, rows, seed=9)


class Copied(nn.Linear):
    """A Linear given ``copies`` copies of the batch's tokens one after the other, as Llama 4's
    experts are (``dpgrad.samplers.registry.register_batch_copies``)."""


class Repeated(nn.Module):
    def __init__(self, copies):
        super().__init__()
        self.tok, self.mix, self.head = nn.Embedding(V, 6), Copied(6, 6), nn.Linear(6, 3)
        self.copies = copies

    def forward(self, ids):
        x = self.tok(ids)
        Bn, Tn, d = x.shape
        scale = torch.arange(1, self.copies + 1, dtype=x.dtype).repeat_interleave(Bn * Tn)[:, None]
        y = self.mix(x.reshape(-1, d).repeat(self.copies, 1) * scale)
        return self.head(torch.tanh(y.view(self.copies, Bn, Tn, d).sum(0)).mean(1))


@pytest.mark.parametrize("rows", [B, 1])
def test_a_layer_given_copies_of_the_tokens(monkeypatch, rows):
    """Registered with its number of copies, exact; without, the independence check refuses it
    (row r is sample (r mod B*T) // T's, not r // (rows per sample)); registered with another
    number, a refusal naming the layer."""
    from dpgrad.samplers import registry

    torch.manual_seed(8)
    model = Repeated(copies=3)
    if rows > 1:
        with pytest.raises(SampleMixingError, match="layer 'mix'"):
            check_per_sample_gradients(model, rows, seed=9)
    monkeypatch.setitem(registry.BATCH_COPIES, Copied, lambda layer: 3)
    check_per_sample_gradients(model, rows, seed=9)
    monkeypatch.setitem(registry.BATCH_COPIES, Copied, lambda layer: 2)
    with pytest.raises(ValueError, match="layer 'mix' .*takes 2 copies of the batch's tokens.*Register"):
        check_per_sample_gradients(model, rows, seed=9)


def test_tokens_flattened_time_major_are_refused():
    """Row i is taken as sample i // T's; a time-major flatten breaks that, and the
    independence check says so, naming the layer."""
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(Folded(time_major=True), single_backward=True)
    ids = torch.randint(0, V, (B, 5), generator=torch.Generator().manual_seed(9))
    with pytest.raises(SampleMixingError, match="layer 'mix'"):
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
        criterion(wrapped(ids), torch.zeros(B, dtype=torch.long)).backward()


# ------------------------------------------------------------------ LoRA on mixture-of-experts
def moe_lora(name: str):
    """The model with peft's LoRA on every linear layer: "all-linear" wraps the routers' and the
    experts' parameters in ParamWrappers (``W + s B A``), nested for the experts' two weights."""
    peft = pytest.importorskip("peft")
    case = CASES[name]()
    torch.manual_seed(11)
    model = peft.get_peft_model(case.model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                              target_modules="all-linear"))
    for n, p in model.named_parameters():
        if "lora_B" in n:  # zero at start: the A's gradients would all be zero
            nn.init.normal_(p, std=0.2)
        if "router.classifier.lora_" in n:  # LongCat's router reads classifier.weight, never calling it
            p.requires_grad_(False)
    wrapped = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert name == "longcat_flash" or any(m.parameter_name == "weight" for m in wrapped)  # a router
    assert any(m.parameter_name == "down_proj" for m in wrapped)  # experts
    return type(case)(model, case.forward, case.per_sample_loss)


@pytest.mark.parametrize("from_norms", [False, True], ids=["auto", "norms"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "longcat_flash"])
def test_lora_on_routers_and_experts_is_exact(name, mode, from_norms):
    """The router's adapters through torch.func (peft's wrapper recomputed with W + s B A), the
    experts' adapters from the experts' pair factors."""
    with _ghost(from_norms):
        model = check(moe_lora(name), MODES[mode])
    adapters = [n for n, p in model.named_parameters() if "experts.lora_" in n or "experts.base_layer.lora_" in n]
    blocks = sum(type(m).__name__.endswith("Experts") for m in model.modules())
    assert blocks and len(adapters) == blocks * 2 * 2  # per block: two experts weights, A and B
    assert all(dict(model.named_parameters())[n].grad is not None for n in adapters)


def test_lora_experts_per_sample_gradients():
    """GradSampleModule: each adapter's per-sample gradients in its own layout (lora_A (E*r,
    in), lora_B (out, r*E)), element by element."""
    checked = checked_grad_samples(moe_lora("qwen3_moe"), lambda n: "experts" in n or "gate" in n)
    assert checked == 2 * (2 * 2 + 2)  # per layer: the experts' two weights' A and B, the router's


class FlatRouter(nn.Module):
    """No sampler (torch.func takes it whole): called on (B, T, d), it returns the scores of the
    tokens flattened, (B*T, E), as DeepSeek's router does, and their top-k weights."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6) * 0.5)

    def forward(self, x):
        logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        return logits, torch.topk(logits.softmax(-1), 2, dim=-1).values


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.router, self.head = nn.Embedding(V, 6), FlatRouter(), nn.Linear(2, 3)

    def forward(self, ids):
        _, top = self.router(self.tok(ids))
        return self.head(top.view(ids.shape[0], ids.shape[1], 2).mean(1))


@pytest.mark.parametrize("rows", [B, 1])
def test_a_layer_whose_output_flattens_the_batch(rows):
    """The backprops of a (B*T, E) output of a (B, T, d) input are each sample's T rows."""
    torch.manual_seed(12)
    check_per_sample_gradients(Routed(), rows, seed=13)
