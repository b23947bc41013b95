"""The model left as it is (``make_private(wrap_model=False)``, ``dpgrad.hooks``): the step
equals the wrapped model's (ghost clipping in both modes, per-block clipping, per-sample
gradients), the model keeps its class, attributes and state_dict keys, the guarantee holds,
and ``cleanup()`` leaves the model plain. The Makefile runs this module on both backends."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import dpgrad
import dpgrad.opacus
from dpgrad.clipping.groups import per_block
from dpgrad.hooks import GradSampleHooks, GradSampleHooksFastGradientClipping

opacus = pytest.importorskip("opacus")

B = 6
MODES = {"single": ("ghost", True), "double": ("ghost", False), "hooks": ("hooks", False)}


class Blocks(nn.Module):
    """Two blocks and a head, with a tied weight and an attribute of its own."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(8, 11)
        self.head.weight = self.embed.weight  # tied
        self.vocabulary = 11

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).mean(1)


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (B, 5), generator=g), torch.randint(0, 11, (B,), generator=g)


def step(mode: str, wrap: bool, clipping: str = "flat", noise: float = 0.0):
    torch.manual_seed(0)
    model = Blocks()
    x, y = batch()
    kind, single = MODES[mode]
    groups = {}
    if clipping == "groups":
        labels = list(dict.fromkeys(per_block(n) for n, p in model.named_parameters()))
        groups = dict(clipping="groups", clipping_groups=per_block, max_grad_norm=[0.3] * len(labels))
    out = dpgrad.opacus.make_private(
        opacus.PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B), noise_multiplier=noise,
        **({"max_grad_norm": 0.3} if not groups else groups), poisson_sampling=False, grad_sample_mode=kind,
        criterion=nn.CrossEntropyLoss(), wrap_model=wrap, noise_generator=torch.Generator().manual_seed(5),
        **({"single_backward": single} if kind == "ghost" else {}))
    handle, optimizer = out[0], out[1]
    caller = model if not wrap else handle
    optimizer.zero_grad()
    if kind == "ghost":
        out[2](caller(x), y).backward()
    else:
        nn.functional.cross_entropy(caller(x), y).backward()
    optimizer.step()
    return model, handle


@pytest.mark.parametrize("mode, clipping", [(m, "flat") for m in MODES] + [("single", "groups"), ("double", "groups")])
def test_the_unwrapped_model_takes_the_wrapped_step(mode, clipping):
    wrapped_model, wrapper = step(mode, True, clipping, noise=0.5)
    model, hooks = step(mode, False, clipping, noise=0.5)
    expected = GradSampleHooks if mode == "hooks" else GradSampleHooksFastGradientClipping
    assert type(hooks) is expected and hooks._module is model and type(model) is Blocks
    assert model.vocabulary == 11 and model.head.weight is model.embed.weight
    assert list(model.state_dict()) == list(Blocks().state_dict())  # no "_module." prefix
    assert list(wrapper.state_dict()) == ["_module." + k for k in Blocks().state_dict()]
    for (n, p), q in zip(wrapped_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
    if mode != "hooks":
        torch.testing.assert_close(hooks.per_sample_gradient_norms, wrapper.per_sample_gradient_norms)
        assert hooks.max_grad_norm == wrapper.max_grad_norm


@pytest.mark.parametrize("mode", list(MODES))
def test_cleanup_leaves_the_model_plain(mode):
    model, hooks = step(mode, False)
    plain = Blocks()
    hooks.cleanup()
    for m in model.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks), m
    assert not hasattr(model, "autograd_grad_sample_hooks")
    for p in model.parameters():
        assert not {"grad_sample", "_norm_sample", "_forward_counter"} & set(vars(p)), vars(p).keys()
    assert list(model.state_dict()) == list(plain.state_dict())
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()  # a plain step, nothing recorded
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_accumulation_and_the_hooks_object_s_interface():
    """Two micro-batches accumulate as with the wrapper; Opacus's methods are there."""
    torch.manual_seed(0)
    model = Blocks()
    twin = copy.deepcopy(model)
    hooks = GradSampleHooksFastGradientClipping(model, max_grad_norm=0.3, loss_reduction="sum", single_backward=True)
    wrapper = dpgrad.GradSampleModuleFastGradientClipping(twin, max_grad_norm=0.3, loss_reduction="sum",
                                                          single_backward=True)
    x, y = batch()
    for caller, handle in ((model, hooks), (wrapper, wrapper)):
        loss = dpgrad.DPLossFastGradientClipping(handle, None, nn.CrossEntropyLoss(reduction="sum"), "sum")
        for rows in (slice(0, 3), slice(3, 6)):
            loss(caller(x[rows]), y[rows]).backward()
    for (n, p), q in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)
    assert hooks.hooks_enabled
    hooks.disable_hooks()
    assert not hooks.hooks_enabled
    hooks.enable_hooks()
    assert len(hooks._module.autograd_grad_sample_hooks) > 0
    with pytest.raises(ValueError, match="already wrapped"):
        GradSampleHooksFastGradientClipping(wrapper)


