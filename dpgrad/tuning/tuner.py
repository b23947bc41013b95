"""The autotuner: which candidate does a kind of work for a layer shape, decided once.

For a new shape key (kind, layer dims, B and T bucketed to powers of two, dtype, device, the
backends allowed) the cost model prunes the candidates that cannot win; the rest run on the
layer's real inputs, are checked against the eager reference, and are timed (tuning/timing.py);
the fastest correct one is used from then on and saved in the per-device store
(tuning/store.py), so the next process starts tuned. Poisson sampling changes B every step: a
bucket is tuned once, never per step.

``DPGRAD_TUNE`` says how far to go: ``on`` (the default) times new keys; ``cached`` uses the
store and otherwise the cost model, never timing; ``off`` uses the cost model only.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch

from dpgrad.kernels import backend

from . import cost_model, store
from .candidates import CANDIDATES, Candidate, Shape, applicable, shape_of
from .progress import TUNING_PROGRESS
from .timing import CandidateTiming, Decision, _describe, _far_off, _stored, _time_opacus, measure_ms

ENV_VAR = "DPGRAD_TUNE"
MODES = ("off", "cached", "on")
# Exact shapes whose chosen candidate a step looks up directly, at most (variable sequence
# lengths would grow the table without end): beyond it the table starts again, and each shape
# is found again from its bucketed key's decision, which is kept.
MAX_CHOSEN = 4096


def tune_mode() -> str:
    value = os.environ.get(ENV_VAR, "").strip().lower() or "on"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: use one of {', '.join(MODES)}")
    return value


def bucket(n: int) -> int:
    """The power of two at or above n (0 stays 0): B and T are tuned per bucket."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclass
class Recording:
    """Decisions per layer while ``Tuner.recording`` is active (see the autotune report)."""

    opacus: bool
    callback: Optional[Callable[[object, Decision], None]] = None  # called per new layer
    layers: List[tuple] = field(default_factory=list)  # (layer, Decision, opacus_ms or reason)
    # (id(layer), kind) -> the chosen candidate's ms on the layer's inputs, timed in this
    # process (by the tuner as it measured, or by the recording): what a speedup divides by.
    chosen_ms: Dict[tuple, float] = field(default_factory=dict)
    _seen: set = field(default_factory=set)


