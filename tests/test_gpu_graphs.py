"""The DP step captured in a real CUDA graph (``dpgrad.graphed_step``): exact against the eager
step, fresh noise at each replay, the accounting per replay, a non-finite replay withheld and
reported, and a step that waits for the GPU refused. Skipped without CUDA (the CPU tests of the
same code path are in ``tests/test_graphs.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.gpu, pytest.mark.opacus,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

opacus = pytest.importorskip("opacus")
transformers = pytest.importorskip("transformers")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dpgrad  # noqa: E402
import dpgrad.opacus  # noqa: E402

V, T, N, BATCH, PHYSICAL = 64, 16, 256, 16, 32


def _gpt2():
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).cuda()


def _private(single: bool, noise: float, lr: float = 0.05):
    torch.manual_seed(0)
    model = _gpt2()
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(1))
    engine = opacus.PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(ids), batch_size=BATCH), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=noise, max_grad_norm=1.0, single_backward=single, physical_batch_size=PHYSICAL,
        cuda_graph=True)

    assert optimizer.original_optimizer.param_groups[0]["capturable"]

    def step(ids):  # the batch on the GPU already: a graph cannot capture a copy from host memory
        logits = model(ids).logits
        loss = criterion(logits.reshape(-1, V), ids.reshape(-1), shape=logits.shape[:2])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return engine, model, optimizer, criterion, loader, step


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_the_graphed_step_matches_the_eager_step_on_gpu(single):
    runs = {}
    for graphed in (False, True):
        engine, model, optimizer, _, loader, step = _private(single, noise=0.0)
        run = dpgrad.graphed_step(step, module=model, optimizer=optimizer) if graphed else step
        losses = [run(ids.cuda()).clone() for (ids,) in loader]
        torch.cuda.synchronize()
        runs[graphed] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()},
                         list(engine.accountant.history), run)
    (losses, params, history, _), (g_losses, g_params, g_history, graphed) = runs[False], runs[True]
    assert graphed.captured and graphed.replays > 0
    assert g_history == history
    torch.testing.assert_close(torch.stack(g_losses), torch.stack(losses), rtol=1e-5, atol=1e-6)
    for name in params:
        torch.testing.assert_close(g_params[name], params[name], rtol=1e-4, atol=1e-6, msg=name)


def test_each_replay_draws_new_noise_on_gpu():
    engine, model, optimizer, criterion, loader, _ = _private(True, noise=1.0, lr=0.0)
    first = next(p for p in model.parameters() if p.requires_grad)
    ids = next(iter(loader))[0].cuda()

    def step(ids):
        logits = model(ids).logits
        criterion(logits.reshape(-1, V), ids.reshape(-1), shape=logits.shape[:2]).backward()
        optimizer.step()  # lr 0: the parameters stay, so every step's clipped sum is the same
        gradient = first.grad.detach().clone()
        optimizer.zero_grad()
        return gradient

    graphed = dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1)
    draws = [graphed(ids).clone() for _ in range(4)]
    assert graphed.replays == 3
    # Two steps differ by their noise alone: sqrt(2) * sigma * C / expected batch size ("mean").
    std = 2 ** 0.5 * 1.0 * 1.0 / optimizer.expected_batch_size
    for a, b in zip(draws[1:], draws[2:]):
        assert abs((b - a).std().item() / std - 1) < 0.1
    assert engine.accountant.history[-1][2] == 4  # (sigma, sample rate, steps): every replay counted


def test_a_non_finite_replay_adds_nothing_and_is_reported_on_gpu():
    engine, model, optimizer, _, loader, step = _private(True, noise=0.0)
    graphed = dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1)
    batches = [ids.cuda() for (ids,) in loader]
    graphed(batches[0])
    graphed(batches[1])
    bias = model._module.transformer.ln_f.bias
    kept = bias.detach().clone()
    with torch.no_grad():
        bias.fill_(float("nan"))
    graphed(batches[2])
    with torch.no_grad():
        bias.copy_(kept)
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for n, p in model.named_parameters() if "ln_f.bias" not in n)
    with pytest.raises(FloatingPointError, match="1 replayed DP step"):
        graphed(batches[3])
        graphed.raise_if_not_finite()


def test_a_step_that_waits_for_the_gpu_is_refused_on_gpu():
    engine, model, optimizer, _, loader, step = _private(True, noise=1.0)

    def waits(ids):
        loss = step(ids)
        print(f"loss {loss.item():.3f}")
        return loss

    graphed = dpgrad.graphed_step(waits, module=model, optimizer=optimizer, warmup=1)
    batches = [ids.cuda() for (ids,) in loader]
    graphed(batches[0])
    with pytest.raises(RuntimeError, match="could not be captured in a CUDA graph"):
        graphed(batches[1])


def test_a_batch_in_host_memory_is_refused_on_gpu():
    engine, model, optimizer, _, loader, step = _private(True, noise=1.0)
    graphed = dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1)
    batches = [ids for (ids,) in loader]
    graphed(batches[0].cuda())
    with pytest.raises(ValueError, match="copy it to the GPU before the call"):
        graphed(batches[1])


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_graphed_passes_with_the_optimizer_outside_match_the_eager_loop_on_gpu(single):
    """``graphed_step(..., optimizer=None)``: the forward pass and clipped backward replayed, the
    noise and the optimizer's step outside, eager; the replays add to p.grad as eager passes do."""
    runs = {}
    for graphed in (False, True):
        engine, model, optimizer, criterion, loader, _ = _private(single, noise=0.0)

        def pass_(ids):
            logits = model(ids).logits
            loss = criterion(logits.reshape(-1, V), ids.reshape(-1), shape=logits.shape[:2])
            loss.backward()
            return loss.detach()

        run = dpgrad.graphed_step(pass_, module=model, optimizer=None) if graphed else pass_
        losses = []
        for (ids,) in loader:
            losses.append(run(ids.cuda()).clone())
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        runs[graphed] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()},
                         list(engine.accountant.history), run)
    (losses, params, history, _), (g_losses, g_params, g_history, graphed) = runs[False], runs[True]
    assert graphed.captured and graphed.replays > 0 and g_history == history
    torch.testing.assert_close(torch.stack(g_losses), torch.stack(losses), rtol=1e-5, atol=1e-6)
    for name in params:
        torch.testing.assert_close(g_params[name], params[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dptrainer_with_cuda_graph_trains_as_the_eager_trainer_on_gpu(tmp_path):
    """``PrivacyArguments(cuda_graph=True)`` on a GPU: each physical batch replayed from a real
    CUDA graph, the weights and the accounting of the eager trainer."""
    from dpgrad.hf import DPTrainer, PrivacyArguments
    from hf_trainer_worker import gpt2, rows, training_args

    found = {}
    for graph in (False, True):
        torch.manual_seed(0)
        model = gpt2().cuda()
        privacy = PrivacyArguments(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=3, cuda_graph=graph)
        t = DPTrainer(model=model, args=training_args(tmp_path / str(graph), use_cpu=False, max_steps=4),
                      train_dataset=rows(), privacy_args=privacy)
        t.train()
        found[graph] = ({n: p.detach().clone() for n, p in model.named_parameters()}, t.accountant.history, t)
    (eager, history, _), (replayed, g_history, t) = found[False], found[True]
    assert g_history == history
    assert sum(g.replays for g in t._graphed.graphs.values()) > 0
    for name in eager:
        torch.testing.assert_close(replayed[name], eager[name], rtol=1e-4, atol=1e-6, msg=name)
