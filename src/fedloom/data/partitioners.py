"""The built-in partitioners: iid, dirichlet, shards, quantity, natural, rotation."""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from fedloom.core.rng import generator
from fedloom.data.partition import (
    KEY,
    PARTITIONS,
    Partition,
    UnpooledPartition,
    round_preserving_sum,
    split_by_sizes,
)
from fedloom.data.rotate import rotate_images
from fedloom.errors import ConfigError

MAX_DIRICHLET_TRIES = 100


def _classes(labels: np.ndarray) -> np.ndarray:
    if labels.dtype.kind not in "iub":
        raise ConfigError(
            f"{KEY}.kind: this partition needs integer class labels, got {labels.dtype} targets"
        )
    return np.unique(labels)


def _check_min_size(num_clients: int, min_size: int, n: int) -> None:
    """Every client can get ``min_size`` of the ``n`` samples, or a ConfigError says so."""
    if num_clients * min_size > n:
        raise ConfigError(
            f"{KEY}.min_size: {num_clients} clients x min_size {min_size} exceeds the "
            f"{n} samples; lower data.num_clients or {KEY}.min_size"
        )


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
    IID. The whole draw is repeated until every client holds at least ``min_size`` samples, at
    most MAX_DIRICHLET_TRIES times (then a ConfigError naming the numbers).

    ``pfllib: true`` adds PFLlib's balancing rule (Zhang et al., PFLlib, JMLR 2025,
    ``separate_data``, ``partition == 'dir'``, after Yurochkin et al.'s PFNM code): classes are
    dealt in label order and a client already holding ``n / num_clients`` samples or more gets
    no share of the later classes. PFLlib redraws until every client has ``least_samples``
    (``int(min(40, n / num_clients / 2))``, see pfllib_partitions.py): set ``min_size`` to
    that number to get its split (docs/partitions.md).
    """

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, allow_inf_nan=False)
    min_size: int = Field(10, ge=1)
    pfllib: bool = False

    def split_classes(
        self, labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        n = len(labels)
        _check_min_size(num_clients, self.min_size, n)
        by_class = [np.flatnonzero(labels == c) for c in classes]
        draws = f"Dirichlet draws (alpha={self.alpha}{', pfllib' if self.pfllib else ''})"
        return redraw_dirichlet(
            by_class, num_clients, self.alpha, self.min_size, rng, draws, balance=self.pfllib
        )


def redraw_dirichlet(
    by_class: list[np.ndarray],
    num_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
    draws: str,
    *,
    balance: bool,
    holders: list[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """One index array per client from Dirichlet draws (``draw_dirichlet``), the whole draw
    repeated until every client holds at least ``min_size`` samples, at most
    MAX_DIRICHLET_TRIES times; then a ConfigError naming the numbers (``draws``: the kind of
    draw and its settings)."""
    smallest = 0
    for _ in range(MAX_DIRICHLET_TRIES):
        drawn = draw_dirichlet(by_class, num_clients, alpha, rng, balance=balance, holders=holders)
        if drawn is None:
            continue
        smallest = int(drawn[2].min())
        if smallest >= min_size:
            return assemble(drawn, num_clients)
    n = sum(len(c) for c in by_class)
    raise ConfigError(
        f"{KEY}.min_size: after {MAX_DIRICHLET_TRIES} {draws} of {n} samples over {num_clients} "
        f"clients some client still had fewer than min_size={min_size} samples (the last "
        f"draw's smallest: {smallest}); raise {KEY}.alpha, lower {KEY}.min_size or use fewer "
        "clients"
    )


DirichletDraw = tuple[list[np.ndarray], list[np.ndarray], np.ndarray]
"""Each class's shuffled indices, its cut points (np.split) and the clients' sizes."""


def draw_dirichlet(
    by_class: list[np.ndarray],
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    balance: bool,
    holders: list[np.ndarray] | None = None,
) -> DirichletDraw | None:
    """One Dirichlet draw over the classes' indices ``by_class``, in order.

    For each class: shuffle its indices, draw shares ~ Dir(alpha) over all clients, keep only
    the class's ``holders`` (a boolean mask per class, ExDir) and, with ``balance``, only the
    clients holding fewer than ``n / num_clients`` samples so far (PFLlib's rule; ignored for a
    class where it would leave no share), then cut at ``floor(cumsum(shares) * n_c)``. With
    ``holders``, the rounding remainder goes to the class's last holder (as PFLlib's ExDir).
    None when no client has a positive share of some class (underflow at tiny alpha).
    """
    n = sum(len(idx) for idx in by_class)
    sizes = np.zeros(num_clients, dtype=np.int64)
    shuffled, cuts = [], []
    for c, idx in enumerate(by_class):
        idx = rng.permutation(idx)
        shares = rng.dirichlet(np.full(num_clients, alpha))
        if holders is not None:
            shares = shares * holders[c]
        if balance:
            capped = shares * (sizes < n / num_clients)
            shares = capped if capped.sum() > 0 else shares
        if holders is not None or balance:
            total = shares.sum()
            if not total > 0:
                return None
            shares = shares / total
        cut = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
        if holders is not None:
            cut[int(np.flatnonzero(shares)[-1]) :] = len(idx)
        sizes += np.diff(cut, prepend=0, append=len(idx))
        shuffled.append(idx)
        cuts.append(cut)
    return shuffled, cuts, sizes


def assemble(drawn: DirichletDraw, num_clients: int) -> list[np.ndarray]:
    """Each client's indices from a draw: its piece of every class."""
    pieces = [np.split(idx, cut) for idx, cut in zip(drawn[0], drawn[1], strict=True)]
    return [np.concatenate([p[k] for p in pieces]) for k in range(num_clients)]


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
        _check_min_size(num_clients, self.min_size, n)
        weights = rng.lognormal(0.0, self.sigma, num_clients)
        sizes = self.min_size + round_preserving_sum(weights, n - num_clients * self.min_size)
        return split_by_sizes(rng.permutation(n), sizes)