class Tuner(CandidateTiming):
    """Chooses candidates; one per process (``get_tuner``), or built with a ``timer`` for tests."""

    def __init__(self, timer: Callable[..., float] = measure_ms):
        self.timer = timer
        self._decisions: Dict[str, Decision] = {}
        # (kind, exact shapes, dtypes, devices, backend asked for) -> the chosen candidate: what
        # a training step looks up, once per layer group, without building the shape key.
        self._chosen: Dict[tuple, Candidate] = {}
        self._stores: Dict[str, store.TuneStore] = {}
        self._recordings: List[Recording] = []
        # When set, stored choices are not used: every new shape key is measured again and
        # its stored entry replaced (``dpgrad autotune-report --retune``).
        self.retune = False
        self._short = 0  # depth of ``short_of_memory`` contexts
        # (fast key, budget) -> (candidate, samples per batch slice): ``select_by_memory``'s answers.
        self._by_memory: Dict[tuple, tuple] = {}

    def select(self, kind: str, inputs: tuple, layer: Optional[torch.nn.Module] = None) -> Candidate:
        """The candidate to run ``kind`` on ``inputs`` (tuning the shape key if it is new)."""
        fast = _fast_key(kind, inputs)
        chosen = self._chosen.get(fast)
        if chosen is not None and not self._recordings:
            return chosen
        shape = shape_of(kind, inputs)
        tensors = tuple(t for t in inputs if isinstance(t, torch.Tensor))
        candidates = applicable(kind, shape, tensors)
        by_name = {c.name: c for c in candidates}
        key = self.key(shape, candidates)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decide(shape, key, candidates, inputs, layer)
            self._decisions[key] = decision
        for rec in self._recordings:
            self._record(rec, layer, decision, inputs)
        if len(self._chosen) >= MAX_CHOSEN:
            self._chosen.clear()
        chosen = self._chosen[fast] = by_name[decision.choice].with_config(decision.config)
        return chosen

    def call(self, kind: str, inputs: tuple, layer: Optional[torch.nn.Module] = None,
             work: Optional[Callable[[Candidate], object]] = None):
        """``work(candidate)`` (default: the candidate run on ``inputs``) with the candidate
        chosen for ``inputs``, through ``run``."""
        return self.run(kind, self.select(kind, inputs, layer), inputs, layer, work)

    def run(self, kind: str, cand: Candidate, inputs: tuple, layer: Optional[torch.nn.Module],
            work: Optional[Callable[[Candidate], object]] = None):
        """``work(cand)`` (default: the candidate run on ``inputs``), where ``cand`` was selected
        for ``inputs`` (``work`` runs it, on these inputs or on a layer's of the same shapes). A Triton candidate with the config chosen
        for the shape (measured here, or found in the tune store) launches its kernel with it
        directly, with no config search. A Triton candidate that raises, as one
        whose kernel fails to compile for a shape may, is never fatal under the ``auto``
        backend: ``work`` runs again with the eager candidate, which this shape key keeps from
        then on, in this process and in the tune store; one warning names the layer, the shape
        and the error. Under ``DPGRAD_BACKEND=triton`` the error is raised, naming the layer."""
        if work is None:
            def work(chosen: Candidate):
                return chosen.run(*inputs)
        if cand.backend != "triton":
            return work(cand)
        try:
            with cand.configured():
                return work(cand)
        except Exception as exc:
            fallback = self._failed(kind, cand, inputs, layer, exc)
        return work(fallback)

    def _failed(self, kind: str, cand: Candidate, inputs: tuple, layer, exc: Exception) -> Candidate:
        """Replace a failed candidate by an eager one for its shape key, for good (raises under a
        forced Triton backend)."""
        shape = shape_of(kind, inputs)
        tensors = tuple(t for t in inputs if isinstance(t, torch.Tensor))
        candidates = applicable(kind, shape, tensors)
        key = self.key(shape, candidates)
        eager = [c for c in CANDIDATES[kind] if c.backend == "eager"]
        if kind == "linear_norm":
            eager = [c for c in eager if (c.algorithm == "outer") == (shape.T == 1)]
        fallback = next((c for c in eager if c.algorithm == cand.algorithm), None) or min(
            eager, key=lambda c: c.cost(shape).seconds(cost_model.device_spec(shape.device),
                                                       shape.dtype in (torch.float16, torch.bfloat16)))
        store_note = ""
        decision = self._decisions.get(key)
        if decision is not None:
            decision.skipped[cand.name] = f"failed in a step: {type(exc).__name__}: {exc}"[:300]
            decision.timings_ms.pop(cand.name, None)
            decision.choice, decision.source = fallback.name, "eager after a failure"
            decision.config = None
            if tune_mode() != "off":
                handle = self._store(shape)
                handle.put(key, _stored(decision))
                store_note = f" (kept in the tune store {handle.path})"
        backend.kernel_failed(kind.replace("_", " "), layer, f"{_describe(shape)} ({cand.name})", exc,
                              f"{fallback.name} does it for this shape from now on{store_note}")
        self._chosen[_fast_key(kind, inputs)] = fallback
        self._by_memory.clear()  # the failed candidate is skipped there too from now on
        return fallback

    def select_group(self, kind: str, inputs: List[tuple], layers: List[torch.nn.Module]) -> Candidate:
        """The candidate for a group of layers whose inputs have the same shapes: chosen once,
        for the first; a recording (the autotune report) still sees every layer."""
        chosen = self.select(kind, inputs[0], layers[0])
        if self._recordings:
            for layer_inputs, layer in zip(inputs[1:], layers[1:]):
                self.select(kind, layer_inputs, layer)
        return chosen

    @contextmanager
    def short_of_memory(self) -> Iterator[None]:
        """While active (norms served early because memory on the device is short,
        ``dpgrad.backward.group_flush``), ``memory_is_short`` is True: a sampler whose work can be cut
        into batch slices asks ``select_by_memory`` instead of ``select_group``."""
        self._short += 1
        try:
            yield
        finally:
            self._short -= 1

    @property
    def memory_is_short(self) -> bool:
        return self._short > 0

    def select_by_memory(self, kind: str, inputs: List[tuple], layers: List[torch.nn.Module],
                         budget: float) -> tuple:
        """(the candidate, at most how many samples a batch slice takes) for a group of layers
        of one shape when memory is short: of the candidates known to be right here (the time
        choice, the eager ones, and those that passed the check against the eager reference
        when the shape was timed, none that failed), the one whose work holds the least memory
        per sample (``Candidate.workspace``, from the cost model), the time choice where it
        holds as little; its batch slices cut so that a slice holds at most ``budget`` bytes
        (at least one sample). The time choice is made (and recorded) as usual first."""
        chosen = self.select_group(kind, inputs, layers)
        key = (_fast_key(kind, inputs[0]), int(budget))
        found = self._by_memory.get(key)
        if found is None:
            shape = shape_of(kind, inputs[0])
            tensors = tuple(t for t in inputs[0] if isinstance(t, torch.Tensor))
            candidates = applicable(kind, shape, tensors)
            decision = self._decisions.get(self.key(shape, candidates))
            timed = decision.timings_ms if decision is not None else {}
            skipped = decision.skipped if decision is not None else {}
            candidates = [c for c in candidates if c.name == chosen.name or (
                c.name not in skipped and (c.backend == "eager" or c.name in timed))]
            held = {c.name: c.workspace(shape) for c in candidates}
            if any(h is None for h in held.values()):
                raise ValueError(f"{kind.replace('_', ' ')} has no memory model: use select_group")
            least = min(held.values())
            lean = [c for c in candidates if held[c.name] <= least]
            cand = next((c for c in lean if c.name == chosen.name), lean[0])
            if cand.name == chosen.name:
                cand = chosen  # with its Triton config
            if len(self._by_memory) >= MAX_CHOSEN:
                self._by_memory.clear()
            found = self._by_memory[key] = (cand, max(1, int(budget // max(held[cand.name], 1.0))))
        return found

    @staticmethod
    def key(shape: Shape, candidates: List[Candidate]) -> str:
        dims = ",".join(f"{k}={v}" for k, v in shape.dims)
        backends = "+".join(sorted({c.backend for c in candidates}))
        dtype = str(shape.dtype).replace("torch.", "")
        return (f"{shape.kind}|{dims}|B<={bucket(shape.B)}|T<={bucket(shape.T)}|{dtype}|"
                f"{_device_name(shape.device)}|{backends}")

    @contextmanager
    def recording(self, opacus: bool = False, callback=None) -> Iterator[Recording]:
        """Collect the decision for every layer that selects while active; with ``opacus``, also
        time Opacus's own eager sampler on the layer's first inputs. ``callback(layer,
        decision)`` runs for each newly recorded layer (a progress display)."""
        rec = Recording(opacus, callback)
        self._recordings.append(rec)
        try:
            yield rec
        finally:
            self._recordings.remove(rec)

    def forget(self) -> None:
        """Drop this process's decisions (the store keeps its own)."""
        self._decisions.clear()
        self._chosen.clear()
        self._by_memory.clear()

    # ------------------------------------------------------------------ deciding
    def _decide(self, shape: Shape, key: str, candidates: List[Candidate], inputs: tuple,
                layer: Optional[torch.nn.Module] = None) -> Decision:
        spec = cost_model.device_spec(shape.device)
        half = shape.dtype in (torch.float16, torch.bfloat16)
        costs = {c.name: c.cost(shape) for c in candidates}
        decision = Decision(
            kind=shape.kind, key=key, choice="", source="",
            shape={"B": shape.B, "T": shape.T, **dict(shape.dims), "dtype": str(shape.dtype).replace("torch.", "")},
            estimates_ms={n: cost.seconds(spec, half) * 1e3 for n, cost in costs.items()},
            extra_bytes={n: cost.extra_bytes for n, cost in costs.items()},
        )
        by_estimate = min(candidates, key=lambda c: decision.estimates_ms[c.name]).name
        mode = tune_mode()
        if len(candidates) == 1:
            decision.choice, decision.source = candidates[0].name, "only candidate"
            return decision
        stored = self._store(shape).get(key) if mode != "off" and not self.retune else None
        # An entry stored before candidates were timed in rounds (one timing could decide it),
        # or one whose re-timing did not settle, is measured anew.
        untrusted = stored is not None and mode == "on" and len(stored.get("timings_ms", {})) > 1 and (
            "rounds" not in stored or stored.get("unstable", False))
        if stored is not None and stored["choice"] in decision.estimates_ms and not untrusted:
            decision.choice, decision.source = stored["choice"], "store"
            decision.timings_ms = dict(stored.get("timings_ms", {}))
            decision.skipped = dict(stored.get("skipped", {}))
            decision.config = stored.get("config")
            decision.stored_at = stored.get("measured")
            decision.spread = dict(stored.get("spread", {}))
            decision.window_ms = {k: list(v) for k, v in stored.get("window_ms", {}).items()}
            decision.rounds = stored.get("rounds", 0)
            return decision
        if mode != "on" or shape.B == 0:
            decision.choice, decision.source = by_estimate, "cost model"
            return decision
        TUNING_PROGRESS.measuring(_describe_shape(shape, layer))
        try:
            self._measure(decision, shape, candidates, inputs, layer)
        finally:
            TUNING_PROGRESS.measured()
        if decision.timings_ms:
            decision.source = "measured"
            decision.config = next(c for c in candidates if c.name == decision.choice).triton_config()
            self._keep(shape, decision, replacing=stored is not None)
        else:
            # Nothing ran correctly: the eager reference is the one answer known to be right.
            eager = [c for c in candidates if c.backend == "eager"] or candidates
            decision.choice = min(eager, key=lambda c: decision.estimates_ms[c.name]).name
            decision.source = "cost model (no candidate passed)"
            if decision.skipped and any(c.backend == "eager" for c in candidates):
                self._store(shape).put(key, _stored(decision))  # not tried again in every process
        return decision

    def _store(self, shape: Shape) -> store.TuneStore:
        name = _device_name(shape.device)
        directory = str(store.default_dir())
        handle = self._stores.get(name + "|" + directory)
        if handle is None:
            handle = self._stores[name + "|" + directory] = store.TuneStore(name, directory)
        return handle

    def _record(self, rec: Recording, layer, decision: Decision, inputs: tuple) -> None:
        ident = (id(layer), decision.kind)
        if ident in rec._seen:
            return
        rec._seen.add(ident)
        if decision.source == "measured" and decision.choice in decision.timings_ms:
            rec.chosen_ms[ident] = decision.timings_ms[decision.choice]  # timed in this process
        else:
            # An only candidate, or a choice from the store or the cost model: the chosen
            # candidate is timed here, on these inputs, never taken from an earlier process.
            try:
                chosen = next(c for c in CANDIDATES[decision.kind] if c.name == decision.choice)
                chosen = chosen.with_config(decision.config)

                def run():
                    with chosen.configured():
                        chosen.run(*inputs)

                rec.chosen_ms[ident] = self.timer(run, inputs[1].device, name=chosen.name)
            except Exception as exc:
                decision.skipped.setdefault(decision.choice, f"failed: {type(exc).__name__}: {exc}"[:300])
            timed = rec.chosen_ms.get(ident)
            if decision.source == "store" and timed is not None and _far_off(decision, timed) and tune_mode() == "on":
                # A stored choice far off here: its candidates are timed again, and the store told.
                self._retime(decision, inputs, layer)
                if decision.choice in decision.timings_ms:
                    rec.chosen_ms[ident] = decision.timings_ms[decision.choice]
        opacus_ms = _time_opacus(self.timer, decision.kind, layer, inputs) if rec.opacus else None
        rec.layers.append((layer, decision, opacus_ms))
        if rec.callback is not None:
            rec.callback(layer, decision)


def _fast_key(kind: str, inputs: tuple) -> tuple:
    """What a step looks a chosen candidate up by: exact shapes, dtypes, devices, the backend asked for."""
    return (kind, backend.requested(), *(
        (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in inputs))


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    # Asked on every select: the CUDA query is not free.
    return store.device_name(device)


_TUNER: Optional[Tuner] = None


def get_tuner() -> Tuner:
    """The process's tuner, shared by every sampler."""
    global _TUNER
    if _TUNER is None:
        _TUNER = Tuner()
    return _TUNER



def _describe_shape(shape: Shape, layer: Optional[torch.nn.Module]) -> str:
    """"linear_norm d=768,p=3072 B=8 T=1024 at 'h.0.mlp.c_fc' (Conv1D)", for the progress bar."""
    dims = ",".join(f"{k}={v}" for k, v in shape.dims)
    where = f" at {backend.layer_name(layer)}" if layer is not None else ""
    return f"{shape.kind} {dims} B={shape.B} T={shape.T}{where}"
