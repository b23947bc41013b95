"""Poisson batches of a fixed physical size.

Poisson sampling, which the privacy accounting assumes, gives every step a batch of a
different size: each size is a new shape for the autotuner's buckets and for anything
captured or compiled once per shape, and a large batch can run out of memory.
``FixedShapeBatches`` serves each logical (Poisson) batch of a DP data loader as physical
batches of exactly ``size`` samples:

- a logical batch of L samples becomes ``ceil(L / size)`` physical batches (one for an empty
  batch), the last padded to ``size`` with copies of one of its own samples (the dataset's
  first for an empty batch);
- a padded sample's loss weight is exactly zero (``weights``, which dpgrad's loss wrapper
  applies to the per-sample losses), so its per-sample gradient, its norm and its clipped
  contribution are exactly zero: it adds nothing to the step;
- the optimizer is told to skip its step after every physical batch but the last of a logical
  batch (Opacus's ``signal_skip_step``, as its ``BatchMemoryManager`` does), so it steps,
  draws its noise and counts for the accountant once per logical batch, as without padding.

The sampling, the expected batch size and the accountant are the data loader's, unchanged.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Deque, Dict, Iterator, List, Tuple

import torch
from torch.utils.data import DataLoader, Sampler


def rank_generator(seed: int, rank: int) -> torch.Generator:
    """A generator for the Poisson sampler of process ``rank`` of a run seeded with ``seed``:
    each rank its own draws (ranks seeded alike would otherwise take the same positions of
    their shares together, where the accountant assumes independent samples), reproducible
    from the seed."""
    digest = hashlib.sha256(f"{seed}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def padded_parts(items: list, size: int, empty_filler) -> Iterator[Tuple[list, int]]:
    """A logical batch's ``items`` as parts of exactly ``size``: ``(part, real items)`` for each,
    the last part padded with copies of its first item (``empty_filler`` for an empty batch,
    which gives one part of padding alone)."""
    parts = [items[i:i + size] for i in range(0, len(items), size)] or [[]]
    for part in parts:
        filler = part[0] if part else empty_filler
        yield part + [filler] * (size - len(part)), len(part)


class PaddedBatchSampler(Sampler[List[int]]):
    """The index lists of ``sampler`` (logical batches) as lists of exactly ``size`` indices,
    each logical batch split and its last part padded; for every list made, ``(real samples,
    whether it ends its logical batch)`` is appended to ``plan``, in order."""

    def __init__(self, sampler, size: int, plan: Deque[Tuple[int, bool]]):
        self.sampler, self.size, self.plan = sampler, size, plan

    def __iter__(self) -> Iterator[List[int]]:
        size = self.size
        for indices in self.sampler:
            parts = list(padded_parts(list(indices), size, 0))  # the dataset's first row pads an empty batch
            for k, (part, real) in enumerate(parts):
                self.plan.append((real, k == len(parts) - 1))
                yield part

    def __len__(self) -> int:
        expected = getattr(self.sampler, "sample_rate", 0) * getattr(self.sampler, "num_samples", 0)
        return len(self.sampler) * max(1, -(-int(round(expected)) // self.size))


class FixedShapeBatches:
    """A DP data loader's Poisson batches as physical batches of exactly ``size`` samples
    (see the module docstring). Iterate over it as over the data loader; ``weights(like)`` are
    the loss weights of the batch last yielded (1 for a sampled sample, 0 for padding) and
    ``samples`` its number of sampled samples.

    Args:
        data_loader: a DP data loader (Opacus's ``DPDataLoader``: Poisson sampling).
        size: the physical batch size.
        optimizer: the DP optimizer, told which physical batches end a logical one
            (``signal_skip_step``).
    """

    def __init__(self, data_loader: DataLoader, size: int, optimizer):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"physical_batch_size must be a positive integer, not {size!r}")
        self.size = size
        self.optimizer = optimizer
        self.dataset = data_loader.dataset
        self.sample_rate = getattr(data_loader, "sample_rate", None)
        self._plan: Deque[Tuple[int, bool]] = deque()
        self.batch_sampler = PaddedBatchSampler(data_loader.batch_sampler, size, self._plan)
        self._loader = DataLoader(
            dataset=data_loader.dataset, batch_sampler=self.batch_sampler, collate_fn=data_loader.collate_fn,
            num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory, timeout=data_loader.timeout,
            worker_init_fn=data_loader.worker_init_fn, multiprocessing_context=data_loader.multiprocessing_context,
            generator=data_loader.generator, prefetch_factor=data_loader.prefetch_factor,
            persistent_workers=data_loader.persistent_workers,
        )
        self.samples = 0
        # One weights tensor per device and dtype, rewritten in place when the number of sampled
        # samples changes (a step captured in a CUDA graph reads it where it was at capture),
        # from masks made once for each number.
        self._weights: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._masks: Dict[Tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        self._written: Dict[Tuple[torch.device, torch.dtype], int] = {}

    def __iter__(self):
        self._plan.clear()
        for batch in self._loader:
            # The sampler runs ahead of the batches (workers prefetch): its plan is read in order.
            self.samples, last = self._plan.popleft()
            self.optimizer.signal_skip_step(do_skip=not last)
            for key in self._weights:
                self._write(key)
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def weights(self, like: torch.Tensor) -> torch.Tensor:
        """The loss weights of the batch last yielded, (size,), on ``like``'s device and in its
        dtype: the same tensor for every batch, rewritten when the batch is yielded."""
        key = (like.device, like.dtype)
        if key not in self._weights:
            self._weights[key] = torch.empty(self.size, device=like.device, dtype=like.dtype)
            self._write(key)
        return self._weights[key]

    def _write(self, key: Tuple[torch.device, torch.dtype]) -> None:
        """Bring the weights on ``key``'s device and dtype to the number of sampled samples."""
        if self._written.get(key) == self.samples:
            return
        device, dtype = key
        mask = self._masks.get((self.samples, device, dtype))
        if mask is None:
            mask = self._masks[(self.samples, device, dtype)] = (torch.arange(self.size) < self.samples).to(
                device=device, dtype=dtype)
        self._weights[key].copy_(mask, non_blocking=True)
        self._written[key] = self.samples
