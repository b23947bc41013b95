"""A DP step captured in a CUDA graph: ``dpgrad.graphed_step`` and ``make_private(cuda_graph=True)``.

A CPU has no CUDA graph. ``Rerun`` stands in for one as far as a CPU allows: its capture runs
the step once (what the capture and its first replay do together) and each later replay runs
it again on the same input memory, writing its outputs into the captured ones, with what the
graphed step does around a replay (the accountant called per replay, finite checks counted on
the device, the optimizer's skip queue popped) as for a real graph. So the graphed loop must
give exactly the eager loop's parameters, losses and accounting: a batch not copied into the
graph's inputs, padding weights not rewritten in place, a step counted twice or not at all,
fail here. The real capture is tested on a GPU (``tests/test_gpu_graphs.py``).

The whole step under ``torch.compile`` (Inductor) must give the eager step's parameters, up to
the rounding of the fused optimizer arithmetic, and the same accounting, with its graph breaks
at the calls of dpgrad's hooks, backward and optimizer, none inside them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("opacus")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import dpgrad  # noqa: E402
import dpgrad.graphs  # noqa: E402
import dpgrad.opacus  # noqa: E402
from test_fixed_batches import BATCH, Classifier, _dataset  # noqa: E402  (the same model and data)

pytestmark = pytest.mark.opacus



class Rerun(dpgrad.graphs.CudaGraphs):
    """A CPU's stand-in for a CUDA graph (see the module docstring)."""

    def __init__(self):
        self.captures = 0

    def check_device(self, params):
        pass

    def check_inputs(self, leaves):
        pass

    def synchronize(self):
        pass

    def warmup_stream(self):
        return None

    def run_on(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def join(self, stream):
        pass

    def capture(self, fn, generator):
        self.captures += 1
        out = fn()
        first = [True]

        def replay():
            if first[0]:  # the capture ran the step: it was the first replay's work
                first[0] = False
                return
            again = fn()
            for kept, new in zip(tree_flatten(out)[0], tree_flatten(again)[0]):
                if isinstance(kept, torch.Tensor):
                    kept.copy_(new)

        return replay, out

    def finite_memory(self):
        return torch.zeros((), dtype=torch.int32)

    def event(self):
        class Done:
            def query(self):
                return True

            def synchronize(self):
                pass

        return Done()


@pytest.fixture
def rerun(monkeypatch):
    graphs = Rerun()
    monkeypatch.setattr(dpgrad.graphs, "GRAPHS", graphs)
    return graphs


def _private(physical=16, single=True, optimizer=None, **extra):
    torch.manual_seed(0)  # the Poisson sampler draws from the global generator
    model = Classifier()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        data_loader=DataLoader(_dataset(), batch_size=BATCH), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=0.5, single_backward=single,
        noise_generator=torch.Generator().manual_seed(7), physical_batch_size=physical, **extra)
    return engine, model, optimizer, criterion, loader


