"""Hugging Face models built from tiny configs (random weights), against a float64 microbatch reference.

GPT-2 (Conv1D projections, the LM head tied to the token embedding), Llama fully trained and
with PEFT LoRA adapters (RMSNorm, rotary positions, no bias; only the adapters train), Qwen3
(RMSNorms on each head's queries and keys too), a BERT-style
encoder with a classification head, a ViT image classifier (a patch-embedding convolution), and
the encoder-decoders T5 (a relative attention bias shared by all samples) and BART (embedding
subclasses, tied). Causal-LM losses are per sequence, the mean over the
tokens not labelled -100 (padding, with an attention mask), as DPLossFastGradientClipping's
``shape=`` gives them. The reference runs each sample alone through a float64 copy with plain
autograd. dpgrad, in both modes: per-sample norms within fp32 rel 1e-5 (bf16 rel 1e-2), and
``p.grad`` equal to ``sum_b c_b g_b``, element-wise within rel 1e-5 of the gradient's scale.

Some gradients are zero in exact arithmetic (an attention key bias: softmax ignores a shift
of all scores) and only rounding noise in the model's own precision. For those the element
tolerance is also floored at 4x the error plain autograd makes, running the same samples one
at a time in the model's precision (under autocast where the step is): measured, never assumed. Norm tolerances are not touched.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import dpgrad  # noqa: E402
from dpgrad.samplers import registry  # noqa: E402
from dpgrad.samplers import norms  # noqa: E402
from mixed_net import clipped_from_norms  # noqa: E402
from per_sample_reference import RTOL, assert_norms_close, assert_tensor_close, total_norm  # noqa: E402

MODES = {"single": True, "double": False}
B, T, V = 4, 8, 40
BF16_RTOL = 1e-2


@dataclass
class Case:
    """A model and its batch: ``forward(model, rows)`` gives the criterion's arguments and
    ``shape`` for the rows of the batch (a slice)."""

    model: nn.Module
    forward: Callable
    per_sample_loss: Callable  # plain torch: (model, rows, loss_reduction) -> (len(rows),)


def _batch(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 5:] = 0  # right padding
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def causal_lm(model: nn.Module, position_ids: bool, device="cpu") -> Case:
    """A causal LM and its batch, both on ``device``."""
    model.to(device)
    ids, mask = _batch(device=device)
    labels = ids.masked_fill(mask == 0, -100)
    positions = torch.arange(T, device=device).expand(B, T)

    def logits_of(m, rows):
        extra = dict(position_ids=positions[rows]) if position_ids else {}
        return m(input_ids=ids[rows], attention_mask=mask[rows], **extra).logits[:, :-1]

    def forward(m, rows):
        logits = logits_of(m, rows)
        return (logits.reshape(-1, V), labels[rows, 1:].reshape(-1)), logits.shape[:2]

    def per_sample_loss(m, rows, loss_reduction="mean"):
        logits = logits_of(m, rows).float()
        token = F.cross_entropy(logits.transpose(1, 2), labels[rows, 1:], reduction="none")
        # Opacus's per-sequence loss: the mean over the labelled tokens, or under "sum" their sum.
        return token.sum(1) / ((labels[rows, 1:] != -100).sum(1) if loss_reduction == "mean" else 1)

    return Case(model, forward, per_sample_loss)


def gpt2(device="cpu", position_ids=True) -> Case:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=T, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return causal_lm(model, position_ids=position_ids, device=device)


def llama_config(**kwargs):
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=V, max_position_embeddings=T, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=1, **kwargs)


def lora(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # zero at start: the A's gradients would all be zero
            nn.init.normal_(p, std=0.2)
    return model


def llama_lora(device="cpu") -> Case:
    torch.manual_seed(1)
    return causal_lm(lora(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True))), position_ids=False,
                     device=device)


def llama(device="cpu") -> Case:
    """Every parameter trains: the RMSNorms (LlamaRMSNorm) are clipped by dpgrad's own sampler."""
    torch.manual_seed(5)
    return causal_lm(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=False)), position_ids=False,
                     device=device)


