"""What the colour-image datasets (CIFAR-10, CIFAR-100, Tiny-ImageNet) share: their options
(per-channel normalization, train-time augmentation, which official splits make the pool),
and turning their uint8 pool into a FederatedData (docs/datasets.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from fedloom.core.settings import FrozenModel
from fedloom.data.augment import AugmentSpec
from fedloom.data.federated import FederatedData
from fedloom.data.pool import federate_pool
from fedloom.data.spec import DATASETS, IMAGE_PARTITIONS, DataRequest, DatasetSpec

DEFAULT_CLIENTS = 20


class ImageOptions(FrozenModel):
    """``data.<name>``: the standard preprocessing of a colour-image dataset."""

    normalize: bool = True
    """Subtract the dataset's published per-channel mean and divide by its std (after /255)."""
    augment: bool = False
    """Random crop after zero padding and a horizontal flip on every local step's minibatch
    (data/augment.py; docs/augmentation.md)."""
    pool: Literal["train", "all"] = "train"
    """The samples partitioned: the official training split (as for MNIST), or the training
    and test splits together, as PFLlib pools them before its per-client 75/25 split."""


@dataclass(frozen=True)
class Pool:
    """A dataset's official splits as uint8 images (n, 3, H, W) and int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int


@dataclass(frozen=True)
class Preprocessing:
    """A dataset's published channel statistics and its standard crop padding."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_padding: int


def federate_images(name: str, pool: Pool, prep: Preprocessing, req: DataRequest) -> FederatedData:
    """``pool`` partitioned by ``req`` (data/pool.py), scaled to [0, 1], normalized and
    augmented as ``req.options`` say."""
    opts = req.options
    assert isinstance(opts, ImageOptions)
    x, y = pool.x_train, pool.y_train
    if opts.pool == "all":
        x, y = np.concatenate([x, pool.x_test]), np.concatenate([y, pool.y_test])
    data = federate_pool(name, x, y, pool.num_classes, req, scale=255.0)
    if opts.normalize:
        mean = torch.tensor(prep.mean).view(3, 1, 1)
        std = torch.tensor(prep.std).view(3, 1, 1)
        for client in data.clients:  # slices of one tensor: normalized in place, no copy
            client.x_train.sub_(mean).div_(std)
            client.x_test.sub_(mean).div_(std)
    if opts.augment:
        data = replace(data, augment=AugmentSpec(crop_padding=prep.crop_padding, flip=True))
    return data


def add_image_dataset(
    name: str,
    build: Callable[[DataRequest], FederatedData],
    options: type[ImageOptions] = ImageOptions,
) -> None:
    """Register a colour-image dataset with the image partitions (default IID, 20 clients)."""
    spec = DatasetSpec(name, build, IMAGE_PARTITIONS, "iid", DEFAULT_CLIENTS, options)
    DATASETS.add(name, spec)
