"""CIFAR-10 and CIFAR-100 from the official binary releases (Krizhevsky, "Learning Multiple
Layers of Features from Tiny Images", 2009; https://www.cs.toronto.edu/~kriz/cifar.html).

A binary file is a run of fixed-size records: the label byte(s), then 3,072 pixel bytes, the
1,024 red values of the 32x32 image row by row, then the green, then the blue. CIFAR-10's
records have one label byte (``cifar-10-batches-bin/data_batch_1..5.bin``, ``test_batch.bin``),
CIFAR-100's two, the coarse (20 superclasses) then the fine label (100 classes)
(``cifar-100-binary/train.bin``, ``test.bin``). The number of records comes from the file's
size. The python releases (pickles) are not read. Preprocessing: data/images.py, docs/datasets.md.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from fedloom.data.archive import Archive, ensure_unpacked
from fedloom.data.federated import FederatedData
from fedloom.data.images import (
    ImageOptions,
    Pool,
    Preprocessing,
    add_image_dataset,
    federate_images,
)
from fedloom.data.spec import DataRequest
from fedloom.errors import DataError

PIXELS = 3 * 32 * 32

CIFAR10 = Archive(
    url="https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    md5="c32a1d4ab5d03f1284b67883e8d87530",
    file="cifar10/cifar-10-binary.tar.gz",
    folder="cifar10/cifar-10-batches-bin",
)
CIFAR100 = Archive(
    url="https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
    md5="03b5dce01913d631647c71ecec9e9cb8",
    file="cifar100/cifar-100-binary.tar.gz",
    folder="cifar100/cifar-100-binary",
)
CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = ("test_batch.bin",)
CIFAR100_TRAIN, CIFAR100_TEST = ("train.bin",), ("test.bin",)

# The training split's per-channel mean and std of pixel/255, as the field publishes and uses
# them (e.g. the CIFAR recipes of He et al. 2016's reimplementations; PFLlib and FL-bench's
# CIFAR transforms). Recomputed from the training images, they agree to 4 decimals.
CIFAR10_PREP = Preprocessing((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), crop_padding=4)
CIFAR100_PREP = Preprocessing((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), crop_padding=4)


class Cifar100Options(ImageOptions):
    """``data.cifar100``: also ``coarse: true`` for the 20 superclass labels."""

    coarse: bool = False


def read_records(path: Path, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The images (n, 3, 32, 32) uint8 and labels (n, label_bytes) uint8 of a CIFAR binary
    file of records ``label_bytes`` + 3,072 bytes long (read-only views of one read)."""
    record = label_bytes + PIXELS
    size = path.stat().st_size
    if size == 0 or size % record:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {record}-byte records "
            f"({label_bytes} label byte(s) + {PIXELS} pixels): the file is damaged or another "
            "release (the binary one is read); delete it to unpack it again"
        )
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, record)
    return raw[:, label_bytes:].reshape(-1, 3, 32, 32), raw[:, :label_bytes]


def _read_split(folder: Path, files: tuple[str, ...], label_bytes: int):
    parts = [read_records(folder / f, label_bytes) for f in files]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


@lru_cache(maxsize=2)
def load_cifar10(root: str, root_source: str = "") -> Pool:
    """CIFAR-10's official splits under ``root`` (50,000 / 10,000 images, 10 classes)."""
    folder = ensure_unpacked(
        Path(root),
        CIFAR10,
        CIFAR10_TRAIN + CIFAR10_TEST,
        dataset="cifar10",
        root_source=root_source,
    )
    x_train, y_train = _read_split(folder, CIFAR10_TRAIN, 1)
    x_test, y_test = _read_split(folder, CIFAR10_TEST, 1)
    return Pool(x_train, _labels(y_train[:, 0], 10), x_test, _labels(y_test[:, 0], 10), 10)


@lru_cache(maxsize=4)
def load_cifar100(root: str, coarse: bool = False, root_source: str = "") -> Pool:
    """CIFAR-100's official splits under ``root`` (50,000 / 10,000 images): the fine labels
    (100 classes), or the coarse ones (20 superclasses)."""
    folder = ensure_unpacked(
        Path(root),
        CIFAR100,
        CIFAR100_TRAIN + CIFAR100_TEST,
        dataset="cifar100",
        root_source=root_source,
    )
    column, classes = (0, 20) if coarse else (1, 100)
    x_train, y_train = _read_split(folder, CIFAR100_TRAIN, 2)
    x_test, y_test = _read_split(folder, CIFAR100_TEST, 2)
    return Pool(
        x_train,
        _labels(y_train[:, column], classes),
        x_test,
        _labels(y_test[:, column], classes),
        classes,
    )


def _labels(y: np.ndarray, classes: int) -> np.ndarray:
    if len(y) and int(y.max()) >= classes:
        raise DataError(
            f"a label {int(y.max())} in a file of {classes} classes: the file is damaged"
        )
    return y.astype(np.int64)


def _build_cifar10(req: DataRequest) -> FederatedData:
    return federate_images(
        "cifar10", load_cifar10(str(req.root.absolute()), req.root_source), CIFAR10_PREP, req
    )


def _build_cifar100(req: DataRequest) -> FederatedData:
    opts = req.options
    assert isinstance(opts, Cifar100Options)
    pool = load_cifar100(str(req.root.absolute()), opts.coarse, req.root_source)
    return federate_images("cifar100", pool, CIFAR100_PREP, req)


add_image_dataset("cifar10", _build_cifar10)
add_image_dataset("cifar100", _build_cifar100, Cifar100Options)