def bert(position_ids=True) -> Case:
    torch.manual_seed(2)
    cfg = transformers.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  vocab_size=V, max_position_embeddings=T, type_vocab_size=2, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    model = transformers.BertForSequenceClassification(cfg)
    ids, mask = _batch(seed=3)
    y = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(T).expand(B, T)

    def logits_of(m, rows):
        extra = dict(position_ids=positions[rows]) if position_ids else {}
        return m(input_ids=ids[rows], attention_mask=mask[rows], **extra).logits

    return Case(model, lambda m, rows: ((logits_of(m, rows), y[rows]), None),
                lambda m, rows, loss_reduction="mean": F.cross_entropy(logits_of(m, rows).float(), y[rows],
                                                                       reduction="none"))


def vit(device="cpu") -> Case:
    """ViTForImageClassification: the patch embedding's convolution (ghost-clipped), the class
    token and position embeddings (parameters of the embeddings module itself), LayerNorm, Linear;
    model and batch on ``device``."""
    from dpgrad.tools.vision import vit as build_vit

    torch.manual_seed(6)
    model = build_vit(image_size=8, patch_size=4, hidden=16, layers=2, heads=2, mlp=32, classes=3).to(device)
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(B, 3, 8, 8, generator=g).to(device)
    y = torch.randint(0, 3, (B,), generator=g).to(device)

    def logits_of(m, rows):
        return m(pixel_values=pixels[rows]).logits

    return Case(model, lambda m, rows: ((logits_of(m, rows), y[rows]), None),
                lambda m, rows, loss_reduction="mean": F.cross_entropy(logits_of(m, rows).float(), y[rows],
                                                                       reduction="none"))


def qwen3(device="cpu") -> Case:
    """Qwen3: besides Llama's, RMSNorms on each head's queries and keys ((B, T, H, head_dim)
    inputs), every parameter trained."""
    torch.manual_seed(5)
    cfg = transformers.Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=8, vocab_size=V, max_position_embeddings=T,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)
    return causal_lm(transformers.Qwen3ForCausalLM(cfg), position_ids=False, device=device)


def seq2seq(model: nn.Module, mask: bool = True) -> Case:
    """An encoder-decoder and its batch: the encoder's ids (padded, with their attention mask
    where ``mask``), the decoder's, and per-sequence losses over the labelled decoder tokens."""
    ids, attention = _batch(seed=8)
    g = torch.Generator().manual_seed(9)
    decoder_ids = torch.randint(3, V, (B, 6), generator=g)
    labels = torch.randint(3, V, (B, 6), generator=g)
    labels[1, 4:] = -100

    def logits_of(m, rows):
        extra = dict(attention_mask=attention[rows]) if mask else {}
        return m(input_ids=ids[rows], decoder_input_ids=decoder_ids[rows], **extra).logits

    def forward(m, rows):
        logits = logits_of(m, rows)
        return (logits.reshape(-1, V), labels[rows].reshape(-1)), logits.shape[:2]

    def per_sample_loss(m, rows, loss_reduction="mean"):
        token = F.cross_entropy(logits_of(m, rows).float().transpose(1, 2), labels[rows], reduction="none")
        return token.sum(1) / ((labels[rows] != -100).sum(1) if loss_reduction == "mean" else 1)

    return Case(model, forward, per_sample_loss)


def t5(mask: bool = True) -> Case:
    """T5: a relative attention bias per head from an Embedding on (T, T) position buckets,
    shared by every sample (``dpgrad.backward.shared_outputs``), in the encoder and the decoder."""
    torch.manual_seed(10)
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
                                decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    return seq2seq(transformers.T5ForConditionalGeneration(cfg), mask)


def bart(mask: bool = True) -> Case:
    """BART: scaled word embeddings (an nn.Embedding subclass) tied to the LM head, and learned
    positions (another subclass, offsetting its ids), both clipped at their F.embedding calls."""
    torch.manual_seed(11)
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, pad_token_id=1,
                                  decoder_start_token_id=2, scale_embedding=True)
    return seq2seq(transformers.BartForConditionalGeneration(cfg), mask)


