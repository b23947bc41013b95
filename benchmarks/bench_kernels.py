"""Kernel timings at GPT-2 and Llama layer shapes: dpgrad against Opacus 1.6's samplers and the GEMM.

For every layer shape and T in {128, 512, 1024, 4096} (B = 8192 // T, so every call sees
8192 tokens: GPT-2 small at B = 64, Llama-1B at B = 8 and T = 1024), in bf16:
- ``linear_norm``: per-sample weight norms, dpgrad's direct and Gram forms, Opacus's
  ``compute_linear_norm_sample`` (two (B, T, T) Gram tensors), and the plain weight-gradient
  GEMM ``G^T A`` over the batch (the direct form's floor: both do 2*B*T*p*d flops);
- ``embedding_norm``: dpgrad against Opacus's ``compute_embedding_norm_sample``;
- ``linear_grad_sample``: per-sample gradients with the norms fused in, against Opacus's
  ``compute_linear_grad_sample`` einsum alone and followed by the norms its optimizer takes;
- ``linear_clipped_sum``: the single backward's clipped sum ``(c ⊙ G)^T A`` against the GEMM
  (Opacus has no such step: it runs a second backward pass);
- ``experts_norm``, ``experts_clipped_sum``: a mixture-of-experts weight (E, p, q) over its
  routed (token, expert) pairs (top-k of E per token): dpgrad's Triton kernels over (expert,
  sample) segments against its eager ones and the weight-gradient GEMMs per expert
  (``gemm-per-expert``: ``L_e^T R_e`` for each expert's pairs, sorted beforehand);
- ``roofline``: the device's limits as measured in the same run, a large GEMM's FLOP/s
  (``cublas-gemm``, 8192^3) and a large copy's bytes/s (``copy``, 1 GiB). Each row's work, the
  fewest FLOPs of its cheapest form and one read of its inputs (``benchmarks/conftest.py``,
  ``kernel_work``), over these gives its fraction of the roofline; the Linear norms also run
  cuBLAS doing the Gram form's work (``cublas-gram``: ``bmm(A, A^T)`` and ``bmm(G, G^T)``).
On a GPU times are ``triton.testing.do_bench`` quantiles (L2 flushed between runs); dpgrad
runs its Triton kernels, and its eager candidates run too (``dpgrad-eager-*``: the ones the
autotuner chooses instead where they are faster; the tables take dpgrad's fastest). Quick mode (the default without CUDA) takes small layers at T in
{32, 128} with 512 tokens per call, in fp32, and times with pytest-benchmark rounds; dpgrad
runs its eager kernels there (so the ``dpgrad-eager-*`` rows are skipped). A call that needs more memory than the limit, runs out of it,
or raises is recorded with the reason. ``DPGRAD_BENCH_SEQ_LENS=128,1024`` takes only those T.
"""

from __future__ import annotations

import os

import pytest
import torch

from dpgrad.kernels import backend
from dpgrad.kernels import reference as eager
from dpgrad.tools import results

opacus = pytest.importorskip("opacus")
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample  # noqa: E402
from opacus.grad_sample.linear import compute_linear_grad_sample, compute_linear_norm_sample  # noqa: E402

CUDA = torch.cuda.is_available()
QUICK = results.quick_mode()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.float32 if QUICK else torch.bfloat16
SEQ_LENS = (32, 128) if QUICK else (128, 512, 1024, 4096)
if os.environ.get("DPGRAD_BENCH_SEQ_LENS"):  # e.g. "128,1024": fewer cases, for a short run
    SEQ_LENS = tuple(int(t) for t in os.environ["DPGRAD_BENCH_SEQ_LENS"].split(","))
