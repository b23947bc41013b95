"""The autotuner: selection, modes, buckets, the store, and agreement with the cost model.

Timings are injected (a timer that returns set figures per candidate) wherever the outcome
must not depend on this machine; the tests at extreme shapes time for real, where one form
does orders of magnitude fewer flops than the other.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from dpgrad import GradSampleModuleFastGradientClipping
from dpgrad.kernels import reference
from dpgrad.tuning import Tuner, bucket, store
from dpgrad.tuning.timing import MAX_ROUNDS, ROUNDS
from dpgrad.tuning.candidates import applicable, shape_of


def fixed_timer(times: dict, calls: list):
    """A timer that runs the candidate once (so failures surface) and returns ``times[name]``."""

    def timer(fn, device, name=""):
        fn()
        calls.append(name)
        return times[name]

    return timer


def linear_inputs(B=4, T=6, d=10, p=12, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g).to(dtype), torch.randn(B, T, p, generator=g).to(dtype)


@pytest.fixture
def tune_on(monkeypatch, tmp_path):
    monkeypatch.setenv("DPGRAD_TUNE", "on")
    monkeypatch.setenv("DPGRAD_TUNE_DIR", str(tmp_path))
    monkeypatch.delenv("DPGRAD_BACKEND", raising=False)
    return tmp_path


def test_fastest_correct_candidate_wins_and_is_stored(tune_on):
    calls = []
    tuner = Tuner(timer=fixed_timer({"eager-direct": 3.0, "eager-gram": 1.0}, calls))
    chosen = tuner.select("linear_norm", linear_inputs())
    assert chosen.name == "eager-gram" and sorted(calls) == ["eager-direct"] * ROUNDS + ["eager-gram"] * ROUNDS
    (decision,) = tuner._decisions.values()
    assert decision.source == "measured" and decision.timings_ms == {"eager-direct": 3.0, "eager-gram": 1.0}
    # A new process: read from the store, nothing timed again.
    calls.clear()
    again = Tuner(timer=fixed_timer({}, calls)).select("linear_norm", linear_inputs(seed=1))
    assert again.name == "eager-gram" and calls == []
    path = store.store_path(store.device_name(torch.device("cpu")), tune_on)
    assert path.exists() and "eager-gram" in path.read_text()


def test_failing_and_wrong_candidates_are_skipped(tune_on, monkeypatch):
    calls = []
    tuner = Tuner(timer=fixed_timer({"eager-direct": 3.0, "eager-gram": 1.0}, calls))

    def broken(A, G):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(reference, "linear_weight_sq_norm_gram", broken)
    with pytest.warns(RuntimeWarning, match=r"candidate eager-gram for linear norm failed on B=4, T=6, d=10, p=12, "
                                            r"float32 \(RuntimeError: out of resources\)"):
        assert tuner.select("linear_norm", linear_inputs()).name == "eager-direct"
    (decision,) = tuner._decisions.values()
    assert decision.skipped["eager-gram"].startswith("failed: RuntimeError")

    tuner = Tuner(timer=fixed_timer({"eager-direct": 3.0, "eager-gram": 1.0}, calls))
    monkeypatch.setattr(reference, "linear_weight_sq_norm_gram", lambda A, G: torch.ones(A.shape[0]))
    assert tuner.select("linear_norm", linear_inputs(B=5)).name == "eager-direct"
    (decision,) = tuner._decisions.values()
    assert decision.skipped["eager-gram"] == "wrong result against the eager reference"


@pytest.mark.parametrize("field, value", [("timings_ms", {"eager-direct": "fast"}), ("skipped", ["eager-gram"]),
                                          ("config", {"BLOCK_K": [64]}), ("spread", "wide")])
def test_an_ill_typed_stored_entry_is_retuned_not_fatal(tune_on, field, value):
    """A store entry for this very shape with a field of the wrong type: warned about and
    measured again, and the step goes on."""
    calls = []
    tuner = Tuner(timer=fixed_timer({"eager-direct": 3.0, "eager-gram": 1.0}, calls))
    tuner.select("linear_norm", linear_inputs())
    (key,) = tuner._decisions
    path = store.store_path(store.device_name(torch.device("cpu")), tune_on)
    data = json.loads(path.read_text())
    data["entries"][key][field] = value
    path.write_text(json.dumps(data))
    calls.clear()
    with pytest.warns(RuntimeWarning, match=f"dropped 1 malformed entries.*'{field}' is not"):
        chosen = Tuner(timer=fixed_timer({"eager-direct": 3.0, "eager-gram": 1.0}, calls)).select(
            "linear_norm", linear_inputs(seed=1))
    assert chosen.name == "eager-gram" and sorted(calls) == ["eager-direct"] * ROUNDS + ["eager-gram"] * ROUNDS


def test_the_exact_shape_table_is_bounded(tune_on, monkeypatch):
    """A step per sequence length (variable-length batches): the table of exact shapes stays
    bounded; the bucketed decisions are kept, so nothing is measured again."""
    from dpgrad.tuning import tuner as tuner_module

    monkeypatch.setattr(tuner_module, "MAX_CHOSEN", 4)
    calls = []
    tuner = Tuner(timer=fixed_timer({"eager-direct": 3.0, "eager-gram": 1.0}, calls))
    for T in range(9, 17):  # one bucket, T <= 16
        assert tuner.select("linear_norm", linear_inputs(T=T)).name == "eager-gram"
        assert len(tuner._chosen) <= 4
    assert len(tuner._decisions) == 1 and sorted(calls) == ["eager-direct"] * ROUNDS + ["eager-gram"] * ROUNDS


def test_modes(tune_on, monkeypatch):
    calls = []
    inputs = linear_inputs()
    monkeypatch.setenv("DPGRAD_TUNE", "off")
    off = Tuner(timer=fixed_timer({}, calls))
    chosen = off.select("linear_norm", inputs)
    (decision,) = off._decisions.values()
    assert decision.source == "cost model" and calls == []
    assert chosen.name == min(decision.estimates_ms, key=decision.estimates_ms.get)

    monkeypatch.setenv("DPGRAD_TUNE", "cached")
    cached = Tuner(timer=fixed_timer({}, calls))
    cached.select("linear_norm", inputs)
    assert calls == [] and next(iter(cached._decisions.values())).source == "cost model"

    monkeypatch.setenv("DPGRAD_TUNE", "on")
    Tuner(timer=fixed_timer({"eager-direct": 1.0, "eager-gram": 4.0}, calls)).select("linear_norm", inputs)
    assert sorted(calls) == ["eager-direct"] * ROUNDS + ["eager-gram"] * ROUNDS
    monkeypatch.setenv("DPGRAD_TUNE", "cached")
    from_store = Tuner(timer=fixed_timer({}, calls))
    assert from_store.select("linear_norm", inputs).name == "eager-direct"
    assert next(iter(from_store._decisions.values())).source == "store"

    monkeypatch.setenv("DPGRAD_TUNE", "sometimes")
    with pytest.raises(ValueError, match="off, cached, on"):
        Tuner().select("linear_norm", inputs)


def test_batch_and_tokens_are_bucketed_not_retuned_per_step(tune_on):
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000)] == [0, 1, 2, 4, 8, 8, 16, 1024]
    calls = []
    tuner = Tuner(timer=fixed_timer({"eager-direct": 1.0, "eager-gram": 4.0}, calls))
    for B in (5, 6, 7, 8, 6, 5):  # Poisson sampling: B moves within the bucket (5..8]
        tuner.select("linear_norm", linear_inputs(B=B, T=6))
    assert len(calls) == 2 * ROUNDS and len(tuner._decisions) == 1
    tuner.select("linear_norm", linear_inputs(B=9, T=6))
    assert len(calls) == 4 * ROUNDS and len(tuner._decisions) == 2


@pytest.mark.parametrize("B,T,d,p,expected", [
    (4, 4, 512, 512, "gram"),  # 2BT^2(p+d) = 131k flops against 2BTpd = 8.4M
    (4, 512, 8, 8, "direct"),  # 33.6M against 262k
])
def test_measured_choice_agrees_with_the_cost_model(tune_on, B, T, d, p, expected):
    """Real CPU timings at shapes where one form is far cheaper: the cost model and the
    clock agree, and both change between gram and direct with the shape."""
    tuner = Tuner()
    A, G = linear_inputs(B, T, d, p)
    chosen = tuner.select("linear_norm", (A, G))
    (decision,) = tuner._decisions.values()
    assert decision.source == "measured"
    assert chosen.name == f"eager-{expected}"
    assert min(decision.estimates_ms, key=decision.estimates_ms.get) == f"eager-{expected}"


def test_cost_model_swaps_gram_and_direct_with_the_shape(monkeypatch):
    """Across T at fixed layer dims, the cost model picks gram for short sequences and direct
    for long ones, with exactly one swap, for both backends' counts."""
    from dpgrad.tuning.cost_model import device_spec, linear_norm_cost

    for backend in ("eager", "triton"):
        spec = device_spec(torch.device("cpu"))
        picks = []
        for T in (2, 8, 32, 128, 512, 2048, 8192):
            cost = {a: linear_norm_cost(a, backend, 8, T, 768, 768, 2).seconds(spec, True) for a in ("gram", "direct")}
            picks.append(min(cost, key=cost.get))
        assert picks[0] == "gram" and picks[-1] == "direct", (backend, picks)
        assert sum(a != b for a, b in zip(picks, picks[1:])) == 1, (backend, picks)


