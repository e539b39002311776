"""core/skinny.py: a stacked linear layer's products through oneDNN, one client at a time,
equal torch's batched products to float rounding, forward and input gradient; only large
weights take them; a stacked step through them equals each client's own step."""

from __future__ import annotations

import pytest
import torch

from fedloom.core import skinny
from fedloom.core.functional import FunctionalModel
from fedloom.core.skinny import grads_times_weights, rows_times_weights, stacked_linear
from fedloom.models import build_model
from fedloom.solvers.stacked_sgd import stacked_sgd_step
from tests.solvers.test_stacked import CLIENTS, SHAPES, batch, own_steps, stacked_params

pytestmark = pytest.mark.skipif(not skinny.ONEDNN, reason="this torch build has no oneDNN")


def weights(clients: int = 3, rows: int = 10, d_in: int = 300, d_out: int = 40):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(clients, rows, d_in, generator=g),
        torch.randn(clients, d_out, d_in, generator=g) / d_in**0.5,
        torch.randn(clients, d_out, generator=g),
        torch.randn(clients, rows, d_out, generator=g),
    )


def test_only_weights_of_at_least_min_weight_take_onednn(monkeypatch):
    _, w, _, _ = weights()  # 40 x 300 = 12,000 elements a client
    monkeypatch.setattr(skinny, "MIN_WEIGHT", 12_001)
    assert not skinny.takes_onednn(w)
    monkeypatch.setattr(skinny, "MIN_WEIGHT", 12_000)
    assert skinny.takes_onednn(w)
    assert not skinny.takes_onednn(w.double())


def test_products_equal_the_batched_ones(monkeypatch):
    monkeypatch.setattr(skinny, "MIN_WEIGHT", 0)
    rows, w, b, g = weights()
    batched = torch.baddbmm(b.unsqueeze(1), rows, w.transpose(1, 2))
    torch.testing.assert_close(rows_times_weights(rows, w, b), batched, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        rows_times_weights(rows, w), torch.bmm(rows, w.transpose(1, 2)), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(grads_times_weights(g, w), torch.bmm(g, w), atol=1e-5, rtol=1e-5)


def test_stacked_linear_is_differentiable_in_its_rows(monkeypatch):
    monkeypatch.setattr(skinny, "MIN_WEIGHT", 0)
    rows, w, b, g = weights()
    ours, theirs = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out = stacked_linear(ours, w, b)
    assert out.grad_fn is not None and "StackedLinear" in type(out.grad_fn).__name__
    (out * g).sum().backward()
    (torch.baddbmm(b.unsqueeze(1), theirs, w.transpose(1, 2)) * g).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    # a weight that needs a gradient of its own takes the batched, fully differentiable path
    w_leaf = w.clone().requires_grad_()
    out = stacked_linear(rows, w_leaf, b)
    assert "StackedLinear" not in type(out.grad_fn).__name__
    out.sum().backward()
    assert w_leaf.grad is not None


@pytest.mark.parametrize("name", ["cnn", "cnn4"])
def test_stacked_step_through_onednn_equals_each_clients_own(name, monkeypatch):
    """Every linear layer through oneDNN (MIN_WEIGHT 0): each client's step equals its own
    autograd step, as core/stacked.py's tests ask of the batched products."""
    monkeypatch.setattr(skinny, "MIN_WEIGHT", 0)
    calls = []
    linear = skinny._linear

    def counted(*args):
        calls.append(1)
        return linear(*args)

    monkeypatch.setattr(skinny, "_linear", counted)
    model = FunctionalModel(build_model(name, SHAPES[name], 5), "classification")
    params = stacked_params(model, 3)
    b = batch(SHAPES[name], padded=True)
    expected, losses = own_steps(model, params, b)
    got = stacked_sgd_step(model, params, b, 0.1)
    assert calls, "no product went through oneDNN"
    assert got.tolist() == pytest.approx(losses, abs=1e-5)
    for c in range(CLIENTS):
        for k in params:
            torch.testing.assert_close(params[k][c], expected[c][k], atol=1e-5, rtol=0)