def _train(how: str, physical=16, single=True, epochs=2, backend="inductor"):
    """``epochs`` of make_private's loop, the step run ``how``: "eager", "graphed"
    (``graphed_step``) or "compiled" (``torch.compile`` with ``backend``); the parameters, the
    losses, the accountant's history, what ran the steps, the step itself and the data loader."""
    engine, model, optimizer, criterion, loader = _private(physical, single)

    def step(ids, labels):
        loss = criterion(model(ids), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    run = {"eager": step, "graphed": lambda: dpgrad.graphed_step(step, module=model, optimizer=optimizer),
           "compiled": lambda: torch.compile(step, backend=backend)}[how]
    run = run if how == "eager" else run()
    losses = [run(ids, labels).clone() for _ in range(epochs) for ids, labels in loader]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, losses, engine.accountant.history, run, step, loader


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_the_graphed_loop_is_the_eager_loop(rerun, single):
    params, losses, history, *_ = _train("eager", single=single)
    g_params, g_losses, g_history, graphed, *_ = _train("graphed", single=single)
    assert graphed.captured and rerun.captures == 1
    assert graphed.replays == len(losses) - graphed.warmup and graphed.eager_steps == graphed.warmup
    assert g_history == history  # every step accounted once, as eagerly
    for a, b in zip(losses, g_losses):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for name in params:
        torch.testing.assert_close(g_params[name], params[name], rtol=0, atol=0, msg=name)


def test_batches_larger_than_the_physical_size_run_eagerly(rerun):
    # A physical size of 8 splits about half the Poisson batches (8 expected): their parts
    # accumulate eagerly, between replays of the others.
    params, losses, history, *_ = _train("eager", physical=8, epochs=4)
    g_params, g_losses, g_history, graphed, *_ = _train("graphed", physical=8, epochs=4)
    assert graphed.replays >= 4 and graphed.eager_steps >= graphed.warmup + 4
    assert g_history == history
    for name in params:
        torch.testing.assert_close(g_params[name], params[name], rtol=0, atol=0, msg=name)


def _graphed(rerun, **extra):
    engine, model, optimizer, criterion, loader = _private(**extra)

    def step(ids, labels):
        loss = criterion(model(ids), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1), model, optimizer, loader


def _batch(size=16):
    ids, labels = _dataset().tensors
    return ids[:size], labels[:size]


def test_inputs_of_another_shape_are_refused(rerun):
    step, *_ = _graphed(rerun)
    step(*_batch())
    step(*_batch())  # captured
    with pytest.raises(ValueError, match=r"captured for inputs \[16, 5\] int64, \[16\] int64 and got \[8, 5\]"):
        step(*_batch(8))


def test_settings_changed_after_the_capture_are_refused_until_reset(rerun):
    step, model, optimizer, _ = _graphed(rerun)
    step(*_batch())
    step(*_batch())
    optimizer.param_groups[0]["lr"] = 0.1
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]: 0.5 -> 0.1.*reset\(\)"):
        step(*_batch())
    step.reset()
    step(*_batch())  # captured again, with the new rate
    assert rerun.captures == 2 and step.captured


def test_a_schedule_inside_the_step_is_refused(rerun):
    engine, model, optimizer, criterion, loader = _private()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer.original_optimizer, step_size=1, gamma=0.5)

    def step(ids, labels):
        criterion(model(ids), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()

    graphed = dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1)
    graphed(*_batch())
    with pytest.raises(ValueError, match="changes the optimizer's settings .*lr"):
        graphed(*_batch())
    assert not graphed.captured


def test_a_step_without_the_optimizer_step_is_refused(rerun):
    engine, model, optimizer, criterion, loader = _private()

    def step(ids, labels):
        criterion(model(ids), labels).backward()

    graphed = dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1)
    graphed(*_batch())
    with pytest.raises(ValueError, match=r"did not step the DP optimizer: call optimizer.step\(\)"):
        graphed(*_batch())


