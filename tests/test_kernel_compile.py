"""dpgrad's Triton kernels proven on real GPU targets, without a GPU (``dpgrad.tools.kernel_compile``).

Every kernel of ``dpgrad.kernels``, in every variant its launchers pass (dtypes, autocast's
fp32-beside-half pairs, constexpr flags: a table the first test proves complete), with every
config its autotuner may choose on the target, compiled for sm_80, sm_90 and (where the
installed Triton can) sm_100: each compiles, spills no register, fits the target's shared
memory, uses the tensor cores for its dots on half operands and never TF32 for fp32 ones, and
(the GEMM skeleton's kernels on aligned tensors) loads through asynchronous copies. Compiles whose answer the results cache
(tests/data/kernel_compiles.json, keyed by the kernels' source, Triton's version, the target,
the variant and the config) holds are not repeated; a changed kernel is compiled again here.
Also: a spilling config and a variant that does not compile are caught (the check can fail),
and every launcher's grid stays within CUDA's limits at the largest shapes of the benchmarks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from dpgrad.kernels import triton_common  # noqa: E402

# Its session-scoped fixture runs once: under pytest-xdist the module's tests share a worker.
pytestmark = pytest.mark.xdist_group("test_kernel_compile")

def _compiler_env() -> dict:
    """The test session's environment without Triton's interpreter, which compiles nothing."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


# One process without the interpreter for both parts (each prints its own line): the tool's
# run over every kernel (``main``, as ``python -m dpgrad.tools.kernel_compile`` runs it), then
# what shows that its checks can fail. The second part changes a prune rule, so it comes after.
COMPILE = textwrap.dedent("""
    import dataclasses, json, sys
    from dpgrad.tools import kernel_compile as kc
    code = kc.main(sys.argv[1:])
    print(json.dumps({"main": code}), flush=True)

    base = next(v for v in kc.variants() if v.kernel.endswith("_linear_per_sample_kernel")
                and v.label == "fp32/fp32 grad=1 bias=1 norm=1")
    # Tiles of 128 x 128 fp32 accumulators over 4 warps (128 registers a thread for them
    # alone) with their operands: more registers than a thread has. (16 rows at a time, not
    # pipelined: 64 rows in 3 stages spill more, but take the compiler eight times as long.)
    big = {"BP": 128, "BD": 128, "BT": 16, "num_warps": 4, "num_stages": 1}
    spilling = kc.problems(base, "sm_90", kc.compile_one(base, big, "sm_90"))
    # The norm asked for without the buffer it is written to: no kernel can be built.
    broken = dataclasses.replace(base, pointers=tuple((k, None if k == "W_SQ" else t) for k, t in base.pointers))
    config = {"BP": 64, "BD": 64, "BT": 32, "num_warps": 4, "num_stages": 3}
    failing = kc.problems(broken, "sm_90", kc.compile_one(broken, config, "sm_90"))
    # A prune rule that keeps a config the kernel does not have (a misspelt name).
    from dpgrad.kernels import triton_common
    triton_common.keep_only("_linear_gram_norm_kernel", triton_common.linear_family,
                            {"half": ["BK=32 BT=48 w4"]}, "test")
    print(json.dumps({"caught": [spilling, failing, kc.table_problems()]}))
""")


