# Eager Gram norms on the GPU against float64: Llama-1B shapes (random) and the all-equal worst case.
import torch, time
from dpgrad.kernels import reference as R
torch.manual_seed(0)
dev = "cuda"
for (d, p) in [(2048, 8192), (8192, 2048), (2048, 128256)]:
    A = torch.randn(8, 1024, d, device=dev, dtype=torch.bfloat16)
    G = (torch.randn(8, 1024, p, device=dev) * 1e-3).to(torch.bfloat16)
    exact = torch.stack([(G[b].double().T @ A[b].double()).square().sum() for b in range(8)])
    for name, fn in [("gram", R.linear_weight_sq_norm_gram), ("direct", R.linear_weight_sq_norm_direct)]:
        got = fn(A, G).double()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(5): fn(A, G)
        torch.cuda.synchronize(); ms = (time.perf_counter() - t) / 5 * 1e3
        print(f"d={d} p={p} {name}: max rel err {((got - exact).abs() / exact).max().item():.2e}, {ms:.3f} ms")
    del A, G
for n in (8192, 32768, 128256):
    v = 1 + 2**-8
    A = torch.full((1, 16, n), v, dtype=torch.bfloat16, device=dev)
    exact = 16 * 16 * (n * v * v) ** 2
    got = R.linear_weight_sq_norm_gram(A, A).item()
    print(f"all-equal n={n}: rel err {abs(got - exact) / exact:.2e}")
