"""Sparsification: send k = ceil(ratio * d) of a tensor's d entries.

- top-k: the k largest in magnitude, as values and indices (Aji & Heafield, EMNLP 2017;
  with error feedback: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018);
- random-k: k entries chosen by a generator both sides derive from (seed, round, client), so
  only the values travel, the server regenerates the indices (Stich et al. 2018, section 2;
  Konecny et al., "Federated Learning: Strategies for Improving Communication Efficiency",
  2016, "random mask"). Without error feedback the values are scaled by d / k, which makes
  the scheme unbiased (E[decode(encode(x))] = x); with error feedback they are not scaled
  (the memory keeps what was not sent, Stich et al. 2018, Algorithm 1).
"""

from __future__ import annotations

import math

import torch

from fedloom.compression.base import Scheme
from fedloom.compression.payload import Payload, index_dtype


def kept(numel: int, ratio: float) -> int:
    """Entries sent of a tensor of ``numel``: ceil(ratio * numel), at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel)))


class TopK(Scheme):
    name = "topk"
    biased = True

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def encode(self, x: torch.Tensor, gen: torch.Generator) -> Payload:
        k = kept(x.numel(), self.ratio)
        index = x.abs().topk(k, sorted=False).indices.sort().values
        return Payload({"values": x[index], "indices": index.to(index_dtype(x.numel()))})

    def decode(self, payload: Payload, numel: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32)
        out[payload.parts["indices"].to(torch.int64)] = payload.parts["values"].float()
        return out


class RandK(Scheme):
    name = "randk"

    def __init__(self, ratio: float, unbiased: bool) -> None:
        self.ratio = ratio
        self.unbiased = unbiased
        """Scale the values by d / k (off under error feedback)."""

    def _index(self, numel: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randperm(numel, generator=gen)[: kept(numel, self.ratio)]

    def encode(self, x: torch.Tensor, gen: torch.Generator) -> Payload:
        index = self._index(x.numel(), gen)
        values = x[index]
        if self.unbiased:
            values = values * (x.numel() / index.numel())
        return Payload({"values": values})

    def decode(self, payload: Payload, numel: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32)
        out[self._index(numel, gen)] = payload.parts["values"].float()
        return out