TOKENS_PER_CALL = 512 if QUICK else 8192
# Cases whose tensors would need more than this are recorded as skipped, not run.
MEMORY_LIMIT = 60 * 2**30
# (layer, d, p) and (layer, V, d)
LINEAR_LAYERS = (
    [("gpt2-like.c_attn", 64, 192), ("gpt2-like.lm_head", 64, 2048), ("llama-like.down_proj", 172, 64)]
    if QUICK
    else [("gpt2.attn.c_proj", 768, 768), ("gpt2.attn.c_attn", 768, 2304), ("gpt2.mlp.c_fc", 768, 3072),
          ("gpt2.lm_head", 768, 50257), ("llama1b.attn.q_proj", 2048, 2048), ("llama1b.attn.k_proj", 2048, 512),
          ("llama1b.mlp.up_proj", 2048, 8192), ("llama1b.mlp.down_proj", 8192, 2048), ("llama7b.mlp.up_proj", 4096, 11008),
          ("llama7b.mlp.down_proj", 11008, 4096), ("llama7b.attn.q_proj", 4096, 4096)]
)
EMBEDDINGS = (
    [("gpt2-like.wte", 2048, 64)]
    if QUICK
    else [("gpt2.wte", 50257, 768), ("llama7b.embed_tokens", 32000, 4096), ("llama3-8b.embed_tokens", 128256, 4096)]
)
# (layer, experts E, top k, p, q): the weight's (E, p, q) gradient sums left (p) x right (q) per pair.
EXPERTS = (
    [("qwen3-moe-like.gate_up", 8, 2, 32, 64)]
    if QUICK
    else [("qwen3-moe-small.gate_up", 16, 2, 1024, 1024), ("qwen3-moe-small.down", 16, 2, 1024, 512),
          ("qwen3-30b-a3b.gate_up", 128, 8, 1536, 2048), ("qwen3-30b-a3b.down", 128, 8, 2048, 768)]
)
EXPERTS_PROVIDERS = ["dpgrad", "dpgrad-eager", "gemm-per-expert"]
PROVIDERS = {
    "linear_norm": ["dpgrad-direct", "dpgrad-gram", "dpgrad-eager-direct", "dpgrad-eager-gram", "opacus", "gemm",
                    "cublas-gram"],
    "embedding_norm": ["dpgrad", "dpgrad-eager-sort", "opacus"],
    "linear_grad_sample": ["dpgrad", "dpgrad-eager-bmm", "opacus", "opacus-with-norm"],
    "linear_clipped_sum": ["dpgrad", "dpgrad-eager-gemm", "gemm"],
}