def test_candidates_follow_the_backend(monkeypatch):
    A, G = linear_inputs()
    shape = shape_of("linear_norm", (A, G))
    monkeypatch.delenv("DPGRAD_BACKEND", raising=False)
    assert {c.backend for c in applicable("linear_norm", shape, (A, G))} == {"eager"}
    monkeypatch.setenv("DPGRAD_BACKEND", "triton")
    assert {c.name for c in applicable("linear_norm", shape, (A, G))} == {"triton-direct", "triton-gram"}
    A64, G64 = A.double(), G.double()
    assert {c.backend for c in applicable("linear_norm", shape_of("linear_norm", (A64, G64)), (A64, G64))} == {"eager"}
    A1, G1 = A[:, :1], G[:, :1]
    assert [c.name for c in applicable("linear_norm", shape_of("linear_norm", (A1, G1)), (A1, G1))] == ["triton-outer"]


def test_forced_triton_tunes_between_the_kernels(tune_on, monkeypatch):
    """Under the interpreter the Triton candidates run, are checked and timed like any other."""
    monkeypatch.setenv("DPGRAD_BACKEND", "triton")
    calls = []
    tuner = Tuner(timer=fixed_timer({"triton-direct": 2.0, "triton-gram": 1.0}, calls))
    assert tuner.select("linear_norm", linear_inputs(B=3, T=20, d=33, p=17)).name == "triton-gram"
    (decision,) = tuner._decisions.values()
    assert decision.config is not None and "BT" in decision.config


