"""CIFAR-10 and CIFAR-100 (data/cifar.py, data/images.py, data/archive.py) on releases the tests
write in the official binary layout (tests/data/image_fixtures.py): pixels where the byte
layout puts them, labels, record counts from the size, normalization, augmentation, the
archive's checksum, download and safe unpacking, and the offline error."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch

import fedloom
from fedloom.data import cifar, download, load_dataset
from fedloom.data.archive import unpack
from fedloom.data.augment import AugmentSpec
from fedloom.data.cifar import CIFAR10_PREP, read_records
from fedloom.errors import ConfigError, DataError
from tests.data.image_fixtures import (
    cifar10_archive,
    cifar_records,
    pixels,
    tar_with,
    write_cifar10,
    write_cifar100,
)


def test_records_land_as_the_byte_layout_says(tmp_path):
    """Hand-built record: label 7, then byte R(h=1, w=2) at 1*32+2, G(0, 0) at 1024, B(31, 31)
    at 3071."""
    record = np.zeros(1 + 3072, dtype=np.uint8)
    record[0] = 7
    record[1 + 1 * 32 + 2] = 11
    record[1 + 1024] = 22
    record[1 + 2048 + 31 * 32 + 31] = 33
    path = tmp_path / "one.bin"
    path.write_bytes(record.tobytes() * 3)
    x, y = read_records(path, 1)
    assert x.shape == (3, 3, 32, 32) and y.tolist() == [[7]] * 3
    assert x[0, 0, 1, 2] == 11 and x[0, 1, 0, 0] == 22 and x[0, 2, 31, 31] == 33
    assert int(x[0].sum()) == 66


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    folder = write_cifar10(tmp_path)
    data = (folder / "data_batch_3.bin").read_bytes()
    (folder / "data_batch_3.bin").write_bytes(data[:-5])
    with pytest.raises(DataError, match=r"data_batch_3\.bin: .* not a whole number of 3073-byte"):
        cifar.load_cifar10(str(tmp_path))


def test_cifar10_pool_and_clients(cfg, tmp_path):
    write_cifar10(tmp_path, per_file=40, test=30)
    pool = cifar.load_cifar10(str(tmp_path))
    assert pool.x_train.shape == (200, 3, 32, 32) and pool.x_test.shape == (30, 3, 32, 32)
    assert np.array_equal(pool.x_train, pixels(200)) and np.array_equal(
        pool.x_test, pixels(30, 10_000)
    )
    assert pool.y_train.tolist() == [r % 10 for r in range(200)] and pool.num_classes == 10
    raw = {"normalize": False}
    fd = load_dataset(cfg("cifar10", root=str(tmp_path), num_clients=4, options=raw), seed=0)
    assert fd.num_clients == 4 and fd.input_shape == (3, 32, 32) and fd.num_outputs == 10
    assert sum(c.num_train + c.num_test for c in fd.clients) == 200  # the training split
    train, _ = fd.extras["client_indices"][2]
    expected = torch.from_numpy(pixels(200)[train]).float() / 255
    assert torch.equal(fd.clients[2].x_train, expected)
    assert fd.clients[2].y_train.tolist() == [int(i) % 10 for i in train]
    assert fd.augment is None
    every = load_dataset(
        cfg("cifar10", root=str(tmp_path), num_clients=4, options={"pool": "all"}), seed=0
    )
    assert sum(c.num_train + c.num_test for c in every.clients) == 230  # train + test, as PFLlib


def test_normalization_uses_the_published_channel_statistics(cfg, tmp_path):
    """An all-128 image normalizes to (128/255 - mean_c) / std_c in channel c."""
    folder = tmp_path / "cifar10" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    flat = np.full((20, 3, 32, 32), 128, dtype=np.uint8)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (folder / name).write_bytes(cifar_records(np.arange(20)[:, None] % 10, flat))
    fd = load_dataset(cfg("cifar10", root=str(tmp_path), num_clients=2), seed=0)
    x = torch.cat([fd.clients[0].x_train, fd.clients[1].x_test])
    for c in range(3):
        value = (128 / 255 - CIFAR10_PREP.mean[c]) / CIFAR10_PREP.std[c]
        assert torch.allclose(x[:, c], torch.full_like(x[:, c], value), atol=1e-6)


def test_augment_option_declares_crop_and_flip(cfg, tmp_path):
    write_cifar10(tmp_path)
    fd = load_dataset(
        cfg("cifar10", root=str(tmp_path), num_clients=2, options={"augment": True}), seed=0
    )
    assert fd.augment == AugmentSpec(crop_padding=4, flip=True)


def test_cifar100_fine_and_coarse_labels(cfg, tmp_path):
    write_cifar100(tmp_path, train=200, test=50)
    fine = cifar.load_cifar100(str(tmp_path))
    coarse = cifar.load_cifar100(str(tmp_path), coarse=True)
    assert fine.num_classes == 100 and coarse.num_classes == 20
    assert fine.y_train.tolist() == [r % 100 for r in range(200)]
    assert coarse.y_test.tolist() == [r % 20 for r in range(50)]
    assert np.array_equal(fine.x_train, pixels(200))
    fd = load_dataset(
        cfg("cifar100", root=str(tmp_path), num_clients=2, options={"coarse": True}), seed=0
    )
    assert fd.num_outputs == 20
    with pytest.raises(ConfigError, match="coarse"):  # cifar10 has no such option
        load_dataset(cfg("cifar10", root=str(tmp_path), options={"coarse": True}), seed=0)


def test_offline_without_data_names_the_files_and_the_address(tmp_path):
    with pytest.raises(DataError) as info:
        cifar.load_cifar10(str(tmp_path / "empty"))
    message = str(info.value)
    assert "cifar10" in message and "FEDLOOM_OFFLINE=1" in message
    assert "cifar-10-batches-bin" in message and "cifar-10-binary.tar.gz" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in message
    assert "c32a1d4ab5d03f1284b67883e8d87530" in message


def test_the_cli_exits_2_offline_naming_the_archive(tmp_path):
    from typer.testing import CliRunner

    from fedloom.cli import app

    config = tmp_path / "c.yaml"
    config.write_text(
        f"data: {{name: cifar10, root: {tmp_path / 'none'}}}\nmodel: {{name: cnn4}}\n"
    )
    done = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "run")])
    assert done.exit_code == 2, done.output
    assert "cifar-10-binary.tar.gz" in done.output.replace("\n", "")


class _Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def test_download_is_verified_then_unpacked(tmp_path, monkeypatch):
    payload = cifar10_archive(tmp_path / "made").read_bytes()
    md5 = hashlib.md5(payload).hexdigest()
    monkeypatch.setattr(cifar, "CIFAR10", replace(cifar.CIFAR10, md5=md5))
    monkeypatch.delenv("FEDLOOM_OFFLINE")
    urls = []
    monkeypatch.setattr(
        download.urllib.request,
        "urlopen",
        lambda url, timeout: urls.append(url) or _Response(payload),
    )
    root = tmp_path / "root"
    pool = cifar.load_cifar10(str(root))
    assert urls == [cifar.CIFAR10.url] and pool.x_train.shape == (200, 3, 32, 32)
    assert (root / "cifar10" / "cifar-10-binary.tar.gz").read_bytes() == payload
    assert sorted(p.name for p in (root / "cifar10").iterdir()) == [
        "cifar-10-batches-bin",
        "cifar-10-binary.tar.gz",
    ]  # no temporary folder or part file left


def test_an_archive_with_another_checksum_is_refused_before_unpacking(tmp_path):
    archive = cifar10_archive(tmp_path / "made")
    (tmp_path / "root" / "cifar10").mkdir(parents=True)
    archive.rename(tmp_path / "root" / "cifar10" / "cifar-10-binary.tar.gz")
    with pytest.raises(DataError, match=r"checksum mismatch .* expected MD5 c32a1d4a"):
        cifar.load_cifar10(str(tmp_path / "root"))
    assert not (tmp_path / "root" / "cifar10" / "cifar-10-batches-bin").exists()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([_member("top/../../evil")], "written outside"),
        ([_member("/etc/evil")], "written outside"),
        ([_member("top/link", tarfile.SYMTYPE, "/etc/passwd")], "is a link"),
        ([_member("top/hard", tarfile.LNKTYPE, "top/a")], "is a link"),
        ([_member("top/dev", tarfile.CHRTYPE)], "is a special file"),
    ],
)
def test_unsafe_tar_members_are_refused_before_anything_is_written(tmp_path, members, message):
    archive = tar_with(tmp_path / "bad.tar.gz", [_member("top/a"), *members])
    target = tmp_path / "out" / "top"
    with pytest.raises(DataError, match=message):
        unpack(archive, target)
    assert not target.exists() and list((tmp_path / "out").iterdir()) == []
    assert not (tmp_path / "evil").exists()


def test_unsafe_zip_members_are_refused(tmp_path):
    path = tmp_path / "bad.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("top/a", b"x")
        zf.writestr("/abs/evil", b"x")
    with pytest.raises(DataError, match="written outside"):
        unpack(path, tmp_path / "out" / "top")
    link = tmp_path / "link.zip"
    with zipfile.ZipFile(link, "w") as zf:
        info = zipfile.ZipInfo("top/link")
        info.external_attr = 0o120777 << 16  # a symbolic link's mode
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(DataError, match="is a link"):
        unpack(link, tmp_path / "out2" / "top")


def test_a_run_on_cifar10_end_to_end(tmp_path):
    write_cifar10(tmp_path / "data")
    config = {
        "data": {
            "name": "cifar10",
            "root": str(tmp_path / "data"),
            "num_clients": 3,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
            "cifar10": {"augment": True},
        },
        "model": {"name": "cnn4"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 1, "local_steps": 2, "batch_size": 8, "lr": 0.01},
    }
    result = fedloom.run(config, write=False, progress=False)
    assert result.summary["dataset"] == "cifar10" and result.summary["rounds"] == 1
    last = result.history[-1]
    assert np.isfinite(last["train_loss"]) and 0 <= last["global"]["accuracy"] <= 1
