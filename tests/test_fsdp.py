"""Ghost clipping on models sharded by FSDP2, 2 and 3 processes on gloo (CPU), against one
process on the global batch.

- Every rank's gathered gradient, after the clipped backward of two micro-batches
  (accumulated), is the one-process clipped sum over FSDP's averaging (divided by the world
  size), fp32 rel 1e-5; each rank's per-sample norms are the one-process norms of its samples.
  Both modes, both reductions; a small transformer with LayerNorm, a padded Embedding and tied
  embeddings, and a peft LoRA model; bf16 parameters with fp32 reduction at bf16 tolerance;
  layers sharded on their own, in the transformer and every layer of an Embedding-first
  nn.Sequential; Hugging Face GPT-2; micro-batches accumulated unreduced
  (``set_requires_gradient_sync(False)``) and reduced once.
- ``dpgrad.opacus.make_private`` on the sharded model takes the one-process noisy step: the
  noise is added once; ranks seeded alike draw independent Poisson batches.
- Single backward hands FSDP one parameter group's gradients at a time, and FSDP frees them;
  only there are the finish step's groups split by FSDP parameter group.
- A step with non-finite norms raises before any gradient reaches FSDP, and the next is right.
- What cannot be exact is refused, naming the layer and what to do.

With every sampler on the Triton kernels (the Makefile's second pass), the two-rank
transformer cases in both modes run; the rest of the matrix adds nothing backend-specific.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import fsdp_worker as F
from dpgrad.tools.ranks import spawn
from per_sample_reference import BACKEND_PASS, assert_norms_close, assert_tensor_close

# Its session-scoped fixture runs once: under pytest-xdist the module's tests share a worker.
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed"),
              pytest.mark.xdist_group("test_fsdp")]
# The Makefile's pass with every sampler on the Triton kernels (the interpreter on a CPU) takes
# the two-rank transformer cases in both modes: what FSDP2 adds is the same on every backend.
whole_matrix = pytest.mark.skipif(BACKEND_PASS, reason="the Triton pass takes the two-rank transformer cases")
MODES = {"single": True, "double": False}
KINDS = ["transformer"] + (["lora"] if importlib.util.find_spec("peft") and not BACKEND_PASS else [])
OPACUS = importlib.util.find_spec("opacus") is not None
BF16_RTOL = 1e-2
CLIPPED = [dict(kind=k, single=s, reduction=r) for k in KINDS for s in MODES.values()
           for r in (("mean",) if BACKEND_PASS else ("mean", "sum"))]
# Three ranks (shards of uneven sizes): the transformer with the mean reduction (the sum's
# scaling is the same on any number of ranks, and two ranks take both; LoRA's adapters are
# sharded like any other parameter, and two ranks take them).
THREE = [kw for kw in CLIPPED if kw["reduction"] == "mean" and kw["kind"] == "transformer"]
BF16 = [dict(kind="transformer", single=s, reduction="mean", precision="bf16") for s in MODES.values()]
LEAVES = [dict(kind="transformer", single=s, reduction="mean", leaves=True) for s in MODES.values()]
LAYERS = [dict(kind="layers", single=s, reduction="mean") for s in MODES.values()]
HF = [dict(kind="gpt2", single=s, reduction="mean", leaves=leaves) for s in MODES.values() for leaves in (False, True)] \
    if importlib.util.find_spec("transformers") else []
OPACUS_NAME = [dict(kind="transformer", single=s, reduction="mean", opacus_name=True) for s in MODES.values()]
AUTOMATIC = [dict(kind="transformer", single=s, reduction="mean", opacus_name=True, automatic=True)
             for s in MODES.values()]
NO_SYNC = [dict(kind=k, single=s, reduction="mean", no_sync=True) for k in KINDS for s in MODES.values()]
REFUSALS = ["tied apart", "grad sample module", "sharded after wrapping", "blocks only", "other torch",
            "opacus name, not sharded", "clipping groups", "mixing model", "mixing loss"]


@pytest.fixture(scope="session")  # once per worker, however its tests interleave
def two():
    jobs = [("clipped_gradients", kw) for kw in CLIPPED]
    if BACKEND_PASS:
        return jobs, spawn(2, jobs, "fsdp_worker")
    jobs += [("clipped_gradients", kw) for kw in BF16 + LEAVES + LAYERS + NO_SYNC + HF + OPACUS_NAME + AUTOMATIC]
    jobs += [("held_gradients", {})] + [("refusal", dict(case=c)) for c in REFUSALS]
    jobs += [("finish_groups", dict(single=s)) for s in MODES.values()]
    jobs += [("after_non_finite", dict(single=s)) for s in MODES.values()]
    jobs += [("uneven_batches", dict(single=s, mixing=m)) for s in MODES.values() for m in (False, True)]
    if OPACUS:
        jobs += [("noisy_step", dict(kind=k, single=s)) for k in KINDS for s in MODES.values()]
        jobs += [("noisy_step", dict(kind="transformer", single=True, mode="ghost_fsdp")), ("poisson_batches", {})]
        jobs += [("noisy_step", dict(kind="transformer", single=s, wrap=False)) for s in MODES.values()]
    return jobs, spawn(2, jobs, "fsdp_worker")


@pytest.fixture(scope="session")  # once per worker, however its tests interleave
def three():
    jobs = [("clipped_gradients", kw) for kw in THREE]
    return jobs, spawn(3, jobs, "fsdp_worker")


def _results(ranks, name, **kwargs):
    jobs, results = ranks
    i = jobs.index((name, kwargs))
    return [out[i] for out in results]


def _check_clipped(ranks, kw, rtol=1e-5):
    world = len(ranks[1])
    ref = F.one_process("clipped_gradients", **kw)
    if kw.get("precision") != "bf16":
        assert (ref["norms"] > F.C[kw["kind"]]).all(), "every sample should be clipped"
    for rank, got in enumerate(_results(ranks, "clipped_gradients", **kw)):
        assert_norms_close(torch.from_numpy(got["norms"]), torch.from_numpy(ref["norms"][:, rank::world]),
                           f"rank {rank} norms", rtol=rtol)
        assert set(got["grads"]) == set(ref["grads"])
        for n, expected in ref["grads"].items():
            assert np.abs(expected).max() > 0, n
            assert_tensor_close(torch.from_numpy(got["grads"][n]), torch.from_numpy(expected) / world,
                                f"rank {rank} {n}", rtol=rtol)


@pytest.mark.parametrize("kw", CLIPPED, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_two_ranks_take_the_one_process_clipped_sum(two, kw):
    _check_clipped(two, kw)


@whole_matrix
@pytest.mark.parametrize("kw", THREE, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_three_ranks_take_the_one_process_clipped_sum(three, kw):
    _check_clipped(three, kw)


@whole_matrix
@pytest.mark.parametrize("kw", BF16, ids=lambda kw: "single" if kw["single"] else "double")
def test_bf16_parameters_fp32_reduction(two, kw):
    """MixedPrecisionPolicy(bf16 parameters, fp32 reduce) against one process in bf16."""
    _check_clipped(two, kw, rtol=BF16_RTOL)


@whole_matrix
@pytest.mark.parametrize("kw", LEAVES, ids=lambda kw: "single" if kw["single"] else "double")
def test_layers_sharded_on_their_own(two, kw):
    """An Embedding and a LayerNorm sharded alone (fully_shard makes them FSDPEmbedding and
    FSDPLayerNorm) are clipped by their classes' samplers."""
    _check_clipped(two, kw)