def test_wrapper_records_a_decision_per_layer(tune_on):
    """Through the wrapper: every hooked Linear/Embedding gets a decision, with Opacus timed
    (each clipped from its norms: layers this small would otherwise be from their per-sample
    gradients)."""
    from dpgrad.tuning import get_tuner
    from mixed_net import clipped_from_norms

    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    wrapped = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, loss_reduction="sum")
    get_tuner().forget()
    with get_tuner().recording(opacus=True) as rec, clipped_from_norms():
        wrapped(torch.randint(0, 20, (3, 5))).sum().backward()
    kinds = sorted((type(layer).__name__, d.kind) for layer, d, _ in rec.layers)
    assert kinds == [("Embedding", "embedding_norm"), ("Linear", "linear_norm"), ("Linear", "linear_norm")]
    assert all(isinstance(ms, float) and ms > 0 for _, _, ms in rec.layers)


# ------------------------------------------------------------------------ failing kernels
def _with_triton(kind, shape, tensors):
    """The candidates ``auto`` allows on a GPU, Triton's beside the eager ones (on CPU tensors
    the Triton kernels run under the interpreter)."""
    from dpgrad.tuning.candidates import CANDIDATES

    return [c for c in CANDIDATES[kind] if kind != "linear_norm" or (c.algorithm == "outer") == (shape.T == 1)]


def _one_linear():
    from collections import OrderedDict

    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc=nn.Linear(10, 12)))


def _norms_step(wrapped, x):
    wrapped.zero_grad(set_to_none=True)
    wrapped(x).square().sum().backward()
    return wrapped.get_norm_sample()


def _reference_norms(model, x):
    from per_sample_reference import per_sample_grads, total_norm

    return total_norm(per_sample_grads(model, x, torch.zeros(x.shape[0]), lambda out, y: out.square().flatten(1).sum(1)))


