"""Kernel timings on a GPU at GPT-2 and Llama-7B layer shapes: dpgrad against Opacus 1.6.

For every layer shape and T in {128, 1024, 4096}, in bf16:
- Linear per-sample weight norms: dpgrad direct and gram, Opacus's
  ``compute_linear_norm_sample`` (its ghost norm: two (B, T, T) Gram tensors), and the plain
  weight-gradient GEMM ``G^T A`` over the whole batch (the floor the direct kernel aims at:
  both do 2*B*T*p*d flops);
- Embedding per-sample norms: dpgrad against Opacus's ``compute_embedding_norm_sample``;
- Linear per-sample gradients with the norms as an epilogue (``linear_per_sample(bias=True,
  norm=True)``) against Opacus's ``compute_linear_grad_sample`` einsum, alone and followed by
  the norms its optimizer then takes of the per-sample gradients.
B = 4096 // T, so every call sees 4096 tokens. Times are medians of
``triton.testing.do_bench`` (L2 flushed between runs), in ms; an Opacus call that runs out of
memory or raises is recorded as "oom" or its error, not timed.

Run it either way (both write benchmarks/results/kernels_<gpu>.json, with device, versions,
commit and date):
    pytest benchmarks/bench_kernels.py        # medians also in each benchmark's extra_info
    python benchmarks/bench_kernels.py        # prints a table
Skipped without CUDA, so ``pytest benchmarks`` still runs the CPU benchmarks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    if __name__ == "__main__":
        sys.exit("bench_kernels.py needs a CUDA device")
    pytest.skip("the kernel benchmarks need a CUDA device", allow_module_level=True)

import opacus  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample  # noqa: E402
from opacus.grad_sample.linear import compute_linear_grad_sample, compute_linear_norm_sample  # noqa: E402

from dpgrad.kernels import triton_ops as ops  # noqa: E402
from dpgrad.report import git_commit  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEV = "cuda"
DTYPE = torch.bfloat16
SEQ_LENS = (128, 1024, 4096)
TOKENS_PER_CALL = 4096
WARMUP_MS, REP_MS = 25, 50
# Cases whose tensors would need more than this are recorded as skipped, not run.
MEMORY_LIMIT = 60 * 2**30
# (layer, d, p) and (layer, V, d)
LINEAR_LAYERS = [
    ("gpt2.attn.c_proj", 768, 768),
    ("gpt2.attn.c_attn", 768, 2304),
    ("gpt2.mlp.c_fc", 768, 3072),
    ("gpt2.lm_head", 768, 50257),
    ("llama7b.mlp.up_proj", 4096, 11008),
    ("llama7b.mlp.down_proj", 11008, 4096),
    ("llama7b.attn.q_proj", 4096, 4096),
]
EMBEDDINGS = [
    ("gpt2.wte", 50257, 768),
    ("llama7b.embed_tokens", 32000, 4096),
    ("llama3-8b.embed_tokens", 128256, 4096),
]
LINEAR_CASES = [(name, d, p, T) for T in SEQ_LENS for name, d, p in LINEAR_LAYERS]
EMBEDDING_CASES = [(name, V, d, T) for T in SEQ_LENS for name, V, d in EMBEDDINGS]
# The timings of each kind that are dpgrad's (a dpgrad failure fails its pytest case).
DPGRAD_KEYS = {
    "linear_norm": ("dpgrad_direct_ms", "dpgrad_gram_ms"),
    "embedding_norm": ("dpgrad_ms",),
    "linear_grad_sample": ("dpgrad_ms",),
}


def batch_for(T: int) -> int:
    return max(1, TOKENS_PER_CALL // T)


def time_ms(fn):
    """Median of ``fn``'s GPU time in ms, or "oom" / "error: ..." where it fails."""
    try:
        return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    except torch.cuda.OutOfMemoryError:
        return "oom"
    except Exception as e:  # noqa: BLE001 - Opacus failing at a shape is a result, not a crash
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return f"error: {type(e).__name__}: {first_line}"
    finally:
        torch.cuda.empty_cache()


def ratio(num, den):
    """num / den where both are timings (not "oom" or an error), else None."""
    ok = isinstance(num, float) and isinstance(den, float) and den > 0
    return num / den if ok else None


def _fits(row: dict, n_bytes: int) -> bool:
    if n_bytes > MEMORY_LIMIT:
        row["skipped"] = f"needs about {n_bytes / 2**30:.0f} GiB (> {MEMORY_LIMIT / 2**30:.0f} GiB)"
        return False
    return True


