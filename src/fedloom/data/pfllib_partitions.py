"""Label-skew partitions with PFLlib's semantics: ``pathological`` and ``extended_dirichlet``.

PFLlib: Zhang et al., "PFLlib: A Beginner-Friendly and Comprehensive Personalized Federated
Learning Library", JMLR 2025 (arXiv 2312.04992); its ``dataset/utils/dataset_utils.py``,
``separate_data`` (branches ``partition == 'pat'`` and ``'exdir'``). Written from that
description, with two changes so that every sample lands on exactly one client: see each
class's docstring and docs/partitions.md.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field

from fedloom.data.partition import KEY, PARTITIONS, split_by_sizes
from fedloom.data.partitioners import LabelSkewPartition, redraw_dirichlet
from fedloom.errors import ConfigError

MAX_ASSIGNMENT_TRIES = 1000
"""ExDir's redraws of the classes-to-clients assignment before a ConfigError."""

PFLLIB_LEAST_SAMPLES_CAP = 40
"""PFLlib's ``least_samples`` is ``int(min(batch_size / (1 - train_ratio), n / clients / 2))``
with its batch size 10 and train ratio 0.75: 10 / 0.25 = 40."""


def pfllib_least_samples(num_samples: int, num_clients: int) -> int:
    """PFLlib's per-client sample floor (``least_samples`` in ``separate_data``)."""
    return int(min(PFLLIB_LEAST_SAMPLES_CAP, num_samples / num_clients / 2))


def pat_clients_per_class(num_clients: int, num_classes: int, k: int) -> list[list[int]]:
    """PFLlib's 'pat' choice of clients for each class, in order.

    Class ``i`` (in label order) goes to the first ``ceil(num_clients / num_classes * k)``
    clients (in id order) that still need a class; each of them then needs one class less.
    So clients 0..m-1 take classes 0..k-1, the next m clients the next k classes, and so on
    (m = num_clients k / num_classes). A class no client needs any more gets an empty list.
    """
    need = [k] * num_clients
    cap = math.ceil(num_clients / num_classes * k)
    out: list[list[int]] = []
    for _ in range(num_classes):
        chosen = [c for c in range(num_clients) if need[c] > 0][:cap]
        for c in chosen:
            need[c] -= 1
        out.append(chosen)
    return out


def _check_pat(owners: list[list[int]], classes: np.ndarray, num_clients: int, k: int) -> None:
    key = f"{KEY}.classes_per_client"
    hint = (
        f"data.num_clients x classes_per_client a multiple of the {len(classes)} classes and "
        f"classes_per_client a divisor of {len(classes)} always work"
    )
    if k > len(classes):
        raise ConfigError(f"{key}: must be <= the number of classes ({len(classes)}), got {k}")
    orphans = [int(classes[i]) for i, o in enumerate(owners) if not o]
    if orphans:
        raise ConfigError(
            f"{key}: PFLlib's 'pat' dealing of {num_clients} clients x {k} classes leaves "
            f"class(es) {orphans[:5]} without a client (PFLlib drops their samples); {hint}"
        )
    held = np.zeros(num_clients, dtype=np.int64)
    for o in owners:
        held[o] += 1
    short = np.flatnonzero(held != k)
    if len(short):
        raise ConfigError(
            f"{key}: PFLlib's 'pat' dealing of {num_clients} clients x {k} classes leaves client "
            f"{int(short[0])} with {int(held[short[0]])} class(es), not {k}; {hint}"
        )


