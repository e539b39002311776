"""Read IDX files (the MNIST container format: http://yann.lecun.com/exdb/mnist/), gzipped."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from fedloom.errors import DataError

IMAGES_MAGIC = 2051  # unsigned byte, 3 dimensions
LABELS_MAGIC = 2049  # unsigned byte, 1 dimension


def read_idx(path: Path, expected_magic: int) -> np.ndarray:
    """The uint8 array stored in the gzipped IDX file ``path`` (read-only, no copy)."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path} as gzip: {exc}") from None
    if len(data) < 4:
        raise DataError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected_magic:
        raise DataError(f"{path}: IDX magic number {magic}, expected {expected_magic}")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected_len = header + int(np.prod(dims))
    if len(data) != expected_len:
        raise DataError(
            f"{path}: IDX header says {dims} ({expected_len} bytes) but the file has {len(data)}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)
