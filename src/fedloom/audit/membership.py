"""Who is a member: balanced sets of members (a client's training samples) and non-members
(samples no client ever trained on), label-matched, and the reserve of never-seen samples they
come from.

The reserve is the dataset's official held-out split where it has one (MNIST and
Fashion-MNIST: the 10,000 t10k images, which a fedloom run never touches), else a ``holdout``
the caller gives, else the clients' held-out test splits (evaluated on, never trained on). It
is cut, once per audit and seeded, into three disjoint parts: non-members for the attacks,
shadow data for the shadow models (Shokri et al. 2017: same distribution, never seen by a
client) and public data for the distillation defence.

Each member is paired with a non-member of the same label (and, under a feature-shift
partition, passed through the same client's transform), so a target's AUC measures membership,
not the label skew between a client and the population: a personalized model on a
Dirichlet(0.3) client would otherwise "recognise" its own classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedloom.core.rng import generator
from fedloom.data import FederatedData
from fedloom.data.partition import PARTITIONS
from fedloom.errors import ConfigError

OFFICIAL_HELDOUT = ("mnist", "fashion_mnist")
"""Registered datasets whose official test split no run uses (data/mnist.py)."""
RESERVE_SHARES = (0.4, 0.4, 0.2)
"""Non-member, shadow and public shares of the reserve."""

Transform = Callable[[torch.Tensor, int], torch.Tensor]


def identity(x: torch.Tensor, client: int) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Pool:
    """Labelled samples."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def take(self, idx: torch.Tensor) -> Pool:
        return Pool(self.x[idx], self.y[idx])


@dataclass(frozen=True)
class Reserve:
    """Samples no client trained on, in three disjoint parts."""

    nonmembers: Pool
    shadow: Pool
    public: Pool
    source: str
    """Where they come from, in words (audit.json's ``reserve``)."""
    transform: Transform = identity
    """Client k's feature shift (rotation partitions), applied to a non-member paired with one
    of k's members."""


@dataclass(frozen=True)
class MembershipSet:
    """Balanced, label-matched members and non-members of one target."""

    x: torch.Tensor
    y: torch.Tensor
    member: torch.Tensor
    """bool, True for members."""

    @property
    def size(self) -> tuple[int, int]:
        return int(self.member.sum()), int((~self.member).sum())


def official_heldout(data: FederatedData, root: str | None) -> Pool | None:
    """The official test split of a registered MNIST-family dataset, scaled as its training
    images are (data/pool.py), or None for other datasets."""
    if data.name not in OFFICIAL_HELDOUT:
        return None
    from fedloom.data.load import default_root
    from fedloom.data.mnist import load_mnist_arrays

    _, _, x, y = load_mnist_arrays(root or default_root(), data.name)
    xs = torch.from_numpy(x.astype(np.float32)).div_(255.0).unsqueeze(1)  # a copy
    return Pool(xs, torch.from_numpy(y.astype(np.int64)))


def clients_heldout(data: FederatedData) -> Pool:
    """Every client's held-out test split together: evaluated on, never trained on."""
    return Pool(
        torch.cat([c.x_test for c in data.clients]), torch.cat([c.y_test for c in data.clients])
    )


def partition_transform(data: FederatedData) -> Transform:
    """The partition's per-client feature shift (identity for label and quantity skew)."""
    params = data.extras.get("partition")
    if not isinstance(params, dict) or "kind" not in params:
        return identity
    part = PARTITIONS.get(str(params["kind"])).model_validate(params)
    if not part.needs_images:
        return identity
    n = data.num_clients
    # seed -1: the noise kind draws non-members' noise apart from the clients' own
    return lambda x, client: part.transform(x, client, n, -1)


def make_reserve(
    data: FederatedData, seed: int, holdout: Pool | None = None, root: str | None = None
) -> Reserve:
    """The reserve of never-seen samples (see the module doc), cut by the stream
    (seed, 'audit/reserve')."""
    if data.task != "classification":
        raise ConfigError(
            f"membership inference needs a classification task, {data.name} is {data.task}"
        )
    transform: Transform = identity
    if holdout is not None:
        pool, source = holdout, "the given holdout (never seen by any client)"
    elif (official := official_heldout(data, root)) is not None:
        pool, transform = official, partition_transform(data)
        source = f"{data.name} official test split (never used by the run)"
    else:
        pool = clients_heldout(data)
        source = "the clients' held-out test splits (evaluated on, never trained on)"
    if len(pool) < 10:
        raise ConfigError(f"too few never-seen samples for an audit: {len(pool)} in {source}")
    order = torch.randperm(len(pool), generator=generator(seed, "audit/reserve"))
    a = int(RESERVE_SHARES[0] * len(pool))
    b = a + int(RESERVE_SHARES[1] * len(pool))
    return Reserve(
        pool.take(order[:a]), pool.take(order[a:b]), pool.take(order[b:]), source, transform
    )


def allocate(total: int, sizes: Sequence[int]) -> list[int]:
    """``total`` split over sources proportionally to ``sizes`` (largest remainder), each at
    most its size."""
    total = min(total, sum(sizes))
    raw = np.asarray(sizes, dtype=np.float64) * total / max(1, sum(sizes))
    out = np.floor(raw).astype(np.int64)
    for i in np.argsort(-(raw - out), kind="stable")[: total - int(out.sum())]:
        out[i] += 1
    return [int(v) for v in np.minimum(out, sizes)]


def matched_set(
    sources: Sequence[tuple[int, Pool, int]],
    pool: Pool,
    gen: torch.Generator,
    transform: Transform = identity,
) -> MembershipSet:
    """Members and as many label-matched non-members.

    ``sources``: (client id, its training samples, how many to draw). Each drawn member gets a
    distinct non-member of its label from ``pool`` (without replacement across the whole set),
    passed through ``transform(., client)``; members of a label the pool has run out of are
    dropped, so the set stays balanced."""
    by_class: dict[int, list[int]] = {}
    for c in torch.unique(pool.y).tolist():
        idx = torch.nonzero(pool.y == c).flatten()
        by_class[c] = idx[torch.randperm(len(idx), generator=gen)].tolist()
    xs, ys, members = [], [], []
    for client, data, count in sources:
        chosen = torch.randperm(len(data), generator=gen)[:count]
        keep, partners = [], []
        for i, label in zip(chosen.tolist(), data.y[chosen].tolist(), strict=True):
            free = by_class.get(label)
            if free:
                keep.append(i)
                partners.append(free.pop())
        if not keep:
            continue
        m = data.take(torch.tensor(keep))
        n = pool.take(torch.tensor(partners))
        xs += [m.x, transform(n.x, client)]
        ys += [m.y, n.y]
        members += [
            torch.ones(len(keep), dtype=torch.bool),
            torch.zeros(len(keep), dtype=torch.bool),
        ]
    if not xs:
        raise ConfigError("no member could be paired with a never-seen sample of its label")
    return MembershipSet(torch.cat(xs), torch.cat(ys), torch.cat(members))
