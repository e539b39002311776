"""Frozen partitions: ``partition.json`` in a run directory, and ``kind: file`` to read one back.

A run on a pooled dataset (one that ``federate_pool`` splits) records which pool samples each
client trains and tests on, with a SHA-256 of the pool, so that a split can be shared with a
paper and reused exactly (docs/partitions.md, "Sharing a split with a paper").
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from fedloom.data.config import validate
from fedloom.data.federated import FederatedData
from fedloom.data.partition import KEY, PARTITIONS, Partition, UnpooledPartition
from fedloom.errors import ConfigError, DataError

FORMAT = "fedloom-partition/1"
FILE_NAME = "partition.json"
CHECKSUM_OF = "SHA-256 over the pool's features then labels (dtype, shape, raw bytes)"
POOL_KEY = "pool"
"""``FederatedData.extras`` key of the :class:`PoolInfo` that ``federate_pool`` records."""


def pool_checksum(x: np.ndarray, y: np.ndarray) -> str:
    """SHA-256 of the pool as the loader hands it over (before scaling and transforms).

    Every feature and label byte counts, with the arrays' dtypes and shapes: another dataset,
    other data files, another subset or order of samples, or other dataset options that change
    the samples all give another checksum (MNIST's 60,000 images: about 0.05 s)."""
    digest = hashlib.sha256()
    for a in (x, y):
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape};".encode())
        digest.update(a.reshape(-1).view(np.uint8))
    return digest.hexdigest()


@dataclass(frozen=True)
class PoolInfo:
    """What ``federate_pool`` knows about the split it made, for ``partition.json``."""

    sha256: str
    num_samples: int
    seed: int
    test_fraction: float
    partition: dict[str, Any]
    """The partition that made the split (for a split read from a file: the file's)."""
    source: str | None = None
    """The partition file it was read from, if any."""


@PARTITIONS.register("file")
class FilePartition(UnpooledPartition):
    """The clients of a ``partition.json`` (each one's train and test samples, in order).

    ``federate_pool`` reads the file (:func:`read_partition_file`); the file's own partition
    (a feature shift such as ``rotation`` or ``noise``) is applied again with the file's seed.
    """

    kind: Literal["file"] = "file"
    path: str
    refusal: ClassVar[str] = (
        "'file' holds indices into a dataset's pool of samples; this dataset has none (its "
        "clients are its own)"
    )


@dataclass(frozen=True)
class FrozenSplit:
    """A validated partition file."""

    path: Path
    dataset: str
    num_samples: int
    sha256: str
    partition: Partition
    seed: int
    test_fraction: float
    indices: list[tuple[np.ndarray, np.ndarray]]


def _bad(path: Path, problem: str) -> DataError:
    return DataError(f"{path}: {problem}; write it with a fedloom run (partition.json)")


def _int(path: Path, obj: dict[str, Any], key: str, low: int = 0) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(path, f"'{key}' must be an integer >= {low}, got {value!r}")
    return value


def _indices(path: Path, value: Any, where: str, n: int) -> np.ndarray:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise _bad(path, f"{where} must be a list of integers")
    idx = np.asarray(value, dtype=np.int64).reshape(-1)
    if len(idx) and (idx.min() < 0 or idx.max() >= n):
        bad = int(idx[(idx < 0) | (idx >= n)][0])
        raise _bad(path, f"{where} holds index {bad}, outside the pool's 0..{n - 1}")
    return idx