def measure_linear_norm(name: str, d: int, p: int, T: int):
    """Per-sample weight-norm timings of one Linear layer shape -> (row, dpgrad direct call)."""
    B = batch_for(T)
    row = dict(kind="linear_norm", layer=name, d=d, p=p, T=T, B=B)
    # Inputs, Opacus's two (B, T, T) Grams, the GEMM's (p, d) output; dpgrad adds O(B).
    if not _fits(row, 2 * (B * T * (d + p) + 2 * B * T * T + p * d)):
        return row, None
    A = torch.randn(B, T, d, device=DEV, dtype=DTYPE)
    G = torch.randn(B, T, p, device=DEV, dtype=DTYPE)
    # Opacus only reads the layer's parameters as dict keys and for requires_grad: no memory.
    layer = torch.nn.Linear(d, p, bias=False, device="meta", dtype=DTYPE)

    def direct():
        return ops.linear_weight_sq_norm_direct(A, G)

    row["dpgrad_direct_ms"] = time_ms(direct)
    row["dpgrad_gram_ms"] = time_ms(lambda: ops.linear_weight_sq_norm_gram(A, G))
    row["opacus_ms"] = time_ms(lambda: compute_linear_norm_sample(layer, [A], G))
    row["gemm_ms"] = time_ms(lambda: torch.matmul(G.reshape(-1, p).T, A.reshape(-1, d)))
    timed = [row[k] for k in ("dpgrad_direct_ms", "dpgrad_gram_ms") if isinstance(row[k], float)]
    best = min(timed) if timed else None
    row["speedup_direct_vs_opacus"] = ratio(row["opacus_ms"], row["dpgrad_direct_ms"])
    row["speedup_gram_vs_opacus"] = ratio(row["opacus_ms"], row["dpgrad_gram_ms"])
    row["speedup_best_vs_opacus"] = ratio(row["opacus_ms"], best)
    row["direct_over_gemm"] = ratio(row["dpgrad_direct_ms"], row["gemm_ms"])
    row["gram_over_gemm"] = ratio(row["dpgrad_gram_ms"], row["gemm_ms"])
    return row, direct


def measure_embedding_norm(name: str, V: int, d: int, T: int):
    """Per-sample embedding-norm timings of one vocabulary shape -> (row, dpgrad call)."""
    B = batch_for(T)
    row = dict(kind="embedding_norm", layer=name, V=V, d=d, T=T, B=B)
    if not _fits(row, 4 * B * T * d * 2 + 64 * B * T):
        return row, None
    # A third of the positions from 64 frequent tokens: real text repeats tokens. No padding
    # index: Opacus does not take one, and both must do the same work.
    ids = torch.randint(0, V, (B, T), device=DEV)
    frequent = torch.randint(0, V, (64,), device=DEV)
    pick = torch.rand(B, T, device=DEV) < 1 / 3
    ids = torch.where(pick, frequent[torch.randint(0, 64, (B, T), device=DEV)], ids)
    G = torch.randn(B, T, d, device=DEV, dtype=DTYPE)
    layer = torch.nn.Embedding(V, d, device="meta", dtype=DTYPE)

    def dpgrad():
        return ops.embedding_sq_norm(ids, G, V, None)

    row["dpgrad_ms"] = time_ms(dpgrad)
    row["opacus_ms"] = time_ms(lambda: compute_embedding_norm_sample(layer, [ids], G))
    row["speedup_vs_opacus"] = ratio(row["opacus_ms"], row["dpgrad_ms"])
    return row, dpgrad


