"""The Poisson sampling of ``DPTrainer`` (``dpgrad.hf``): the sampling units (rows, or each
user's rows), each step's logical batch of units taken independently with the sample rate,
one generator per rank, and the dataset's rows with their indices."""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import Sampler

from dpgrad.batches import rank_generator


class LogicalBatch:
    """One Poisson-sampled logical batch: the dataset's rows (uncollated), their indices and
    each row's clipping share (1 / the rows its user has in the batch; 1 without users)."""

    def __init__(self, rows: list, indices: List[int], shares: List[float]):
        self.rows, self.indices, self.shares = rows, indices, shares

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key) -> bool:  # the Trainer looks for "labels" in a batch
        return False


class PoissonSampler(Sampler[List[int]]):
    """Logical batches of dataset indices, ``steps`` per epoch: each unit (a row, or a user's
    rows) is taken with probability ``sample_rate``, independently of the others and of other
    steps (a fresh draw each step, from ``generator``)."""

    def __init__(self, units: List[List[int]], sample_rate: float, generator: torch.Generator):
        self.units, self.sample_rate, self.generator = units, sample_rate, generator
        self.steps = max(1, int(1 / sample_rate))
        self.epoch_start: Optional[torch.Tensor] = None  # the generator's state when this epoch began

    def __iter__(self) -> Iterator[List[int]]:
        self.epoch_start = self.generator.get_state()
        for _ in range(self.steps):
            taken = torch.rand(len(self.units), generator=self.generator) < self.sample_rate
            yield [i for u in taken.nonzero().flatten().tolist() for i in self.units[u]]

    def __len__(self) -> int:
        return self.steps


def sampling_units(dataset, user_column: Optional[str]) -> Tuple[List[List[int]], List[float]]:
    """The sampling units (lists of row indices: a row each, or a user's rows, read from
    ``user_column`` before any column is removed) and each row's clipping share, 1 / the rows
    of its unit (a sampled user brings all of them)."""
    n = len(dataset)
    if user_column is None:
        return [[i] for i in range(n)], [1.0] * n
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if user_column not in names:
            raise ValueError(f"user_column={user_column!r} is not a column of the training dataset ({names})")
        users = list(dataset[user_column])
    else:
        users = []
        for i in range(n):
            row = dataset[i]
            if not isinstance(row, dict) or user_column not in row:
                raise ValueError(f"row {i} of the training dataset has no {user_column!r} (user_column)")
            users.append(row[user_column])
    by_user: Dict[object, List[int]] = {}
    for i, user in enumerate(users):
        by_user.setdefault(user.item() if isinstance(user, torch.Tensor) else user, []).append(i)
    units = list(by_user.values())
    shares = [0.0] * n
    for unit in units:
        for i in unit:
            shares[i] = 1.0 / len(unit)
    return units, shares


def sampling_generator(seed: int, rank: int, world: int) -> torch.Generator:
    """The generator of a rank's Poisson sampler: ``seed`` itself in one process, one of each
    rank's own with several (``dpgrad.batches.rank_generator``)."""
    return torch.Generator().manual_seed(seed) if world == 1 else rank_generator(seed, rank)


class Indexed(torch.utils.data.Dataset):
    """A dataset's rows with their indices, for the logical batch to know them."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i], i
