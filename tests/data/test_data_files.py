"""Missing, corrupt and downloaded files (the network is always mocked or disabled)."""

from __future__ import annotations

import io
import urllib.error
from pathlib import Path

import pytest

from fedloom.data import download, load_dataset, load_mnist_arrays
from fedloom.data.download import KNOWN_FILES, ensure_files
from fedloom.errors import DataError

MNIST_FILES = [k for k in KNOWN_FILES if k.startswith("mnist/")]


def _mirror(data_root: Path, tmp: Path, corrupt: str | None = None) -> Path:
    """tmp/mnist with symlinks to the real files, except ``corrupt``, copied with a byte flipped."""
    (tmp / "mnist").mkdir()
    for rel in MNIST_FILES:
        src, dst = data_root / rel, tmp / rel
        if Path(rel).name == corrupt:
            data = bytearray(src.read_bytes())
            data[len(data) // 2] ^= 0xFF
            dst.write_bytes(bytes(data))
        else:
            dst.symlink_to(src)
    return tmp


def test_missing_file_offline(cfg, tmp_path) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(cfg("mnist", root=str(tmp_path)), seed=0)
    msg = str(info.value)
    assert str(tmp_path / "mnist" / "train-images-idx3-ubyte.gz") in msg
    assert "t10k-labels-idx1-ubyte.gz" in msg and "data.root" in msg
    assert "FEDLOOM_OFFLINE=1" in msg and "https://ossci-datasets.s3.amazonaws.com/mnist/" in msg


def test_missing_femnist_and_shakespeare(cfg, tmp_path) -> None:
    with pytest.raises(DataError, match=r"femnist: no \*\.json files in .*LEAF"):
        load_dataset(cfg("femnist", root=str(tmp_path)), seed=0)
    with pytest.raises(DataError, match=r"tinyshakespeare/input\.txt"):
        load_dataset(cfg("shakespeare", root=str(tmp_path)), seed=0)


def test_corrupt_labels_file(data_root, cfg, tmp_path) -> None:
    root = _mirror(data_root, tmp_path, corrupt="train-labels-idx1-ubyte.gz")
    with pytest.raises(DataError) as info:
        load_dataset(cfg("mnist", root=str(root)), seed=0)
    msg = str(info.value)
    assert "checksum mismatch" in msg
    assert str(root / "mnist" / "train-labels-idx1-ubyte.gz") in msg
    assert KNOWN_FILES["mnist/train-labels-idx1-ubyte.gz"].sha256 in msg


def test_intact_mirror_loads(data_root, tmp_path) -> None:
    root = _mirror(data_root, tmp_path)
    assert load_mnist_arrays(root, "mnist")[0].shape == (60000, 28, 28)


class _FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def test_download_is_verified_and_atomic(data_root, tmp_path, monkeypatch) -> None:
    rel = "mnist/t10k-labels-idx1-ubyte.gz"
    payload = (data_root / rel).read_bytes()
    urls: list[str] = []

    def fake_urlopen(url: str, timeout: float):
        urls.append(url)
        return _FakeResponse(payload)

    monkeypatch.delenv("FEDLOOM_OFFLINE")
    monkeypatch.setattr(download.urllib.request, "urlopen", fake_urlopen)
    (path,) = ensure_files(tmp_path, [rel], dataset="mnist")
    assert path.read_bytes() == payload
    assert urls == ["https://ossci-datasets.s3.amazonaws.com/mnist/t10k-labels-idx1-ubyte.gz"]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left

    payload = payload[:-1] + bytes([payload[-1] ^ 1])
    rel2 = "mnist/train-labels-idx1-ubyte.gz"
    with pytest.raises(DataError, match="checksum mismatch"):
        ensure_files(tmp_path, [rel2], dataset="mnist")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_download_failure_explains(tmp_path, monkeypatch) -> None:
    def failing(url: str, timeout: float):
        raise urllib.error.URLError("no route to host")

    monkeypatch.delenv("FEDLOOM_OFFLINE")
    monkeypatch.setattr(download.urllib.request, "urlopen", failing)
    with pytest.raises(DataError, match=r"Download failed: .*no route to host") as info:
        ensure_files(tmp_path, ["tinyshakespeare/input.txt"], dataset="shakespeare")
    assert "raw.githubusercontent.com/karpathy/char-rnn" in str(info.value)
