"""LEAF's next-character model for Shakespeare (Caldas et al., 2018, arXiv:1812.01097):
an 8-dimensional character embedding, two LSTM layers of 256 units, and a linear output over
the vocabulary read from the last position."""

from __future__ import annotations

import torch
from torch import nn

from fedloom.models.base import FedModel


class CharLSTM(FedModel):
    head_modules = ("out",)

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_outputs: int,
        embedding_dim: int = 8,
        hidden: int = 256,
        layers: int = 2,
    ) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"char_lstm needs sequences of character ids, got shape {input_shape}")
        self.embed = nn.Embedding(num_outputs, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h[:, -1, :])
