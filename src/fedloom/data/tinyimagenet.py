"""Tiny-ImageNet (Le & Yang, "Tiny ImageNet Visual Recognition Challenge", CS231N 2015): 200
ImageNet classes, 64x64 JPEGs, 500 training and 50 validation images per class, read from the
release as published (``tiny-imagenet-200/``: ``wnids.txt``, ``train/<wnid>/images/*.JPEG``,
``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``; the unlabelled ``test/`` is not
read). The validation images are the test split.

The JPEGs are decoded once, with Pillow (greyscale ones converted to RGB), into a uint8 cache
beside the release (``tinyimagenet/cache-<key>.npz``); the key is a hash of every image's name
and size and of the two label files, so a changed release is decoded again. Classes are the
sorted wnids (as torchvision's ImageFolder orders them). Preprocessing: data/images.py.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedloom.data.archive import Archive, ensure_unpacked
from fedloom.data.federated import FederatedData
from fedloom.data.images import (
    ImageOptions,
    Pool,
    Preprocessing,
    add_image_dataset,
    federate_images,
)
from fedloom.data.spec import DataRequest
from fedloom.errors import DataError

ARCHIVE = Archive(
    url="http://cs231n.stanford.edu/tiny-imagenet-200.zip",
    md5="90528d7ca1a48142e341f4ef8d21d0de",
    file="tinyimagenet/tiny-imagenet-200.zip",
    folder="tinyimagenet/tiny-imagenet-200",
)
LABEL_FILES = ("wnids.txt", "val/val_annotations.txt")
SIZE = 64

# ImageNet's per-channel statistics at this resolution, as published with the dataset's common
# training recipes (e.g. PFLlib's and FL-bench's Tiny-ImageNet transforms).
PREP = Preprocessing((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821), crop_padding=8)
"""Crop padding 8: the CIFAR recipe's 4 of 32 pixels, scaled to 64."""


def _images(folder: Path) -> tuple[list[str], list[tuple[Path, int]], list[tuple[Path, int]]]:
    """The sorted wnids, and the (path, class) of every training and validation image."""
    wnids = sorted({w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()})
    index = {w: i for i, w in enumerate(wnids)}
    train = []
    for wnid in wnids:
        images = folder / "train" / wnid / "images"
        if not images.is_dir():
            raise DataError(f"tinyimagenet: {images} is missing (wnids.txt lists {wnid})")
        train += [(p, index[wnid]) for p in sorted(images.iterdir()) if p.suffix == ".JPEG"]
    val = []
    annotations = folder / "val" / "val_annotations.txt"
    for n, line in enumerate(annotations.read_text().splitlines(), 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2 or fields[1] not in index:
            raise DataError(
                f"{annotations}:{n}: expected 'file<TAB>wnid<TAB>...' with a wnid of wnids.txt"
            )
        val.append((folder / "val" / "images" / fields[0], index[fields[1]]))
    return wnids, train, val


def _key(folder: Path, files: list[tuple[Path, int]]) -> str:
    digest = hashlib.sha256()
    for name in LABEL_FILES:
        digest.update((folder / name).read_bytes())
    for path, label in files:
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0{label}\n".encode())
    return digest.hexdigest()[:16]


def _decode(files: list[tuple[Path, int]]) -> np.ndarray:
    from PIL import Image  # imported here: only a first load decodes

    out = np.empty((len(files), 3, SIZE, SIZE), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            with Image.open(path) as image:
                rgb = np.asarray(image.convert("RGB"))
        except OSError as exc:
            raise DataError(f"tinyimagenet: cannot decode {path}: {exc}") from None
        if rgb.shape != (SIZE, SIZE, 3):
            raise DataError(f"tinyimagenet: {path} is {rgb.shape[1]}x{rgb.shape[0]}, not 64x64")
        out[i] = rgb.transpose(2, 0, 1)
    return out


def _cached_arrays(folder: Path, files: list[tuple[Path, int]]) -> np.ndarray:
    """Every image of ``files`` as (n, 3, 64, 64) uint8, from the cache or decoded into it."""
    cache = folder.parent / f"cache-{_key(folder, files)}.npz"
    if cache.is_file():
        with np.load(cache) as stored:
            return stored["x"]
    print(f"tinyimagenet: decoding {len(files):,} JPEGs once into {cache}", file=sys.stderr)
    x = _decode(files)
    fd, tmp = tempfile.mkstemp(prefix=".cache-", suffix=".npz.part", dir=folder.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x=x)
        os.replace(tmp, cache)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return x


@lru_cache(maxsize=1)
def load_tinyimagenet(root: str, root_source: str = "") -> Pool:
    """Tiny-ImageNet's training (100,000) and validation (10,000) images under ``root``."""
    folder = ensure_unpacked(
        Path(root), ARCHIVE, LABEL_FILES, dataset="tinyimagenet", root_source=root_source
    )
    wnids, train, val = _images(folder)
    x = _cached_arrays(folder, train + val)
    y = np.array([label for _, label in train + val], dtype=np.int64)
    n = len(train)
    return Pool(x[:n], y[:n], x[n:], y[n:], len(wnids))


def _build(req: DataRequest) -> FederatedData:
    pool = load_tinyimagenet(str(req.root.absolute()), req.root_source)
    return federate_images("tinyimagenet", pool, PREP, req)


add_image_dataset("tinyimagenet", _build, ImageOptions)
