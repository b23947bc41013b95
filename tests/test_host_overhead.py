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
  layer, and waits for the device at most ``EXTRA_SYNCS`` more times;
- the double-backward step waits at most ``EXTRA_SYNCS`` more times (its second backward
  pass repeats the model's own backward, so its operation count has no per-layer bound).
The waits are also counted with every layer clipped from its norms ("ghost", as on the
full-size models, where the tied embedding's cross terms run); there an index made from host
data at step time counts as a wait (on a GPU it is copied from pageable memory, which waits
for the queue).
The kernels are the eager ones whatever ``DPGRAD_BACKEND`` asks for: Triton's interpreter
runs a kernel as host code whose tensor calls a GPU would never see.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Dict, Tuple

import pytest

BENCHMARKS = str(Path(__file__).parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

pytest.importorskip("transformers")
pytest.importorskip("peft")
import torch  # noqa: E402
from dispatch_counts import MODELS, PROVIDERS, WARMUP_STEPS, DispatchCounts, build_model, count, make_step  # noqa: E402
from mixed_net import clipped_from_norms  # noqa: E402

OPS_PER_LAYER = 6
EXTRA_SYNCS = 1
BATCH, SEQ_LEN = 8, 64
CPU = torch.device("cpu")

# (model, policy) -> provider -> (the counts of two consecutive steps, hooked layers)
_counted: Dict[Tuple[str, str], Dict[str, Tuple[Tuple[DispatchCounts, DispatchCounts], int]]] = {}
# How layers are clipped: as dpgrad chooses for these small models (from per-sample gradients
# where they are small), or all from their norms, as on the full-size models ("ghost": the
# norm kernels, the clipped sums and the cross terms of the tied embedding run).
POLICIES = ("chosen", "ghost")


def _counts(name: str, policy: str = "chosen") -> Dict[str, Tuple[Tuple[DispatchCounts, DispatchCounts], int]]:
    """Every provider's counts for ``name``, measured once per session."""
    if (name, policy) not in _counted:
        built = build_model(name, quick=True, device=CPU, dtype="fp32")
        by_provider = {}
        with pytest.MonkeyPatch.context() as patch, (clipped_from_norms() if policy == "ghost" else nullcontext()):
            patch.setenv("DPGRAD_BACKEND", "eager")
            for provider in PROVIDERS:
                step = make_step(provider, built, BATCH, SEQ_LEN, CPU)
                for _ in range(WARMUP_STEPS):
                    step.run()
                by_provider[provider] = ((count(step.run), count(step.run)), step.hooked_layers)
        _counted[(name, policy)] = by_provider
    return _counted[(name, policy)]


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


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("provider", ["dpgrad-single", "dpgrad-double"])
@pytest.mark.parametrize("name", MODELS)
def test_at_most_one_more_host_wait(name, provider, policy):
    counted = _counts(name, policy)
    base = counted["non-private"][0][0]
    (counts, _), layers = counted[provider]
    assert counts.syncs - base.syncs <= EXTRA_SYNCS, (
        f"{name}: {counts.syncs - base.syncs} more operations that wait for the device than the "
        f"non-private step (bound {EXTRA_SYNCS})\n" + _report(provider, counts, base, layers))
