"""Timing candidates for the tuner, and the decision it fills in.

The candidates of a new shape key that the cost model keeps run on the layer's real inputs, are
checked against the eager reference (``_close``) and are timed in rounds (``measure_ms``, or a
timer injected in tests) until the choice is stable; ``Decision`` holds the outcome, and
``_stored`` is the form the tune store keeps. ``CandidateTiming`` is the part of ``Tuner``
(tuner.py) that does this, and that times a stored choice again when the autotune report finds
it far off (``_far_off``); the tuner decides what is timed, and when. Opacus's own sampler is
timed here too, for the report.
"""

from __future__ import annotations

import datetime
import statistics
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from dpgrad.kernels import backend
from dpgrad.kernels import reference

from .candidates import Candidate, Shape, applicable, shape_of

# Candidates predicted this many times slower than the best prediction are not timed.
PRUNE_FACTOR = 8.0
# Candidates are timed in rounds, each round every candidate once, in an order rotated from
# round to round, so that a load on the machine falls on all of them alike: the choice is the
# candidate with the least median over the rounds of its time over the round's fastest (each
# round a like-for-like window). At least ROUNDS rounds, and more, up to MAX_ROUNDS, until the
# choice is stable: against every other candidate, its time over the other's, round by round,
# at most 1 + TIE at the 80th percentile (one disturbed round in five is forgiven). Only a
# stable choice is stored; an unstable one serves this process and is timed again in the next.
ROUNDS = 3
MAX_ROUNDS = 7
TIE = 0.1
# A stored choice that a later run (the autotune report) times at more than this factor of
# another candidate's stored time, or this factor away from its own, is timed again, and the
# store corrected.
FAR_OFF = 2.0
# Relative per-sample tolerance of a candidate's result against the eager reference.
NORM_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def measure_ms(fn: Callable[[], object], device: torch.device, name: str = "") -> float:
    """Time of ``fn`` in ms: the median of ``triton.testing.do_bench`` on a GPU; on a CPU the
    fastest of a few wall-clock runs.

    ``name`` (the candidate's, or "opacus") is for timers injected in tests.
    """
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 7 and (len(times) < 3 or time.perf_counter() - start < 0.25):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    # The fastest run: other processes on a shared CPU only ever add time.
    return min(times)


@dataclass
class Decision:
    """What was chosen for a shape key, and why."""

    kind: str
    key: str
    choice: str
    source: str  # "measured", "store", "cost model" or "only candidate"
    shape: Dict[str, object]
    estimates_ms: Dict[str, float]
    extra_bytes: Dict[str, float]
    timings_ms: Dict[str, float] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    config: Optional[Dict[str, object]] = None
    stored_at: Optional[str] = None  # source "store": when the stored timings were taken
    # Each timed candidate's spread over the rounds: (p80 - p20) / median, and [p20, p80] in ms.
    spread: Dict[str, float] = field(default_factory=dict)
    window_ms: Dict[str, List[float]] = field(default_factory=dict)
    rounds: int = 0  # rounds of timing (source "measured", or stored with it)
    stable: bool = True  # whether the choice held over the rounds (only a stable one is stored)