CASES = {"gpt2": gpt2, "llama_lora": llama_lora, "llama": llama, "qwen3": qwen3, "bert": bert, "vit": vit,
         "t5": t5, "bart": bart}


def autocast_on(model: nn.Module, enabled: bool):
    """Autocast to bf16 on the model's device, where ``enabled``."""
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=enabled)


def reference(case: Case, dtype=torch.float64, loss_reduction="mean", autocast=False) -> Dict[str, torch.Tensor]:
    """Per-sample gradients of the trainable parameters by plain autograd, one sample at a
    time, on a copy of the model in ``dtype`` (None: the model's own), its forward pass under
    autocast to bf16 where ``autocast``."""
    model = copy.deepcopy(case.model)
    if dtype is not None:
        model = model.to(dtype)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = {n: [] for n in params}
    for b in range(B):
        model.zero_grad()
        with autocast_on(model, autocast):
            loss = case.per_sample_loss(model, slice(b, b + 1), loss_reduction).sum()
        loss.backward()
        for n, p in params.items():
            grads[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {n: torch.stack(g) for n, g in grads.items()}


def saved_tensors_passed_through():
    """Saved-tensor hooks that give back what they are given (as checkpointing and offloading
    hooks stand between autograd and what it saved)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def clipped_step(case: Case, single: bool, loss_reduction: str, C: float, autocast: bool = False,
                 saved_hooks: bool = False, first: Optional[slice] = None):
    """dpgrad's clipped backward on the whole batch: (model, per-sample norms); after a first
    step on the rows ``first`` (its gradients dropped), where given."""
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=C, loss_reduction=loss_reduction,
                                                          single_backward=single)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(reduction=loss_reduction),
                                                  loss_reduction)
    for rows in ([first] if first is not None else []) + [slice(None)]:
        model.zero_grad(set_to_none=True)
        with autocast_on(model, autocast), \
                saved_tensors_passed_through() if saved_hooks else contextlib.nullcontext():
            args, shape = case.forward(wrapped, rows)
            loss = criterion(*args, shape=shape)
        loss.backward()
    return model, wrapped.per_sample_gradient_norms


def weighted_autograd(case: Case, coef: torch.Tensor, loss_reduction: str = "mean") -> Dict[str, torch.Tensor]:
    """The non-private step's gradients of ``sum_b coef_b loss_b``: plain autograd on the whole
    batch in the model's precision, the error the same model makes without dpgrad."""
    model = copy.deepcopy(case.model)
    (case.per_sample_loss(model, slice(None), loss_reduction) * coef.float()).sum().backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()
            if p.requires_grad}


def check(case: Case, single: bool, loss_reduction: str = "mean", rtol: float = RTOL, autocast=False,
          saved_hooks=False):
    ref = reference(case, loss_reduction=loss_reduction)
    # plain autograd in the model's precision, as the step runs it
    own = reference(case, dtype=None, loss_reduction=loss_reduction, autocast=autocast)
    ref_norms = total_norm(ref)
    C = float(ref_norms.median())  # about half the samples clipped
    model, norms = clipped_step(case, single, loss_reduction, C, autocast, saved_hooks)
    assert norms.dtype == torch.float32
    assert_norms_close(norms, ref_norms, "per-sample norms", rtol)
    coef = (C / (norms + 1e-6)).clamp(max=1.0).double()
    assert (coef < 1).any() and (coef == 1).any()
    params = dict(model.named_parameters())
    with autocast_on(case.model, autocast):
        batched = weighted_autograd(case, coef, loss_reduction)
    for n, g in ref.items():
        g = g.double()  # a layer may cast itself back in its forward (Switch Transformers' router to fp32)
        expected = torch.einsum("b,b...->...", coef, g)
        scale = (coef[:, None] * g.flatten(1).abs()).sum(0).max().item()
        # the error plain autograd makes in the model's precision, per sample or on the batch
        autograd_error = max((torch.einsum("b,b...->...", coef, own[n].double()) - expected).abs().max().item(),
                             (batched[n].double() - expected).abs().max().item())
        got = params[n].grad
        assert got is not None and got.dtype == params[n].dtype, n
        assert_tensor_close(got, expected, f"clipped {n}.grad", max(scale, 4 * autograd_error / rtol), rtol)
    for n, p in params.items():
        if n not in ref:
            assert p.grad is None, f"frozen {n} got a gradient"
    return model


