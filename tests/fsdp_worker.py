"""What each process of tests/test_fsdp.py runs (spawned; gloo on CPU), and the same steps in
one process for the references.

A model is sharded as FSDP2 users write it (``fully_shard`` on each block, then on the root),
then wrapped by dpgrad. Every scenario returns plain numpy arrays (tensors sent through a
queue would live in shared memory that disappears with the process).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn as nn

import dpgrad
from distributed_worker import center_block, lm_step, mixing_step, share
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig

# LayerNorm, an Embedding with padding_idx 0, the output layer tied to the token embedding.
CFG = TinyTransformerConfig(vocab_size=31, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=24,
                            tie_embeddings=True)
LORA_CFG = TinyTransformerConfig(vocab_size=31, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=24)
# Below every per-sample norm: each sample has its own factor.
C = {"transformer": 0.3, "lora": 0.02, "gpt2": 0.3, "layers": 1.0}
GLOBAL_BATCH = 6  # shared by 2 or 3 ranks
MICRO_BATCHES = 2


def model(kind: str) -> nn.Module:
    """The same weights in every process: "transformer" (every parameter trains), "lora"
    (peft LoRA adapters, random B, on a frozen TinyTransformer), "gpt2" (Hugging Face GPT-2:
    Conv1D layers, tied embeddings, default position ids; no dropout) or "layers" (an
    nn.Sequential starting with an Embedding, whose layers ``shard`` shards one by one; the
    Embedding's and the Linears' (B, T, d) outputs are views of their products)."""
    torch.manual_seed(0)
    if kind == "transformer":
        return TinyTransformer(CFG)
    if kind == "layers":
        return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
                             nn.LayerNorm(16), nn.Linear(16, 50))
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=CFG.vocab_size, n_positions=CFG.max_seq_len, n_embd=16,
                                          n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=1, eos_token_id=1))
    from peft import LoraConfig, get_peft_model

    return get_peft_model(TinyTransformer(LORA_CFG),
                          LoraConfig(r=4, target_modules=["qkv", "down"], init_lora_weights=False))


def blocks(net: nn.Module) -> list:
    if isinstance(net, nn.Sequential):  # "layers": each layer with parameters is a block of its own
        return [layer for layer in net if next(layer.parameters(), None) is not None]
    if hasattr(net, "transformer"):  # GPT-2
        return net.transformer.h
    return net.base_model.model.blocks if hasattr(net, "base_model") else net.blocks


def shard(net: nn.Module, precision: str = "fp32", leaves: bool = False) -> nn.Module:
    """FSDP2 as its users write it: each block, then the root (which keeps the embeddings, the
    final norm and the output layer); the "layers" model's layers with parameters, each on its
    own, then the root. With ``leaves``, the position embedding and the final norm are sharded
    on their own first (fully_shard makes them FSDPEmbedding, FSDPLayerNorm)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    if leaves and hasattr(net, "transformer"):  # GPT-2: its position embedding takes one row of ids
        fully_shard(net.transformer.wpe, mp_policy=policy)
    elif leaves:
        fully_shard(net.pos, mp_policy=policy)
        fully_shard(net.ln_f, mp_policy=policy)
    for block in blocks(net):
        fully_shard(block, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    return net


def batches() -> torch.Tensor:
    """(MICRO_BATCHES, GLOBAL_BATCH, T) token ids; the last positions of every other sequence
    are padding (id 0), which the token embedding gives no gradient."""
    ids = torch.randint(1, CFG.vocab_size, (MICRO_BATCHES, GLOBAL_BATCH, CFG.max_seq_len),
                        generator=torch.Generator().manual_seed(1))
    ids[:, ::2, -3:] = CFG.padding_idx
    return ids


def _full(t: torch.Tensor) -> np.ndarray:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().double().numpy()


def clipped_gradients(rank: int, world: int, kind: str, single: bool, reduction: str,
                      precision: str = "fp32", leaves: bool = False, no_sync: bool = False,
                      opacus_name: bool = False, sharded: bool = True, automatic: bool = False) -> dict:
    """The gathered gradient after the clipped backward of MICRO_BATCHES micro-batches
    (accumulated), and this rank's per-sample norms of each. With ``no_sync``, FSDP reduces
    only the last micro-batch's gradients (``set_requires_gradient_sync``), with the sum of
    the unsharded gradients of all. With ``opacus_name``, the wrapper is built by its Opacus
    name for sharded models (GradSampleModuleFastGradientClippingFSDP). With ``automatic``,
    automatic clipping (``clipping="automatic"``)."""
    net = model(kind)
    if sharded:
        shard(net, precision, leaves)
    elif precision == "bf16":
        net = net.to(torch.bfloat16)
    wrapper = dpgrad.GradSampleModuleFastGradientClippingFSDP if opacus_name and sharded else \
        dpgrad.GradSampleModuleFastGradientClipping
    wrapped = wrapper(net, max_grad_norm=C[kind], single_backward=single, loss_reduction=reduction,
                      clipping="automatic" if automatic else "flat")
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(reduction=reduction), reduction)
    norms = []
    for i, ids in enumerate(batches()):
        if sharded and no_sync:
            net.set_requires_gradient_sync(i == MICRO_BATCHES - 1)
        lm_step(wrapped, criterion, share(ids, rank, world))
        norms.append(wrapped.per_sample_gradient_norms.detach().double().numpy())
    grads = {n: _full(p.grad) for n, p in net.named_parameters() if p.requires_grad}
    return {"grads": grads, "norms": np.stack(norms)}


