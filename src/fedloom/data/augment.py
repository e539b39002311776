"""Train-time image augmentation as data declares it: random crop with zero padding and
horizontal flip, the standard CIFAR recipe (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016, sec. 4.2).

A dataset that asks for augmentation sets ``FederatedData.augment`` to an :class:`AugmentSpec`;
the engine applies it to each local step's minibatch, drawing every sample's crop offset and
flip from the client's own random stream (seed, round, client, 'augment'), so that a run is
reproducible and every executor sees the same augmented samples (docs/data.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AugmentSpec:
    """Random crop after zero padding of ``crop_padding`` pixels on each side (0: no crop) and a
    horizontal flip with probability 1/2 (``flip``)."""

    crop_padding: int = 4
    flip: bool = True

    def __post_init__(self) -> None:
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.flip