@pytest.mark.parametrize("from_norms", [False, True], ids=["auto", "norms"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_fp32_matches_float64_reference(name, mode, from_norms):
    """These models are small enough for dpgrad to take every layer's per-sample gradients;
    "norms" clips every layer with a norm sampler from its norms (ghost), cross terms of the
    tied embedding included."""
    with clipped_from_norms() if from_norms else contextlib.nullcontext():
        check(CASES[name](), MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_gpt2_sum_reduction(mode):
    check(gpt2(), MODES[mode], loss_reduction="sum")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["gpt2", "llama_lora", "llama", "qwen3"])
def test_half_precision_weights(name, mode, dtype):
    """bf16 and fp16 weights: norms accumulated in fp32, within bf16's rel 1e-2 of a float64
    run of the same (rounded) weights."""
    case = CASES[name]()
    case.model.to(dtype)
    check(case, MODES[mode], rtol=BF16_RTOL)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_lora"])
def test_fp32_weights_under_autocast(name, mode):
    """fp32 weights under autocast (the Trainer's bf16=True): the projections (Conv1D, Linear,
    LoRA's) multiply their inputs cast to bf16, which the hooks keep; fp32 gradients, the
    norms within bf16's tolerance of float64."""
    check(CASES[name](), MODES[mode], rtol=BF16_RTOL, autocast=True)


@pytest.mark.parametrize("path", norms.HF_RMS_NORMS, ids=lambda p: p.rsplit(".", 1)[1])
def test_llama_family_rms_norms(path):
    """Each RMSNorm class dpgrad serves by dotted path computes Llama's form; the per-sample
    weight gradients equal torch.func's in float64, and in bf16 the sums of the layer's own
    rounded normalised inputs times the backprops."""
    module, name = path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{path} is not in this transformers")
    d = 24
    layer = cls(d, eps=1e-5).double()
    nn.init.normal_(layer.weight)
    registry.resolve(layer)
    sampler = registry.GRAD_SAMPLERS[cls]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 7, d, generator=g, dtype=torch.float64) * 2 + 0.5
    bp = torch.randn(3, 7, d, generator=g, dtype=torch.float64)
    params = dict(layer.named_parameters())

    def loss(p, xb, gb):
        return (torch.func.functional_call(layer, p, (xb[None],))[0] * gb).sum()

    expected = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, bp)["weight"]
    assert_tensor_close(sampler(layer, [x], bp)[layer.weight], expected, "float64", expected.abs().max().item(), RTOL)
    half = copy.deepcopy(layer).to(torch.bfloat16)
    xh, bph = x.to(torch.bfloat16), bp.to(torch.bfloat16)
    with torch.no_grad():
        half.weight.fill_(1.0)
        normed = half(xh)  # the layer's own rounded normalised inputs (times ones)
    expected = (normed.double() * bph.double()).sum(1)
    got = norms.per_sample_grads(half, xh, bph)[0]
    assert got.dtype == torch.float32
    assert_tensor_close(got, expected, "bf16", expected.abs().max().item(), RTOL)


def _rms_norm_inputs_alive(model: nn.Module, forward) -> int:
    """How many inputs of the model's RMSNorms are still alive after ``forward()`` returns,
    what it returned (the outputs and their graph) kept."""
    refs = []
    # The forward pass's own calls (the independence check's forward probe runs the model
    # again, without gradients, on the first step).
    hooks = [m.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0]))
                                         if torch.is_grad_enabled() else None)
             for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    try:
        kept = forward()
    finally:
        for hook in hooks:
            hook.remove()
    gc.collect()
    assert len(refs) == 5 and kept is not None  # two layers of two, and the final norm
    return sum(ref() is not None for ref in refs)