def noisy_step(rank: int, world: int, kind: str, single: bool, mode: str = "ghost", sharded: bool = True,
               wrap: bool = True) -> dict:
    """One step of ``dpgrad.opacus.make_private`` (noise multiplier 1, SGD with lr 1, a
    generator seeded alike everywhere; ``mode``, its grad_sample_mode on the sharded model),
    each rank on its share of the batch: the gathered parameters after it. With ``wrap=False``
    the sharded model itself is called (its hooks object returned in the wrapper's place)."""
    import dpgrad.opacus
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    net = model(kind)
    if sharded:
        shard(net)
    data = TensorDataset(batches()[0])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if sharded else None
    wrapped, optimizer, criterion, loader = dpgrad.opacus.make_private(
        PrivacyEngine(), module=net,
        optimizer=torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=1.0),
        data_loader=DataLoader(data, batch_size=len(data) // world, sampler=sampler),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=C[kind], poisson_sampling=False,
        single_backward=single, noise_generator=torch.Generator().manual_seed(7),
        grad_sample_mode=mode if sharded else "ghost", wrap_model=wrap,
    )
    if not wrap:
        assert isinstance(wrapped, dpgrad.GradSampleHooksFastGradientClipping) and wrapped._module is net
        wrapped = net  # the caller calls its own model
    (batch,) = next(iter(loader))
    assert torch.equal(batch, share(batches()[0], rank, world))
    optimizer.zero_grad()
    lm_step(wrapped, criterion, batch)
    optimizer.step()
    return {"params": {n: _full(p) for n, p in net.named_parameters() if p.requires_grad},
            "optimizer": type(optimizer).__name__}