def test_a_kernel_that_fails_in_a_step_falls_back_for_good(tune_on, monkeypatch):
    """A Triton kernel that fails once it was chosen (as one that does not compile for a new
    shape of the same bucket): the step completes on the eager candidate with exact norms,
    one warning names the layer, the shape and the error, and the tune store keeps the eager
    choice, so that a new process does not try the kernel again."""
    import copy
    import warnings

    from dpgrad.kernels.backend import triton_ops
    from dpgrad.tuning import tuner as tuner_module
    from per_sample_reference import assert_norms_close

    monkeypatch.setattr(tuner_module, "applicable", _with_triton)
    calls = []
    monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=fixed_timer({"triton-outer-product": 1.0,
                                                                          "eager-bmm": 4.0}, calls)))
    model = _one_linear()
    wrapped = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=1.0, loss_reduction="sum")
    x = torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(1))
    expected = _reference_norms(model, x)
    assert_norms_close(_norms_step(wrapped, x), expected, "norms, Triton kernel working")
    assert tuner_module.get_tuner()._decisions and calls[:2] == ["triton-outer-product", "eager-bmm"]
    timed = len(calls)

    failures = []

    def broken(*args, **kwargs):
        failures.append(1)
        raise RuntimeError("PassManager::run failed\nmore lines of the compiler's log")

    monkeypatch.setattr(triton_ops(), "linear_per_sample", broken)
    with pytest.warns(RuntimeWarning) as caught:
        assert_norms_close(_norms_step(wrapped, x), expected, "norms after the kernel failed")
    messages = [str(w.message) for w in caught if "dpgrad" in str(w.message)]
    assert len(messages) == 1 and len(failures) == 1
    assert "'fc' (Linear)" in messages[0] and "B=4, T=6, d=10, p=12" in messages[0]
    assert "PassManager::run failed" in messages[0] and "eager-bmm" in messages[0]
    assert "more lines" not in messages[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_norms_close(_norms_step(wrapped, x), expected, "norms, the next step")
    assert len(failures) == 1

    # A new process: the store's choice, no timing and no second try of the kernel.
    fresh = Tuner(timer=fixed_timer({}, calls))
    monkeypatch.setattr(tuner_module, "_TUNER", fresh)
    wrapped = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=1.0, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_norms_close(_norms_step(wrapped, x), expected, "norms, a new process")
    (decision,) = fresh._decisions.values()
    assert decision.source == "store" and decision.choice == "eager-bmm"
    assert decision.skipped["triton-outer-product"].startswith("failed in a step: RuntimeError: PassManager")
    assert len(failures) == 1 and len(calls) == timed


def test_a_failing_kernel_raises_under_forced_triton(tune_on, monkeypatch):
    """DPGRAD_BACKEND=triton allows no fallback: the error names the layer and says so."""
    from dpgrad.kernels.backend import triton_ops
    from dpgrad.tuning import tuner as tuner_module

    monkeypatch.setenv("DPGRAD_BACKEND", "triton")
    monkeypatch.setattr(tuner_module, "_TUNER", Tuner(timer=fixed_timer({}, [])))

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_ops(), "linear_per_sample", broken)
    wrapped = GradSampleModuleFastGradientClipping(_one_linear(), max_grad_norm=1.0, loss_reduction="sum")
    with pytest.raises(RuntimeError, match=r"layer 'fc' \(Linear\).*PassManager::run failed.*DPGRAD_BACKEND=triton"):
        _norms_step(wrapped, torch.randn(4, 6, 10))