@PARTITIONS.register("natural")
class NaturalPartition(UnpooledPartition):
    """The dataset's own users (writers, roles, devices); only natural datasets support it."""

    kind: Literal["natural"] = "natural"
    refusal: ClassVar[str] = (
        "'natural' needs a dataset with its own users (femnist, shakespeare, synthetic, quadratic)"
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

    def transform(
        self, x: torch.Tensor, client: int, num_clients: int = 1, seed: int = 0
    ) -> torch.Tensor:
        if x.ndim != 4:
            raise ConfigError(f"{KEY}.kind: 'rotation' needs image data (n, C, H, W)")
        degrees = self.angle(client)
        return x if degrees % 360 == 0 else rotate_images(x, degrees)


@PARTITIONS.register("noise")
class NoisePartition(ShuffledPartition):
    """Feature skew: an IID split where client k's features (train and test) get Gaussian
    noise of standard deviation ``sigma * k / (N - 1)``, from 0 for client 0 to ``sigma`` for
    the last one.

    Li, Diao, Chen & He, "Federated Learning on Non-IID Data Silos: An Experimental Study",
    ICDE 2022, Sec. IV-B, noise-based feature imbalance (the paper writes Gau(sigma i / N) for
    party i = 1..N; its code, used here, gives party k = 0..N-1 the standard deviation
    sigma k / (N - 1)). The noise is added once, on the [0, 1] scale, from the stream (seed,
    'partition/noise', client): fixed per sample, where that code draws it afresh each time a
    sample is loaded.
    """

    kind: Literal["noise"] = "noise"
    sigma: float = Field(0.1, ge=0, allow_inf_nan=False)
    needs_images: ClassVar[bool] = True

    def level(self, client: int, num_clients: int) -> float:
        """Client ``client``'s noise standard deviation."""
        return self.sigma * client / (num_clients - 1) if num_clients > 1 else 0.0

    def transform(
        self, x: torch.Tensor, client: int, num_clients: int = 1, seed: int = 0
    ) -> torch.Tensor:
        if not x.dtype.is_floating_point:
            raise ConfigError(f"{KEY}.kind: 'noise' needs real-valued features, got {x.dtype}")
        std = self.level(client, num_clients)
        if std == 0.0:
            return x
        gen = generator(seed, "partition/noise", client=client)
        return x + std * torch.randn(x.shape, generator=gen, dtype=x.dtype)