WRAPPERS = {
    "gsm": lambda m: dpgrad.GradSampleModule(m, loss_reduction="sum"),
    "double": lambda m: dpgrad.GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0),
    "single": lambda m: dpgrad.GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0, single_backward=True),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_llama_rms_norm_inputs_are_not_kept(wrapper):
    """In bf16 a Llama RMSNorm's input (the residual stream) is not among what autograd saves: it
    saves the rounded normalised input for the weight's gradient, and plain autograd lets the
    input go when the forward pass ends. The hooks keep autograd's tensor, not the input, so a
    wrapped model holds no more memory through its backward pass than the plain one (the
    per-sample gradients stay exact: test_half_precision_weights, and below)."""
    case = llama()
    case.model.to(torch.bfloat16)
    model = copy.deepcopy(case.model)
    assert _rms_norm_inputs_alive(model, lambda: case.forward(model, slice(None))) == 0  # plain autograd
    wrapped = WRAPPERS[wrapper](model)
    assert _rms_norm_inputs_alive(model, lambda: case.forward(wrapped, slice(None))) == 0
    if wrapper != "gsm":
        return
    case.per_sample_loss(wrapped, slice(None), "sum").sum().backward()
    ref = reference(case, loss_reduction="sum")
    for name, p in model.named_parameters():
        if "norm" in name:
            expected = ref[name]
            assert_tensor_close(p.grad_sample, expected, f"{name}.grad_sample", expected.abs().max().item(), BF16_RTOL)


@pytest.mark.parametrize("mode", list(MODES))
def test_llama_rms_norms_under_saved_tensor_hooks(mode):
    """Under saved-tensor hooks (checkpointing, offloading) what autograd saved cannot be read
    without unpacking it: the hooks keep the RMSNorms' inputs, and the step is as exact."""
    case = llama()
    case.model.to(torch.bfloat16)
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, single_backward=MODES[mode])

    def forward():
        with saved_tensors_passed_through():
            return case.forward(wrapped, slice(None))

    assert _rms_norm_inputs_alive(model, forward) == 5
    check(case, MODES[mode], rtol=BF16_RTOL, saved_hooks=True)


def test_a_users_rms_norm_sampler_gets_the_inputs(monkeypatch):
    """A grad sampler of the user's own for LlamaRMSNorm is called with the layer's inputs, as
    Opacus calls it, not with what dpgrad's own sampler keeps."""
    case = llama()
    case.model.to(torch.bfloat16)
    model = copy.deepcopy(case.model)
    cls = type(model.model.norm)
    registry.resolve(model)  # the samplers registered by dotted path, as a wrapper finds them
    ours = registry.GRAD_SAMPLERS[cls]
    given, inputs = [], []

    def users(layer, activations, backprops):
        given.append(list(activations))
        return ours(layer, activations, backprops)

    monkeypatch.setitem(registry.GRAD_SAMPLERS, cls, users)
    monkeypatch.delitem(registry.GRAD_SAMPLE_GROUPS, cls)  # so that the sampler itself is called
    wrapped = dpgrad.GradSampleModule(model, loss_reduction="sum")
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    case.per_sample_loss(wrapped, slice(None), "sum").sum().backward()
    hook.remove()
    assert len(given) == 5 and all(len(a) == 1 for a in given)
    assert any(a[0] is inputs[0] for a in given)  # the final norm's own input


def test_gpt2_per_sample_gradients_of_conv1d():
    """GradSampleModule: Conv1D's per-sample gradients come from the Linear kernels, transposed."""
    case = gpt2()
    ref = reference(case)
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModule(model, loss_reduction="sum")
    conv1d = type(model.transformer.h[0].attn.c_attn)
    assert conv1d in dpgrad.GRAD_SAMPLERS and wrapped._path.functorch_layers == set()
    case.per_sample_loss(wrapped, slice(None)).sum().backward()
    for n, p in model.named_parameters():
        assert_tensor_close(p.grad_sample, ref[n], n)


