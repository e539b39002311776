"""``cnn4``: the CNN of PFLlib's leaderboard (Zhang et al., "PFLlib: A Beginner-Friendly and
Comprehensive Personalized Federated Learning Library and Benchmark", JMLR 2025, arXiv:2312.04992;
its ``FedAvgCNN``), the
FedAvg paper's two-convolution network (McMahan et al., 2017) without padding.

conv 5x5 32 -> ReLU -> max-pool 2 -> conv 5x5 64 -> ReLU -> max-pool 2 -> flatten -> FC 512
-> ReLU -> FC classes. Without padding each convolution trims 4 pixels, so the first FC layer
has 64 * 5 * 5 = 1600 inputs on 3x32x32 (CIFAR-10: 878,538 parameters) and 64 * 4 * 4 = 1024
on 1x28x28 (FMNIST: 582,026). Parameters are named as PFLlib's (``conv1.0``, ``conv2.0``,
``fc1.0``, ``fc``) and the head is PFLlib's: the last FC layer ``fc`` (docs/models.md).
Weights start from PyTorch's default initialization, drawn from the run's ``init`` stream
(core/functional.py ``initial_state``).
"""

from __future__ import annotations

import torch
from torch import nn

from fedloom.models.base import FedModel

KERNEL = 5


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    """conv 5x5 (stride 1, no padding) -> ReLU -> 2x2 max pooling."""
    return nn.Sequential(nn.Conv2d(cin, cout, KERNEL), nn.ReLU(), nn.MaxPool2d(2))


class CNN4(FedModel):
    head_modules = ("fc",)
    samplewise = True

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(
                f"cnn4 needs image inputs (channels, height, width), got {input_shape}"
            )
        channels, height, width = input_shape
        side = [(s - KERNEL + 1) // 2 for s in (height, width)]
        side = [(s - KERNEL + 1) // 2 for s in side]
        if min(side) < 1:
            raise ValueError(f"cnn4 needs images of at least 16x16 pixels, got {height}x{width}")
        self.conv1 = _conv_block(channels, 32)
        self.conv2 = _conv_block(32, 64)
        self.fc1 = nn.Sequential(nn.Linear(64 * side[0] * side[1], 512), nn.ReLU())
        self.fc = nn.Linear(512, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(self.conv1(x))
        return self.fc(self.fc1(h.flatten(1)))
