"""What each process of tests/test_distributed.py runs (spawned; gloo on CPU).

Every scenario returns plain numpy arrays: tensors sent through a queue would live in shared
memory that disappears with the process.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dpgrad
import dpgrad.loss
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig, per_sample_lm_loss

CFG = TinyTransformerConfig(vocab_size=31, max_seq_len=8, d_model=16, n_heads=2, n_layers=1, d_ff=24,
                            tie_embeddings=True)
C = 0.3  # below every per-sample norm: each sample is clipped by its own factor
GLOBAL_BATCH = 6


def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG)


def global_ids() -> torch.Tensor:
    return torch.randint(1, CFG.vocab_size, (GLOBAL_BATCH, CFG.max_seq_len), generator=torch.Generator().manual_seed(1))


def share(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a global batch: rank r takes rows r, r + world, ..."""
    return x[rank::world]


def _grads(m: nn.Module) -> dict:
    return {n: p.grad.detach().clone().numpy() for n, p in m.named_parameters()}


def lm_step(wrapped: nn.Module, criterion, ids: torch.Tensor) -> None:
    """Forward and clipped backward of next-token losses, one per sequence (fp32 logits, of a
    Hugging Face model's output too)."""
    out = wrapped(ids[:, :-1])
    logits = getattr(out, "logits", out)
    criterion(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), shape=logits.shape[:2]).backward()


def clipped_gradients(rank: int, world: int, single: bool, order: str, per_block: bool = False) -> dict:
    """p.grad after two steps' clipped backward (the second checks that DDP finished the
    first's reduction), and this rank's per-sample norms (with ``per_block``, one clipping
    group per block, ``dpgrad.clipping.groups``: the per-sample group norms)."""
    from dpgrad.clipping.groups import per_block as by_block

    net = model()
    kw = dict(max_grad_norm=C, single_backward=single)
    if per_block:
        kw.update(clipping="groups", clipping_groups=by_block, max_grad_norm=[C] * GROUPS)
    if order == "dpgrad(ddp)":
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(DDP(net), **kw)
    else:
        wrapped = DDP(dpgrad.GradSampleModuleFastGradientClipping(net, **kw))
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    ids = share(global_ids(), rank, world)
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        lm_step(wrapped, criterion, ids)
    wrapper = dpgrad.loss.clipping_wrapper(wrapped)
    norms = wrapper.per_sample_group_norms if per_block else wrapper.per_sample_gradient_norms
    return {"grads": _grads(net), "norms": norms.detach().numpy()}


GROUPS = 2  # CFG's one block, and the rest (embeddings, final norm)


