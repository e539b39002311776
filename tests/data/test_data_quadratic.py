"""Quadratic clients: the closed-form optima and Hessians in extras are right."""

from __future__ import annotations

import pytest
import torch

from fedloom.data import load_dataset
from fedloom.errors import ConfigError


def _loss(c, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    x, y = c.x_train.double(), c.y_train.double()
    return ((x @ w + b - y) ** 2).mean()


def _grad(c, opt: dict) -> torch.Tensor:
    w = opt["w"].clone().requires_grad_(True)
    b = opt["b"].clone().requires_grad_(True)
    gw, gb = torch.autograd.grad(_loss(c, w, b), (w, b))
    return torch.cat([gw, gb.reshape(1)])


@pytest.fixture(scope="module")
def fd(cfg):
    return load_dataset(cfg("quadratic"), seed=0)


def test_shapes(fd) -> None:
    assert fd.task == "regression" and fd.num_outputs == 1 and fd.num_clients == 10
    c = fd.clients[0]
    assert c.x_train.shape == (40, 5) and c.x_test.shape == (10, 5)
    assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.float32
    assert c.y_train.shape == (40,)


def test_local_optima_zero_local_gradient(fd) -> None:
    for c, opt in zip(fd.clients, fd.extras["local_optima"], strict=True):
        assert opt["w"].shape == (5,) and opt["b"].shape == ()
        assert _grad(c, opt).abs().max() < 1e-8


def test_global_optimum_zero_weighted_gradient(fd) -> None:
    opt = fd.extras["global_optimum"]
    n = sum(fd.train_sizes())
    total = sum(c.num_train / n * _grad(c, opt) for c in fd.clients)
    assert total.abs().max() < 1e-8
    # ...and it is not a stationary point of the clients one by one: heterogeneity
    assert min(_grad(c, opt).abs().max() for c in fd.clients) > 1e-2
    gaps = [(loc["w"] - opt["w"]).norm() for loc in fd.extras["local_optima"]]
    assert min(gaps) > 0.1


def test_hessians(fd) -> None:
    for c, h in zip(fd.clients, fd.extras["hessians"], strict=True):

        def f(p: torch.Tensor, c=c) -> torch.Tensor:
            return _loss(c, p[:-1], p[-1])

        auto = torch.autograd.functional.hessian(f, torch.zeros(6, dtype=torch.float64))
        assert torch.allclose(auto, h, atol=1e-10)
    # feature skew: the curvature differs across clients
    diags = torch.stack([h.diagonal()[:-1] for h in fd.extras["hessians"]])
    assert (diags.max(0).values / diags.min(0).values).min() > 2


def test_without_skew_hessians_are_alike(cfg) -> None:
    fd = load_dataset(cfg("quadratic", options={"feature_skew": False, "samples": 2000}), seed=0)
    diags = torch.stack([h.diagonal()[:-1] for h in fd.extras["hessians"]])
    assert (diags.max(0).values / diags.min(0).values).max() < 1.3


def test_too_few_samples(cfg) -> None:
    with pytest.raises(ConfigError, match=r"data\.quadratic\.samples: .* at least dim\+1 = 11"):
        load_dataset(cfg("quadratic", options={"dim": 10, "samples": 10}), seed=0)


def test_per_client_sizes(cfg) -> None:
    fd = load_dataset(cfg("quadratic", options={"samples": [10, 20, 40, 80]}), seed=1)
    assert fd.num_clients == 4
    assert [c.num_train + c.num_test for c in fd.clients] == [10, 20, 40, 80]
    opt = fd.extras["global_optimum"]
    n = sum(fd.train_sizes())
    assert sum(c.num_train / n * _grad(c, opt) for c in fd.clients).abs().max() < 1e-8
    with pytest.raises(ConfigError, match=r"data\.quadratic\.samples: 2 per-client sizes"):
        load_dataset(cfg("quadratic", num_clients=3, options={"samples": [10, 20]}), seed=0)
    with pytest.raises(ConfigError, match=r"data\.quadratic\.samples: must be >= 2"):
        load_dataset(cfg("quadratic", options={"samples": [10, 1]}), seed=0)
