"""The partitioner interface and the ``PARTITIONS`` registry.

A partitioner is a validated pydantic model (its fields are the ``data.partition`` options)
that is called as ``part(labels, num_clients, rng)`` and returns one index array per client.
Every index appears exactly once across clients: no sample lost or duplicated.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.core.settings import FrozenModel
from fedloom.errors import ConfigError
from fedloom.registry import Registry

KEY = "data.partition"


class Partition(FrozenModel):
    """Base class: subclasses set ``kind`` (a Literal) and implement :meth:`split`."""

    kind: str
    #: True for label-skew partitions that need classification labels.
    needs_labels: ClassVar[bool] = False
    #: True for partitions that transform each client's images (feature shift).
    needs_images: ClassVar[bool] = False

    def split(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        raise NotImplementedError

    def __call__(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        labels = np.asarray(labels)
        if num_clients < 1:
            raise ConfigError(f"data.num_clients: must be >= 1, got {num_clients}")
        if num_clients > len(labels):
            raise ConfigError(
                f"data.num_clients: {num_clients} clients cannot share {len(labels)} samples"
            )
        parts = [
            np.sort(np.asarray(p, dtype=np.int64)) for p in self.split(labels, num_clients, rng)
        ]
        check_partition(parts, len(labels))
        return parts

    def transform(
        self, x: torch.Tensor, client: int, num_clients: int = 1, seed: int = 0
    ) -> torch.Tensor:
        """Client ``client``'s (of ``num_clients``) features after a feature shift (identity by
        default); any randomness comes from the run seed ``seed``."""
        return x

    def params(self) -> dict[str, Any]:
        return self.model_dump()


class UnpooledPartition(Partition):
    """Base of the partitions whose clients come from elsewhere than a split of a pool of
    samples (a dataset's own users, a partition file): ``split`` refuses with ``refusal``."""

    refusal: ClassVar[str] = ""

    def split(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        raise ConfigError(f"{KEY}.kind: {self.refusal}")


def check_partition(parts: list[np.ndarray], n: int) -> None:
    """Raise if ``parts`` is not an exact cover of ``range(n)`` (an internal bug, not input)."""
    allidx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(allidx) != n or not np.array_equal(np.sort(allidx), np.arange(n)):
        raise RuntimeError(f"partition lost or duplicated samples: {len(allidx)} indices for {n}")


def split_by_sizes(indices: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Cut ``indices`` into consecutive pieces of the given sizes (which sum to its length)."""
    return np.split(indices, np.cumsum(sizes)[:-1])


def round_preserving_sum(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer sizes proportional to ``weights`` summing to ``total`` (largest remainder)."""
    raw = np.asarray(weights, dtype=np.float64) / np.sum(weights) * total
    sizes = np.floor(raw).astype(np.int64)
    short = total - int(sizes.sum())
    if short > 0:
        order = np.argsort(-(raw - sizes), kind="stable")
        sizes[order[:short]] += 1
    return sizes


PARTITIONS: Registry[type[Partition]] = Registry("partition", f"{KEY}.kind")
