"""The interface every compression scheme implements: ``encode`` a flat float tensor into a
:class:`~fedloom.compression.payload.Payload`, ``decode`` it back. Random schemes get a
generator; the server's decode gets a generator of the same stream as the client's encode
(random-k regenerates the indices from it instead of receiving them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from fedloom.compression.payload import Payload


class Scheme(ABC):
    """One compression scheme (``compression.kind``)."""

    name: ClassVar[str]
    biased: ClassVar[bool] = False
    """Whether E[decode(encode(x))] != x (top-k, int8 rounding): error feedback corrects it."""

    @abstractmethod
    def encode(self, x: torch.Tensor, gen: torch.Generator) -> Payload:
        """``x``: a flat floating-point tensor."""

    @abstractmethod
    def decode(self, payload: Payload, numel: int, gen: torch.Generator) -> torch.Tensor:
        """The flat float32 tensor of ``numel`` entries that ``payload`` stands for."""
