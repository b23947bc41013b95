"""The ``dpgrad`` command line.

``dpgrad demo``: a short DP-SGD training run of the built-in transformer with ghost clipping,
printing the loss and per-sample gradient-norm statistics of every step.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import torch

from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.models import TinyTransformer, TinyTransformerConfig, per_sample_lm_loss, synthetic_batch


def dp_sgd_step(
    model: GradSampleModuleFastGradientClipping,
    optimizer: torch.optim.Optimizer,
    loss_per_sample: torch.Tensor,
    noise_multiplier: float,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One DP-SGD step from a batch's per-sample losses (B,), with two backward passes.

    The first pass gives the per-sample gradient norms, the second the clipped summed
    gradient ``sum_b c_b g_b``; Gaussian noise of std ``noise_multiplier * C`` is added and
    the sum divided by B, as Opacus's DPOptimizerFastGradientClipping does. Returns the
    per-sample gradient norms.
    """
    loss_per_sample.mean().backward(retain_graph=True)
    coef = model.get_clipping_coef()
    norms = model.per_sample_gradient_norms
    optimizer.zero_grad(set_to_none=True)
    model.disable_hooks()
    try:
        (coef.to(loss_per_sample.dtype) * loss_per_sample).sum().backward()
    finally:
        model.enable_hooks()
    std = noise_multiplier * model.max_grad_norm
    batch_size = max(1, loss_per_sample.shape[0])
    for p in model.parameters():
        if p.grad is not None:
            noise = torch.normal(0.0, std, p.grad.shape, generator=generator, device=p.device) if std > 0 else 0.0
            p.grad.add_(noise).div_(batch_size)
    optimizer.step()
    return norms


def demo(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="dpgrad demo", description=__doc__.split("\n\n")[1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = TinyTransformerConfig()
    model = GradSampleModuleFastGradientClipping(
        TinyTransformer(cfg), max_grad_norm=args.max_grad_norm, loss_reduction="mean"
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"dpgrad demo: TinyTransformer ({n_params / 1e6:.2f}M parameters, {cfg.n_layers} layers, "
        f"d_model {cfg.d_model}), batch {args.batch_size} x {args.seq_len} tokens, "
        f"C = {args.max_grad_norm}, sigma = {args.noise_multiplier}, device cpu"
    )
    print(f"{'step':>4} {'loss':>8} {'norm min':>9} {'median':>9} {'max':>9} {'clipped':>8} {'time s':>7}")
    for step in range(1, args.steps + 1):
        ids = synthetic_batch(cfg, args.batch_size, args.seq_len, generator=gen)
        start = time.perf_counter()
        loss_per_sample = per_sample_lm_loss(model(ids), ids, cfg.padding_idx)
        norms = dp_sgd_step(model, optimizer, loss_per_sample, args.noise_multiplier, gen)
        elapsed = time.perf_counter() - start
        clipped = (norms > args.max_grad_norm).float().mean().item()
        print(
            f"{step:>4} {loss_per_sample.mean().item():>8.4f} {norms.min().item():>9.4f} "
            f"{norms.median().item():>9.4f} {norms.max().item():>9.4f} {clipped:>8.0%} {elapsed:>7.3f}"
        )
    return 0


COMMANDS = {"demo": demo}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: dpgrad {{{','.join(COMMANDS)}}} [options]   (dpgrad COMMAND --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