class CandidateTiming:
    """``Tuner``'s checking and timing of candidates (a mixin: it uses the tuner's ``timer``,
    ``_store`` and ``_chosen``)."""

    def _measure(self, decision: Decision, shape: Shape, candidates: List[Candidate], inputs: tuple,
                 layer: Optional[torch.nn.Module] = None) -> None:
        """Check each candidate the cost model keeps against the eager reference, then time
        the correct ones in rounds (``ROUNDS``): sets the decision's timings, spread, rounds,
        choice and whether it is stable."""
        best = min(decision.estimates_ms.values())
        expected = None
        passed = []
        for cand in candidates:
            if decision.estimates_ms[cand.name] > PRUNE_FACTOR * best:
                decision.skipped[cand.name] = "pruned by the cost model"
                continue
            try:
                out = cand.run(*inputs)  # also compiles and tunes Triton's block sizes
                if expected is None:
                    expected = _reference_result(shape.kind, inputs)
                if not _close(shape.kind, out, expected, shape.dtype):
                    decision.skipped[cand.name] = "wrong result against the eager reference"
                    continue
                passed.append(cand)
            except Exception as exc:  # a candidate that cannot run here is skipped, not fatal
                self._skip(decision, shape, cand, layer, exc)
        decision.timings_ms, decision.spread, decision.window_ms = {}, {}, {}
        times: Dict[str, List[float]] = {c.name: [] for c in passed}
        rounds = 0
        while passed:
            shift = rounds % len(passed)
            for cand in passed[shift:] + passed[:shift]:
                try:
                    times[cand.name].append(self.timer(lambda cand=cand: cand.run(*inputs), shape.device,
                                                       name=cand.name))
                except Exception as exc:
                    self._skip(decision, shape, cand, layer, exc)
            failed = [c for c in passed if len(times[c.name]) <= rounds]
            passed = [c for c in passed if c not in failed]
            for cand in failed:
                del times[cand.name]
            rounds += 1
            if len(passed) < 2 or rounds >= MAX_ROUNDS or (rounds >= ROUNDS and _verdict(times)[1]):
                break
        if not times:
            return
        decision.choice, decision.stable = _verdict(times)
        decision.rounds = rounds
        for name, runs in times.items():
            p20, median, p80 = _quantiles(runs)
            decision.timings_ms[name] = median
            decision.window_ms[name] = [p20, p80]
            decision.spread[name] = (p80 - p20) / median if median > 0 else 0.0

    def _keep(self, shape: Shape, decision: Decision, replacing: bool) -> None:
        """Store a measured decision when its choice is stable; an unstable one only where it
        replaces a stored entry, marked so that it is timed again."""
        if decision.stable:
            self._store(shape).put(decision.key, _stored(decision))
        elif replacing:
            self._store(shape).put(decision.key, {**_stored(decision), "unstable": True})

    def _retime(self, decision: Decision, inputs: tuple, layer) -> None:
        """Time a stored decision's candidates again on ``inputs`` (its choice was found far off)."""
        shape = shape_of(decision.kind, inputs)
        tensors = tuple(t for t in inputs if isinstance(t, torch.Tensor))
        candidates = [c for c in applicable(decision.kind, shape, tensors) if c.name in decision.estimates_ms]
        decision.skipped = {}
        self._measure(decision, shape, candidates, inputs, layer)
        if not decision.timings_ms:
            return
        decision.source = "measured again"
        decision.config = next(c for c in candidates if c.name == decision.choice).triton_config()
        decision.stored_at = None
        self._keep(shape, decision, replacing=True)
        self._chosen.clear()  # steps look the new choice up again

    @staticmethod
    def _skip(decision: Decision, shape: Shape, cand: Candidate, layer, exc: Exception) -> None:
        decision.skipped[cand.name] = f"failed: {type(exc).__name__}: {exc}"[:300]
        warnings.warn(f"dpgrad: candidate {cand.name} for {shape.kind.replace('_', ' ')}"
                      f"{backend.of_layer(layer)} failed on {_describe(shape)} ({backend.first_line(exc)}); "
                      "tuning goes on without it", RuntimeWarning, stacklevel=3)


def _verdict(times: Dict[str, List[float]]) -> tuple:
    """(the choice, whether it is stable) from candidates' times in rounds (``times[name][r]``):
    the least median time over the round's fastest, ties by the median time; stable when,
    against every other candidate, the 80th percentile over the rounds of the choice's time
    over the other's is at most 1 + TIE."""
    rounds = min(len(t) for t in times.values())
    fastest = [min(t[r] for t in times.values()) for r in range(rounds)]
    relative = {name: statistics.median(t[r] / fastest[r] if fastest[r] > 0 else 1.0 for r in range(rounds))
                for name, t in times.items()}
    choice = min(times, key=lambda name: (relative[name], statistics.median(times[name])))
    mine = times[choice]
    stable = all(_quantiles([mine[r] / t[r] if t[r] > 0 else 1.0 for r in range(rounds)])[2] <= 1 + TIE
                 for name, t in times.items() if name != choice)
    return choice, stable


def _far_off(decision: Decision, timed_ms: float) -> bool:
    """Whether a stored choice timed at ``timed_ms`` now is far from what was stored: over
    FAR_OFF times another candidate's stored time, or FAR_OFF times away from its own."""
    others = [t for name, t in decision.timings_ms.items() if name != decision.choice]
    own = decision.timings_ms.get(decision.choice)
    return bool(others) and (timed_ms > FAR_OFF * min(others) or (
        own is not None and own > 0 and not own / FAR_OFF <= timed_ms <= FAR_OFF * own))