def poisson_batches(rank: int, world: int) -> list:
    """The positions, within this rank's share of the data set, of the samples in each of the
    Poisson batches ``dpgrad.opacus.make_private`` draws for it (every process seeded alike)."""
    import dpgrad.opacus
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    net = shard(model("transformer"))
    data = TensorDataset(torch.arange(64))
    _, _, _, loader = dpgrad.opacus.make_private(
        PrivacyEngine(), module=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0)
    loader.batch_sampler.shuffle = False  # rank r's share is then r, r + world, ...: positions are i // world
    return [sorted((batch // world).tolist()) for (batch,) in loader]


def refusal(rank: int, world: int, case: str) -> str:
    """The error of a model dpgrad cannot clip exactly under FSDP2 (or "no error")."""
    from torch.distributed.fsdp import fully_shard

    net = model("transformer")
    try:
        if case == "tied apart":  # the token embedding sharded alone, the tied output layer by the root
            fully_shard(net.tok)
            fully_shard(net)
            dpgrad.GradSampleModuleFastGradientClipping(net)
        elif case == "grad sample module":
            dpgrad.GradSampleModule(shard(net))
        elif case == "sharded after wrapping":
            wrapped = dpgrad.GradSampleModuleFastGradientClipping(net)
            shard(net)
            wrapped(batches()[0][:, :-1])
        elif case == "other torch":  # an FSDP2 without the final callback dpgrad drives
            from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

            callback = FSDPState._root_post_backward_final_callback
            del FSDPState._root_post_backward_final_callback
            try:
                dpgrad.GradSampleModuleFastGradientClipping(shard(net))
            finally:
                FSDPState._root_post_backward_final_callback = callback
        elif case == "opacus name, not sharded":
            dpgrad.GradSampleModuleFastGradientClippingFSDP(net)
        elif case == "clipping groups":
            dpgrad.GradSampleModuleFastGradientClipping(shard(net), clipping="per_layer",
                                                        max_grad_norm=[1.0] * len(list(net.parameters())))
        elif case in ("mixing model", "mixing loss"):  # dpgrad.checks.independence, through FSDP2's hooks
            if case == "mixing model":
                center_block(net)
            wrapped = dpgrad.GradSampleModuleFastGradientClipping(shard(net), max_grad_norm=C["transformer"],
                                                                  single_backward=True)
            return mixing_step(net, wrapped, wrapped, share(batches()[0], rank, world), reorder=case == "mixing loss")
        elif case == "blocks only":
            for block in net.blocks:
                fully_shard(block)
            dpgrad.GradSampleModuleFastGradientClipping(net)
    except (NotImplementedError, RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def uneven_batches(rank: int, world: int, single: bool, mixing: bool) -> list:
    """Steps whose ranks hold different numbers of samples (Poisson batches: rank 0 one
    sample, rank 1 three, then two each): what each step did, "ok" or its refusal's first
    line. The independence check's passes are FSDP2's collectives: every rank runs as many."""
    net = model("transformer")
    if mixing:
        center_block(net)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(shard(net), max_grad_norm=C["transformer"],
                                                          single_backward=single)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss(), "mean")
    ids, seen = batches()[0], []
    for sizes in [(1, 3), (2, 2)]:
        start = sum(sizes[:rank])
        try:
            lm_step(wrapped, criterion, ids[start:start + sizes[rank]])
            seen.append("ok")
        except dpgrad.SampleMixingError as err:
            seen.append(str(err).splitlines()[0])
            break
        wrapped.zero_grad()
    return seen


def held_gradients(rank: int, world: int) -> dict:
    """Single backward: at each reduce-scatter, the bytes of full (unsharded) clipped gradients
    handed to FSDP and whether FSDP had freed them when it returned; each parameter group's
    bytes and the model's; whether every unsharded copy's gradient is freed at the end."""
    net = shard(model("transformer"))
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=C["transformer"], single_backward=True)
    sharded = wrapped._path.sharded
    calls = []
    reduce_scatter = sharded.reduce_scatter

    def counted(group, sums):
        held = sum(s.numel() * s.element_size() for s in sums.values())
        reduce_scatter(group, sums)
        # Reduced and freed now, before the next group's sums exist.
        freed = all(fp._unsharded_param.grad is None for fp in sharded._groups[group][1].fsdp_params)
        calls.append((group, held, freed))

    sharded.reduce_scatter = counted
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss())
    lm_step(wrapped, criterion, share(batches()[0], rank, world))
    copies = [fp._unsharded_param for _, group in sharded._groups for fp in group.fsdp_params]
    groups = [sum(fp.sharded_param.numel() * fp.sharded_param.element_size() for fp in group.fsdp_params)
              for _, group in sharded._groups]
    return {"calls": calls, "groups": groups, "freed": all(c.grad is None for c in copies),
            "model": sum(p.numel() * p.element_size() for p in net.parameters())}


def finish_groups(rank: int, world: int, single: bool) -> dict:
    """The finish plan of one step on the sharded transformer: for each group of records, the
    FSDP2 parameter groups its layers belong to."""
    net = shard(model("transformer"))
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=C["transformer"], single_backward=single)
    planned = []
    plan = wrapped._path.planner._plan

    def kept(records, *args):
        planned.append(([record.layer for record in records], plan(records, *args)))
        return planned[-1][1]

    wrapped._path.planner._plan = kept
    lm_step(wrapped, dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss()),
            share(batches()[0], rank, world))
    ((layers, made),) = planned
    return {"groups": [sorted({wrapped._path.sharded.group_of[layers[i]] for i in group.indices})
                       for group in made.groups]}


def after_non_finite(rank: int, world: int, single: bool, sharded: bool = True) -> dict:
    """A step whose losses are not finite: its clipped gradients are withheld (zeros reach
    FSDP, or nothing in double backward on a sharded model, where the host waits for the
    check before the second pass, whose reduce-scatter FSDP runs) and it raises, at its
    backward (``error``) or at the next forward pass (``next_error``); the next step's
    gathered gradient is returned."""
    net = model("transformer")
    if sharded:
        shard(net)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(net, max_grad_norm=C["transformer"], single_backward=single)
    criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss())
    ids = share(batches()[0], rank, world)
    logits = wrapped(ids[:, :-1]) * float("inf")
    error = next_error = "no error"
    try:
        criterion(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), shape=logits.shape[:2]).backward()
    except FloatingPointError as err:
        error = str(err)
    withheld = all(p.grad is None or not _full(p.grad).any() for p in net.parameters())
    try:
        lm_step(wrapped, criterion, ids)
    except FloatingPointError as err:
        next_error = str(err)
        lm_step(wrapped, criterion, ids)
    return {"error": error, "next_error": next_error, "withheld": withheld,
            "grads": {n: _full(p.grad) for n, p in net.named_parameters() if p.requires_grad}}


SCENARIOS = {"after_non_finite": after_non_finite, "poisson_batches": poisson_batches, "held_gradients": held_gradients, "finish_groups": finish_groups, "clipped_gradients": clipped_gradients,
             "noisy_step": noisy_step, "refusal": refusal, "uneven_batches": uneven_batches}


def one_process(name: str, **kwargs) -> Optional[dict]:
    """A scenario in this process on the whole batch, with nothing sharded (the reference)."""
    return SCENARIOS[name](0, 1, sharded=False, **kwargs)


__all__ = ["SCENARIOS", "lm_step", "one_process", "share"]
