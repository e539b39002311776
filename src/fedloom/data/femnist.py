"""FEMNIST in LEAF's JSON format, one client per writer (natural partition).

Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018. Reads every
``ROOT/femnist/train/*.json`` and ``ROOT/femnist/test/*.json``; each writer keeps LEAF's own
train/test split, so ``data.test_fraction`` is ignored. Images are LEAF's floats as given
(1.0 = background), reshaped to (1, 28, 28); 62 classes (digits, upper, lower case).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.natural import add_natural_dataset, first_users, from_users
from fedloom.data.spec import DataRequest
from fedloom.errors import DataError

CLASSES = 62
HOW_TO_GET = (
    "FEMNIST has no canonical download: generate it with LEAF "
    "(https://github.com/TalwalkarLab/leaf, in data/femnist run e.g. "
    "'./preprocess.sh -s niid --sf 0.05 -k 0 -t sample --tf 0.9') and copy "
    "data/train/*.json to ROOT/femnist/train/ and data/test/*.json to ROOT/femnist/test/."
)

Writer = tuple[np.ndarray, np.ndarray]


def _read_split(folder: Path) -> dict[str, Writer]:
    users: dict[str, Writer] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            blob = json.loads(path.read_text())
            for uid, data in blob["user_data"].items():
                x = np.asarray(data["x"], dtype=np.float32).reshape(-1, 1, 28, 28)
                y = np.asarray(data["y"], dtype=np.int64)
                if uid in users:
                    x = np.concatenate([users[uid][0], x])
                    y = np.concatenate([users[uid][1], y])
                users[uid] = (x, y)
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(
                f"{path}: not LEAF FEMNIST JSON ({type(exc).__name__}: {exc})"
            ) from None
    return users


@lru_cache(maxsize=2)
def load_femnist_writers(root: str, root_source: str = "") -> dict[str, tuple[Writer, Writer]]:
    """``{writer id: ((x_train, y_train), (x_test, y_test))}`` under ``root``, sorted by id."""
    base = Path(root) / "femnist"
    folders = [base / "train", base / "test"]
    empty = [str(f) for f in folders if not any(f.glob("*.json"))]
    if empty:
        where = f" (data root from {root_source})" if root_source else ""
        raise DataError(f"femnist: no *.json files in {', '.join(empty)}{where}. {HOW_TO_GET}")
    train, test = (_read_split(f) for f in folders)
    none = (np.zeros((0, 1, 28, 28), np.float32), np.zeros(0, np.int64))
    writers = {}
    for uid in sorted(set(train) | set(test)):
        writers[uid] = (train.get(uid, none), test.get(uid, none))
        for _, y in writers[uid]:
            if len(y) and (y.min() < 0 or y.max() >= CLASSES):
                raise DataError(f"femnist: writer {uid} has labels outside 0..{CLASSES - 1}")
    return writers


def build(req: DataRequest) -> FederatedData:
    writers = load_femnist_writers(str(req.root), req.root_source)
    available = f"femnist under {req.root} has {len(writers)} writers"
    users = {}
    for uid in first_users(list(writers), req.num_clients, available):
        (xtr, ytr), (xte, yte) = writers[uid]
        users[uid] = ClientData(
            torch.from_numpy(xtr),
            torch.from_numpy(ytr),
            torch.from_numpy(xte),
            torch.from_numpy(yte),
        )
    return from_users("femnist", users, input_shape=(1, 28, 28), num_classes=CLASSES)


add_natural_dataset("femnist", build)
