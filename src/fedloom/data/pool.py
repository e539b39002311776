"""Turn one pool of samples into a FederatedData: partition, per-client train/test split."""

from __future__ import annotations

import numpy as np
import torch

from fedloom.core.rng import numpy_rng
from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.spec import DataRequest
from fedloom.errors import ConfigError


def num_test(n: int, test_fraction: float) -> int:
    """Held-out count for a client of ``n`` samples: round(f n), but at least one sample on each
    side whenever ``n >= 2``."""
    k = round(test_fraction * n)
    return min(max(k, 1), n - 1) if n >= 2 else 0


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
    ``extras['client_indices']`` gives each client's (train, test) indices into the pool.
    """
    part = req.partition
    num_clients = req.num_clients
    assert num_clients is not None
    if num_clients > len(y):
        raise ConfigError(f"data.num_clients: {num_clients} clients for {len(y)} samples")
    parts = part(y, num_clients, numpy_rng(req.seed, f"partition/{part.kind}"))
    order: list[np.ndarray] = []
    indices: list[tuple[np.ndarray, np.ndarray]] = []
    for k, idx in enumerate(parts):
        perm = numpy_rng(req.seed, "train_test_split", client=k).permutation(idx)
        cut = len(perm) - num_test(len(perm), req.test_fraction)
        train, test = np.sort(perm[:cut]), np.sort(perm[cut:])
        indices.append((train, test))
        order.extend([train, test])
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
        block = part.transform(view, k, num_clients, req.seed)
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
            "partition": part.params(),
            "client_indices": indices,
        },
    )
