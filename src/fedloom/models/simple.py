"""Logistic regression and the FedAvg paper's 2NN (McMahan et al., 2017, arXiv:1602.05629)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedloom.models.base import FedModel


class LogisticRegression(FedModel):
    """A linear model on flattened inputs: multinomial logistic regression for classes,
    linear least squares for regression targets."""

    head_modules = ("linear",)
    samplewise = True
    relu_chain = ("linear",)

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(FedModel):
    """The 2NN of the FedAvg paper: two hidden layers of 200 ReLU units."""

    head_modules = ("fc3",)
    samplewise = True
    relu_chain = ("fc1", "fc2", "fc3")

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x.flatten(1)))
        h = torch.relu(self.fc2(h))
        return self.fc3(h)