def test_lora_hooks_only_the_adapters():
    """Frozen base layers are not hooked: they cost no per-sample work."""
    case = llama_lora()
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(case.model, single_backward=True)
    names = list(wrapped._path.layer_names.values())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    trainable = [n for n, p in case.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("order", ["moved_first", "peft_first"])
def test_lora_whether_moved_before_or_after_peft(order):
    """The model is moved to the device (CUDA when there is one) before or after
    get_peft_model; on a CPU-only machine this only checks that the order does not matter."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    base = transformers.LlamaForCausalLM(llama_config())
    model = lora(base.to(device)) if order == "moved_first" else lora(base).to(device)
    check(causal_lm(model.float(), position_ids=False, device=device), single=True)


@pytest.mark.parametrize("from_norms", [False, True], ids=["auto", "norms"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_default_position_ids_are_exact(name, mode, from_norms):
    """Left to themselves, GPT-2 and BERT embed positions (1, T) and broadcast them over the
    batch: the position embedding runs on its ids expanded to the batch, and every gradient
    matches the float64 reference, with no extra argument."""
    with clipped_from_norms() if from_norms else contextlib.nullcontext():
        check(CASES[name](position_ids=False), MODES[mode])


def test_default_position_ids_give_per_sample_gradients():
    """The same through GradSampleModule: the position embedding's per-sample gradients."""
    case = gpt2(position_ids=False)
    ref = reference(case, loss_reduction="sum")
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModule(model, loss_reduction="sum")
    case.per_sample_loss(wrapped, slice(None), "sum").sum().backward()
    grad_sample = model.transformer.wpe.weight.grad_sample
    assert grad_sample.shape == (B, T, 16)
    assert_tensor_close(grad_sample, ref["transformer.wpe.weight"], "wpe per-sample gradients")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoders_without_an_attention_mask(name, mode):
    """Without a mask, T5's bias stays shared into every layer and meets the batch in each
    attention: exact all the same."""
    check(CASES[name](mask=False), MODES[mode])


def test_t5_per_sample_gradients_of_the_relative_bias():
    """GradSampleModule: each sample's gradient of the shared relative attention bias."""
    case = t5()
    ref = reference(case, loss_reduction="sum")
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModule(model, loss_reduction="sum")
    case.per_sample_loss(wrapped, slice(None), "sum").sum().backward()
    for n, p in model.named_parameters():
        if "relative_attention_bias" in n:
            assert_tensor_close(p.grad_sample, ref[n], f"{n} per-sample gradients")


def gpt2_checkpointed(use_reentrant: bool) -> Case:
    case = gpt2()
    case.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    case.model.train()
    return case


@pytest.mark.parametrize("mode", list(MODES))
def test_gpt2_non_reentrant_checkpointing(mode):
    """Hugging Face's non-reentrant activation checkpointing: exact in both modes (the blocks
    are recomputed in the backward pass, the hooks record the first computation)."""
    check(gpt2_checkpointed(use_reentrant=False), MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_llama_rms_norm_on_an_input_without_gradient(mode):
    """Frozen token embeddings: the first RMSNorm's input needs no gradient, its weight does
    (autograd saves the normalised input for the weight alone); bf16, exact."""
    case = llama()
    case.model.to(torch.bfloat16)
    case.model.model.embed_tokens.weight.requires_grad_(False)
    check(case, MODES[mode], rtol=BF16_RTOL)


@pytest.mark.parametrize("mode", list(MODES))
def test_llama_non_reentrant_checkpointing_in_bf16(mode):
    """The same for Llama in bf16, every parameter trained: its RMSNorms' inputs are kept (what
    autograd saved is behind checkpointing's hooks), and the step is exact."""
    case = llama()
    case.model.to(torch.bfloat16)
    case.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    case.model.train()
    check(case, MODES[mode], rtol=BF16_RTOL)


@pytest.mark.parametrize("mode", list(MODES))
def test_gpt2_reentrant_checkpointing_is_refused_with_the_fix(mode):
    case = gpt2_checkpointed(use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"reentrant activation checkpointing .*gradient_checkpointing_kwargs="
                                           r"\{'use_reentrant': False\}"):
        clipped_step(case, MODES[mode], "mean", 1.0)
