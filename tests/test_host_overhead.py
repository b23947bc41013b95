"""The host overhead of dpgrad's DP steps, counted on a CPU: aten operations and host waits.

On a GPU, a DP step of a model with few layers spends much of its time in the host issuing
work, and every operation that makes the host wait for the device (``item()``, a boolean
mask, a data-sized output) empties the queue. What the host is asked to do does not depend
on the device, so it is counted here, deterministically, on the quick models of
``benchmarks/bench_host_overhead.py`` (bench_dp_step's two-layer "-tiny" GPT-2 with tied
embeddings and Llama with LoRA adapters; B=8, T=64, fp32), with the steps built by the same
code (``benchmarks/dispatch_counts.py``), after the same two warm-up steps. Against the
non-private step of the same model:
- the single-backward step dispatches at most ``OPS_PER_LAYER`` more operations per hooked
  layer;
- neither the single- nor the double-backward step waits for the device more often
  (``EXTRA_SYNCS`` = 0), whatever the clipping (flat, per layer, per block, automatic,
  adaptive): the finite check is decided on the device (the double-backward step's operation
  count has no per-layer bound: its second backward pass repeats the model's own backward).
The waits are also counted with every layer clipped from its norms ("ghost", as on the
full-size models, where the tied embedding's cross terms run); there an index made from host
data at step time counts as a wait (on a GPU it is copied from pageable memory, which waits
for the queue).
The kernels are the eager ones whatever ``DPGRAD_BACKEND`` asks for: Triton's interpreter
runs a kernel as host code whose tensor calls a GPU would never see.

The finish step's work does not grow with depth (last section): 6-layer GPT-2 and Llama
models against 2-layer ones of the same layer shapes, on the eager backend and on the Triton
kernels (launches counted under the interpreter, the operations inside them left out). From
the same models, what each hooked layer adds to the whole step over the non-private step: at
most ``OPS_PER_LAYER_ADDED`` where layers of one shape are served together, and a bound per
model family where the eager backend takes a product per layer (``EAGER_BY_LAYER_OPS``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Dict, Tuple

import pytest

BENCHMARKS = str(Path(__file__).parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

pytest.importorskip("transformers")
pytest.importorskip("peft")
import torch  # noqa: E402
from dispatch_counts import (  # noqa: E402
    CLIPPINGS, MODELS, PROVIDERS, WARMUP_STEPS, DispatchCounts, build_model, count, make_step)
from mixed_net import clipped_from_norms  # noqa: E402

# The counts are built once per worker and shared by its tests (the Triton runs under the
# interpreter are the module's slowest): under pytest-xdist the module's tests share a worker.
pytestmark = pytest.mark.xdist_group("test_host_overhead")

OPS_PER_LAYER = 6
EXTRA_SYNCS = 0
BATCH, SEQ_LEN = 8, 64
CPU = torch.device("cpu")

# (model, policy, clipping) -> provider -> (the counts of two consecutive steps, hooked layers)
_counted: Dict[Tuple[str, str, str], Dict[str, Tuple[Tuple[DispatchCounts, DispatchCounts], int]]] = {}
# How layers are clipped: as dpgrad chooses for these small models (from per-sample gradients
# where they are small), or all from their norms, as on the full-size models ("ghost": the
# norm kernels, the clipped sums and the cross terms of the tied embedding run).
POLICIES = ("chosen", "ghost")


def _counts(name: str, policy: str = "chosen",
            clipping: str = "flat") -> Dict[str, Tuple[Tuple[DispatchCounts, DispatchCounts], int]]:
    """Every provider's counts for ``name`` (dpgrad's clipped as ``clipping`` says), measured
    once per session."""
    if (name, policy, clipping) not in _counted:
        built = build_model(name, quick=True, device=CPU, dtype="fp32")
        by_provider = {}
        with pytest.MonkeyPatch.context() as patch, (clipped_from_norms() if policy == "ghost" else nullcontext()):
            patch.setenv("DPGRAD_BACKEND", "eager")
            for provider in PROVIDERS:
                step = make_step(provider, built, BATCH, SEQ_LEN, CPU, clipping=clipping)
                for _ in range(WARMUP_STEPS):
                    step.run()
                by_provider[provider] = ((count(step.run), count(step.run)), step.hooked_layers)
        _counted[(name, policy, clipping)] = by_provider
    return _counted[(name, policy, clipping)]


def _report(provider: str, counts: DispatchCounts, base: DispatchCounts, layers: int) -> str:
    """The figures behind a failed bound, and which operations make the difference."""
    return (f"{provider}: {counts.ops} ops, {counts.syncs} host waits {dict(counts.sync_names)}, "
            f"{layers} hooked layers; non-private: {base.ops} ops, {base.syncs} host waits "
            f"{dict(base.sync_names)}.\nAdded waits: {dict(counts.sync_names - base.sync_names)}."
            f"\nMost added operations: {(counts.names - base.names).most_common(15)}."
            f"\nMost removed operations: {(base.names - counts.names).most_common(5)}.")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", MODELS)
def test_counts_are_the_same_every_step(name, policy):
    for provider, ((first, second), _) in _counts(name, policy).items():
        assert first.names == second.names, (
            f"{name}, {provider}: two steps dispatched different operations: "
            f"{dict(first.names - second.names)} against {dict(second.names - first.names)}")
        assert first.sync_names == second.sync_names


@pytest.mark.parametrize("name", MODELS)
def test_single_backward_adds_few_operations_per_layer(name):
    counted = _counts(name)
    base = counted["non-private"][0][0]
    (counts, _), layers = counted["dpgrad-single"]
    assert layers > 0
    assert counts.ops - base.ops <= OPS_PER_LAYER * layers, (
        f"{name}: {counts.ops - base.ops} more operations than the non-private step, over the bound "
        f"{OPS_PER_LAYER} x {layers} hooked layers = {OPS_PER_LAYER * layers}\n"
        + _report("dpgrad-single", counts, base, layers))


@pytest.mark.parametrize("policy, clipping", [(p, "flat") for p in POLICIES] + [("chosen", c) for c in CLIPPINGS[1:]])
@pytest.mark.parametrize("provider", ["dpgrad-single", "dpgrad-double"])
@pytest.mark.parametrize("name", MODELS)
def test_no_more_host_waits(name, provider, policy, clipping):
    counted = _counts(name, policy, clipping)
    base = counted["non-private"][0][0]
    (counts, _), layers = counted[provider]
    assert counts.syncs - base.syncs <= EXTRA_SYNCS, (
        f"{name}: {counts.syncs - base.syncs} more operations that wait for the device than the "
        f"non-private step (bound {EXTRA_SYNCS})\n" + _report(provider, counts, base, layers))


# ------------------------------------------------------------------ depth
# The finish step of a model 3x deeper, of the same layer shapes, issues the same work: its
# norm pass (norms, coefficients) dispatches the same operations and launches the same
# kernels, and its clipped sums the same kernels and operations but for one hand-off per
# parameter (autograd's accumulation of p.grad, which the non-private backward also does).
# Counted on the eager backend (the models are small, so each group is one batched product),
# and on the Triton kernels under the interpreter with no group small enough to concatenate
# (STACK_ELEMENTS = 0), as at real sizes: there a group of layers of one shape is one launch,
# whatever its number of layers. (The eager backend at real sizes runs a GEMM per layer.) Operations inside a kernel launch are the
# interpreter's, not the host's on a GPU, and are not counted.
# One layer apart: the counts are deterministic, and what a step does once is the same at
# both depths, so one operation more per layer is one more in the count (2 and 6 layers with
# room for 2 caught the same, in 60% more of the interpreter's time).
DEPTHS = (2, 3)
# Operations a deeper model may add besides the hand-offs: none.
DEPTH_SLACK = 0


def _deep_model(kind: str, n_layer: int):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=16, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


class _FinishCounts:
    """Operations dispatched outside kernel launches, and kernel launches (under Triton's
    interpreter), of the norm pass (``finish``) and the clipped sums of a backward path, and of
    whole steps (``step``)."""

    def __init__(self, path, monkeypatch):
        self.counts: Dict[str, Tuple[int, int]] = {}
        # What is being counted: [counts, launches, operations inside launches] each.
        self._active: list = []
        for owner, name, key in ((path, "finish", "norms"), (path.sums, "hand_off", "sums")):
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name), key))
        try:
            from triton.runtime import interpreter
        except ImportError:
            return
        launch = interpreter.GridExecutor.__call__
        active = self._active

        def counted_launch(executor, *args, **kwargs):
            before = [entry[0].ops for entry in active]
            try:
                return launch(executor, *args, **kwargs)
            finally:
                for entry, ops in zip(active, before):
                    entry[1] += 1
                    entry[2] += entry[0].ops - ops

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted_launch)

    def _counted(self, fn, key):
        def run(*args, **kwargs):
            with self.counting(key):
                return fn(*args, **kwargs)

        return run

    @contextmanager
    def counting(self, key: str):
        """Count what runs inside as ``counts[key]``: (operations outside launches, launches)."""
        entry = [DispatchCounts(), 0, 0]
        self._active.append(entry)
        try:
            with entry[0]:
                yield
        finally:
            self._active.remove(entry)
            counts, launches, inside = entry
            self.counts[key] = (counts.ops - inside, launches)


_deep: Dict[tuple, Tuple[Dict[str, Tuple[int, int]], int, int]] = {}
# The step's operations without dpgrad (same model, same batch): (kind, n_layer) -> count.
_plain: Dict[tuple, int] = {}
_IDS = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _plain_step_ops(kind: str, n_layer: int) -> int:
    """The operations of the non-private step of ``_deep_model(kind, n_layer)`` (its second)."""
    if (kind, n_layer) not in _plain:
        import torch.nn as nn

        model, criterion = _deep_model(kind, n_layer), nn.CrossEntropyLoss()
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            counts = DispatchCounts()
            with counts:
                criterion(model(input_ids=_IDS).logits.reshape(-1, 64), _IDS.reshape(-1)).backward()
        _plain[(kind, n_layer)] = counts.ops
    return _plain[(kind, n_layer)]


# How the finish runs: "eager" (the eager backend; these small models' layers of one shape in
# one batched product), "eager-by-layer" (the eager backend with nothing concatenated, as at
# real sizes: a product per layer), "triton" (the Triton kernels, one launch per group of
# layers of one shape, nothing concatenated, under the interpreter).
def _finish_counts(kind: str, n_layer: int, mode: str, setting: str):
    """(counts of the second step's finish and whole step, trainable parameters, hooked layers)
    in ``mode``: "single", "double", "per-block" (single backward, clipped per block, with
    the room in memory a GPU's backward pass makes: every complete block waits for the end of
    the pass), "per-layer" (single backward, clipped per parameter, on a CPU: the complete
    groups wait while their records hold under 8 MiB) or "automatic" (single backward)."""
    key = (kind, n_layer, mode, setting)
    if key not in _deep:
        import torch.nn as nn

        import dpgrad
        from dpgrad.clipping.groups import even_split, per_block
        from dpgrad.backward.group_flush import GroupFlush
        from dpgrad.samplers import groups
        from dpgrad.tuning import tuner

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DPGRAD_BACKEND", "triton" if setting == "triton" else "eager")
            # Choices made afresh for this setting (the cost model's, as everywhere in the suite).
            patch.setattr(tuner, "_TUNER", tuner.Tuner())
            if setting != "eager":
                patch.setattr(groups, "STACK_ELEMENTS", 0)
            model = _deep_model(kind, n_layer)
            clipping = dict(max_grad_norm=1.0)
            if mode == "per-block":
                patch.setattr(GroupFlush, "memory_in_use", staticmethod(lambda device, peak=False: 0))
                blocks = len({per_block(n) for n, p in model.named_parameters() if p.requires_grad})
                clipping = dict(clipping="groups", clipping_groups=per_block, max_grad_norm=even_split(1.0, blocks))
            elif mode == "per-layer":
                params = sum(p.requires_grad for p in model.parameters())
                clipping = dict(clipping="per_layer", max_grad_norm=even_split(1.0, params))
            elif mode == "automatic":
                clipping = dict(clipping="automatic", max_grad_norm=1.0)
            # The independence check (its first steps' probes) is counted apart (bench_host_overhead).
            wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, single_backward=mode != "double",
                                                                  check_independence=False, **clipping)
            criterion = dpgrad.DPLossFastGradientClipping(wrapped, None, nn.CrossEntropyLoss())
            counted = _FinishCounts(wrapped._path, patch)
            with clipped_from_norms():
                for _ in range(2):  # the first step plans the finish and chooses kernels
                    with counted.counting("step"):
                        wrapped.zero_grad(set_to_none=True)
                        logits = wrapped(input_ids=_IDS).logits
                        criterion(logits.reshape(-1, 64), _IDS.reshape(-1), shape=logits.shape[:2]).backward()
        _deep[key] = (dict(counted.counts), sum(p.numel() > 0 for p in model.parameters() if p.requires_grad),
                      len(wrapped._path.layer_names))
    return _deep[key]


# The Triton runs, slow under the interpreter, in single-backward mode only: its finish step
# does all the double-backward one does, and the clipped sums. Per block, where the GPU's
# memory has room for the blocks' records until the end of the pass (``GroupFlush``), the
# blocks are clipped together in the finish, as one group of layers of each shape: on the
# Triton kernels for Llama only (GPT-2's Conv1D layers take the Linear sampler and kernels,
# their weight stored transposed, which GPT-2's flat clipping on the Triton kernels counts).
@pytest.mark.parametrize("kind, mode, setting", [
    pytest.param(kind, mode, setting, id=f"{kind}-{mode}-{setting}") for kind in ("gpt2", "llama")
    for mode, setting in [("single", "eager"), ("double", "eager"), ("single", "triton"), ("per-block", "eager"),
                          ("per-block", "triton")]
    if (kind, mode, setting) != ("gpt2", "per-block", "triton")])
def test_finish_step_does_not_grow_with_depth(kind, mode, setting):
    if setting != "eager":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("kernel launches are counted under Triton's interpreter (CPU tensors)")
    single = mode != "double"
    (shallow, params_shallow, _), (deep, params_deep, _) = (_finish_counts(kind, n, mode, setting) for n in DEPTHS)
    ops, launches = shallow["norms"]
    deep_ops, deep_launches = deep["norms"]
    assert deep_launches == launches, f"norm pass: {launches} launches at depth {DEPTHS[0]}, {deep_launches} at {DEPTHS[1]}"
    assert abs(deep_ops - ops) <= DEPTH_SLACK, f"norm pass: {ops} operations at depth {DEPTHS[0]}, {deep_ops} at {DEPTHS[1]}"
    if setting != "eager":
        assert launches > 0
    if single:
        ops, launches = shallow["sums"]
        deep_ops, deep_launches = deep["sums"]
        assert deep_launches == launches, f"clipped sums: {launches} launches at depth {DEPTHS[0]}, {deep_launches} at {DEPTHS[1]}"
        hand_offs = params_deep - params_shallow
        assert abs(deep_ops - ops - hand_offs) <= DEPTH_SLACK, (
            f"clipped sums: {ops} operations at depth {DEPTHS[0]}, {deep_ops} at {DEPTHS[1]}: {deep_ops - ops} more, for "
            f"{hand_offs} more parameters")


# What each hooked layer adds to the step's operations, over the non-private step: the
# difference between the 6- and 2-layer models' extra operations, per hooked layer more. The
# finish's fixed work (the finite check, the coefficients, the loss's per-sample form) does not
# count here; the quick models' totals above bound it. With the layers of one shape served
# together (concatenated when small, a Triton launch per group), a layer adds no more than
# ``OPS_PER_LAYER_ADDED``, whatever the clipping of single backward (flat, per block with the
# blocks waiting for the end of the pass as on a GPU with room, per layer on a CPU, automatic;
# double backward's second pass is a backward of its own); with a product per layer on the
# eager backend (what it does at real sizes) each layer adds its norm's product and reduction,
# its clipped sum's scaling and product, and the zeroing of its sum on the device should the
# norms not be finite, beyond what the non-private step does for it (``EAGER_BY_LAYER_OPS``,
# per model family: GPT-2's layers have biases and LayerNorms).
OPS_PER_LAYER_ADDED = 2
EAGER_BY_LAYER_OPS = {"gpt2": 7.5, "llama": 6}


@pytest.mark.parametrize("setting, mode", [("eager", "single"), ("eager-by-layer", "single"), ("triton", "single"),
                                           ("eager", "per-block"), ("eager", "per-layer"), ("eager", "automatic")])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_operations_each_layer_adds(kind, setting, mode):
    if setting == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("kernel launches are counted under Triton's interpreter (CPU tensors)")
    shallow, deep = (_finish_counts(kind, n, mode, setting) for n in DEPTHS)
    extra = [found[0]["step"][0] - _plain_step_ops(kind, n) for found, n in zip((shallow, deep), DEPTHS)]
    layers = deep[2] - shallow[2]
    per_layer = (extra[1] - extra[0]) / layers
    bound = EAGER_BY_LAYER_OPS[kind] if setting == "eager-by-layer" else OPS_PER_LAYER_ADDED
    assert per_layer <= bound, (
        f"{kind}, {setting}, {mode}: {extra[0]} operations more than the non-private step at depth {DEPTHS[0]}, "
        f"{extra[1]} at depth {DEPTHS[1]}: {per_layer:.2f} per hooked layer more ({layers}), over {bound}")


def test_profile_device_time_is_kernels_not_regions():
    """``profile_dp_step``'s device time per step sums kernels only: a named region on the
    device (``dpgrad.finish``, ``dpgrad.clip_group``) is a span of the timeline that overlaps
    its kernels and includes idle time, so it is listed apart, never added to the work."""
    from types import SimpleNamespace

    import profile_dp_step

    cuda = torch.autograd.DeviceType.CUDA
    cpu = torch.autograd.DeviceType.CPU

    def event(key, device, us, count=2, annotation=False, cpu_us=0.0):
        return SimpleNamespace(key=key, count=count, device_type=device, is_user_annotation=annotation,
                               self_device_time_total=us if device == cuda else 0.0, self_cpu_time_total=cpu_us,
                               cpu_time_total=cpu_us + (500.0 if key == "dpgrad.finish" else 0.0))

    events = [event("gemm", cuda, 6000.0), event("_linear_gram_norm_kernel", cuda, 2000.0, count=8),
              event("dpgrad.finish", cuda, 7000.0, annotation=True),  # a span: 8 ms of kernels would fit in it
              event("dpgrad.finish", cpu, 0.0, annotation=True, cpu_us=1000.0),
              event("cudaLaunchKernel", cpu, 0.0, count=20, cpu_us=400.0),
              event("cudaStreamSynchronize", cpu, 0.0, count=2, cpu_us=3000.0)]
    found = profile_dp_step.summarise(events, steps=2, top=5, cuda=True)
    assert found["device_ms_per_step"] == pytest.approx(4.0)  # (6 + 2) ms over two steps
    assert [name for name, _, _ in found["top_device"]] == ["gemm", "_linear_gram_norm_kernel"]
    assert found["regions"] == [("dpgrad.finish", 1, 3.5)]
    assert found["launches_per_step"] == 10
    # The host's time by region: everything inside it (its own 1 ms and 0.5 ms of operations,
    # over two steps), the device's span of the same name left out.
    assert found["host_regions"] == [("dpgrad.finish", 1, 0.75)]
    assert found["waiting_ms_per_step"] == pytest.approx(1.5)
    assert found["host_ms_per_step"] == pytest.approx(0.7)  # (1 + 0.4) ms over two steps, less the waits
    without_cuda = profile_dp_step.summarise(events, steps=2, top=5, cuda=False)
    assert without_cuda["device_ms_per_step"] == 0.0 and without_cuda["regions"] == []