@PARTITIONS.register("pathological")
class PathologicalPartition(LabelSkewPartition):
    """Each client holds exactly ``classes_per_client`` classes: PFLlib's 'pat' split.

    The clients of each class are chosen as PFLlib does (:func:`pat_clients_per_class`), so
    client k holds the same classes as PFLlib's client k. They share the class's (shuffled)
    samples: ``balanced: true`` in equal shares, the ``n mod s`` remaining samples one each to
    the first clients (sizes differ by at most one; PFLlib gives all of them to the last
    client); ``balanced: false`` PFLlib's random sizes, each but the last client's drawn
    uniformly from the integers in ``[max(n/s/10, least_samples/C), n/s)`` (at least 1) and the
    last client taking the rest. ``least_samples`` is PFLlib's floor
    (:func:`pfllib_least_samples`). A configuration where PFLlib's dealing would leave a class
    without a client, or a client with fewer classes, is a ConfigError.
    """

    kind: Literal["pathological"] = "pathological"
    classes_per_client: int = Field(2, ge=1)
    balanced: bool = True

    def split_classes(
        self, labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        k = self.classes_per_client
        owners = pat_clients_per_class(num_clients, len(classes), k)
        _check_pat(owners, classes, num_clients, k)
        least = pfllib_least_samples(len(labels), num_clients)
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c, chosen in zip(classes, owners, strict=True):
            idx = rng.permutation(np.flatnonzero(labels == c))
            sizes = self._sizes(len(idx), len(chosen), least / len(classes), int(c), rng)
            for client, piece in zip(chosen, split_by_sizes(idx, sizes), strict=True):
                pieces[client].append(piece)
        return [np.concatenate(p) for p in pieces]

    def _sizes(
        self, n: int, s: int, floor: float, label: int, rng: np.random.Generator
    ) -> np.ndarray:
        """How many of a class's ``n`` samples each of its ``s`` clients gets."""
        if n < s:
            raise ConfigError(
                f"{KEY}.classes_per_client: class {label} has {n} samples for its {s} clients; "
                "use fewer data.num_clients or a smaller classes_per_client"
            )
        if self.balanced:
            return np.array([len(p) for p in np.array_split(np.arange(n), s)], dtype=np.int64)
        per = n / s
        low, high = max(1, int(max(per / 10, floor))), int(per)
        if s > 1 and low >= high:
            raise ConfigError(
                f"{KEY}.balanced: class {label} has {n} samples for {s} clients, too few for "
                f"PFLlib's random sizes (drawn from [{low}, {high})); use balanced: true or "
                "fewer data.num_clients"
            )
        drawn = rng.integers(low, high, size=s - 1) if s > 1 else np.zeros(0, dtype=np.int64)
        return np.append(drawn, n - int(drawn.sum())).astype(np.int64)


@PARTITIONS.register("extended_dirichlet")
class ExtendedDirichletPartition(LabelSkewPartition):
    """ExDir: each client is assigned ``classes_per_client`` classes, and each class's samples
    are shared among the clients assigned it with shares ~ Dir(alpha).

    Li & Lyu, "Convergence Analysis of Sequential Federated Learning on Heterogeneous Data",
    NeurIPS 2023 (arXiv 2311.03154), the extended Dirichlet strategy: it joins the "#C = k"
    label split of Li, Diao, Chen & He ("Federated Learning on Non-IID Data Silos: An
    Experimental Study", ICDE 2022, Sec. IV-A) with the Dirichlet split of Hsu et al. (2019).
    As PFLlib's ``separate_data`` (``partition == 'exdir'``): each client draws its classes
    uniformly without replacement, redrawn until every class has at least
    ``max(C N // K // 2, 1)`` clients; then, per class in label order, Dir(alpha) shares over
    all clients are kept for the class's clients (with ``balance: true``, the original's and
    PFLlib's rule, only for those holding fewer than ``n / N`` samples so far), the rounding
    remainder going to its last client; that second level is redrawn until every client has
    ``min_size`` samples. Both redraws are bounded (a ConfigError naming the numbers). A
    client holds at most ``classes_per_client`` classes: the balancing rule, or a tiny share
    rounded to zero samples, can leave it fewer; ``balance: false`` and a large ``alpha`` give
    it all of them.
    """

    kind: Literal["extended_dirichlet"] = "extended_dirichlet"
    classes_per_client: int = Field(2, ge=1)
    alpha: float = Field(0.5, gt=0, allow_inf_nan=False)
    min_size: int = Field(10, ge=1)
    balance: bool = True

    def split_classes(
        self, labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        holders = self.assign(len(classes), num_clients, rng)
        by_class = [np.flatnonzero(labels == c) for c in classes]
        draws = f"ExDir draws (alpha={self.alpha}, classes_per_client={self.classes_per_client})"
        return redraw_dirichlet(
            by_class,
            num_clients,
            self.alpha,
            self.min_size,
            rng,
            draws,
            balance=self.balance,
            holders=holders,
        )

    def assign(
        self, num_classes: int, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Per class, the boolean mask of the clients assigned it (ExDir's first level)."""
        k = self.classes_per_client
        key = f"{KEY}.classes_per_client"
        if k > num_classes:
            raise ConfigError(f"{key}: must be <= the number of classes ({num_classes}), got {k}")
        need = max(k * num_clients // num_classes // 2, 1)
        if k * num_clients < need * num_classes:
            raise ConfigError(
                f"{key}: {num_clients} clients x {k} classes cannot give each of the "
                f"{num_classes} classes a client; raise it or data.num_clients"
            )
        for _ in range(MAX_ASSIGNMENT_TRIES):
            mask = np.zeros((num_classes, num_clients), dtype=bool)
            for client in range(num_clients):
                mask[rng.choice(num_classes, size=k, replace=False), client] = True
            if mask.sum(axis=1).min() >= need:
                return list(mask)
        raise ConfigError(
            f"{key}: {MAX_ASSIGNMENT_TRIES} random assignments of {k} classes to each of "
            f"{num_clients} clients all left some of the {num_classes} classes with fewer than "
            f"{need} clients; raise it or data.num_clients"
        )
