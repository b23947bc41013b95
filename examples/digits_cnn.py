"""DP training of a small CNN (convolutions and GroupNorm) on scikit-learn's bundled digits
images (8x8, ten classes; nothing is downloaded), with Opacus's PrivacyEngine and dpgrad's
ghost clipping in one backward pass per step.

Run: .venv/bin/python examples/digits_cnn.py [--epochs N]
Prints the test accuracy and the privacy spent (epsilon at delta = 1e-5) after each epoch.
"""

import argparse

import torch
import torch.nn as nn
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

import dpgrad.opacus
from dpgrad.tools.cli_common import number_in


def digits(seed: int = 0):
    """(train images, train labels, test images, test labels): the 1797 images of 1x8x8,
    standardised, a fifth of them held out for the test."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(y) // 5], order[len(y) // 5:]
    # A public constant of the data's range (pixels 0 to 16), not statistics of the private data.
    x = (x - 8.0) / 8.0
    return x[train], y[train], x[test], y[test]


def cnn(classes: int = 10, width: int = 16) -> nn.Module:
    """Three convolutions with GroupNorm and tanh (bounded activations suit DP-SGD: Papernot et
    al. 2021, "Tempered Sigmoid Activations"), global pooling and a Linear classifier."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(4, width), nn.Tanh(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(4, 2 * width), nn.Tanh(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.GroupNorm(4, 2 * width), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def main(epochs: int = 40, verbose: bool = True):
    """Train for ``epochs``; returns (test accuracy, epsilon at delta 1e-5)."""
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits()
    model = cnn()
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = dpgrad.opacus.make_private(
        engine,
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
        data_loader=DataLoader(TensorDataset(x_train, y_train), batch_size=256),
        noise_multiplier=2.0,
        max_grad_norm=1.0,
        single_backward=True,
    )
    for epoch in range(1, epochs + 1):
        for x, y in loader:  # Poisson batches: each sample taken with probability 256/N
            optimizer.zero_grad()
            criterion(model(x), y).backward()  # one pass: norms, then the clipped gradients
            optimizer.step()
        acc, eps = accuracy(model, x_test, y_test), engine.get_epsilon(1e-5)
        if verbose:
            print(f"epoch {epoch:2d}  test accuracy {acc:.3f}  epsilon {eps:.2f}")
    return acc, eps


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--epochs", type=number_in(int, 1), default=40, help="epochs (default 40)")
    main(parser.parse_args().epochs)
