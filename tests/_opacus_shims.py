"""Helpers to run Opacus 1.6.0's own test classes against dpgrad's wrappers.

Two things live here:

* ``torchvision_stand_in()``: Opacus's ``grad_sample_module_test`` imports torchvision
  (``FakeData``, ``transforms``, ``mobilenet_v3_small``) at module level. torchvision cannot
  be installed on a CPU-only machine with a CPU build of torch (its PyPI wheels are built
  against the CUDA build, and ``import torchvision`` fails), yet that test only needs random
  images and "some model with BatchNorm". When ``import torchvision`` fails, this context
  manager puts a minimal stand-in into ``sys.modules`` for the duration of the import of
  Opacus's test modules and takes it out again afterwards (the imported test modules keep
  their references), so nothing else in the session ever sees a fake torchvision (Hugging
  Face transformers probes for torchvision with ``importlib.util.find_spec``).
* ``import_opacus_test_module(name)``: imports ``opacus.tests.<name>`` under that context.

The stand-in is deliberately tiny and is *not* torchvision: it covers exactly what Opacus's
``grad_sample_module_test`` uses.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
import types
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = ["import_opacus_test_module", "torchvision_stand_in"]


class FakeData(torch.utils.data.Dataset):
    """Random images and labels, deterministic per index (like torchvision's ``FakeData``).

    Images are float tensors of ``image_size`` (C, H, W) in [0, 1), which is what
    torchvision's ``ToTensor`` makes of its random PIL images; labels are ints in
    ``[0, num_classes)``. Sample ``i`` is drawn from a generator seeded with
    ``i + random_offset``, so the global RNG is left alone.
    """

    def __init__(
        self,
        size: int = 1000,
        image_size: Tuple[int, ...] = (3, 224, 224),
        num_classes: int = 10,
        transform=None,
        target_transform=None,
        random_offset: int = 0,
    ):
        self.size = size
        self.image_size = tuple(image_size)
        self.num_classes = num_classes
        self.transform = transform
        self.target_transform = target_transform
        self.random_offset = random_offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        if not 0 <= index < self.size:
            raise IndexError(f"FakeData index {index} out of range for size {self.size}")
        g = torch.Generator().manual_seed(index + self.random_offset)
        img = torch.rand(self.image_size, generator=g)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class Compose:
    """Apply transforms in order."""

    def __init__(self, transforms: Sequence):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """Tensors pass through as float32 (the stand-in's FakeData already yields tensors)."""

    def __call__(self, x):
        return torch.as_tensor(x, dtype=torch.float32)


class Normalize:
    """Per-channel ``(x - mean) / std`` on a (C, H, W) tensor."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


def mobilenet_v3_small(num_classes: int = 1000, **_ignored) -> nn.Module:
    """A small conv net *with BatchNorm*, standing in for torchvision's MobileNetV3-small.

    The only thing Opacus's test checks is that a model whose trainable layers have buffers
    (BatchNorm's running statistics) is rejected, so this keeps just that property.
    """
    return nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name, "dpgrad test stand-in for torchvision (tests/_opacus_shims.py)")
    # A real spec, so importlib.util.find_spec on it cannot raise while it is installed.
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _build_stand_in() -> dict:
    transforms = _module("torchvision.transforms", Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)
    datasets = _module("torchvision.datasets", FakeData=FakeData)
    models = _module("torchvision.models", mobilenet_v3_small=mobilenet_v3_small)
    root = _module("torchvision", transforms=transforms, datasets=datasets, models=models)
    root.__version__ = "0.0.0+dpgrad-stand-in"
    return {m.__name__: m for m in (root, transforms, datasets, models)}


def _real_torchvision_importable() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or a RuntimeError from a wheel built for another torch
        return False
    return True


@contextlib.contextmanager
def torchvision_stand_in() -> Iterator[Optional[dict]]:
    """Make ``import torchvision`` work inside the block; yields the stand-in modules, or
    None when the real torchvision imports. The stand-in leaves ``sys.modules`` on exit."""
    if _real_torchvision_importable():
        yield None
        return
    for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[key]  # leftovers of the failed import
    fakes = _build_stand_in()
    sys.modules.update(fakes)
    try:
        yield fakes
    finally:
        for key, mod in fakes.items():
            if sys.modules.get(key) is mod:
                del sys.modules[key]


def import_opacus_test_module(name: str) -> types.ModuleType:
    """Import ``opacus.tests.<name>`` (shipped in the Opacus wheel), torchvision stand-in on."""
    with torchvision_stand_in():
        return importlib.import_module(f"opacus.tests.{name}")
