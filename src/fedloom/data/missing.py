"""Clients whose inputs lack some features (``data.missing``; docs/missing_features.md:
horizontal FL's assumption that all clients share the whole feature space often fails, e.g.
bank A records credit-card bills, bank B does not).

A share ``clients`` of the clients, drawn from the stream (seed, ``data/missing``), each lack
a share ``fraction`` of the input features, in all of their data (train and held-out):

- ``columns``: that many of the flattened input's features, drawn per client (tabular data);
- ``regions``: one axis-aligned rectangle of that share of each image's area, placed per
  client, over every channel (images of shape (C, H, W) or (H, W)).

A missing feature is stored as 0: the value standardized data takes at its mean, and the value
for which a linear first layer's weight column gets no gradient from that client. That is what
``observed`` reads back: client k observed feature j when some training sample of k has a
non-zero value there, which is how the feature-aware aggregator (robust/feature_aware.py)
learns the masks, for this option and for users' own zero-filled data alike.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedloom.core.protocol import ClientData
from fedloom.core.rng import numpy_rng
from fedloom.core.settings import StrictModel
from fedloom.data.federated import FederatedData
from fedloom.errors import ConfigError


class MissingFeatures(StrictModel):
    """``data.missing``: which clients lack which input features."""

    kind: Literal["columns", "regions"] = "columns"
    fraction: float = Field(default=0.3, gt=0.0, lt=1.0)
    """Share of the features (columns) or of the image area (regions) a client lacks."""
    clients: float = Field(default=1.0, gt=0.0, le=1.0)
    """Share of the clients that lack features (the others observe all of them)."""


def feature_masks(
    config: MissingFeatures, seed: int, num_clients: int, input_shape: tuple[int, ...]
) -> torch.Tensor:
    """(num_clients, prod(input_shape)) bool: True where client k has feature j."""
    d = math.prod(input_shape)
    masks = torch.ones(num_clients, d, dtype=torch.bool)
    rng = numpy_rng(seed, "data/missing")
    lacking = rng.permutation(num_clients)[: max(1, round(config.clients * num_clients))]
    for k in sorted(int(c) for c in lacking):
        client = numpy_rng(seed, "data/missing", client=k)
        if config.kind == "columns":
            hidden = client.permutation(d)[: max(1, round(config.fraction * d))]
            masks[k, torch.as_tensor(hidden)] = False
        else:
            masks[k] = _region(config.fraction, input_shape, client).reshape(-1)
    return masks


def _region(fraction: float, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    """The mask (True: kept) of one image shape with a rectangle of ``fraction`` of its
    area hidden: side lengths sqrt(fraction) of the image's, at a uniform position."""
    if len(shape) not in (2, 3):
        raise ConfigError(
            f"data.missing.kind: regions needs images of shape (C, H, W) or (H, W); this "
            f"dataset's inputs have shape {tuple(shape)}: use kind: columns"
        )
    h, w = shape[-2:]
    rh = min(h, max(1, round(h * math.sqrt(fraction))))
    rw = min(w, max(1, round(w * math.sqrt(fraction))))
    top, left = int(rng.integers(0, h - rh + 1)), int(rng.integers(0, w - rw + 1))
    plane = torch.ones(h, w, dtype=torch.bool)
    plane[top : top + rh, left : left + rw] = False
    return plane.expand(*shape[:-2], h, w) if len(shape) == 3 else plane


def hide_features(data: FederatedData, config: MissingFeatures | None, seed: int) -> FederatedData:
    """``data`` with each client's missing features set to 0 (a new object; ``data`` is
    unchanged); ``data`` itself when ``config`` is None."""
    if config is None:
        return data
    masks = feature_masks(config, seed, data.num_clients, data.input_shape)
    clients = [
        _hidden(c, m) if not bool(m.all()) else c for c, m in zip(data.clients, masks, strict=True)
    ]
    return replace(data, clients=clients, extras={**data.extras, "feature_masks": masks})


def _hidden(client: ClientData, mask: torch.Tensor) -> ClientData:
    def apply(x: torch.Tensor) -> torch.Tensor:
        return x * mask.reshape(x.shape[1:]).to(x.dtype)

    return ClientData(apply(client.x_train), client.y_train, apply(client.x_test), client.y_test)


def observed(data: FederatedData) -> torch.Tensor:
    """(num_clients, prod(input_shape)) bool: client k observed feature j (a non-zero value in
    some training sample of k)."""
    rows = [c.x_train.reshape(c.num_train, -1) != 0 for c in data.clients]
    none = torch.zeros(math.prod(data.input_shape), dtype=torch.bool)
    return torch.stack([r.any(dim=0) if r.shape[0] else none for r in rows])
