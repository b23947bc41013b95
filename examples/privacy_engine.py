"""DP fine-tuning with Opacus's PrivacyEngine and dpgrad's ghost-clipping wrapper, one
backward pass per step.

Run: .venv/bin/python examples/privacy_engine.py [--steps N]
Trains dpgrad's built-in transformer on synthetic sequences with Poisson sampling and prints
the loss and the privacy spent (epsilon at delta = 1e-5).
"""

import argparse

import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

import dpgrad.opacus
from dpgrad.tools.cli_common import number_in
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig, synthetic_batch


def main(steps: int = 20) -> float:
    torch.manual_seed(0)
    cfg = TinyTransformerConfig()
    return train(TinyTransformer(cfg), cfg, steps)


def train(model: torch.nn.Module, cfg: TinyTransformerConfig, steps: int, device=torch.device("cpu"),
          verbose: bool = True) -> float:
    """``steps`` DP steps of ``model`` (a TinyTransformer of ``cfg``, on ``device``, sharded or
    not) on synthetic sequences; prints the loss and epsilon every 5 steps if ``verbose``."""
    ids = synthetic_batch(cfg, 1024, 33, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), batch_size=64)
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine,
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        data_loader=loader,
        criterion=torch.nn.CrossEntropyLoss(ignore_index=cfg.padding_idx),
        noise_multiplier=0.8,
        max_grad_norm=1.0,
        single_backward=True,
    )
    step = 0
    while step < steps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            logits = model(x)
            # shape= makes the privacy unit one sequence, not one token.
            loss = criterion(logits.reshape(-1, cfg.vocab_size).float(), y.reshape(-1), shape=logits.shape[:2])
            loss.backward()  # one pass: norms, then each layer's clipped gradient
            optimizer.step()
            step += 1
            if verbose and (step % 5 == 0 or step == steps):
                print(f"step {step:3d}  loss {loss.item():.4f}  epsilon {engine.get_epsilon(1e-5):.2f}")
            if step == steps:
                break
    return engine.get_epsilon(1e-5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=number_in(int, 1), default=20, help="training steps (default 20)")
    main(parser.parse_args().steps)
