"""Turn one pool of samples into a FederatedData: partition, per-client train/test split."""

from __future__ import annotations

import numpy as np
import torch

from fedloom.core.rng import numpy_rng
from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.partition import Partition
from fedloom.data.partition_file import (
    POOL_KEY,
    FilePartition,
    PoolInfo,
    check_against_pool,
    pool_checksum,
    read_partition_file,
)
from fedloom.data.spec import DataRequest
from fedloom.errors import ConfigError


def num_test(n: int, test_fraction: float) -> int:
    """Held-out count for a client of ``n`` samples: round(f n), but at least one sample on each
    side whenever ``n >= 2``."""
    k = round(test_fraction * n)
    return min(max(k, 1), n - 1) if n >= 2 else 0


def _split(part: Partition, y: np.ndarray, req: DataRequest) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each client's sorted (train, test) indices: partition, then hold out test_fraction."""
    assert req.num_clients is not None
    parts = part(y, req.num_clients, numpy_rng(req.seed, f"partition/{part.kind}"))
    indices = []
    for k, idx in enumerate(parts):
        perm = numpy_rng(req.seed, "train_test_split", client=k).permutation(idx)
        cut = len(perm) - num_test(len(perm), req.test_fraction)
        indices.append((np.sort(perm[:cut]), np.sort(perm[cut:])))
    return indices


def federate_pool(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    req: DataRequest,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> FederatedData:
    """Partition the pool ``(x, y)`` with ``req.partition`` and hold out ``req.test_fraction`` of
    each client's share (seeded).

    ``x`` is (n, H, W) or (n, C, H, W); it becomes float32 (n, C, H, W) divided by ``scale``.
    All clients' tensors are slices of one reordered tensor: no per-client copies.
    ``extras['client_indices']`` gives each client's (train, test) indices into the pool,
    ``extras['pool']`` the pool's checksum and what made the split (partition.json). With
    ``data.partition.kind: file`` the clients are a partition file's (data/partition_file.py):
    ``test_fraction`` and the seed do not apply, the file's own partition and seed shift the
    features again.
    """
    part = req.partition
    num_clients = req.num_clients
    assert num_clients is not None
    if num_clients > len(y):
        raise ConfigError(f"data.num_clients: {num_clients} clients for {len(y)} samples")
    sha = pool_checksum(x, y)
    if isinstance(part, FilePartition):
        frozen = read_partition_file(part.path)
        check_against_pool(frozen, name, sha, len(y), num_clients)
        indices, shift, seed = frozen.indices, frozen.partition, frozen.seed
        info = PoolInfo(sha, len(y), seed, frozen.test_fraction, shift.params(), part.path)
    else:
        indices, shift, seed = _split(part, y, req), part, req.seed
        info = PoolInfo(sha, len(y), seed, req.test_fraction, part.params())
    order = [i for pair in indices for i in pair]
    flat = np.concatenate(order)
    xs = torch.from_numpy(np.ascontiguousarray(x[flat])).to(dtype)  # int64: token ids
    if scale != 1.0:
        xs.div_(scale)
    if xs.ndim == 3 and dtype.is_floating_point:
        xs = xs.unsqueeze(1)
    ys = torch.from_numpy(y[flat].astype(np.int64))
    clients: list[ClientData] = []
    start = 0
    for k, (train, test) in enumerate(indices):
        mid, end = start + len(train), start + len(train) + len(test)
        view = xs[start:end]
        block = shift.transform(view, k, num_clients, seed)
        if block is not view:
            view.copy_(block)
        clients.append(ClientData(xs[start:mid], ys[start:mid], xs[mid:end], ys[mid:end]))
        start = end
    return FederatedData(
        name=name,
        clients=clients,
        task="classification",
        input_shape=tuple(xs.shape[1:]),
        num_outputs=num_classes,
        extras={
            "partition": shift.params(),
            "client_indices": indices,
            POOL_KEY: info,
        },
    )
