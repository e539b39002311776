"""Train-time image augmentation as data declares it: random crop with zero padding and
horizontal flip, the standard CIFAR recipe (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016, sec. 4.2; torchvision's ``RandomCrop(32, padding=4)`` followed by
``RandomHorizontalFlip()``).

A dataset that asks for augmentation sets ``FederatedData.augment`` to an :class:`AugmentSpec`;
the engine applies it wherever a client trains on its training samples, to each local step's
minibatch where the minibatch is gathered. The draws are one ``(dy, dx, flip)`` row per entry
of the concatenated plan (per step and position), from the client's own stream (seed, round,
client, 'augment') for the round's plan (``augment/<purpose>`` for another plan, e.g.
fine-tuning's): every executor gathers the same plan, so it sees the same augmented samples
(docs/augmentation.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedloom.core.rng import generator
from fedloom.errors import DataError

ROUND_PLAN = "batches"
"""The purpose of the engine's round plan, whose draws come from the stream 'augment'."""


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


def augment_batch(x: torch.Tensor, params: torch.Tensor, padding: int) -> torch.Tensor:
    """Images ``x`` (N, ..., H, W) cropped and flipped by ``params`` (N, 3) rows (dy, dx,
    flip): sample n is the H x W window at offset (dy_n, dx_n) of x_n zero-padded by
    ``padding`` on each side, mirrored left-right when flip_n is 1. One gather over the padded
    batch (crop and flip are index arithmetic); a fresh tensor, ``x`` untouched."""
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    if n == 0:
        return x.clone()
    flat = x.reshape(n, -1, h, w)
    padded = F.pad(flat, (padding, padding, padding, padding)) if padding else flat
    width = w + 2 * padding
    params = params.to(x.device)
    dy, dx, flip = params[:, 0:1], params[:, 1:2], params[:, 2:3].bool()
    i, j = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
    rows = dy + i  # (N, H)
    cols = dx + torch.where(flip, w - 1 - j, j)  # (N, W)
    lin = (rows[:, :, None] * width + cols[:, None, :]).reshape(n, 1, h * w)
    lin = lin.expand(n, flat.shape[1], h * w)
    out = torch.gather(padded.reshape(n, flat.shape[1], -1), 2, lin)
    return out.reshape(x.shape)


@dataclass(frozen=True)
class Augmentation:
    """One plan's draws: ``params`` (N, 3) rows (dy, dx, flip) aligned with the plan's entries
    concatenated (``torch.cat(plan)``), and where each step's minibatch starts among them."""

    spec: AugmentSpec
    params: torch.Tensor
    starts: tuple[int, ...]

    def apply(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``x``, the samples of plan entries ``start`` .. ``start + len(x)``, augmented."""
        rows = self.params[start : start + x.shape[0]]
        return augment_batch(x, rows, self.spec.crop_padding)

    def step(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """``x``, the minibatch of the plan's step ``step``, augmented."""
        return self.apply(x, self.starts[step])


@dataclass(frozen=True)
class Augmenter:
    """A run's augmentation (the dataset's spec and the run's seed): draws a plan's
    :class:`Augmentation` from the client's stream. Small and picklable: it travels with the
    algorithm to worker processes and Ray actors."""

    spec: AugmentSpec
    seed: int

    @staticmethod
    def of(spec: AugmentSpec | None, seed: int, input_shape: tuple[int, ...]) -> Augmenter | None:
        """The augmenter of a dataset's ``spec`` (None when there is none or it does nothing);
        a DataError when its samples (``input_shape``) are not images (..., H, W)."""
        if spec is None or not spec.active:
            return None
        if len(input_shape) < 2:
            raise DataError(
                f"data.augment: random crops and flips need image samples (C, H, W), but this "
                f"dataset's samples have shape {tuple(input_shape)}; set augment to None"
            )
        return Augmenter(spec, seed)

    @staticmethod
    def stream(purpose: str) -> str:
        """The stream of the draws for a plan of ``purpose``: 'augment' for the round's plan,
        'augment/<purpose>' for another."""
        return "augment" if purpose == ROUND_PLAN else f"augment/{purpose}"

    def draw(
        self, plan: Sequence[torch.Tensor], purpose: str, round: int, client: int
    ) -> Augmentation:
        """The draws for ``plan``: one integer per entry from (seed, round, client, stream),
        uniform over every (dy, dx, flip), offsets in [0, 2 crop_padding] and flip 1 with
        probability 1/2 (0 without ``flip``). One draw per entry, in plan order: a plan's
        prefix (a straggler's) gets the prefix of the draws."""
        starts, total = [], 0
        for b in plan:
            starts.append(total)
            total += int(b.shape[0])
        gen = generator(self.seed, self.stream(purpose), round, client)
        k, f = 2 * self.spec.crop_padding + 1, 2 if self.spec.flip else 1
        code = torch.randint(0, k * k * f, (total,), generator=gen)
        params = torch.stack([code // (f * k), (code // f) % k, code % f], 1)
        return Augmentation(self.spec, params, tuple(starts))


def draw_augmentation(
    augmenter: Augmenter | None,
    plan: Sequence[torch.Tensor],
    purpose: str,
    round: int,
    client: int,
) -> Augmentation | None:
    """``augmenter.draw(...)``, or None without augmentation."""
    return None if augmenter is None else augmenter.draw(plan, purpose, round, client)
