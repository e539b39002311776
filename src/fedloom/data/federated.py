"""The in-memory federated dataset every part of fedloom reads: one train/test split per client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedloom.core.protocol import ClientData
from fedloom.data.augment import AugmentSpec
from fedloom.data.checks import check_labels, check_uniform
from fedloom.errors import DataError, clipped

__all__ = ["ClientData", "FederatedData", "from_arrays"]


@dataclass
class FederatedData:
    """A dataset split across clients.

    ``task`` is 'classification' (int64 targets, cross-entropy) or 'regression' (float
    targets, mean squared error). ``input_shape`` is one sample's shape, ``num_outputs`` the
    number of classes or regression outputs. ``extras`` holds dataset-specific facts that tests
    and users may need (e.g. closed-form optima for ``quadratic``, the role names for
    ``shakespeare``, the vocabulary).
    """

    name: str
    clients: list[ClientData]
    task: str
    input_shape: tuple[int, ...]
    num_outputs: int
    client_names: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    augment: AugmentSpec | None = None
    """Train-time augmentation of the clients' training samples (data/augment.py), or None."""

    def __post_init__(self) -> None:
        if not self.client_names:
            self.client_names = [str(i) for i in range(len(self.clients))]
        if self.task not in ("classification", "regression"):
            raise ValueError(f"task must be 'classification' or 'regression', not {self.task!r}")

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_classes(self) -> int:
        return self.num_outputs

    def train_sizes(self) -> list[int]:
        return [c.num_train for c in self.clients]

    def label_histogram(self) -> list[list[int]] | None:
        """Per-client train label counts (classification only), saved in the run directory."""
        if self.task != "classification":
            return None
        return [
            torch.bincount(c.y_train.reshape(-1), minlength=self.num_outputs).tolist()
            for c in self.clients
        ]

    def subset(self, client_ids: Sequence[int]) -> FederatedData:
        return replace(
            self,
            clients=[self.clients[i] for i in client_ids],
            client_names=[self.client_names[i] for i in client_ids],
        )


def _as_tensor(a: Any, what: str) -> torch.Tensor:
    try:
        t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
    except (TypeError, ValueError, RuntimeError) as err:  # strings, ragged lists, objects
        raise DataError(
            f"from_arrays: {what} are not numbers ({clipped(str(err))}); give numeric "
            "arrays (class ids as integers: numpy.unique(y, return_inverse=True))"
        ) from None
    if t.ndim == 0:
        raise DataError(f"from_arrays: {what} must have a sample dimension, got a scalar")
    return t


def _normalize_targets(y: torch.Tensor) -> torch.Tensor:
    if y.dtype.is_floating_point:
        return y.to(torch.float32)
    return y.to(torch.int64).reshape(-1)


def _check_pairs(pairs: Any, what: str) -> None:
    """DataError unless ``pairs`` is a list or tuple of (features, targets) pairs."""
    if not isinstance(pairs, list | tuple):
        raise DataError(
            f"from_arrays: {what} must be a list of (features, targets) pairs, one per client, "
            f"not {type(pairs).__name__}"
        )
    for k, pair in enumerate(pairs):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise DataError(
                f"from_arrays: {what}[{k}] must be a (features, targets) pair, not "
                f"{type(pair).__name__}"
            )


def _check_arguments(train: Any, test: Any, test_fraction: Any, seed: Any, name: Any) -> None:
    """DataError naming the first argument of ``from_arrays`` of the wrong type or range."""
    _check_pairs(train, "train")
    if test is not None:
        _check_pairs(test, "test")
    fraction_ok = isinstance(test_fraction, int | float) and not isinstance(test_fraction, bool)
    if not fraction_ok or not 0 <= test_fraction < 1:
        shown = clipped(repr(test_fraction))
        raise DataError(f"from_arrays: test_fraction must be a number in [0, 1), not {shown}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise DataError(f"from_arrays: seed must be an int >= 0, not {clipped(repr(seed))}")
    if not isinstance(name, str) or not name:
        raise DataError(f"from_arrays: name must be a non-empty string, not {clipped(repr(name))}")


def from_arrays(
    train: Sequence[tuple[Any, Any]],
    test: Sequence[tuple[Any, Any]] | None = None,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
    name: str = "arrays",
) -> FederatedData:
    """Bring your own data: one ``(features, targets)`` pair per client.

    Integer targets mean classification, floating-point targets regression (README.md, "Python
    API").
    Without ``test``, each client's pairs are shuffled (seeded) and ``test_fraction`` of them
    held out.
    """
    from fedloom.core.rng import numpy_rng

    _check_arguments(train, test, test_fraction, seed, name)
    if len(train) == 0:
        raise DataError("from_arrays: train must hold at least one client's (features, targets)")
    if test is not None and len(test) != len(train):
        raise DataError(f"from_arrays: {len(train)} train clients but {len(test)} test clients")
    clients: list[ClientData] = []
    for k, (xk, yk) in enumerate(train):
        x = _as_tensor(xk, f"train[{k}] features")
        y = _normalize_targets(_as_tensor(yk, f"train[{k}] targets"))
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"from_arrays: client {k} has {x.shape[0]} features but {y.shape[0]} targets"
            )
        if x.dtype.is_floating_point:
            x = x.to(torch.float32)
        if test is not None:
            xt = _as_tensor(test[k][0], f"test[{k}] features")
            yt = _normalize_targets(_as_tensor(test[k][1], f"test[{k}] targets"))
            xt = xt.to(torch.float32) if xt.dtype.is_floating_point else xt
            clients.append(ClientData(x, y, xt, yt))
        else:
            perm = torch.from_numpy(
                numpy_rng(seed, "from_arrays_split", client=k).permutation(x.shape[0])
            )
            n_test = round(test_fraction * x.shape[0])
            test_idx, train_idx = perm[:n_test], perm[n_test:]
            clients.append(ClientData(x[train_idx], y[train_idx], x[test_idx], y[test_idx]))
    names = [str(k) for k in range(len(clients))]
    check_uniform(clients, names)
    y0 = clients[0].y_train
    if not y0.dtype.is_floating_point:
        for k, c in enumerate(clients):
            check_labels(c.y_train, f"from_arrays: client {k} (train)")
            check_labels(c.y_test, f"from_arrays: client {k} (test)")
    if y0.dtype.is_floating_point:
        task = "regression"
        num_outputs = 1 if y0.ndim == 1 else int(y0.shape[1])
    else:
        task = "classification"
        num_outputs = int(max(int(c.y_train.max()) if c.num_train else 0 for c in clients)) + 1
        num_outputs = max(
            num_outputs, max((int(c.y_test.max()) + 1 if c.num_test else 0) for c in clients)
        )
    return FederatedData(
        name=name,
        clients=clients,
        task=task,
        input_shape=tuple(clients[0].x_train.shape[1:]),
        num_outputs=num_outputs,
    )
