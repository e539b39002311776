"""The DLG paper's LeNet-style network (Zhu et al. 2019, section 4.1 and their code): three
5x5 convolutions with 12 channels (strides 2, 2, 1) and sigmoid activations, no pooling, one
fully connected output layer; all weights and biases drawn uniformly from (-0.5, 0.5). Smooth
activations make the gradient twice differentiable everywhere, which gradient matching needs;
it is the standard target of gradient-inversion attacks."""

from __future__ import annotations

import torch
from torch import nn

from fedloom.models.base import FedModel


class SigmoidLeNet(FedModel):
    head_modules = ("fc",)

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int) -> None:
        super().__init__()
        channels = input_shape[0]
        self.body = nn.Sequential(
            nn.Conv2d(channels, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        with torch.no_grad():
            flat = self.body(torch.zeros(1, *input_shape)).numel()
        self.fc = nn.Linear(flat, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))


def dlg_init(module: nn.Module, gen: torch.Generator) -> None:
    """Every parameter uniform in (-0.5, 0.5), from ``gen`` (the DLG code's weights_init)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