def measure_linear_grad_sample(name: str, d: int, p: int, T: int):
    """Per-sample gradient (+ norm) timings of one Linear layer shape -> (row, dpgrad call)."""
    B = batch_for(T)
    row = dict(kind="linear_grad_sample", layer=name, d=d, p=p, T=T, B=B)
    # Inputs, and up to three (B, p, d) tensors alive at once (outputs and an einsum temporary).
    if not _fits(row, 2 * (B * T * (d + p) + 3 * B * p * d)):
        return row, None
    A = torch.randn(B, T, d, device=DEV, dtype=DTYPE)
    G = torch.randn(B, T, p, device=DEV, dtype=DTYPE)
    layer = torch.nn.Linear(d, p, bias=True, device="meta", dtype=DTYPE)

    def dpgrad():
        return ops.linear_per_sample(A, G, bias=True, norm=True)

    def opacus_with_norm():
        # What Opacus's DPOptimizer does with per-sample gradients: one norm per parameter,
        # then the norm over parameters.
        grads = compute_linear_grad_sample(layer, [A], G)
        norms = [g.reshape(B, -1).norm(2, dim=-1) for g in grads.values()]
        return torch.stack(norms, dim=1).norm(2, dim=1)

    row["dpgrad_ms"] = time_ms(dpgrad)
    row["opacus_ms"] = time_ms(lambda: compute_linear_grad_sample(layer, [A], G))
    row["opacus_with_norm_ms"] = time_ms(opacus_with_norm)
    row["speedup_vs_opacus"] = ratio(row["opacus_ms"], row["dpgrad_ms"])
    row["speedup_vs_opacus_with_norm"] = ratio(row["opacus_with_norm_ms"], row["dpgrad_ms"])
    return row, dpgrad


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write_results(rows: list, path: Path | None = None) -> Path:
    """Write the JSON record of ``rows`` (default benchmarks/results/kernels_<gpu>.json)."""
    device = torch.cuda.get_device_name()
    record = {
        "benchmark": "kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "commit": git_commit() or "unknown",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "opacus": opacus.__version__,
            "cuda": torch.version.cuda,
        },
        "settings": {
            "dtype": str(DTYPE).removeprefix("torch."),
            "timer": "triton.testing.do_bench, median, L2 flushed between runs",
            "warmup_ms": WARMUP_MS,
            "rep_ms": REP_MS,
            "tokens_per_call": TOKENS_PER_CALL,
        },
        "complete": len(rows) == 2 * len(LINEAR_CASES) + len(EMBEDDING_CASES),
        "results": rows,
    }
    path = path or RESULTS / f"kernels_{_slug(device)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def format_table(rows: list) -> str:
    """One line per case: its timings in ms and its ratios."""
    lines = []
    for row in rows:
        shape = f"{row['layer']:<24} T={row['T']:>4} B={row['B']:>2}"
        if "skipped" in row:
            lines.append(f"{row['kind']:<18} {shape}  skipped: {row['skipped']}")
            continue
        cells = []
        for key, value in row.items():
            if key.endswith("_ms"):
                cells.append(f"{key[:-3]} {value:8.3f}" if isinstance(value, float) else f"{key[:-3]} {value}")
            elif key.startswith(("speedup", "direct_over", "gram_over")) and value is not None:
                cells.append(f"{key} {value:.2f}")
        lines.append(f"{row['kind']:<18} {shape}  " + "  ".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------- pytest cases
ROWS: list = []


class _Summary:
    """A plugin registered once the cases have run: output written during a test is
    captured, so the table goes into pytest's terminal summary instead."""

    def __init__(self, rows: list, path: Path):
        self.rows, self.path = rows, path

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.section(f"kernel benchmarks, {torch.cuda.get_device_name()}")
        terminalreporter.write_line(format_table(self.rows))
        terminalreporter.write_line(f"written {self.path}")


@pytest.fixture(scope="module", autouse=True)
def _results_file(request):
    """After the module's cases: write the JSON, and the table at the end of the run."""
    yield
    if ROWS:
        request.config.pluginmanager.register(_Summary(list(ROWS), write_results(ROWS)), "dpgrad-bench-kernels")


def _report(benchmark, row: dict, call) -> None:
    """Record a case; pytest-benchmark itself times the dpgrad call (synchronised)."""
    ROWS.append(row)
    benchmark.group = f"kernels: {row['kind']}"
    benchmark.extra_info.update(row)
    if call is None:
        pytest.skip(row["skipped"])
    failed = {k: row[k] for k in DPGRAD_KEYS[row["kind"]] if not isinstance(row[k], float)}
    assert not failed, f"dpgrad failed: {failed}"

    def synchronised():
        call()
        torch.cuda.synchronize()

    benchmark.pedantic(synchronised, rounds=10, iterations=1, warmup_rounds=1)


def _ids(cases):
    return [f"{case[0]}-T{case[-1]}" for case in cases]


@pytest.mark.parametrize("name,d,p,T", LINEAR_CASES, ids=_ids(LINEAR_CASES))
def test_linear_norm(benchmark, name, d, p, T):
    _report(benchmark, *measure_linear_norm(name, d, p, T))


@pytest.mark.parametrize("name,V,d,T", EMBEDDING_CASES, ids=_ids(EMBEDDING_CASES))
def test_embedding_norm(benchmark, name, V, d, T):
    _report(benchmark, *measure_embedding_norm(name, V, d, T))


@pytest.mark.parametrize("name,d,p,T", LINEAR_CASES, ids=_ids(LINEAR_CASES))
def test_linear_grad_sample(benchmark, name, d, p, T):
    _report(benchmark, *measure_linear_grad_sample(name, d, p, T))


# -------------------------------------------------------------------------------- script
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="default: benchmarks/results/kernels_<gpu>.json")
    args = parser.parse_args(argv)
    rows = []
    jobs = [(measure_linear_norm, c) for c in LINEAR_CASES]
    jobs += [(measure_embedding_norm, c) for c in EMBEDDING_CASES]
    jobs += [(measure_linear_grad_sample, c) for c in LINEAR_CASES]
    for measure, case in jobs:
        row, _ = measure(*case)
        rows.append(row)
        print(format_table([row]), flush=True)
        torch.cuda.empty_cache()
    path = write_results(rows, args.output)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"opacus {opacus.__version__}, commit {git_commit() or 'unknown'}\nwritten {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
