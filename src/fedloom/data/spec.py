"""What a dataset declares (``DatasetSpec``) and what a loader is given (``DataRequest``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from fedloom.core.settings import FrozenModel
from fedloom.data.federated import FederatedData
from fedloom.data.partition import Partition
from fedloom.registry import Registry


class NoOptions(FrozenModel):
    """Datasets without options: any key under ``data.<name>`` is an error."""


@dataclass(frozen=True)
class DataRequest:
    """The validated ``data`` config a loader builds from."""

    name: str
    root: Path
    root_source: str
    num_clients: int | None
    partition: Partition
    test_fraction: float
    options: BaseModel
    seed: int
    max_length: int | None = None
    """Text datasets: tokens per sample (``data.max_length``)."""


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its loader, allowed partitions and defaults."""

    name: str
    build: Callable[[DataRequest], FederatedData]
    partitions: tuple[str, ...]
    default_partition: str
    default_num_clients: int | None
    options: type[BaseModel] = NoOptions
    text: bool = False
    """Samples are token ids: ``data.max_length`` applies."""


DATASETS: Registry[DatasetSpec] = Registry("dataset", "data.name")

IMAGE_PARTITIONS = (
    "iid",
    "dirichlet",
    "shards",
    "quantity",
    "rotation",
    "noise",
    "pathological",
    "extended_dirichlet",
    "file",
)
"""The partitions of the pooled image datasets (federate_pool); ``file`` reads a partition.json."""
NATURAL = ("natural",)
