"""Federated datasets and partitioners.

``load_dataset(cfg, seed)`` builds a :class:`FederatedData` from a ``data`` config (``name``,
``root``, ``num_clients``, ``partition``, ``test_fraction``, ``options``). Datasets live in
``DATASETS``, partitioners in ``PARTITIONS``; data files are found under ``data.root``, else
``$FEDLOOM_DATA``, else ``~/.cache/fedloom`` (``default_root()``), and downloaded with SHA-256
checks when missing unless ``FEDLOOM_OFFLINE=1``.
"""

from fedloom.data import (  # noqa: F401  (registration side effects)
    bbc_news,
    cifar,
    digits,
    femnist,
    mnist,
    partition_file,
    partitioners,
    pfllib_partitions,
    quadratic,
    shakespeare,
    synthetic,
    tinyimagenet,
)
from fedloom.data.federated import ClientData, FederatedData, from_arrays
from fedloom.data.load import default_root, load_dataset, resolve_data_config
from fedloom.data.mnist import load_mnist_arrays
from fedloom.data.partition import PARTITIONS, Partition
from fedloom.data.spec import DATASETS, DatasetSpec

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "ClientData",
    "DatasetSpec",
    "FederatedData",
    "Partition",
    "default_root",
    "from_arrays",
    "load_dataset",
    "load_mnist_arrays",
    "resolve_data_config",
]
