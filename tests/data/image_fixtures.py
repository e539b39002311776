"""Small CIFAR-10, CIFAR-100 and Tiny-ImageNet releases written in the official layouts (the
byte layout of the binary records, the folder tree and label files of Tiny-ImageNet), for tests
that must never download: pixel values are a known function of (record, channel, row, column)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

CIFAR10_TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]


def pixels(n: int, offset: int = 0, size: int = 32) -> np.ndarray:
    """(n, 3, size, size) uint8: value (7 r + 3 c + 5 h + w) mod 256 at record r (from
    ``offset``), channel c, row h, column w."""
    r, c, h, w = np.meshgrid(
        np.arange(offset, offset + n), np.arange(3), np.arange(size), np.arange(size), indexing="ij"
    )
    return ((7 * r + 3 * c + 5 * h + w) % 256).astype(np.uint8)


def cifar_records(labels: np.ndarray, images: np.ndarray) -> bytes:
    """Records of ``labels`` (n, k) bytes then the R, G and B planes, each row by row."""
    flat = images.reshape(len(images), -1)  # (n, 3072): R plane, G plane, B plane
    return np.concatenate([labels.astype(np.uint8), flat], axis=1).tobytes()


def write_cifar10(root: Path, per_file: int = 40, test: int = 30) -> Path:
    """ROOT/cifar10/cifar-10-batches-bin/ with 5 x ``per_file`` training records (label of
    record r: r mod 10) and ``test`` test records."""
    folder = root / "cifar10" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    for i, name in enumerate(CIFAR10_TRAIN_FILES):
        r = np.arange(i * per_file, (i + 1) * per_file)
        (folder / name).write_bytes(cifar_records((r % 10)[:, None], pixels(per_file, r[0])))
    r = np.arange(test)
    (folder / "test_batch.bin").write_bytes(cifar_records((r % 10)[:, None], pixels(test, 10_000)))
    return folder


def write_cifar100(root: Path, train: int = 200, test: int = 50) -> Path:
    """ROOT/cifar100/cifar-100-binary/ (record r: coarse label r mod 20, fine r mod 100)."""
    folder = root / "cifar100" / "cifar-100-binary"
    folder.mkdir(parents=True)
    for name, n, offset in (("train.bin", train, 0), ("test.bin", test, 10_000)):
        r = np.arange(n)
        labels = np.stack([r % 20, r % 100], axis=1)
        (folder / name).write_bytes(cifar_records(labels, pixels(n, offset)))
    return folder


def cifar10_archive(root: Path) -> Path:
    """cifar-10-binary.tar.gz built from a fixture release, as the official archive nests it."""
    source = root / "source"
    write_cifar10(source)
    path = root / "cifar-10-binary.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(source / "cifar10" / "cifar-10-batches-bin", arcname="cifar-10-batches-bin")
    return path


def tar_with(path: Path, members: list[tarfile.TarInfo], data: bytes = b"x") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            if member.isfile():
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
            else:
                tar.addfile(member)
    return path


WNIDS = ["n02", "n01", "n03"]
"""Three classes, not in sorted order in wnids.txt (the loader sorts them)."""


def write_tinyimagenet(root: Path, per_class: int = 4, val_per_class: int = 2) -> Path:
    """ROOT/tinyimagenet/tiny-imagenet-200/ with 64x64 JPEGs (the first of each class
    greyscale), val/val_annotations.txt and wnids.txt. Image k of class index i (sorted
    wnids) is a flat colour (40 i + 10 k, 60, 200) for RGB ones."""
    from PIL import Image

    folder = root / "tinyimagenet" / "tiny-imagenet-200"
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    lines = []
    for i, wnid in enumerate(sorted(WNIDS)):
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        for k in range(per_class):
            _jpeg(Image, images / f"{wnid}_{k}.JPEG", i, k, grey=k == 0)
        for k in range(val_per_class):
            name = f"val_{i * val_per_class + k}.JPEG"
            _jpeg(Image, folder / "val" / "images" / name, i, k + per_class, grey=False)
            lines.append(f"{name}\t{wnid}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return folder


def flat_colour(i: int, k: int) -> tuple[int, int, int]:
    return (40 * i + 10 * k, 60, 200)


def _jpeg(image_module: Any, path: Path, i: int, k: int, grey: bool) -> None:
    if grey:
        image_module.new("L", (64, 64), 90).save(path, quality=95)
    else:
        image_module.new("RGB", (64, 64), flat_colour(i, k)).save(path, quality=95)