@pytest.mark.parametrize("forced", [False, True])
def test_untuned_kernel_failure_falls_back_or_names_the_layer(tune_on, monkeypatch, forced):
    """Work the autotuner does not choose for (a frozen-weight Linear's bias gradients on 4-D
    inputs) goes through ``backend.guarded``: a failing Triton kernel is done again by the
    eager one, with one warning naming the layer, and not tried again in the process; under
    DPGRAD_BACKEND=triton the error names the layer."""
    from collections import OrderedDict

    from dpgrad import GradSampleModule

    from dpgrad.kernels import backend
    from per_sample_reference import assert_tensor_close, per_sample_grads

    kernels = backend.triton_ops()
    monkeypatch.setattr(backend, "_FAILED", set())
    if forced:
        monkeypatch.setenv("DPGRAD_BACKEND", "triton")
    else:  # on a GPU, auto hands CUDA tensors to the Triton kernels
        monkeypatch.setattr(backend, "ops_for", lambda *tensors: kernels)
    failures = []

    def broken(*args, **kwargs):
        failures.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(kernels, "linear_bias_grad_sample", broken)
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(5, 3)))
    model.proj.weight.requires_grad_(False)
    x = torch.randn(2, 3, 4, 5)
    expected = per_sample_grads(model, x, torch.zeros(2), lambda out, y: out.square().flatten(1).sum(1))["proj.bias"]
    wrapped = GradSampleModule(model, loss_reduction="sum")
    if forced:
        with pytest.raises(RuntimeError, match=r"layer 'proj' \(Linear\).*PassManager.*DPGRAD_BACKEND=triton"):
            wrapped(x).square().sum().backward()
        return
    with pytest.warns(RuntimeWarning, match=r"bias gradients of layer 'proj' \(Linear\) failed on .*PassManager"):
        wrapped(x).square().sum().backward()
    assert_tensor_close(model.proj.bias.grad_sample, expected, "bias per-sample gradients")
    model.proj.bias.grad_sample = None
    wrapped(x).square().sum().backward()
    assert_tensor_close(model.proj.bias.grad_sample, expected, "bias per-sample gradients, again")
    assert len(failures) == 1


def test_a_warm_store_launches_the_stored_config_without_a_search(tune_on, monkeypatch):
    """The Triton config chosen for a shape is stored with the choice; a new process launches
    the kernel with it directly: Triton's config search does not run."""
    import dataclasses

    from dpgrad.kernels import linear_norm_gram

    monkeypatch.setenv("DPGRAD_BACKEND", "triton")
    A, G = linear_inputs(B=3, T=20, d=33, p=17)
    expected = reference.linear_weight_sq_norm_direct(A.double(), G.double())
    first = Tuner(timer=fixed_timer({"triton-direct": 2.0, "triton-gram": 1.0}, []))
    torch.testing.assert_close(first.call("linear_norm", (A, G)).double(), expected, rtol=1e-5, atol=0)
    (decision,) = first._decisions.values()
    assert decision.choice == "triton-gram" and decision.config["BT"] > 0

    searched = []

    def search(*args, **kwargs):
        searched.append(1)
        raise AssertionError("Triton's config search ran")

    monkeypatch.setattr(linear_norm_gram._linear_gram_norm_kernel, "run", search)
    second = Tuner(timer=fixed_timer({}, []))
    cand = second.select("linear_norm", (A, G))
    assert cand.name == "triton-gram" and dict(cand.config) == decision.config
    got = second.call("linear_norm", (A, G))
    assert not searched
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    with pytest.raises(AssertionError, match="config search"):  # what an unconfigured launch does
        dataclasses.replace(cand, config=None).run(A, G)


def test_a_disturbed_timing_does_not_decide(tune_on):
    """Candidates are timed in rounds, in a rotated order, and compared round by round: one
    disturbed timing does not decide (a real case: eager-direct once timed at 13.7 ms against
    eager-gram's 5.1, then at 4.7 every time). The disturbed round keeps the choice from
    counting as stable until it is one round in six; the medians, their spread and the rounds
    are stored."""
    calls = []
    first = {"eager-direct": 13.7}

    def timer(fn, device, name=""):
        fn()
        calls.append(name)
        return first.pop(name) if name in first else {"eager-direct": 4.7, "eager-gram": 5.1}[name]

    tuner = Tuner(timer=timer)
    assert tuner.select("linear_norm", linear_inputs(B=4, T=16, d=64, p=64)).name == "eager-direct"
    (decision,) = tuner._decisions.values()
    assert decision.timings_ms == {"eager-direct": 4.7, "eager-gram": 5.1}
    assert decision.stable and decision.rounds == 6
    assert decision.window_ms == {"eager-direct": [4.7, 4.7], "eager-gram": [5.1, 5.1]}
    # Round by round, the order rotated: direct, gram; gram, direct; ...
    assert calls == ["eager-direct", "eager-gram", "eager-gram", "eager-direct"] * 3
    stored = store.TuneStore(store.device_name(torch.device("cpu")), tune_on).get(decision.key)
    assert stored["choice"] == "eager-direct" and stored["spread"] == decision.spread and stored["rounds"] == 6