@whole_matrix
@pytest.mark.parametrize("kw", LAYERS, ids=lambda kw: "single" if kw["single"] else "double")
def test_every_layer_sharded_on_its_own(two, kw):
    """Embedding, Linear, GELU, Linear, LayerNorm, Linear, each layer with parameters sharded on
    its own, then the root. FSDP2 hooks a sharded module's output to all-gather its parameters
    for its backward; the Embedding's and the Linears' outputs are views, which dpgrad's first
    forward pass hands on as tensors of their own: their gradients must still pass through the
    hooked views, or the backward meets parameters FSDP has resharded."""
    _check_clipped(two, kw)


@whole_matrix
@pytest.mark.parametrize("kw", HF, ids=lambda kw: ("single" if kw["single"] else "double") + ("-wpe" if kw["leaves"] else ""))
def test_hugging_face_gpt2(two, kw):
    """Conv1D layers, tied embeddings and default position ids (one row, broadcast over the
    batch), each block sharded and the root; with "-wpe", the position embedding, which the
    wrapper calls again on the ids expanded to the batch, sharded on its own too."""
    _check_clipped(two, kw)


@whole_matrix
@pytest.mark.parametrize("kw", OPACUS_NAME, ids=lambda kw: "single" if kw["single"] else "double")
def test_opacus_name_for_the_wrapper(two, kw):
    """dpgrad.GradSampleModuleFastGradientClippingFSDP, Opacus's class name and constructor."""
    _check_clipped(two, kw)


