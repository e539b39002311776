"""from_arrays round trips, and determinism of partitions and generators."""

from __future__ import annotations

import numpy as np
import torch

from fedloom.core.rng import numpy_rng
from fedloom.data import from_arrays, load_dataset


def test_from_arrays_classification_round_trip() -> None:
    rng = numpy_rng(0, "test")
    train = [(rng.normal(size=(n, 3)), rng.integers(0, 4, n)) for n in (10, 20)]
    fd = from_arrays(train, test_fraction=0.2, seed=0)
    assert fd.task == "classification" and fd.num_clients == 2 and fd.input_shape == (3,)
    for (x, y), c in zip(train, fd.clients, strict=True):
        got_x = torch.cat([c.x_train, c.x_test]).double()
        got_y = torch.cat([c.y_train, c.y_test])
        order = torch.argsort(got_x[:, 0])
        ref = np.argsort(x[:, 0])
        assert torch.allclose(got_x[order], torch.from_numpy(x[ref]), atol=1e-6)
        assert torch.equal(got_y[order], torch.from_numpy(y[ref]).long())
        assert c.num_test == round(0.2 * len(x))


def test_from_arrays_regression_with_explicit_test() -> None:
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    y = x.sum(1).double()
    fd = from_arrays([(x, y)], test=[(x[:3], y[:3])])
    assert fd.task == "regression" and fd.num_outputs == 1
    c = fd.clients[0]
    assert torch.equal(c.x_train, x) and c.y_train.dtype == torch.float32
    assert torch.allclose(c.y_test, y[:3].float())


def _indices(fd) -> list[np.ndarray]:
    return [np.concatenate(pair) for pair in fd.extras["client_indices"]]


def test_partitions_are_deterministic(cfg) -> None:
    spec = {"kind": "dirichlet", "alpha": 0.5}
    a = load_dataset(cfg("digits", partition=spec), seed=7)
    b = load_dataset(cfg("digits", partition=spec), seed=7)
    c = load_dataset(cfg("digits", partition=spec), seed=8)
    for x, y in zip(_indices(a), _indices(b), strict=True):
        assert np.array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(_indices(a), _indices(c), strict=True))
    for ca, cb in zip(a.clients, b.clients, strict=True):
        assert torch.equal(ca.x_train, cb.x_train) and torch.equal(ca.y_test, cb.y_test)


def test_generators_are_deterministic(cfg) -> None:
    for name in ("synthetic", "quadratic"):
        a, b = (load_dataset(cfg(name), seed=3) for _ in range(2))
        c = load_dataset(cfg(name), seed=4)
        assert all(
            torch.equal(ca.x_train, cb.x_train) and torch.equal(ca.y_train, cb.y_train)
            for ca, cb in zip(a.clients, b.clients, strict=True)
        )
        assert not torch.equal(a.clients[0].x_train[:5], c.clients[0].x_train[:5])
