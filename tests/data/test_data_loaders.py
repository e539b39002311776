"""Real-data loaders: MNIST, Fashion-MNIST, FEMNIST, digits (shapes, counts, conventions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedloom.data import load_dataset, load_mnist_arrays
from fedloom.errors import ConfigError

MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.mark.parametrize(
    ("name", "train_counts", "test_counts"),
    [("mnist", MNIST_TRAIN, MNIST_TEST), ("fashion_mnist", [6000] * 10, [1000] * 10)],
)
def test_official_arrays(data_root, name, train_counts, test_counts) -> None:
    x_train, y_train, x_test, y_test = load_mnist_arrays(data_root, name)
    assert x_train.shape == (60000, 28, 28) and x_test.shape == (10000, 28, 28)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.uint8
    assert np.bincount(y_train, minlength=10).tolist() == train_counts
    assert np.bincount(y_test, minlength=10).tolist() == test_counts


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_federated_image_conventions(data_root, cfg, name) -> None:
    fd = load_dataset(cfg(name, root=str(data_root)), seed=0)
    assert fd.num_clients == 20 and fd.task == "classification" and fd.num_outputs == 10
    assert fd.input_shape == (1, 28, 28)
    assert sum(fd.train_sizes()) + sum(c.num_test for c in fd.clients) == 60000
    c = fd.clients[3]
    assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.int64
    assert c.x_train.min() >= 0 and c.x_train.max() <= 1
    assert c.num_test == round(0.2 * 3000)
    x_raw, y_raw, _, _ = load_mnist_arrays(data_root, name)
    train_idx, test_idx = fd.extras["client_indices"][3]
    assert torch.equal(c.x_train[:, 0], torch.from_numpy(x_raw[train_idx]).float() / 255)
    assert torch.equal(c.y_test, torch.from_numpy(y_raw[test_idx].astype(np.int64)))
    # all clients are views of one storage: no per-client copies
    ptrs = {cl.x_train.untyped_storage().data_ptr() for cl in fd.clients}
    assert len(ptrs) == 1


def test_default_root_comes_from_env(data_root, cfg, monkeypatch, tmp_path) -> None:
    from fedloom.data import default_root

    real = data_root.resolve()
    monkeypatch.chdir(real.parent)
    monkeypatch.setenv("FEDLOOM_DATA", real.name)
    assert default_root() == real
    fd = load_dataset(cfg("mnist", num_clients=3), seed=0)
    assert fd.num_clients == 3
    monkeypatch.delenv("FEDLOOM_DATA")
    assert str(default_root()).endswith(".cache/fedloom")
    monkeypatch.chdir(tmp_path)
    rel = load_dataset(cfg("digits", root="rel", num_clients=2), seed=0)  # digits needs no files
    assert rel.num_clients == 2


def test_digits(cfg) -> None:
    fd = load_dataset(cfg("digits", partition={"kind": "shards"}), seed=0)
    assert fd.num_clients == 10 and fd.input_shape == (1, 8, 8) and fd.num_outputs == 10
    assert sum(fd.train_sizes()) + sum(c.num_test for c in fd.clients) == 1797
    assert all(float(c.x_train.min()) >= 0 and float(c.x_train.max()) <= 1 for c in fd.clients)
    for c in fd.clients:
        labels = torch.cat([c.y_train, c.y_test]).unique()
        assert len(labels) == 2


def test_femnist_writers(data_root, cfg) -> None:
    fd = load_dataset(cfg("femnist", root=str(data_root)), seed=0)
    assert fd.num_clients == 21 and fd.num_outputs == 62 and fd.input_shape == (1, 28, 28)
    assert sum(fd.train_sizes()) == 3108
    assert sum(c.num_test for c in fd.clients) == 355
    assert fd.client_names == sorted(fd.client_names)
    assert all(name.startswith("f") for name in fd.client_names)
    for c in fd.clients:
        assert c.x_train.dtype == torch.float32 and c.x_train.shape[1:] == (1, 28, 28)
        assert float(c.x_train.min()) >= 0 and float(c.x_train.max()) <= 1
        for y in (c.y_train, c.y_test):
            assert y.dtype == torch.int64 and int(y.min()) >= 0 and int(y.max()) <= 61
    labels = torch.cat([c.y_train for c in fd.clients]).unique()
    assert len(labels) > 40  # letters and digits across writers

    first = load_dataset(cfg("femnist", root=str(data_root), num_clients=5), seed=0)
    assert first.client_names == fd.client_names[:5]
    with pytest.raises(ConfigError, match=r"data\.num_clients: femnist .* has 21 writers"):
        load_dataset(cfg("femnist", root=str(data_root), num_clients=22), seed=0)