def test_the_guarantee_holds_without_the_wrapper():
    """A model that mixes samples is refused through the hooks object as through the wrapper."""
    class Centred(Blocks):
        def forward(self, ids):
            h = self.layers[0](self.embed(ids))
            return self.head(h - h.mean(0)).mean(1)

    torch.manual_seed(0)
    model = Centred()
    hooks = GradSampleHooksFastGradientClipping(model, max_grad_norm=0.3, loss_reduction="sum")
    x, y = batch()
    with pytest.raises(dpgrad.SampleMixingError, match="samples are mixed inside the model"):
        dpgrad.DPLossFastGradientClipping(hooks, None, nn.CrossEntropyLoss(reduction="sum"), "sum")(
            model(x), y).backward()


def test_a_hugging_face_model_keeps_its_class_and_keys():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    keys = list(model.state_dict())
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    hooks, optimizer, criterion, _ = dpgrad.opacus.make_private(
        opacus.PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=4), noise_multiplier=0.0, max_grad_norm=0.1,
        poisson_sampling=False, criterion=nn.CrossEntropyLoss(), wrap_model=False, single_backward=True)
    assert isinstance(model, transformers.GPT2LMHeadModel) and list(model.state_dict()) == keys
    positions = torch.arange(8).expand(4, 8)
    logits = model(input_ids=ids, position_ids=positions).logits
    optimizer.zero_grad()
    criterion(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1), shape=(4, 7)).backward()
    optimizer.step()
    assert hooks.per_sample_gradient_norms.shape == (4,)
    assert callable(model.save_pretrained)  # a PreTrainedModel's own methods are there
    hooks.cleanup()
    assert list(model.state_dict()) == keys


def test_lora_adapters_unwrapped_take_the_wrapped_step():
    """A PEFT LoRA model (only its adapters train) left unwrapped: the wrapped model's step, its
    class and keys kept."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(r=2, lora_alpha=4,
                               target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))
    for n, p in base.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(4, 8)
    models = {}
    for wrap in (True, False):
        model = copy.deepcopy(base)
        keys = list(model.state_dict())
        handle, optimizer, criterion, _ = dpgrad.opacus.make_private(
            opacus.PrivacyEngine(), module=model,
            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
            data_loader=DataLoader(TensorDataset(ids), batch_size=4), noise_multiplier=0.0, max_grad_norm=0.01,
            poisson_sampling=False, criterion=nn.CrossEntropyLoss(), wrap_model=wrap, single_backward=True)
        caller = handle if wrap else model
        logits = caller(input_ids=ids, position_ids=positions).logits
        optimizer.zero_grad()
        criterion(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1), shape=(4, 7)).backward()
        optimizer.step()
        if not wrap:
            assert type(model) is type(base) and list(model.state_dict()) == keys
        models[wrap] = model
    moved = 0
    for (n, p), (_, q), (_, before) in zip(models[True].named_parameters(), models[False].named_parameters(),
                                           base.named_parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
        moved += int(not torch.equal(p, before))
    assert moved == sum(p.requires_grad for p in base.parameters()) > 0
