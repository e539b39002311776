"""What the datasets split by their own users (femnist's writers, shakespeare's roles,
synthetic's devices, quadratic's clients) share: taking the first ``data.num_clients`` users,
building one client per user, and registering with the ``natural`` partition only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.spec import DATASETS, NATURAL, DataRequest, DatasetSpec, NoOptions
from fedloom.errors import ConfigError

T = TypeVar("T")


def first_users(users: list[T], num_clients: int | None, available: str) -> list[T]:
    """The first ``num_clients`` of ``users`` (all of them for None). Asking for more than
    there are is a ConfigError that quotes ``available`` (what the dataset has)."""
    if num_clients is None:
        return users
    if num_clients > len(users):
        raise ConfigError(f"data.num_clients: {available}, got {num_clients}")
    return users[:num_clients]


def from_users(
    name: str,
    users: dict[str, ClientData],
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    extras: dict[str, Any] | None = None,
) -> FederatedData:
    """A classification dataset with one client per user, named after the user."""
    return FederatedData(
        name=name,
        clients=list(users.values()),
        task="classification",
        input_shape=input_shape,
        num_outputs=num_classes,
        client_names=list(users),
        extras=extras if extras is not None else {},
    )


def add_natural_dataset(
    name: str,
    build: Callable[[DataRequest], FederatedData],
    *,
    default_num_clients: int | None = None,
    options: type[BaseModel] = NoOptions,
) -> None:
    """Register a dataset whose only partition is its own users (``natural``)."""
    spec = DatasetSpec(name, build, NATURAL, "natural", default_num_clients, options)
    DATASETS.add(name, spec)
