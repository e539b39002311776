"""The membership-inference setting of docs/audit.md ("Measured") as data: Fashion-MNIST (or
MNIST) with a fixed number of training samples per client, so that a client's model can
overfit as in the measured table (200 samples per client), and the official test split as the
never-seen holdout. Used by tests/audit and benchmarks/mia_defences.py with
``fedloom.run(config, data=...)`` and ``fedloom.audit(run_dir, data=..., holdout=...)``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedloom.core.rng import numpy_rng
from fedloom.data import FederatedData, from_arrays
from fedloom.data.mnist import load_mnist_arrays


def small_clients(
    root: str | Path,
    num_clients: int = 20,
    train_per_client: int = 200,
    test_per_client: int = 100,
    seed: int = 0,
    name: str = "fashion_mnist",
) -> tuple[FederatedData, tuple[torch.Tensor, torch.Tensor]]:
    """IID clients of ``train_per_client`` training and ``test_per_client`` held-out samples
    drawn without replacement from the official training split (stream (seed,
    'audit/small_clients')), and the official test split as the holdout."""
    x, y, xt, yt = load_mnist_arrays(root, name)
    need = num_clients * (train_per_client + test_per_client)
    order = numpy_rng(seed, "audit/small_clients").permutation(len(y))[:need]
    xs = torch.from_numpy(x[order].astype(np.float32) / 255.0).unsqueeze(1)
    ys = torch.from_numpy(y[order].astype(np.int64))
    step = train_per_client + test_per_client
    train, test = [], []
    for k in range(num_clients):
        lo, mid, hi = k * step, k * step + train_per_client, (k + 1) * step
        train.append((xs[lo:mid], ys[lo:mid]))
        test.append((xs[mid:hi], ys[mid:hi]))
    data = from_arrays(train, test, name=name)
    holdout = (
        torch.from_numpy(xt.astype(np.float32) / 255.0).unsqueeze(1),
        torch.from_numpy(yt.astype(np.int64)),
    )
    return data, holdout
