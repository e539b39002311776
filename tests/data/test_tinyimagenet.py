"""Tiny-ImageNet (data/tinyimagenet.py) on a release the tests write in the official layout
(tests/data/image_fixtures.py): classes from the sorted wnids, val labels from
val_annotations.txt, greyscale JPEGs as RGB, the decoded cache written once and rebuilt when the
release changes, and the offline error."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.data import load_dataset, tinyimagenet
from fedloom.data.augment import AugmentSpec
from fedloom.errors import DataError
from tests.data.image_fixtures import WNIDS, flat_colour, write_tinyimagenet


def test_images_and_labels(tmp_path):
    write_tinyimagenet(tmp_path, per_class=4, val_per_class=2)
    pool = tinyimagenet.load_tinyimagenet(str(tmp_path))
    assert pool.num_classes == 3 and pool.x_train.shape == (12, 3, 64, 64)
    assert pool.x_test.shape == (6, 3, 64, 64) and pool.x_train.dtype == np.uint8
    assert pool.y_train.tolist() == [0] * 4 + [1] * 4 + [2] * 4  # sorted wnids: n01, n02, n03
    assert pool.y_test.tolist() == [0, 0, 1, 1, 2, 2]
    assert sorted(WNIDS) == ["n01", "n02", "n03"]
    # image 1 of class 2 is flat (90, 60, 200) up to JPEG's rounding; image 0 greyscale 90
    centre = pool.x_train[2 * 4 + 1, :, 32, 32].astype(int)
    assert np.abs(centre - np.array(flat_colour(2, 1))).max() <= 3
    grey = pool.x_train[4].astype(int)
    assert np.abs(grey - 90).max() <= 2 and (grey[0] == grey[1]).all()
    val = pool.x_test[3, :, 10, 10].astype(int)  # val image 1 of class 1: colour (40 + 50, ...)
    assert np.abs(val - np.array(flat_colour(1, 1 + 4))).max() <= 3


def test_decoded_once_into_a_cache_and_again_when_the_release_changes(tmp_path, monkeypatch):
    folder = write_tinyimagenet(tmp_path)
    first = tinyimagenet._cached_arrays(folder, tinyimagenet._images(folder)[1])
    caches = list((tmp_path / "tinyimagenet").glob("cache-*.npz"))
    assert len(caches) == 1

    def no_decoding(files):
        raise AssertionError("decoded again")

    monkeypatch.setattr(tinyimagenet, "_decode", no_decoding)
    again = tinyimagenet._cached_arrays(folder, tinyimagenet._images(folder)[1])
    assert np.array_equal(first, again)
    monkeypatch.undo()
    from PIL import Image

    Image.new("RGB", (64, 64), (1, 2, 3)).save(folder / "train" / "n01" / "images" / "n01_9.JPEG")
    grown = tinyimagenet._cached_arrays(folder, tinyimagenet._images(folder)[1])
    assert len(grown) == len(first) + 1
    assert len(list((tmp_path / "tinyimagenet").glob("cache-*.npz"))) == 2
    assert not list((tmp_path / "tinyimagenet").glob(".cache-*"))  # no part file left


def test_federated_with_options(cfg, tmp_path):
    write_tinyimagenet(tmp_path, per_class=6, val_per_class=2)
    opts = {"augment": True, "pool": "all"}
    fd = load_dataset(cfg("tinyimagenet", root=str(tmp_path), num_clients=2, options=opts), 0)
    assert fd.input_shape == (3, 64, 64) and fd.num_outputs == 3
    assert sum(c.num_train + c.num_test for c in fd.clients) == 24
    assert fd.augment == AugmentSpec(crop_padding=8, flip=True)


def test_a_val_line_with_an_unknown_wnid_names_the_line(tmp_path):
    folder = write_tinyimagenet(tmp_path)
    path = folder / "val" / "val_annotations.txt"
    path.write_text(path.read_text() + "val_x.JPEG\tn99\t0\t0\t1\t1\n")
    with pytest.raises(DataError, match=r"val_annotations\.txt:7: .* wnid of wnids\.txt"):
        tinyimagenet.load_tinyimagenet(str(tmp_path))


def test_offline_without_data_names_the_archive(tmp_path):
    with pytest.raises(DataError) as info:
        tinyimagenet.load_tinyimagenet(str(tmp_path / "none"))
    message = str(info.value)
    assert "tiny-imagenet-200" in message and "FEDLOOM_OFFLINE=1" in message
    assert "http://cs231n.stanford.edu/tiny-imagenet-200.zip" in message
    assert "90528d7ca1a48142e341f4ef8d21d0de" in message