def _load(path: Path) -> dict[str, Any]:
    """The file's JSON object, checked to be a partition file."""
    if not path.is_file():
        raise ConfigError(f"{KEY}.path: no partition file at {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise _bad(path, f"not a partition file (format {got!r}, expected {FORMAT!r})")
    return raw


def _partition(path: Path, raw: dict[str, Any]) -> Partition:
    """The validated parameters of the partition that made the split."""
    params = raw.get("partition")
    if not isinstance(params, dict) or params.get("kind") in (None, "file"):
        raise _bad(path, "'partition' must be the mapping of the partition that made the split")
    try:
        return validate(PARTITIONS.get(str(params["kind"])), params, f"{path}: partition")
    except ConfigError as exc:
        raise _bad(path, str(exc)) from None


def _clients(
    path: Path, raw: dict[str, Any], num_clients: int, n: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each client's (train, test) pool indices: in range, train not empty, none twice."""
    clients = raw.get("clients")
    if not isinstance(clients, list) or len(clients) != num_clients:
        raise _bad(path, f"'clients' must list the {num_clients} clients")
    indices = []
    for k, c in enumerate(clients):
        if not isinstance(c, dict) or set(c) != {"train", "test"}:
            raise _bad(path, f"clients[{k}] must be a mapping with 'train' and 'test'")
        train = _indices(path, c["train"], f"clients[{k}].train", n)
        test = _indices(path, c["test"], f"clients[{k}].test", n)
        if not len(train):
            raise _bad(path, f"clients[{k}].train is empty")
        indices.append((train, test))
    flat = np.concatenate([np.concatenate(pair) for pair in indices])
    uniq, counts = np.unique(flat, return_counts=True)
    if len(uniq) != len(flat):
        twice = int(uniq[counts > 1][0])
        raise _bad(path, f"sample {twice} appears more than once (in two clients or splits)")
    return indices


def read_partition_file(path: str | Path) -> FrozenSplit:
    """Read and check a partition file on its own (types, ranges, no index twice); the checks
    against the dataset are :func:`check_against_pool`'s."""
    path = Path(path).expanduser()
    raw = _load(path)
    dataset, sha = raw.get("dataset"), raw.get("sha256")
    if not isinstance(dataset, str) or not isinstance(sha, str) or len(sha) != 64:
        raise _bad(path, "'dataset' must be a name and 'sha256' a 64-digit checksum")
    n = _int(path, raw, "num_samples", 1)
    num_clients = _int(path, raw, "num_clients", 1)
    seed = _int(path, raw, "seed", -(2**63))
    frac = raw.get("test_fraction")
    if isinstance(frac, bool) or not isinstance(frac, int | float):
        raise _bad(path, f"'test_fraction' must be a number, got {frac!r}")
    part = _partition(path, raw)
    indices = _clients(path, raw, num_clients, n)
    return FrozenSplit(path, dataset, n, sha, part, seed, float(frac), indices)


def check_against_pool(
    split: FrozenSplit, name: str, sha256: str, num_samples: int, num_clients: int
) -> None:
    """The file must come from this dataset's pool and hold ``data.num_clients`` clients."""
    path = split.path
    if split.dataset != name:
        raise DataError(f"{path}: a partition of dataset '{split.dataset}', not '{name}'")
    if split.num_samples != num_samples or split.sha256 != sha256:
        raise DataError(
            f"{path}: made from another {name} pool ({split.num_samples} samples, SHA-256 "
            f"{split.sha256[:12]}...; here {num_samples} samples, {sha256[:12]}...): other data "
            "files or data options"
        )
    if len(split.indices) != num_clients:
        raise ConfigError(
            f"data.num_clients: {path} holds {len(split.indices)} clients, got {num_clients}; "
            f"set data.num_clients: {len(split.indices)}"
        )


def partition_record(data: FederatedData) -> dict[str, Any] | None:
    """The ``partition.json`` content of a dataset ``federate_pool`` made (None otherwise)."""
    info = data.extras.get(POOL_KEY)
    indices = data.extras.get("client_indices")
    if not isinstance(info, PoolInfo) or indices is None:
        return None
    record: dict[str, Any] = {
        "format": FORMAT,
        "dataset": data.name,
        "num_samples": info.num_samples,
        "sha256": info.sha256,
        "checksum_of": CHECKSUM_OF,
        "num_clients": len(indices),
        "partition": info.partition,
        "seed": info.seed,
        "test_fraction": info.test_fraction,
    }
    if info.source is not None:
        record["read_from"] = info.source
    record["clients"] = [
        {"train": train.tolist(), "test": test.tolist()} for train, test in indices
    ]
    return record


def write_partition_file(path: str | Path, data: FederatedData) -> bool:
    """Write ``data``'s partition file to ``path`` (atomically); False when it has none."""
    record = partition_record(data)
    if record is None:
        return False
    clients = record.pop("clients")
    head = json.dumps(record, indent=2, allow_nan=False)[:-2]  # without the closing "\n}"
    rows = ",\n".join("    " + json.dumps(c, separators=(",", ":")) for c in clients)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f'{head},\n  "clients": [\n{rows}\n  ]\n}}\n', encoding="utf-8")
    os.replace(tmp, path)
    return True
