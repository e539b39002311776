"""What every fedloom model declares: its body/head split and its normalization layers.

Algorithms that share only part of a model (FedRep, FedPer, LG-FedAvg, FedBN) read these
declarations instead of guessing from parameter names.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn


class FedModel(nn.Module):
    """An ``nn.Module`` that names its head (the final classifier) and its normalization layers.

    ``head_modules`` are submodule names whose parameters form the head; every other parameter
    is the body. ``norm_modules`` are the normalization layers (their parameters and running
    statistics), kept local by FedBN. ``samplewise`` says the forward pass never mixes samples.
    """

    head_modules: ClassVar[tuple[str, ...]] = ()
    norm_modules: ClassVar[tuple[str, ...]] = ()
    samplewise: ClassVar[bool] = False
    """Whether ``forward`` treats every sample of a batch alone (no batch statistics, no
    operation across samples): such a model of linear and convolution layers runs many
    clients' steps stacked, without ``vmap`` (core/stacked.py)."""
    relu_chain: ClassVar[tuple[str, ...]] = ()
    """The ``nn.Linear`` layers, in order, of a ``forward`` that is exactly flatten, Linear,
    ReLU, ..., Linear (no ReLU after the last): declared, the stacked step runs its backward
    by hand (core/stacked_chain.py). A subclass with a ``forward`` of its own does not inherit
    the declaration."""

    def _keys_under(self, prefixes: tuple[str, ...]) -> list[str]:
        names = [n for n, _ in self.named_parameters()] + [n for n, _ in self.named_buffers()]
        return [n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)]

    def head_keys(self) -> list[str]:
        return self._keys_under(self.head_modules)

    def body_keys(self) -> list[str]:
        head = set(self.head_keys())
        return [n for n, _ in self.named_parameters() if n not in head]

    def norm_keys(self) -> list[str]:
        return self._keys_under(self.norm_modules)
