"""The two peer settings of issue #37 that ``roofline.py`` and ``pfl_baseline.py`` share: the
model, the per-client arrays and fedloom's config of each (benchmarks/README.md, "roofline.py"
and "pfl_baseline.py").

- ``pfl_cifar10``: pfl-research's CIFAR-10 ``baseline.yaml`` setting: 1,000 users x 50 images
  3x32x32, 50 users a round, 1 local epoch, batch 10, local lr 0.1, server SGD lr 1, its
  ``simple_cnn``. The images are synthetic (uniform in [0, 1), random labels): only their
  shapes matter for seconds per round.
- ``fedavg_2nn``: the FedAvg paper's MNIST 2NN shape: 100 clients x 600 images, 10 a round,
  B = 10, E = 1, lr 0.1; real MNIST (IID, seeded) from ``$FEDLOOM_DATA`` when it is there,
  else synthetic images of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

SEED = 0
Arrays = list[tuple[torch.Tensor, torch.Tensor]]


def simple_cnn(input_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10) -> nn.Module:
    """pfl-research's ``simple_cnn`` (its benchmarks' CIFAR-10 model), channels first: conv
    3x3 32, ReLU, conv 3x3 64, ReLU, max-pool 2, dropout 0.25, FC 128, ReLU, dropout 0.5,
    FC; Xavier-uniform weights, zero biases (seeded by the caller)."""
    channels, height, _ = input_shape
    pooled = (height - 4) // 2
    model = nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3),
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(pooled * pooled * 64, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, num_classes),
    )
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return model


def mlp_2nn(input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10) -> nn.Module:
    """The FedAvg paper's 2NN, fedloom's ``mlp`` (784-200-200-10)."""
    from fedloom.models import build_model

    return build_model("mlp", input_shape, num_classes)


@dataclass(frozen=True)
class PeerSetting:
    """One setting: FedAvg, ``per_round`` of ``clients`` clients a round, sample-weighted
    average (server SGD at lr 1 on the mean update, as pfl does)."""

    name: str
    clients: int
    samples: int
    per_round: int
    batch_size: int
    lr: float
    input_shape: tuple[int, int, int]
    make_model: Callable[..., nn.Module]
    epochs: int = 1
    num_classes: int = 10
    test_samples: int = 10
    real_mnist: bool = False
    """Load MNIST from ``$FEDLOOM_DATA`` when present (else synthetic of the same shape)."""

    def model(self) -> nn.Module:
        torch.manual_seed(SEED)
        return self.make_model(self.input_shape, self.num_classes)

    def round_samples(self) -> int:
        return self.per_round * self.samples * self.epochs


SETTINGS: dict[str, PeerSetting] = {
    "pfl_cifar10": PeerSetting("pfl_cifar10", 1000, 50, 50, 10, 0.1, (3, 32, 32), simple_cnn),
    "fedavg_2nn": PeerSetting(
        "fedavg_2nn", 100, 600, 10, 10, 0.1, (1, 28, 28), mlp_2nn, real_mnist=True
    ),
}


def shrink(setting: PeerSetting, clients: int, samples: int, per_round: int) -> PeerSetting:
    """A smaller copy of ``setting`` (smoke tests, ``--quick``)."""
    return replace(setting, clients=clients, samples=samples, per_round=per_round)


def _mnist(setting: PeerSetting) -> tuple[Arrays, Arrays, str] | None:
    """Real MNIST split IID (seeded permutation) into ``clients`` x ``samples``, or None when
    the files are not under ``$FEDLOOM_DATA`` (or the default cache)."""
    from fedloom.data import default_root, load_mnist_arrays

    try:
        xtr, ytr, xte, yte = load_mnist_arrays(default_root())
    except Exception:
        return None
    need = setting.clients * setting.samples
    if need > len(xtr):
        return None
    order = np.random.default_rng(SEED).permutation(len(xtr))[:need]
    x = torch.from_numpy(np.asarray(xtr)[order]).to(torch.float32).div_(255.0).unsqueeze(1)
    y = torch.from_numpy(np.asarray(ytr)[order].astype(np.int64))
    n_test = setting.clients * setting.test_samples
    tx = torch.from_numpy(np.array(xte[:n_test])).to(torch.float32).div_(255.0).unsqueeze(1)
    ty = torch.from_numpy(np.array(yte[:n_test]).astype(np.int64))
    train = list(zip(x.split(setting.samples), y.split(setting.samples), strict=True))
    test = list(zip(tx.split(setting.test_samples), ty.split(setting.test_samples), strict=True))
    return train, test, "mnist"


def make_arrays(setting: PeerSetting) -> tuple[Arrays, Arrays, str]:
    """Per-client ``(x, y)`` train and test arrays and where they came from (``mnist`` or
    ``synthetic``)."""
    if setting.real_mnist:
        real = _mnist(setting)
        if real is not None:
            return real
    gen = torch.Generator().manual_seed(SEED)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(n, *setting.input_shape, generator=gen)
        return x, torch.randint(0, setting.num_classes, (n,), generator=gen)

    train = [draw(setting.samples) for _ in range(setting.clients)]
    test = [draw(setting.test_samples) for _ in range(setting.clients)]
    return train, test, "synthetic"


def fedloom_config(setting: PeerSetting, executor: dict[str, Any]) -> dict[str, Any]:
    """fedloom's config of ``setting`` with the ``executor`` section (FedAvg)."""
    return timed_round_config(
        setting.per_round, setting.epochs, setting.batch_size, setting.lr, executor
    )


def timed_round_config(
    per_round: int,
    epochs: int,
    batch_size: int,
    lr: float,
    executor: dict[str, Any],
    algorithm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A one-round config for timing ``Engine.train_round`` (no evaluation inside the timed
    rounds; monitoring and checkpoints off); the model is the module handed to the engine."""
    return {
        "seed": SEED,
        "model": {"name": "mlp"},  # replaced by the module handed to the engine
        "algorithm": dict(algorithm or {"name": "fedavg"}),
        "train": {
            "rounds": 1,
            "clients_per_round": per_round,
            "local_epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
        },
        "eval": {"every": 1},
        "monitor": {"enabled": False},
        "checkpoint": {"every": None},
        "executor": dict(executor),
    }