@whole_matrix
@pytest.mark.parametrize("kw", AUTOMATIC, ids=lambda kw: "single" if kw["single"] else "double")
def test_automatic_clipping(two, kw):
    """clipping="automatic" on the sharded model, through Opacus's name for the wrapper."""
    _check_clipped(two, kw)


@whole_matrix
@pytest.mark.parametrize("kw", NO_SYNC, ids=lambda kw: f"{kw['kind']}-{'single' if kw['single'] else 'double'}")
def test_accumulation_reduced_once(two, kw):
    """Micro-batches under set_requires_gradient_sync(False), then one that reduces them all."""
    _check_clipped(two, kw)


@whole_matrix
def test_single_backward_holds_one_group_of_gradients_at_a_time(two):
    for rank, got in enumerate(_results(two, "held_gradients")):
        groups = [g for g, _, _ in got["calls"]]
        assert sorted(groups) == list(range(len(got["groups"]))), f"rank {rank}: each group once, {groups}"
        for group, held, freed in got["calls"]:
            assert held == got["groups"][group], f"rank {rank}: group {group} held {held} bytes"
            assert freed, f"rank {rank}: group {group}'s gradients outlived its reduce-scatter"
        assert max(held for _, held, _ in got["calls"]) < got["model"] / 2
        assert got["freed"], f"rank {rank}: an unsharded copy kept its gradient"


@whole_matrix
@pytest.mark.parametrize("mode", list(MODES))
def test_a_non_finite_step_raises_and_the_next_one_is_right(two, mode):
    """Non-finite norms: the step's clipped gradients are withheld (zeros, or nothing where
    the host waits: double backward on a sharded model) and it raises, at the next forward
    pass, or at its backward where the host waited; FSDP is left ready for the next step,
    whose gradient is the one-process clipped sum of its batch."""
    ref = F.after_non_finite(0, 1, single=MODES[mode], sharded=False)  # the whole batch in one process
    assert ref["error"] == "no error" and "non-finite" in ref["next_error"], ref
    for rank, got in enumerate(_results(two, "after_non_finite", single=MODES[mode])):
        said = got["next_error"] if MODES[mode] else got["error"]
        assert "non-finite per-sample gradient norms" in said, got
        assert got["withheld"], f"rank {rank}: a gradient was written"
        for n, expected in ref["grads"].items():
            assert_tensor_close(torch.from_numpy(got["grads"][n]), torch.from_numpy(expected) / 2, f"rank {rank} {n}")


@whole_matrix
def test_groups_split_by_fsdp_group_only_where_sums_are_reduce_scattered(two):
    """Single backward: each group of the finish step within one FSDP2 parameter group.
    Double backward (norms alone): layers of equal shapes batched across blocks as without FSDP."""
    single = _results(two, "finish_groups", single=True)[0]["groups"]
    double = _results(two, "finish_groups", single=False)[0]["groups"]
    assert all(len(g) == 1 for g in single), single
    assert any(len(g) > 1 for g in double), double
    assert len(double) < len(single)


