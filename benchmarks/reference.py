"""A reference FedAvg round written the way common federated-learning libraries write it.

Per client: ``copy.deepcopy`` of the global model, a fresh ``torch.optim.SGD``, a
``DataLoader(TensorDataset(x, y), shuffle=True)``, the usual ``zero_grad / backward / step``
loop, then ``state_dict()``; the server averages the state dicts with sample-size weights.
This is the baseline that ``round_time.py`` compares fedloom's executors against. It is kept
deliberately plain: no flat buffers, no vmap, no reuse of objects across clients.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ClientArrays = tuple[torch.Tensor, torch.Tensor]
"""One client's training data: features (n, *input_shape) and int64 labels (n,)."""


def train_client(
    global_model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    batch_size: int,
    epochs: int,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """Local SGD of one client on a deep copy of ``global_model``: (state_dict, mean loss).

    With ``device`` (a GPU), the model lives there and each minibatch is moved to it as it
    comes out of the DataLoader, as the libraries do."""
    model = copy.deepcopy(global_model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(
        TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=generator
    )
    total, steps = 0.0, 0
    for _ in range(epochs):
        for xb, yb in loader:
            if device is not None:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
    return model.state_dict(), total / max(1, steps)


def average_state_dicts(
    states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Sample-size weighted average of state dicts (non-float entries come from the first)."""
    total = float(sum(weights))
    out: dict[str, torch.Tensor] = {}
    for key, first in states[0].items():
        if not first.dtype.is_floating_point:
            out[key] = first.clone()
            continue
        acc = torch.zeros_like(first)
        for state, w in zip(states, weights, strict=True):
            acc += state[key] * (w / total)
        out[key] = acc
    return out


def fedavg_round(
    global_model: nn.Module,
    clients: Sequence[ClientArrays],
    lr: float,
    batch_size: int,
    epochs: int = 1,
    seed: int = 0,
    device: torch.device | None = None,
) -> float:
    """One FedAvg round with every client participating; updates ``global_model`` in place
    and returns the sample-weighted mean training loss of the round."""
    generator = torch.Generator().manual_seed(seed)
    states, weights, losses = [], [], []
    for x, y in clients:
        state, loss = train_client(global_model, x, y, lr, batch_size, epochs, generator, device)
        states.append(state)
        weights.append(float(len(x)))
        losses.append(loss)
    global_model.load_state_dict(average_state_dicts(states, weights))
    return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)