def test_a_non_finite_replay_adds_nothing_and_is_reported(rerun):
    step, model, optimizer, loader = _graphed(rerun, optimizer=None)
    step(*_batch())
    step(*_batch())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model._module.head.bias.fill_(float("nan"))
    ids, labels = _batch()
    step(ids, labels)  # replayed: its norms are NaN, so its clipped sums are withheld
    with torch.no_grad():
        model._module.head.bias.copy_(before["_module.head.bias"])
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Nothing from the batch: SGD's momentum moves the parameters by its buffer alone.
    momentum = {n: optimizer.original_optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    for name in before:
        if name != "_module.head.bias":
            assert torch.isfinite(after[name]).all()
    with pytest.raises(FloatingPointError, match="1 replayed DP step.*added nothing to p.grad"):
        step(ids, labels)
    assert all(torch.isfinite(m).all() for m in momentum.values())
    step(ids, labels)  # reported once; the model trains on
    step.raise_if_not_finite()
    with torch.no_grad():
        model._module.head.bias.fill_(float("nan"))
    step(ids, labels)
    with pytest.raises(FloatingPointError, match="1 replayed DP step"):
        step.reset()  # a withheld replay is not forgotten with the graph


def test_what_cannot_be_captured_is_refused(rerun):
    step, model, optimizer, _ = _graphed(rerun, recheck_independence=5)
    step(*_batch())
    with pytest.raises(ValueError, match="recheck_independence probes the model from Python"):
        step(*_batch())
    with pytest.raises(ValueError, match="warmup must be a whole number"):
        dpgrad.graphed_step(lambda: None, module=model, optimizer=optimizer, warmup=0)
    with pytest.raises(TypeError, match="needs a model wrapped by dpgrad"):
        dpgrad.graphed_step(lambda: None, module=nn.Linear(2, 2), optimizer=optimizer)


def test_a_model_on_the_cpu_is_refused_by_the_real_graphs():
    step, *_ = _graphed(None)
    with pytest.raises(ValueError, match="move the model to a CUDA device"):
        step(*_batch())
    # A batch in host memory: its copy inside the step could not be captured.
    with pytest.raises(ValueError, match=r"tensors on \['cpu'\]: copy it to the GPU before the call"):
        dpgrad.graphs.CudaGraphs().check_inputs([torch.zeros(2), 3])


def test_make_private_refuses_what_a_graph_cannot_replay():
    model = Classifier()
    with pytest.raises(ValueError, match="cuda_graph=True: Poisson batches differ in size.*physical_batch_size"):
        dpgrad.opacus.make_private(
            PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=BATCH), noise_multiplier=1.0, max_grad_norm=1.0,
            cuda_graph=True)
    with pytest.raises(ValueError, match="adaptive clipping makes a new bound tensor"):
        dpgrad.opacus.make_private(
            PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=BATCH), noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, clipping="adaptive", cuda_graph=True)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    dpgrad.opacus.make_private(
        PrivacyEngine(), module=model, optimizer=adam, data_loader=DataLoader(_dataset(), batch_size=BATCH),
        noise_multiplier=1.0, max_grad_norm=1.0, physical_batch_size=16, cuda_graph=True)
    assert adam.param_groups[0]["capturable"] is False  # on a CPU, where no graph is captured


def test_a_non_capturable_optimizer_is_refused(rerun):
    model = Classifier()
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine, module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=BATCH), noise_multiplier=1.0, max_grad_norm=1.0,
        physical_batch_size=16)

    def step(ids, labels):
        criterion(model(ids), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    graphed = dpgrad.graphed_step(step, module=model, optimizer=optimizer, warmup=1)
    graphed(*_batch())
    with pytest.raises(ValueError, match="Adam was made with capturable=False: pass capturable=True"):
        graphed(*_batch())


# ------------------------------------------------------------------ a pass, the optimizer outside
def _train_in_passes(graphed: bool, single=True, epochs=3, zero_grad=True):
    """``epochs`` of make_private's loop at a physical size of 8, each physical batch's forward
    pass and backward run by ``pass_`` (graphed with ``optimizer=None`` or not), the optimizer
    stepped outside it (its skip signals accumulating a Poisson batch's parts)."""
    engine, model, optimizer, criterion, loader = _private(physical=8, single=single)

    def pass_(ids, labels):
        loss = criterion(model(ids), labels)
        loss.backward()
        return loss.detach()

    run = dpgrad.graphed_step(pass_, module=model, optimizer=None) if graphed else pass_
    losses = []
    for _ in range(epochs):
        for ids, labels in loader:
            losses.append(run(ids, labels).clone())
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, losses, engine.accountant.history, run, model


@pytest.mark.parametrize("single", [True, False], ids=["single", "double"])
def test_graphed_passes_with_the_optimizer_outside_are_the_eager_loop(rerun, single):
    params, losses, history, *_ = _train_in_passes(False, single=single)
    g_params, g_losses, g_history, graphed, model = _train_in_passes(True, single=single)
    assert graphed.captured and rerun.captures == 1 and graphed.replays == len(losses) - graphed.warmup
    assert g_history == history
    for a, b in zip(losses, g_losses):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for name in params:
        torch.testing.assert_close(g_params[name], params[name], rtol=0, atol=0, msg=name)


def test_a_graphed_pass_adds_to_p_grad(rerun):
    """Without a step or zero_grad between passes, each replay adds its clipped gradients to what
    p.grad holds, as an eager backward pass does (none overwrites the sums before it), where
    accumulation is allowed; under Poisson sampling the second is refused, graphed or not."""
    found = {}
    for graphed in (False, True):
        engine, model, optimizer, criterion, loader = _private(physical=16)
        ids, labels = _batch()
        with pytest.raises(ValueError, match="Poisson sampling is not compatible with gradient accumulation"):
            for _ in range(2):
                criterion(model(ids), labels).backward()
        optimizer.zero_grad()
        model.allow_grad_accumulation()

        def pass_(ids, labels):
            criterion(model(ids), labels).backward()

        run = dpgrad.graphed_step(pass_, module=model, optimizer=None, warmup=1) if graphed else pass_
        ids, labels = _batch()
        for k in range(4):  # warm-up, capture, two replays
            run(ids, labels)
        found[graphed] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert rerun.captures == 1
    for name, grad in found[False].items():
        torch.testing.assert_close(found[True][name], grad, rtol=0, atol=0, msg=name)


def test_trainable_parameters_changed_after_the_capture_are_refused_until_reset(rerun):
    engine, model, optimizer, criterion, loader = _private(physical=16)
    model.allow_grad_accumulation()  # passes with no step between
    graphed = dpgrad.graphed_step(lambda ids, labels: criterion(model(ids), labels).backward(),
                                  module=model, optimizer=None, warmup=1)
    graphed(*_batch())
    graphed(*_batch())
    model._module.head.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"trainable parameters changed since the step was captured.*reset\(\)"):
        graphed(*_batch())
    graphed.reset()
    graphed(*_batch())
    assert rerun.captures == 2