@whole_matrix
@pytest.mark.skipif(not OPACUS, reason="needs opacus")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_make_private_adds_the_noise_once(two, kind, mode, monkeypatch):
    """Every rank seeds its generator alike; each adds its shard's slice of the noise, so the
    step is the one-process step with that generator, noise included. The one-process step
    takes Opacus's optimizer, whose draws (parameter by parameter) the FSDP optimizer repeats."""
    import dpgrad.opacus.engine
    from opacus.optimizers import DPOptimizerFastGradientClipping

    monkeypatch.setattr(dpgrad.opacus.engine, "DPOptimizerFastGradientClipping", DPOptimizerFastGradientClipping)
    ref = F.one_process("noisy_step", kind=kind, single=MODES[mode])
    assert ref["optimizer"] == "DPOptimizerFastGradientClipping"
    start = {n: p.detach().double().numpy() for n, p in F.model(kind).named_parameters() if p.requires_grad}
    runs = [_results(two, "noisy_step", kind=kind, single=MODES[mode])]
    if kind == "transformer" and mode == "single":  # Opacus's name for it too
        runs.append(_results(two, "noisy_step", kind=kind, single=True, mode="ghost_fsdp"))
    if kind == "transformer":  # the sharded model left unwrapped (wrap_model=False), called itself
        runs.append(_results(two, "noisy_step", kind=kind, single=MODES[mode], wrap=False))
    for rank, got in ((rank, got) for ranks in runs for rank, got in enumerate(ranks)):
        assert got["optimizer"] == "FSDPOptimizerFastGradientClipping"
        for n, expected in ref["params"].items():
            update = torch.from_numpy(expected - start[n])
            assert update.abs().max() > 0, n
            assert_tensor_close(torch.from_numpy(got["params"][n] - start[n]), update, f"rank {rank} {n}")


@whole_matrix
@pytest.mark.skipif(not OPACUS, reason="needs opacus")
def test_ranks_seeded_alike_sample_independently(two):
    """Opacus's distributed Poisson sampler would draw every rank's mask from the global
    generator, the same on ranks seeded alike: the same positions of each rank's share taken
    together. make_private gives each rank a generator of its own."""
    first, second = (got for got in _results(two, "poisson_batches"))
    assert len(first) > 3 and len(second) > 3
    assert first != second, "ranks seeded alike drew the same Poisson batches"


@whole_matrix
@pytest.mark.parametrize("case, words", [
    ("tied apart", ["'head.weight' and 'tok.weight' were one tied parameter", "on 'the root' and on 'tok'",
                    "one fully_shard call"]),
    ("grad sample module", ["sharded by FSDP", "GradSampleModuleFastGradientClipping"]),
    ("sharded after wrapping", ["replaced after wrapping", "Shard or change the model first"]),
    ("blocks only", ["not sharded by any fully_shard call", "fully_shard(model)"]),
    ("other torch", ["does not recognise this torch's FSDP internals", torch.__version__, "DistributedDataParallel"]),
    ("opacus name, not sharded", ["takes a model sharded by FSDP2", "GradSampleModuleFastGradientClipping"]),
    ("clipping groups", ["clipping='per_layer' is not available on a model sharded by FSDP2", "flat clipping"]),
    ("mixing model", ["samples are mixed inside the model", "(grads untouched: True)"]),
    ("mixing loss", ["in another order than the batch", "(grads untouched: True)"]),
])
def test_what_cannot_be_exact_is_refused(two, case, words):
    for message in _results(two, "refusal", case=case):
        assert all(w in message for w in words), message


@whole_matrix
@pytest.mark.parametrize("single", list(MODES.values()), ids=list(MODES))
def test_ranks_with_batches_of_different_sizes_probe_alike(two, single):
    """The independence check under FSDP2 with one sample on rank 0 and three on rank 1: the
    ranks run as many probe passes (FSDP2's collectives: no rank waits forever), a per-sample
    model steps on, and a mix found on rank 1's batch stops both ranks at that step."""
    for seen in _results(two, "uneven_batches", single=single, mixing=False):
        assert seen == ["ok", "ok"], seen
    first, second = _results(two, "uneven_batches", single=single, mixing=True)
    assert first == ["samples are mixed: the independence probe of another rank's batch found it (this is rank 0; "
                     "that rank's error names the layers or the loss). If the model and the loss are per-sample by "
                     "construction, pass check_independence=False to the wrapper (or make_private / "
                     "PrivacyArguments); that gives up this check. Nothing has reached p.grad from this pass."], first
    assert len(second) == 1 and second[0].startswith("samples are mixed inside the model"), second
