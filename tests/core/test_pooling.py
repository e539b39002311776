"""core/pooling.py: max-pooling through a channels-last copy gives ``F.max_pool2d``'s values,
gradients and second derivatives bit for bit (ties included), falls back to it where it
cannot run (vmap, unbatched inputs), and the trainers that swap it in train the same bits."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import fedloom
from fedloom.core import lean, pooling, stacked
from fedloom.core.pooling import fast_max_pools, max_pool2d, max_pools

CASES = [
    # kernel, stride, padding, dilation, ceil_mode
    (2, None, 0, 1, False),
    (3, 2, 1, 1, True),
    (2, 1, 0, 2, False),
    ((3, 2), (2, 1), (1, 0), 1, False),
]


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation", "ceil_mode"), CASES)
@pytest.mark.parametrize("shape", [(4, 5, 9, 11), (3, 16, 8, 8)])
def test_values_and_gradients_equal_max_pool2d_bit_for_bit(
    kernel, stride, padding, dilation, ceil_mode, shape
):
    args = (kernel, stride, padding, dilation, ceil_mode)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, shape, generator=gen).float()  # many tied maxima
    x = torch.where(torch.rand(shape, generator=gen) < 0.3, torch.randn(shape, generator=gen), x)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = max_pool2d(ours, *args), F.max_pool2d(theirs, *args)
    g = torch.randn(y_theirs.shape, generator=gen)
    y_ours.backward(g)
    y_theirs.backward(g)
    assert torch.equal(y_ours, y_theirs)
    assert torch.equal(ours.grad, theirs.grad)
    assert y_ours.is_contiguous()  # the default layout goes on to the rest of the model


def test_second_derivatives_equal_max_pool2d():
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    out = []
    for pool in (lambda t: max_pool2d(t, 2), lambda t: F.max_pool2d(t, 2)):
        (g,) = torch.autograd.grad((pool(x) ** 3).sum(), x, create_graph=True)
        out.append(torch.autograd.grad(g.sum(), x)[0])
    assert torch.equal(*out)
    assert out[0].abs().sum() > 0


def test_falls_back_to_max_pool2d_under_vmap_and_for_unbatched_inputs(monkeypatch):
    def refuse(*args):
        raise AssertionError("the channels-last path ran")

    monkeypatch.setattr(pooling._ChannelsLastMaxPool, "apply", refuse)
    xs = torch.randn(3, 2, 4, 6, 6)
    got = vmap(grad(lambda t: (max_pool2d(t, 2) ** 2).sum()))(xs)
    want = vmap(grad(lambda t: (F.max_pool2d(t, 2) ** 2).sum()))(xs)
    assert torch.equal(got, want)
    unbatched = torch.randn(4, 6, 6)
    assert torch.equal(max_pool2d(unbatched, 2), F.max_pool2d(unbatched, 2))


def test_swaps_max_pool_layers_for_the_block_only():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(2), nn.MaxPool2d(2, return_indices=True))
    pool, indexed = model[1], model[2]
    calls = []
    original = pooling._ChannelsLastMaxPool.apply

    def counted(*args):
        calls.append(args[1:])
        return original(*args)

    pooling._ChannelsLastMaxPool.apply = counted  # type: ignore[method-assign]
    try:
        x = torch.randn(2, 1, 10, 10)
        with fast_max_pools(max_pools(model)):
            assert "forward" in vars(pool) and "forward" not in vars(indexed)
            y = pool(model[0](x))
        assert "forward" not in vars(pool)  # back to the class's forward
        assert torch.equal(y, F.max_pool2d(model[0](x), 2))
        assert calls == [([2, 2], [2, 2], [0, 0], [1, 1], False)]
    finally:
        pooling._ChannelsLastMaxPool.apply = original  # type: ignore[method-assign]


@pytest.mark.parametrize(("model", "executor"), [("cnn", "sequential"), ("cnn4", "vectorized")])
def test_runs_train_the_same_bits_with_and_without_the_swap(model, executor, monkeypatch):
    """The one-client trainer (core/lean.py) and the stacked path (core/stacked.py) swap the
    pooling in; a whole run's models and metrics are bit for bit those without it."""
    from tests.engine.test_executor_equivalence import digit_images

    cfg = {
        "seed": 2,
        "model": {"name": model},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 2, "clients_per_round": 4, "batch_size": 16, "lr": 0.05},
        "executor": {"kind": executor},
    }
    data = digit_images(16, 1)
    original = pooling._ChannelsLastMaxPool.apply
    calls = []

    def counted(*args):
        calls.append(1)
        return original(*args)

    runs = []
    for swapped in (True, False):
        with monkeypatch.context() as m:
            m.setattr(pooling._ChannelsLastMaxPool, "apply", counted)
            if not swapped:  # nn.MaxPool2d runs F.max_pool2d in both trainers
                m.setattr(lean, "install_fast_max_pools", lambda module: None)
                m.setattr(stacked, "fast_max_pools", lambda layers: contextlib.nullcontext())
            runs.append(fedloom.run(cfg, data=data, write=False, progress=False))
        if swapped:
            assert calls, "the channels-last pooling never ran"
            calls.clear()
    assert not calls
    a, b = runs
    for cid, params in a.client_params.items():
        for key, value in params.items():
            assert torch.equal(value, b.client_params[cid][key]), (cid, key)
    assert [r["train_loss"] for r in a.history] == [r["train_loss"] for r in b.history]