def batch_for(T: int) -> int:
    return max(1, TOKENS_PER_CALL // T)


def _linear_inputs(d, p, T):
    B = batch_for(T)
    A = torch.randn(B, T, d, device=DEV, dtype=DTYPE)
    G = torch.randn(B, T, p, device=DEV, dtype=DTYPE)
    # Opacus only reads the layer's parameters as dict keys and for requires_grad: no memory.
    layer = torch.nn.Linear(d, p, bias=True, device="meta", dtype=DTYPE)
    return A, G, layer


def _gemm(A, G):
    return torch.matmul(G.reshape(-1, G.shape[-1]).T, A.reshape(-1, A.shape[-1]))


def _gram_pair(A, G):
    """cuBLAS doing the Gram form's work: both (B, T, T) Gram matrices, nothing reduced."""
    return torch.bmm(A, A.transpose(1, 2)), torch.bmm(G, G.transpose(1, 2))


def linear_call(kernel: str, provider: str, d: int, p: int, T: int):
    """(bytes it needs, the call) for a Linear kernel and provider."""
    B = batch_for(T)
    inputs = 2 * B * T * (d + p)
    A, G, layer = _linear_inputs(d, p, T)
    ops = backend.ops_for(A, G)
    coef = torch.rand(B, device=DEV)

    def opacus_with_norm():
        # What Opacus's DPOptimizer does with per-sample gradients: a norm per parameter,
        # then the norm over parameters.
        grads = compute_linear_grad_sample(layer, [A], G)
        return torch.stack([g.reshape(B, -1).norm(2, dim=-1) for g in grads.values()], dim=1).norm(2, dim=1)

    calls = {
        ("linear_norm", "dpgrad-direct"): (inputs, lambda: ops.linear_weight_sq_norm_direct(A, G)),
        ("linear_norm", "dpgrad-gram"): (inputs, lambda: ops.linear_weight_sq_norm_gram(A, G)),
        # The eager direct form holds a batch slice's fp32 per-sample gradients; the Gram form
        # each chunk's (B, T, T) fp32 products and their sum.
        ("linear_norm", "dpgrad-eager-direct"): (inputs + 4 * min(B * p * d, eager.CHUNK_ELEMENTS + p * d),
                                                 lambda: eager.linear_weight_sq_norm_direct(A, G)),
        ("linear_norm", "dpgrad-eager-gram"): (inputs + 20 * B * T * T, lambda: eager.linear_weight_sq_norm_gram(A, G)),
        ("linear_norm", "opacus"): (inputs + 8 * B * T * T, lambda: compute_linear_norm_sample(layer, [A], G)),
        ("linear_norm", "gemm"): (inputs + 4 * p * d, lambda: _gemm(A, G)),
        ("linear_norm", "cublas-gram"): (inputs + 4 * B * T * T, lambda: _gram_pair(A, G)),
        ("linear_grad_sample", "dpgrad"): (inputs + 2 * B * p * d,
                                           lambda: ops.linear_per_sample(A, G, bias=True, norm=True)),
        ("linear_grad_sample", "dpgrad-eager-bmm"): (inputs + 6 * B * p * d,
                                                     lambda: eager.linear_per_sample(A, G, bias=True, norm=True)),
        ("linear_grad_sample", "opacus"): (inputs + 6 * B * p * d, lambda: compute_linear_grad_sample(layer, [A], G)),
        ("linear_grad_sample", "opacus-with-norm"): (inputs + 6 * B * p * d, opacus_with_norm),
        ("linear_clipped_sum", "dpgrad"): (inputs + 4 * p * d, lambda: ops.linear_clipped_sum(A, G, coef, bias=True)),
        ("linear_clipped_sum", "dpgrad-eager-gemm"): (inputs + 2 * B * T * min(p, d) + 4 * p * d,
                                                      lambda: eager.linear_clipped_sum_gemm(A, G, coef, bias=True)),
        ("linear_clipped_sum", "gemm"): (inputs + 4 * p * d, lambda: _gemm(A, G)),
    }
    return calls[(kernel, provider)]


def embedding_call(provider: str, V: int, d: int, T: int):
    B = batch_for(T)
    # A third of the positions from 64 frequent tokens: real text repeats tokens. No padding
    # index: Opacus does not take one, and both must do the same work.
    ids = torch.randint(0, V, (B, T), device=DEV)
    frequent = torch.randint(0, V, (64,), device=DEV)
    pick = torch.rand(B, T, device=DEV) < 1 / 3
    ids = torch.where(pick, frequent[torch.randint(0, 64, (B, T), device=DEV)], ids)
    G = torch.randn(B, T, d, device=DEV, dtype=DTYPE)
    layer = torch.nn.Embedding(V, d, device="meta", dtype=DTYPE)
    ops = backend.ops_for(G)
    need = 4 * B * T * d * 2 + 64 * B * T
    if provider == "dpgrad":
        return need, lambda: ops.embedding_sq_norm(ids, G, V, None)
    if provider == "dpgrad-eager-sort":
        return need, lambda: eager.embedding_sq_norm(ids, G, V, None)
    return need, lambda: compute_embedding_norm_sample(layer, [ids], G)


def experts_call(kernel: str, provider: str, E: int, k: int, p: int, q: int, T: int):
    """(bytes it needs, the call) for an experts kernel and provider, on ``TOKENS_PER_CALL``
    tokens routed to k of E experts each."""
    B, N = batch_for(T), batch_for(T) * T
    expert = torch.rand(N, E, device=DEV).topk(k, dim=1).indices.reshape(-1)
    sample = torch.arange(N, device=DEV).repeat_interleave(k) // T
    left = torch.randn(N * k, p, device=DEV, dtype=DTYPE)
    right = torch.randn(N * k, q, device=DEV, dtype=DTYPE)
    coef = torch.rand(B, device=DEV)[sample]
    ops = backend.ops_for(left, right)
    need = 2 * N * k * (p + q) + 4 * E * p * q + 16 * N * k
    order = torch.argsort(expert)
    counts = torch.bincount(expert, minlength=E).tolist()
    Ls, Rs = left[order].split(counts), right[order].split(counts)
    calls = {
        ("experts_norm", "dpgrad"): lambda: ops.experts_sq_norms(left, right, expert, sample, E, B),
        ("experts_norm", "dpgrad-eager"): lambda: eager.experts_sq_norms(left, right, expert, sample, E, B),
        ("experts_clipped_sum", "dpgrad"): lambda: ops.experts_clipped_sum(left, right, expert, coef, E, DTYPE),
        ("experts_clipped_sum", "dpgrad-eager"): lambda: eager.experts_clipped_sum(left, right, expert, coef, E,
                                                                                    DTYPE),
    }
    return need, calls.get((kernel, provider), lambda: [L.T @ R for L, R in zip(Ls, Rs)])


def _run(bench, need: int, call) -> None:
    """Time ``call`` (or record why not) for the ``bench`` row."""
    if "-eager" in bench.provider and not CUDA:
        bench.skip("on a CPU dpgrad's own rows run the eager kernels already")
    if need > MEMORY_LIMIT:
        bench.skip(f"needs about {need / 2**30:.0f} GiB (> {MEMORY_LIMIT / 2**30:.0f} GiB)")
    try:
        call()
        if CUDA:
            import triton.testing

            torch.cuda.synchronize()
            p20, p50, p80 = triton.testing.do_bench(call, warmup=25, rep=50, quantiles=[0.2, 0.5, 0.8])
            bench.metrics["time"] = results.metric("time", p50, p20, p80)
    except torch.cuda.OutOfMemoryError:
        bench.skip("out of memory")
    except Exception as exc:  # noqa: BLE001 - Opacus failing at a shape is a result, not a crash
        if bench.provider.startswith("dpgrad"):
            raise
        bench.skip(f"error: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}")
    finally:
        if CUDA:
            torch.cuda.empty_cache()

    def synchronised():
        call()
        if CUDA:
            torch.cuda.synchronize()

    bench.benchmark_fixture.pedantic(synchronised, rounds=5 if CUDA else 10, iterations=1, warmup_rounds=1)


# The roofline, first (a run cut short at its time limit still has it): a large GEMM's FLOP/s
# and a large copy's bytes/s, which every row's work is measured against.
ROOFLINE_N = 1024 if QUICK else 8192
ROOFLINE_BYTES = 2**26 if QUICK else 2**30


def roofline_call(provider: str):
    """(the row's shape, the call) for a roofline provider."""
    if provider == "cublas-gemm":
        x = torch.randn(ROOFLINE_N, ROOFLINE_N, device=DEV, dtype=DTYPE)
        y = torch.randn(ROOFLINE_N, ROOFLINE_N, device=DEV, dtype=DTYPE)
        work = dict(layer=f"gemm {ROOFLINE_N}^3", flops=2 * ROOFLINE_N**3, bytes=3 * ROOFLINE_N**2 * x.element_size())
        return work, lambda: torch.mm(x, y)
    src = torch.empty(ROOFLINE_BYTES, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return dict(layer=f"copy {ROOFLINE_BYTES // 2**20} MiB", flops=0, bytes=2 * ROOFLINE_BYTES), lambda: dst.copy_(src)


@pytest.mark.parametrize("provider", ["cublas-gemm", "copy"])
def test_roofline(bench, provider):
    work, call = roofline_call(provider)
    shape = dict(kernel="roofline", T=None, B=None, dtype=str(DTYPE).removeprefix("torch."), **work)
    bench.describe("kernels", "roofline", shape, provider)
    _run(bench, 0, call)


LINEAR_CASES = [(name, d, p, T) for T in SEQ_LENS for name, d, p in LINEAR_LAYERS]
EMBEDDING_CASES = [(name, V, d, T) for T in SEQ_LENS for name, V, d in EMBEDDINGS]


def _ids(cases):
    return [f"{case[0]}-T{case[-1]}" for case in cases]


@pytest.mark.parametrize("kernel, provider", [(k, p) for k in PROVIDERS if k != "embedding_norm" for p in PROVIDERS[k]])
@pytest.mark.parametrize("name, d, p, T", LINEAR_CASES, ids=_ids(LINEAR_CASES))
def test_linear_kernel(bench, kernel, provider, name, d, p, T):
    shape = dict(kernel=kernel, layer=name, d=d, p=p, T=T, B=batch_for(T), dtype=str(DTYPE).removeprefix("torch."))
    bench.describe("kernels", kernel, shape, provider)
    _run(bench, *linear_call(kernel, provider, d, p, T))


@pytest.mark.parametrize("provider", PROVIDERS["embedding_norm"])
@pytest.mark.parametrize("name, V, d, T", EMBEDDING_CASES, ids=_ids(EMBEDDING_CASES))
def test_embedding_norm(bench, provider, name, V, d, T):
    shape = dict(kernel="embedding_norm", layer=name, V=V, d=d, T=T, B=batch_for(T),
                 dtype=str(DTYPE).removeprefix("torch."))
    bench.describe("kernels", "embedding_norm", shape, provider)
    _run(bench, *embedding_call(provider, V, d, T))


EXPERTS_CASES = [(name, E, k, p, q, T) for T in SEQ_LENS for name, E, k, p, q in EXPERTS]


@pytest.mark.parametrize("kernel", ["experts_norm", "experts_clipped_sum"])
@pytest.mark.parametrize("provider", EXPERTS_PROVIDERS)
@pytest.mark.parametrize("name, E, k, p, q, T", EXPERTS_CASES, ids=_ids(EXPERTS_CASES))
def test_experts_kernel(bench, kernel, provider, name, E, k, p, q, T):
    shape = dict(kernel=kernel, layer=name, E=E, k=k, p=p, q=q, T=T, B=batch_for(T),
                 dtype=str(DTYPE).removeprefix("torch."))
    bench.describe("kernels", kernel, shape, provider)
    _run(bench, *experts_call(kernel, provider, E, k, p, q, T))
