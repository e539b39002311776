"""scikit-learn's bundled 8x8 digits (UCI optical recognition of handwritten digits): offline.

Alpaydin & Kaynak, "Optical Recognition of Handwritten Digits", UCI, 1998. 1797 images with
values 0..16, scaled to [0, 1].
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from fedloom.data.federated import FederatedData
from fedloom.data.pool import federate_pool
from fedloom.data.spec import DATASETS, IMAGE_PARTITIONS, DataRequest, DatasetSpec

DEFAULT_CLIENTS = 10


@lru_cache(maxsize=1)
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images (1797, 8, 8) float64 in 0..16, labels int64)`` from scikit-learn."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def build(req: DataRequest) -> FederatedData:
    x, y = load_digits_arrays()
    return federate_pool("digits", x, y, 10, req, scale=16.0)


DATASETS.add(
    "digits",
    DatasetSpec(
        name="digits",
        build=build,
        partitions=IMAGE_PARTITIONS,
        default_partition="iid",
        default_num_clients=DEFAULT_CLIENTS,
    ),
)
