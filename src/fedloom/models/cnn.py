"""The FedAvg paper's CNN (McMahan et al., 2017): two 5x5 conv layers (32, 64 channels), each
followed by 2x2 max pooling, a 512-unit ReLU layer and a softmax output; ``cnn_bn`` adds batch
normalization after each convolution (the FedBN paper's setting, Li et al., ICLR 2021)."""

from __future__ import annotations

import torch
from torch import nn

from fedloom.models.base import FedModel


class CNN(FedModel):
    head_modules = ("fc2",)
    samplewise = True

    def __init__(
        self, input_shape: tuple[int, ...], num_outputs: int, batch_norm: bool = False
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs image inputs (channels, height, width), got {input_shape}")
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.bn1 = nn.BatchNorm2d(32) if batch_norm else nn.Identity()
        self.bn2 = nn.BatchNorm2d(64) if batch_norm else nn.Identity()
        self.pool = nn.MaxPool2d(2)  # a module: fedloom's trainers swap in core/pooling.py's
        flat = 64 * (height // 4) * (width // 4)
        self.fc1 = nn.Linear(flat, 512)
        self.fc2 = nn.Linear(512, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn1(self.conv1(x))))
        h = self.pool(torch.relu(self.bn2(self.conv2(h))))
        h = torch.relu(self.fc1(h.flatten(1)))
        return self.fc2(h)


class CNNBatchNorm(CNN):
    norm_modules = ("bn1", "bn2")
    samplewise = False  # batch normalization mixes the samples of a batch in training

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int) -> None:
        super().__init__(input_shape, num_outputs, batch_norm=True)