@pytest.fixture(scope="session")  # once per worker, however its tests interleave
def compiled(tmp_path_factory):
    """(the process, the tool's JSON, {part: what it printed})."""
    out = tmp_path_factory.mktemp("kernel_compile") / "run.json"
    proc = subprocess.run([sys.executable, "-c", COMPILE, "--json", str(out), "--jobs", str(os.cpu_count() or 1)],
                          env=_compiler_env(), capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = {}
    for line in proc.stdout.splitlines():
        if line.startswith(("{\"main\"", "{\"caught\"")):
            parts.update(json.loads(line))
    return proc, json.loads(out.read_text()), parts


def test_every_kernel_and_flag_is_in_the_compile_table(compiled):
    """A kernel or a constexpr flag added to dpgrad.kernels without its variants fails here."""
    _, run, _ = compiled
    assert run["table"] == []


def test_every_config_compiles_for_every_target_without_spilling(compiled):
    proc, run, parts = compiled
    assert {"sm_80", "sm_90"} <= set(run["targets"])
    assert run["compiles"] > 1000, run["compiles"]
    assert run["problems"] == [], "\n".join(run["problems"][:50])
    assert parts.get("main") == 0, proc.stdout[-3000:]


def test_a_spilling_config_a_variant_that_does_not_compile_and_a_misspelt_rule_are_caught(compiled):
    proc, _, parts = compiled
    assert "caught" in parts, proc.stderr[-3000:]
    spilling, failing, table = parts["caught"]
    assert any(p.startswith("spills: ") for p in spilling), spilling
    assert any(p.startswith("does not compile") for p in failing), failing
    assert table == ["linear_norm_gram:_linear_gram_norm_kernel: its prune rule keeps 'BK=32 BT=48 w4' for half, "
                     "not one of its configs"], table


# The largest shapes the benchmarks run: (B, T, d, p) of Linear layers (with how many layers of
# the shape one launch takes), embeddings (B, T, V, d) and normalised widths.
LARGEST_LINEAR = [
    (8, 1024, 2048, 128256, 1), (1, 8192, 2048, 128256, 1), (1, 16384, 768, 50257, 1),  # output layers
    (8, 1024, 2048, 8192, 16), (8, 1024, 8192, 2048, 16), (1, 8192, 2048, 8192, 16),  # Llama-1B MLPs
    (1, 16384, 768, 2304, 12), (64, 128, 768, 3072, 12),  # GPT-2 small
    (8, 1024, 2048, 16, 112), (8, 1024, 16, 8192, 32),  # LoRA r16 adapters of Llama-1B
    (1, 4096, 4096, 11008, 1), (32, 128, 11008, 4096, 1),  # bench_kernels' Llama-7B MLP
]
LARGEST_EMBEDDING = [(8, 1024, 128256, 2048), (1, 16384, 50257, 768), (1, 8192, 128256, 2048)]
LARGEST_NORM = [(8, 1024, 2048, 33), (1, 16384, 768, 25), (1, 8192, 2048, 33)]
# GroupNorm (B, C, H, W, groups, L): WRN-16-4's at B=256 on 32x32 images.
LARGEST_GROUP_NORM = [(256, 64, 32, 32, 16, 3), (256, 128, 16, 16, 16, 3), (256, 256, 8, 8, 16, 4)]
# Mixture-of-experts weights (B, T, k, E, p, q): Qwen3-30B-A3B's experts (up and down projections).
LARGEST_EXPERTS = [(8, 1024, 8, 128, 1536, 2048), (8, 1024, 8, 128, 2048, 768), (1, 16384, 8, 128, 1536, 2048)]


def test_grids_within_cuda_limits_at_the_largest_bench_shapes(monkeypatch):
    """Every launcher's grid at those shapes (on meta tensors: nothing is allocated or run),
    for the smallest blocks of each kernel's configs, whose grids are the largest: at most
    2^31 - 1 blocks along x, 65535 along y and z (``triton_common.GRID_LIMITS``)."""
    from dpgrad.kernels import triton_ops as K

    grids = []

    def record(kernel, grid, *args, **kwargs):
        configs = getattr(kernel, "configs", None) or [triton.Config(dict(kwargs))]
        smallest = min(configs, key=lambda c: sum(v for v in c.kwargs.values() if isinstance(v, int)))
        blocks = grid({**kwargs, **smallest.kwargs}) if callable(grid) else grid
        grids.append((getattr(kernel, "fn", kernel).__name__, tuple(blocks)))
        return None

    for module in {sys.modules[f.__module__] for f in (K.linear_per_sample, K.linear_clipped_sum,
                                                       K.linear_weight_sq_norm_gram, K.linear_bias_grad_sample,
                                                       K.linear_weight_sq_norm_direct,
                                                       K.embedding_sq_norm, K.norm_layer_grad_sample_grouped,
                                                       K.group_norm_grad_sample_grouped, K.experts_sq_norms)}:
        monkeypatch.setattr(module, "launch", record)
    meta = dict(device="meta", dtype=torch.bfloat16)
    for B, T, d, p, L in LARGEST_LINEAR:
        As = [torch.empty(B, T, d, **meta) for _ in range(L)]
        Gs = [torch.empty(B, T, p, **meta) for _ in range(L)]
        coef = torch.empty(B, device="meta")
        K.linear_per_sample_grouped(As, Gs, grad=False, bias=True, norm=True)
        K.linear_clipped_sum_grouped(As, Gs, coef, bias=True)
        K.linear_weight_sq_norm_gram_grouped(As, Gs)
        K.linear_weight_sq_norm_direct_grouped(As, Gs)
        K.linear_bias_grad_sample_grouped(Gs)
    for B, T, V, d in LARGEST_EMBEDDING:
        ids = torch.empty(B, T, dtype=torch.int64, device="meta")
        G = torch.empty(B, T, d, **meta)
        K.embedding_sq_norm(ids, G, V)
        K.embedding_clipped_sum(ids, G, torch.empty(B, device="meta"), V)
    for B, T, d, L in LARGEST_NORM:
        Xs = [torch.empty(B, T, d, **meta) for _ in range(L)]
        K.norm_layer_grad_sample_grouped(Xs, Xs, 1e-5, rms=False, weight=True, bias=True)
    for B, C, H, W, groups, L in LARGEST_GROUP_NORM:
        Xs = [torch.empty(B, C, H, W, **meta) for _ in range(L)]
        K.group_norm_grad_sample_grouped(Xs, Xs, groups, 1e-5, weight=True, bias=True)
    for B, T, k, E, p, q in LARGEST_EXPERTS:
        S = B * T * k
        left, right = torch.empty(S, p, **meta), torch.empty(S, q, **meta)
        expert, sample = (torch.empty(S, dtype=torch.int64, device="meta") for _ in range(2))
        for r in (right, None):
            K.experts_sq_norms(left, r, expert, sample, E, B)
            K.experts_clipped_sum(left, r, expert, torch.empty(S, device="meta"), E, torch.bfloat16)
            K.experts_grad_sample(left, r, expert, sample, E, B, torch.bfloat16)
    kernels = {name for name, _ in grids}
    assert kernels >= {"_linear_per_sample_kernel", "_linear_clipped_sum_kernel", "_linear_gram_norm_kernel",
                       "_linear_direct_norm_kernel",
                       "_token_sum_kernel", "_segment_sum_kernel", "_per_sample_total_kernel",
                       "_norm_layer_grad_sample_kernel", "_group_norm_grad_sample_kernel",
                       "_experts_segment_kernel", "_experts_clipped_sum_kernel", "_experts_rows_kernel"}, kernels
    for name, blocks in grids:
        for n, limit in zip(blocks, triton_common.GRID_LIMITS):
            assert 0 < n <= limit, (name, blocks)


def test_a_grid_over_the_limits_is_refused_naming_the_kernel():
    with pytest.raises(ValueError, match="_k: a grid of \\(1, 70000\\) blocks, 70000 along y"):
        triton_common.checked_grid("_k", lambda meta: (1, 70000))({})
    assert triton_common.checked_grid("_k", (2**31 - 1, 65535, 65535)) == (2**31 - 1, 65535, 65535)


def test_the_tool_run_under_the_interpreter_says_to_run_it_without():
    """``python -m dpgrad.tools.kernel_compile`` (as docs/kernels.md runs it) with Triton's
    interpreter on compiles nothing: it stops with a usage error that says so."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "dpgrad.tools.kernel_compile", "--only", "linear"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "run without TRITON_INTERPRET: the interpreter compiles nothing" in proc.stderr, proc.stderr[-2000:]