def moe_model() -> nn.Module:
    """A two-layer Qwen3-MoE (four experts, top-2), its experts run by their eager loop."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=CFG.vocab_size,
        max_position_embeddings=CFG.max_seq_len, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        tie_word_embeddings=False)
    config._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(config)


def moe_clipped_gradients(rank: int, world: int, single: bool) -> dict:
    """p.grad after a clipped backward of the MoE model inside DDP, every layer clipped from
    its norms (the experts' segment samplers), and this rank's per-sample norms."""
    from unittest import mock

    from dpgrad.backward import finish_plan

    net = moe_model()
    with mock.patch.multiple(finish_plan, GRAD_SAMPLE_MEMORY_FRACTION=0.0, TINY_GRAD_SAMPLE_ELEMENTS=-1):
        wrapped = DDP(dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=C, single_backward=single))
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
        lm_step(wrapped, criterion, share(global_ids(), rank, world))
    norms = dpgrad.loss.clipping_wrapper(wrapped).per_sample_gradient_norms
    return {"grads": _grads(net), "norms": norms.detach().numpy()}


class ConvNet(nn.Module):
    """Convolutions (one grouped, strided, circular) and GroupNorm before a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2, padding_mode="circular")
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv2(torch.relu(self.norm(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


def conv_model() -> ConvNet:
    torch.manual_seed(2)
    return ConvNet()


def global_images():
    g = torch.Generator().manual_seed(3)
    return torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def conv_clipped_gradients(rank: int, world: int, single: bool) -> dict:
    """p.grad of the ConvNet after its clipped backward under DDP, every layer clipped from its
    norms (no per-sample gradient), and this rank's per-sample norms."""
    from mixed_net import clipped_from_norms

    net = conv_model()
    with clipped_from_norms():
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(DDP(net), max_grad_norm=CONV_C, single_backward=single)
        criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
        x, y = (share(t, rank, world) for t in global_images())
        criterion(wrapped(x), y).backward()
    return {"grads": _grads(net), "norms": wrapped.per_sample_gradient_norms.detach().numpy()}


CONV_C = 0.05


def mixing_refused(rank: int, world: int, order: str, where: str) -> str:
    """The first line of the refusal, on this rank, of a model that mixes samples ("model": its
    block's output centred over the batch) or of per-sample losses in another order than the
    batch ("loss"), and whether p.grad stayed empty; "no error" otherwise."""
    net = model()
    if where == "model":
        center_block(net)
    inner = dpgrad.GradSampleModuleFastGradientClipping(DDP(net) if order == "dpgrad(ddp)" else net,
                                                        max_grad_norm=C, single_backward=True)
    wrapped = inner if order == "dpgrad(ddp)" else DDP(inner)
    return mixing_step(net, wrapped, inner, share(global_ids(), rank, world), reorder=where == "loss")


def center_block(net: nn.Module) -> None:
    """Make the first block's output centred over the batch: a mix of samples."""
    net.blocks[0].register_forward_hook(lambda module, args, out: out - out.mean(0, keepdim=True))


def mixing_step(net: nn.Module, wrapped: nn.Module, wrapper, ids: torch.Tensor, reorder: bool) -> str:
    """A step of per-sequence next-token losses (rolled by one sample: out of order, with
    ``reorder``): the refusal's first line and whether p.grad stayed empty, or "no error"."""
    try:
        logits = wrapped(ids[:, :-1])
        losses = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                             reduction="none").view(ids.shape[0], -1).mean(1)
        wrapper.clipped_backward(losses.roll(1) if reorder else losses)
    except dpgrad.SampleMixingError as err:
        untouched = all(p.grad is None for p in net.parameters())
        return f"{str(err).splitlines()[0]} (grads untouched: {untouched})"
    return "no error"


def all_reduce_calls(rank: int, world: int, protocol: str) -> list:
    """The passes in which DistributedDataParallel reduces a bucket during one step of
    ``protocol``: "norms" (before the clipping factors exist) or "clipped" (after)."""
    net = model()
    ddp = DDP(dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=C))
    wrapper = ddp.module
    phase, calls = ["norms"], []

    def counting_allreduce(state, bucket):
        calls.append(phase[0])
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    norm_sample = wrapper._path.norm_sample

    def norms_then_clipped_pass():  # the norms are asked for once the norm pass is over
        phase[0] = "clipped"
        return norm_sample()

    wrapper._path.norm_sample = norms_then_clipped_pass
    ddp.register_comm_hook(None, counting_allreduce)
    ids = share(global_ids(), rank, world)
    losses = per_sample_lm_loss(ddp(ids), ids)
    if protocol == "dpgrad":
        wrapper.clipped_backward(losses)
    else:  # Opacus's: a plain first pass, then the weighted second one
        losses.mean().backward(retain_graph=True)
        net.zero_grad()
        dpgrad.loss.weighted_backward(wrapper, wrapper.get_clipping_coef(), losses)
    return calls


def privacy_engine_step(rank: int, world: int, single: bool, noise: float, wrap: bool = True) -> dict:
    """One step of dpgrad.opacus.make_private on the DDP model, each rank on its share; with
    ``wrap=False`` the DDP model itself is called (its hooks object returned in the wrapper's place)."""
    import dpgrad.opacus
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from dpgrad.opacus import DistributedDPOptimizerFastGradientClipping

    net = model()
    data = TensorDataset(global_ids())
    # Rank r's rows r, r + world, ...: its share of the one batch.
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    ddp = DDP(net)
    wrapped, optimizer, criterion, loader = dpgrad.opacus.make_private(
        PrivacyEngine(), module=ddp, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=len(data) // world, sampler=sampler),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=noise, max_grad_norm=C, poisson_sampling=False,
        single_backward=single, noise_generator=torch.Generator().manual_seed(7 + rank), wrap_model=wrap,
    )
    if not wrap:
        assert isinstance(wrapped, dpgrad.GradSampleHooksFastGradientClipping) and wrapped._module is ddp
        wrapped = ddp  # the caller calls its own model
    assert isinstance(optimizer, DistributedDPOptimizerFastGradientClipping)
    (batch,) = next(iter(loader))
    assert torch.equal(batch, share(global_ids(), rank, world))
    optimizer.zero_grad()
    lm_step(wrapped, criterion, batch)
    optimizer.step()
    return {n: p.detach().clone().numpy() for n, p in net.named_parameters()}


def adaptive_steps(rank: int, world: int, single: bool, public: bool, steps: int = 3,
                   sharded: bool = True) -> dict:
    """``steps`` steps of adaptive clipping (dpgrad.opacus.PrivacyEngineAdaptiveClipping) on the
    DDP model, each rank on its share of the same batch, without gradient noise, the global
    generator seeded alike before each step (the count's noise: drawn on rank 0); with
    ``sharded=False``, the same in one process on the whole batch. The bounds and parameters."""
    import dpgrad.opacus
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    net = model()
    data = TensorDataset(global_ids())
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if sharded else None
    module = DDP(net) if sharded else net
    wrapped, optimizer, criterion, loader = dpgrad.opacus.PrivacyEngineAdaptiveClipping(accountant="rdp").make_private(
        module=module, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=len(data) // world, sampler=sampler),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False,
        single_backward=single, target_unclipped_quantile=0.5, min_clipbound=0.01, clipbound_learning_rate=1.0,
        public_batch_size=public)
    if sharded:  # noise scaled by the bound on the device, added once (rank 0)
        assert type(optimizer) is dpgrad.opacus.DistributedDPOptimizerFastGradientClipping
    (batch,) = next(iter(loader))
    bounds = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        lm_step(wrapped, criterion, batch)
        optimizer.step()
        bounds.append(float(wrapped.max_grad_norm))
    return {"bounds": np.array(bounds), **{n: p.detach().clone().numpy() for n, p in net.named_parameters()}}


def fsdp_refused(rank: int, world: int) -> str:
    """The error of GradSampleModule on a model sharded by FSDP2, and whether the model was left as it was."""
    from torch.distributed.fsdp import fully_shard

    net = model()
    fully_shard(net)

    def hooks():  # FSDP2 has hooks of its own
        return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in net.modules()]

    before = hooks()
    try:
        dpgrad.GradSampleModule(net)
    except NotImplementedError as err:
        return f"{err} (untouched: {hooks() == before})"
    return "no error"


def environment(rank: int, world: int, name: str) -> dict:
    """This rank's process, and the value of the environment variable ``name`` it sees."""
    import os

    return {"pid": os.getpid(), "value": os.environ.get(name)}


SCENARIOS = {
    "adaptive_steps": adaptive_steps,
    "environment": environment,
    "fsdp_refused": fsdp_refused,
    "mixing_refused": mixing_refused,
    "clipped_gradients": clipped_gradients,
    "conv_clipped_gradients": conv_clipped_gradients,
    "moe_clipped_gradients": moe_clipped_gradients,
    "all_reduce_calls": all_reduce_calls,
    "privacy_engine_step": privacy_engine_step,
}


__all__ = ["C", "CFG", "GROUPS", "SCENARIOS", "center_block", "global_ids", "lm_step", "mixing_step", "model",
           "moe_model", "np", "share"]
