"""Data poisoning of the malicious clients' training sets, once, before the run.

- ``label_flip`` (Ditto's and the classic label attacks): ``mode: complement`` y -> C - 1 - y;
  ``all_to_one`` y -> target; ``targeted`` source -> target (other labels kept).
- ``random_labels`` (Ditto's A1): every label replaced by a uniform random class.
- ``backdoor`` (Bagdasaryan et al. 2020; Sun et al. 2019): a ``poison_fraction`` of the client's
  samples get a square trigger of ``trigger.size`` pixels in the bottom-right corner, set to
  ``trigger.value`` (default: the largest input value of the dataset), and the label ``target``.

Test sets are left clean. Random draws come from the stream (seed, 'attack/data', client).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from fedloom.core.protocol import ClientData
from fedloom.core.rng import generator
from fedloom.data.federated import FederatedData
from fedloom.errors import ConfigError

if TYPE_CHECKING:
    from fedloom.attacks.config import AttackConfig

DATA_ATTACKS = ("label_flip", "random_labels", "backdoor")


def trigger_value(data: FederatedData) -> float:
    """The trigger's pixel value by default: the largest input value in the training data."""
    return max(float(c.x_train.max()) for c in data.clients if c.num_train)


def apply_trigger(x: torch.Tensor, size: int, value: float) -> torch.Tensor:
    """``x`` (samples first, images (C, H, W) or flat vectors) with the trigger stamped: the
    bottom-right size x size pixels of every channel (flat inputs: the last size^2 features)."""
    out = x.clone()
    if x.dim() >= 3:
        out[..., -size:, -size:] = value
    else:
        out[:, -size * size :] = value
    return out


def poison_client(
    client: ClientData, config: AttackConfig, num_classes: int, seed: int, cid: int, value: float
) -> ClientData:
    """The client's data with its training set poisoned (``config.kind``)."""
    y = client.y_train.clone()
    gen = generator(seed, "attack/data", client=cid)
    if config.kind == "random_labels":
        y = torch.randint(num_classes, y.shape, generator=gen)
    elif config.kind == "label_flip":
        if config.mode == "complement":
            y = num_classes - 1 - y
        elif config.mode == "all_to_one":
            y = torch.full_like(y, config.target)
        else:
            y = torch.where(y == config.source, torch.full_like(y, config.target), y)
    elif config.kind == "backdoor":
        n = client.num_train
        chosen = torch.randperm(n, generator=gen)[: round(config.poison_fraction * n)]
        x = client.x_train.clone()
        x[chosen] = apply_trigger(x[chosen], config.trigger.size, value)
        y[chosen] = config.target
        return replace(client, x_train=x, y_train=y)
    return replace(client, y_train=y.to(client.y_train.dtype))


def check_fits(config: AttackConfig, data: FederatedData) -> None:
    """ConfigError when the attack names a class the data lacks, or a backdoor trigger larger
    than its inputs."""
    classes = data.num_outputs
    for key in ("target", "source"):
        label = getattr(config, key)
        uses = key == "source" or config.kind == "backdoor" or config.mode != "complement"
        if config.kind != "random_labels" and uses and label is not None and label >= classes:
            raise ConfigError(
                f"attack.{key}: class {label} does not exist: {data.name} has {classes} "
                f"classes (0 to {classes - 1})"
            )
    if config.kind == "backdoor":
        shape, size = tuple(data.input_shape), config.trigger.size
        room = min(shape[-2:]) if len(shape) >= 3 else int(shape[-1] ** 0.5)
        if size > room:
            raise ConfigError(
                f"attack.trigger.size: a {size} x {size} trigger does not fit {data.name}'s "
                f"inputs of shape {list(shape)}: use at most {room}"
            )


def poison(
    data: FederatedData, config: AttackConfig, malicious: Sequence[int], seed: int
) -> FederatedData:
    """``data`` with the malicious clients' training sets poisoned (unchanged for model
    attacks)."""
    if config.kind not in DATA_ATTACKS:
        return data
    check_fits(config, data)
    if not malicious:
        return data
    value = config.trigger.value if config.trigger.value is not None else trigger_value(data)
    bad = set(malicious)
    clients = [
        poison_client(c, config, data.num_outputs, seed, cid, value) if cid in bad else c
        for cid, c in enumerate(data.clients)
    ]
    return replace(data, clients=clients)