def _quantiles(runs: List[float]) -> tuple:
    """(p20, median, p80) of a candidate's rounds."""
    ranked = sorted(runs)
    if len(ranked) == 1:
        return ranked[0], ranked[0], ranked[0]
    cut = statistics.quantiles(ranked, n=5, method="inclusive")
    return cut[0], statistics.median(ranked), cut[3]


def _describe(shape: Shape) -> str:
    dims = ", ".join(f"{k}={v}" for k, v in shape.dims)
    return f"B={shape.B}, T={shape.T}, {dims}, {str(shape.dtype).replace('torch.', '')}"


def _stored(decision: Decision) -> dict:
    """A decision as the tune store keeps it."""
    return {"choice": decision.choice, "timings_ms": decision.timings_ms, "skipped": decision.skipped,
            "spread": decision.spread, "window_ms": decision.window_ms, "rounds": decision.rounds,
            "config": decision.config, "shape": decision.shape,
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _reference_result(kind: str, inputs: tuple):
    if kind == "linear_clipped_sum":
        return reference.linear_clipped_sum(*inputs[:3], out_dtype=torch.float32)[0]
    if kind == "linear_norm":
        return reference.linear_weight_sq_norm_direct(*inputs[:2])
    if kind == "linear_grad_sample":
        return reference.linear_per_sample(*inputs[:2], out_dtype=torch.float32).weight
    if kind == "embedding_norm":
        return reference.embedding_sq_norm(*inputs)
    if kind == "conv_norm":
        return reference.conv_weight_sq_norm_grad_sample(*inputs[:3])
    return reference.embedding_grad_sample(*inputs)


def _close(kind: str, out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Per sample: ||out - expected|| <= rtol * ||expected|| (norms: per element; a clipped
    sum, which has no samples: as a whole)."""
    if isinstance(out, tuple):
        out = out[0]
    if kind == "linear_clipped_sum":
        out, expected = out.reshape(1, -1), expected.reshape(1, -1)
    if out.shape != expected.shape:
        return False
    if out.numel() == 0:
        return True
    rtol = (NORM_RTOL if kind.endswith("norm") else GRAD_RTOL).get(dtype, 1e-5)
    diff = (out.double() - expected.double()).reshape(out.shape[0], -1)
    scale = expected.double().reshape(out.shape[0], -1)
    return bool((diff.norm(dim=1) <= rtol * scale.norm(dim=1) + 1e-30).all())


def _time_opacus(timer, kind: str, layer, inputs: tuple):
    """Opacus 1.6's eager sampler for this layer on the same inputs, in ms (or why not)."""
    if layer is None:
        return "no layer"
    if kind == "linear_clipped_sum":
        return "Opacus has no clipped sum (it sums clipped per-sample gradients)"
    try:
        from opacus.grad_sample import embedding as op_embedding
        from opacus.grad_sample import embedding_norm_sample as op_embedding_norm
        from opacus.grad_sample import linear as op_linear
    except ImportError:
        return "Opacus not installed"
    if kind == "linear_norm":
        A, G = inputs[:2]
        # The weight alone, like the candidates (Opacus would add the bias by another Gram).
        weight_only = types.SimpleNamespace(weight=layer.weight, bias=None)
        fn = lambda: op_linear.compute_linear_norm_sample(weight_only, [A], G)  # noqa: E731
    elif kind == "linear_grad_sample":
        A, G = inputs[:2]
        fn = lambda: op_linear.compute_linear_grad_sample(layer, [A], G)  # noqa: E731
    elif kind == "conv_norm":
        # Opacus has no convolution norm sampler: its per-sample gradients, then their norms.
        from opacus.grad_sample import conv as op_conv

        def fn():
            grads = op_conv.compute_conv_grad_sample(layer, [inputs[0]], inputs[1])
            return grads[layer.weight].flatten(1).norm(dim=1)
    else:
        ids, G = inputs[0].contiguous(), inputs[1]  # Opacus views the ids
        compute = (op_embedding_norm.compute_embedding_norm_sample if kind == "embedding_norm"
                   else op_embedding.compute_embedding_grad_sample)
        fn = lambda: compute(layer, [ids], G)  # noqa: E731
    try:
        return timer(fn, inputs[1].device, name="opacus")
    except Exception as exc:
        return f"failed: {type(exc).__name__}"
