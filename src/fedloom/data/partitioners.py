"""The built-in partitioners: iid, dirichlet, shards, quantity, natural, rotation."""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from fedloom.data.partition import KEY, PARTITIONS, Partition, round_preserving_sum, split_by_sizes
from fedloom.data.rotate import rotate_images
from fedloom.errors import ConfigError

MAX_DIRICHLET_TRIES = 100


def _classes(labels: np.ndarray) -> np.ndarray:
    if labels.dtype.kind not in "iub":
        raise ConfigError(
            f"{KEY}.kind: this partition needs integer class labels, got {labels.dtype} targets"
        )
    return np.unique(labels)


class LabelSkewPartition(Partition):
    """Base of the label-skew splits: they need integer class labels and deal by class."""

    needs_labels: ClassVar[bool] = True

    def split(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        return self.split_classes(labels, _classes(labels), num_clients, rng)

    def split_classes(
        self, labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """One index array per client, given the sorted distinct ``classes`` of ``labels``."""
        raise NotImplementedError


class ShuffledPartition(Partition):
    """Base of the IID splits: shuffle, then deal equal shares (sizes differ by at most one)."""

    def split(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        return np.array_split(rng.permutation(len(labels)), num_clients)


@PARTITIONS.register("iid")
class IIDPartition(ShuffledPartition):
    """Shuffle, then deal equal shares (sizes differ by at most one)."""

    kind: Literal["iid"] = "iid"


@PARTITIONS.register("dirichlet")
class DirichletPartition(LabelSkewPartition):
    """Label skew: for each class, client shares ~ Dir(alpha).

    Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
    Visual Classification", 2019. Small ``alpha`` is very skewed, large ``alpha`` approaches
    IID. The whole draw is repeated until every client holds at least ``min_size`` samples.
    """

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, allow_inf_nan=False)
    min_size: int = Field(10, ge=1)

    def split_classes(
        self, labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        if num_clients * self.min_size > len(labels):
            raise ConfigError(
                f"{KEY}.min_size: {num_clients} clients x min_size {self.min_size} exceeds the "
                f"{len(labels)} samples; lower data.num_clients or {KEY}.min_size"
            )
        by_class = [np.flatnonzero(labels == c) for c in classes]
        smallest = 0
        for _ in range(MAX_DIRICHLET_TRIES):
            pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for idx in by_class:
                idx = rng.permutation(idx)
                shares = rng.dirichlet(np.full(num_clients, self.alpha))
                cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
                for k, piece in enumerate(np.split(idx, cuts)):
                    pieces[k].append(piece)
            parts = [np.concatenate(p) for p in pieces]
            smallest = min(len(p) for p in parts)
            if smallest >= self.min_size:
                return parts
        raise ConfigError(
            f"{KEY}.min_size: after {MAX_DIRICHLET_TRIES} Dirichlet draws with alpha={self.alpha} "
            f"some client still had fewer than {self.min_size} samples (last draw: {smallest}); "
            f"raise {KEY}.alpha, lower {KEY}.min_size or use fewer clients"
        )


def _shards_per_class(counts: np.ndarray, total: int, num_clients: int) -> np.ndarray | None:
    """Shards per class: at least one each, roughly proportional to class size, at most
    ``num_clients`` (so no client needs two shards of one label) and at most the class size.
    None when no such allocation exists."""
    caps = np.minimum(counts, num_clients)
    if len(counts) > total or caps.sum() < total:
        return None
    alloc = np.ones(len(counts), dtype=np.int64)
    target = counts / counts.sum() * total
    for _ in range(total - len(counts)):
        deficit = np.where(alloc < caps, target - alloc, -np.inf)
        alloc[int(np.argmax(deficit))] += 1
    return alloc


@PARTITIONS.register("shards")
class ShardsPartition(LabelSkewPartition):
    """Pathological label skew: label-sorted shards, ``shards_per_client`` per client.

    McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
    Data" (FedAvg), AISTATS 2017. Unlike the original, shards are label-pure and dealt so that
    every client ends with exactly ``shards_per_client`` distinct labels; shard sizes within a
    class differ by at most one, so no sample is lost.
    """

    kind: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, ge=1)

    def split_classes(
        self, labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        counts = np.array([(labels == c).sum() for c in classes])
        spc = self.shards_per_client
        total = num_clients * spc
        key = f"{KEY}.shards_per_client"
        if spc > len(classes):
            raise ConfigError(
                f"{key}: must be <= the number of classes ({len(classes)}) so that each client "
                f"gets distinct labels, got {spc}"
            )
        if total > len(labels):
            raise ConfigError(
                f"{key}: {num_clients} clients x {spc} shards = {total} shards, more than the "
                f"{len(labels)} samples"
            )
        alloc = _shards_per_class(counts, total, num_clients)
        if alloc is None:
            raise ConfigError(
                f"{key}: cannot deal {num_clients} clients x {spc} = {total} shards over "
                f"{len(classes)} classes (each class needs between 1 and data.num_clients shards "
                f"so that no sample is lost and no client gets one label twice)"
            )
        shards: list[np.ndarray] = []
        for c in rng.permutation(len(classes)):
            idx = rng.permutation(np.flatnonzero(labels == classes[c]))
            shards.extend(np.array_split(idx, alloc[c]))
        # Consecutive shards of one class (at most num_clients of them) go to distinct clients.
        owner = rng.permutation(num_clients)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for i, shard in enumerate(shards):
            parts[owner[i % num_clients]].append(shard)
        return [np.concatenate(p) for p in parts]


@PARTITIONS.register("quantity")
class QuantityPartition(Partition):
    """Quantity skew: lognormal client sizes (shares ~ LogNormal(0, sigma)), labels IID.

    The lognormal size model follows LEAF / FedProx's unbalanced devices (Li et al., "Federated
    Optimization in Heterogeneous Networks", MLSys 2020). Each client gets ``min_size`` samples
    first, the rest is shared out in proportion to the drawn weights.
    """

    kind: Literal["quantity"] = "quantity"
    sigma: float = Field(1.0, gt=0, allow_inf_nan=False)
    min_size: int = Field(10, ge=1)

    def split(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        n = len(labels)
        if num_clients * self.min_size > n:
            raise ConfigError(
                f"{KEY}.min_size: {num_clients} clients x min_size {self.min_size} exceeds the "
                f"{n} samples; lower data.num_clients or {KEY}.min_size"
            )
        weights = rng.lognormal(0.0, self.sigma, num_clients)
        sizes = self.min_size + round_preserving_sum(weights, n - num_clients * self.min_size)
        return split_by_sizes(rng.permutation(n), sizes)


@PARTITIONS.register("natural")
class NaturalPartition(Partition):
    """The dataset's own users (writers, roles, devices); only natural datasets support it."""

    kind: Literal["natural"] = "natural"

    def split(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        raise ConfigError(
            f"{KEY}.kind: 'natural' needs a dataset with its own users "
            "(femnist, shakespeare, synthetic, quadratic)"
        )


@PARTITIONS.register("rotation")
class RotationPartition(ShuffledPartition):
    """Feature shift: an IID split where client k's images are rotated by
    ``angles[k % len(angles)]`` degrees (Ghosh et al., IFCA, NeurIPS 2020)."""

    kind: Literal["rotation"] = "rotation"
    angles: list[float] = Field(default_factory=lambda: [0.0, 90.0, 180.0, 270.0], min_length=1)
    needs_images: ClassVar[bool] = True

    def angle(self, client: int) -> float:
        return float(self.angles[client % len(self.angles)])

    def transform(self, x: torch.Tensor, client: int) -> torch.Tensor:
        if x.ndim != 4:
            raise ConfigError(f"{KEY}.kind: 'rotation' needs image data (n, C, H, W)")
        degrees = self.angle(client)
        return x if degrees % 360 == 0 else rotate_images(x, degrees)