def test_a_graph_for_each_shape(rerun):
    engine, model, optimizer, criterion, loader = _private(physical=None)
    model.allow_grad_accumulation()  # passes with no step between
    passes = dpgrad.graphs.GraphedPerShape(lambda ids, labels: criterion(model(ids), labels).backward(),
                                           module=model, warmup=1)
    for size in (16, 8, 16, 8, 16):
        passes(*_batch(size))
    assert rerun.captures == 2 and sorted(g.replays for g in passes.graphs.values()) == [1, 2]
    passes.MANY_SHAPES = 2
    with pytest.warns(UserWarning, match="3 input shapes, each captured in a CUDA graph of its own memory"):
        passes(*_batch(4))


@pytest.mark.parametrize("single, backend", [(True, "inductor"), (False, "inductor"), (True, "aot_eager")],
                         ids=["single", "double", "single-aot_eager"])
@pytest.mark.xdist_group("inductor")  # with test_guarantee's: Inductor's first compile paid once
def test_the_step_under_torch_compile_is_the_eager_step(single, backend):
    """The step of the guide (docs/cuda-graphs.md), its loss returned detached, compiled by
    Inductor and by aot_eager (whose graph ran `loss.detach()` on the loss subclass itself)."""
    torch._dynamo.reset()
    params, losses, history, *_ = _train("eager", single=single)
    c_params, c_losses, c_history, _, step, loader = _train("compiled", single=single, backend=backend)
    assert c_history == history
    torch.testing.assert_close(torch.stack(c_losses), torch.stack(losses), rtol=1e-5, atol=1e-6)
    for name in params:  # SGD with momentum, compiled by Inductor: a few ulps from the eager sums
        torch.testing.assert_close(c_params[name], params[name], rtol=1e-5, atol=1e-6, msg=name)
    # The graph breaks of a step: at the calls of dpgrad's model hooks (the layer hooks' module
    # runs eagerly), loss wrapper and backward, and in torch's optimizer step (its own
    # graph_break); none inside dpgrad's code. (Dynamo's graphs, whatever the backend: once.)
    if backend != "inductor":
        return
    ids, labels = next(iter(loader))
    explained = torch._dynamo.explain(step)(ids, labels)
    inside = [str(r.reason).splitlines()[0] for r in explained.break_reasons
              if any("/dpgrad/" in frame.filename for frame in r.user_stack)
              and "disable()`d function" not in str(r.reason)]  # the call of an eager part: at its edge
    assert not inside
    assert explained.graph_break_count <= 5
    torch._dynamo.reset()
