"""MNIST and Fashion-MNIST from the original IDX gzip files.

LeCun et al., "Gradient-Based Learning Applied to Document Recognition", 1998; Xiao, Rasul &
Vollgraf, "Fashion-MNIST", 2017. The federated partition is over the 60,000 official training
images; each client's share is then split into train/test by ``data.test_fraction``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from fedloom.data.download import ensure_files
from fedloom.data.federated import FederatedData
from fedloom.data.idx import IMAGES_MAGIC, LABELS_MAGIC, read_idx
from fedloom.data.pool import federate_pool
from fedloom.data.spec import DATASETS, IMAGE_PARTITIONS, DataRequest, DatasetSpec
from fedloom.errors import DataError

FOLDERS = {"mnist": "mnist", "fashion_mnist": "fashion-mnist"}
FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
DEFAULT_CLIENTS = 20


def load_mnist_arrays(
    root: str | Path, name: str = "mnist", root_source: str = ""
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The official arrays ``(x_train (60000, 28, 28) uint8, y_train uint8, x_test, y_test)``
    of ``name`` ('mnist' or 'fashion_mnist') under ``root``; read-only, cached per process."""
    if name not in FOLDERS:
        raise ValueError(f"name must be one of {sorted(FOLDERS)}, got {name!r}")
    return _load_cached(str(Path(root).absolute()), name, root_source)


@lru_cache(maxsize=4)
def _load_cached(
    root: str, name: str, root_source: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    folder = FOLDERS[name]
    paths = ensure_files(
        Path(root), [f"{folder}/{f}" for f in FILES], dataset=name, root_source=root_source
    )
    x_train, y_train, x_test, y_test = (
        read_idx(p, IMAGES_MAGIC if "images" in p.name else LABELS_MAGIC) for p in paths
    )
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 3 or x.shape[1:] != (28, 28) or len(x) != len(y):
            raise DataError(
                f"{name} {split}: expected (n, 28, 28) images with n labels, got images "
                f"{x.shape} and {len(y)} labels under {Path(root) / folder}"
            )
    return x_train, y_train, x_test, y_test


def _build(name: str):
    def build(req: DataRequest) -> FederatedData:
        x, y, _, _ = load_mnist_arrays(req.root, name, req.root_source)
        return federate_pool(name, x, y.astype(np.int64), 10, req, scale=255.0)

    return build


for _name in FOLDERS:
    DATASETS.add(
        _name,
        DatasetSpec(
            name=_name,
            build=_build(_name),
            partitions=IMAGE_PARTITIONS,
            default_partition="iid",
            default_num_clients=DEFAULT_CLIENTS,
        ),
    )
