"""Checks of a dataset handed to the Python API (docs/inputs.md, "What the Python API checks"):
one target dtype and one feature shape across clients, integral labels in [0, classes), finite
features, a training sample on every client that trains. Each check is one vectorized pass over
a client's tensors, run once at load; a failure is a DataError naming the client and the fix."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from fedloom.core.protocol import ClientData
from fedloom.errors import DataError

if TYPE_CHECKING:
    from fedloom.data.federated import FederatedData

MAX_CLASSES = 1_000_000
"""The most classes a classification dataset may have: a label of 1e9 is a label to remap,
not a billion-way output layer."""

REMAP = "remap them to 0..K-1 (numpy.unique(y, return_inverse=True))"


def _splits(
    clients: Sequence[ClientData], names: Sequence[str]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    for name, c in zip(names, clients, strict=True):
        yield f"client {name} (train)", c.x_train, c.y_train
        yield f"client {name} (test)", c.x_test, c.y_test


def check_labels(y: torch.Tensor, where: str, classes: int | None = None) -> None:
    """DataError unless ``y`` holds integral class ids in [0, ``classes``) (any non-negative
    id under MAX_CLASSES when ``classes`` is None)."""
    if y.numel() == 0:
        return
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.dtype.is_complex:
        raise DataError(f"{where}: labels are {y.dtype}, not integers; give int64 class ids")
    low, high = int(y.min()), int(y.max())
    if low < 0:
        raise DataError(f"{where}: a label is {low}; labels are class ids 0..K-1: {REMAP}")
    limit = MAX_CLASSES if classes is None else classes
    if high >= limit:
        bound = f"the {classes} classes" if classes is not None else f"{MAX_CLASSES} classes"
        raise DataError(f"{where}: a label is {high}, beyond {bound}: {REMAP}")


def check_uniform(clients: Sequence[ClientData], names: Sequence[str]) -> None:
    """DataError naming the first client whose features or targets cannot be batched with
    the first client's: another sample shape, another target kind, a non-finite value."""
    for where, x, y in _splits(clients, names):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise DataError(f"data, {where}: features and targets must be torch tensors")
    first = clients[0]
    shape, target = tuple(first.x_train.shape[1:]), first.y_train.dtype
    for where, x, y in _splits(clients, names):
        if x.shape[0] != y.shape[0]:
            raise DataError(f"data, {where}: {x.shape[0]} features but {y.shape[0]} targets")
        if tuple(x.shape[1:]) != shape:
            raise DataError(
                f"data, {where}: one sample has shape {list(x.shape[1:])}, client "
                f"{names[0]}'s {list(shape)}; give every client one feature shape"
            )
        if y.numel() and y.dtype.is_floating_point != target.is_floating_point:
            raise DataError(
                f"data, {where}: {y.dtype} targets, client {names[0]}'s {target}; give every "
                "client integer labels (classification) or float targets (regression)"
            )
        if x.dtype.is_floating_point and x.numel() and not bool(torch.isfinite(x).all()):
            raise DataError(f"data, {where}: a feature is NaN or infinite; clean or impute it")
        if y.dtype.is_floating_point and y.numel() and not bool(torch.isfinite(y).all()):
            raise DataError(f"data, {where}: a target is NaN or infinite; clean or drop it")


def check_data(data: FederatedData, training_clients: int | None = None) -> None:
    """DataError naming the first client whose tensors cannot train or test with the others'
    or whose labels are not among the data's classes; the first ``training_clients`` clients
    (all by default) must hold a training sample."""
    if not data.clients:
        raise DataError("data: no clients; give at least one client's (features, targets)")
    names = [str(n) for n in data.client_names]
    check_uniform(data.clients, names)
    if data.task == "classification":
        for where, _, y in _splits(data.clients, names):
            check_labels(y, f"data, {where}", data.num_outputs)
    trains = data.num_clients if training_clients is None else training_clients
    for k in range(trains):
        if data.clients[k].num_train == 0:
            raise DataError(
                f"data, client {names[k]}: no training sample; give it one, drop the "
                "client, or hold it out (eval.new_clients)"
            )