def test_a_load_that_slows_one_round_falls_on_every_candidate_of_it(tune_on):
    """Each round a like-for-like window: a load that triples every time in round two (as a
    busy CPU may) changes no ratio, and eager-gram, 10% faster in every round, wins and is
    stable."""
    calls = []
    base = {"eager-direct": 2.2, "eager-gram": 2.0}

    def timer(fn, device, name=""):
        fn()
        calls.append(name)
        return base[name] * (3.0 if 3 <= len(calls) <= 4 else 1.0)

    tuner = Tuner(timer=timer)
    assert tuner.select("linear_norm", linear_inputs(B=4, T=16, d=64, p=64)).name == "eager-gram"
    (decision,) = tuner._decisions.values()
    assert decision.stable and decision.rounds == ROUNDS
    assert decision.timings_ms == {"eager-direct": 2.2, "eager-gram": 2.0}


def test_a_choice_that_does_not_settle_serves_the_process_and_is_not_stored(tune_on):
    """Winners that swap by 2x from round to round: timed up to MAX_ROUNDS, the choice serves
    this process, nothing is stored, and the next process times it again."""
    calls = []

    def timer(fn, device, name=""):
        fn()
        calls.append(name)
        slow = (len(calls) - 1) // 2 % 2  # round by round, each pair of calls
        return {"eager-direct": 2.0 if slow else 1.0, "eager-gram": 1.0 if slow else 2.0}[name]

    inputs = linear_inputs(B=4, T=16, d=64, p=64)
    tuner = Tuner(timer=timer)
    tuner.select("linear_norm", inputs)
    (decision,) = tuner._decisions.values()
    assert not decision.stable and decision.rounds == MAX_ROUNDS and len(calls) == 2 * MAX_ROUNDS
    assert store.TuneStore(store.device_name(torch.device("cpu")), tune_on).get(decision.key) is None
    calls.clear()
    Tuner(timer=timer).select("linear_norm", inputs)
    assert len(calls) == 2 * MAX_ROUNDS


def test_an_entry_stored_before_timing_in_rounds_is_measured_anew(tune_on):
    """An entry without rounds (one timing may have decided it) is not trusted for good."""
    inputs = linear_inputs(B=4, T=16, d=64, p=64)
    first = Tuner(timer=fixed_timer({"eager-direct": 1.0, "eager-gram": 5.0}, []))
    first.select("linear_norm", inputs)
    (key,) = first._decisions
    handle = store.TuneStore(store.device_name(torch.device("cpu")), tune_on)
    old = {k: v for k, v in handle.get(key).items() if k not in ("rounds", "window_ms")}
    handle.put(key, {**old, "choice": "eager-gram", "timings_ms": {"eager-direct": 13.7, "eager-gram": 5.1}})
    calls = []
    again = Tuner(timer=fixed_timer({"eager-direct": 4.7, "eager-gram": 5.1}, calls))
    assert again.select("linear_norm", inputs).name == "eager-direct"
    assert next(iter(again._decisions.values())).source == "measured" and calls


def test_a_stored_choice_found_far_off_is_timed_again_and_the_store_corrected(tune_on):
    """The autotune report times each stored choice on its layer's inputs: one at more than
    twice another candidate's stored time (eager-direct 20 ms here, eager-gram stored at 5) is
    timed again in rounds, and the store takes the new choice."""
    inputs = linear_inputs(B=4, T=16, d=64, p=64)
    Tuner(timer=fixed_timer({"eager-direct": 1.0, "eager-gram": 5.0}, [])).select("linear_norm", inputs)
    calls = []
    later = Tuner(timer=fixed_timer({"eager-direct": 20.0, "eager-gram": 5.0}, calls))
    with later.recording() as rec:
        later.select("linear_norm", inputs)
    (decision,) = later._decisions.values()
    assert decision.choice == "eager-gram" and decision.source == "measured again"
    assert decision.timings_ms == {"eager-direct": 20.0, "eager-gram": 5.0}
    assert calls.count("eager-direct") == 1 + ROUNDS and calls.count("eager-gram") == ROUNDS
    assert next(iter(rec.chosen_ms.values())) == 5.0
    stored = store.TuneStore(store.device_name(torch.device("cpu")), tune_on).get(decision.key)
    assert stored["choice"] == "eager-gram" and stored["rounds"] == ROUNDS
    assert later.select("linear_norm", inputs).name == "eager-gram"  # the step's table was cleared
