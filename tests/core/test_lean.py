"""The sequential trainer's speed-ups change how, never what: channels-last convolution
weights, the direct autograd entry, grouped minibatch gathers, stacked-row aggregation and the
frozen heap during a run."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.lean import LeanModule, backward
from fedloom.models import build_model
from fedloom.solvers import local
from fedloom.solvers.local import minibatches


def cnn_model() -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(build_model("cnn", (1, 12, 12), 10), "classification")


def test_channels_last_weights_round_trip_in_the_default_layout():
    model = cnn_model()
    assert LeanModule(model.module).channels_last == set()  # off by default (core/lean.py)
    lean = LeanModule(model.module, channels_last=True)
    assert lean.channels_last == {"conv1.weight", "conv2.weight"}
    assert lean.views["conv2.weight"].is_contiguous(memory_format=torch.channels_last)
    params, buffers = model.initial_state(3)
    lean.load(params, buffers)
    out = lean.params()
    for k, v in params.items():
        assert out[k].is_contiguous() and torch.equal(out[k], v), k
    # the flat buffer really holds the NHWC order: its first run is conv1's weight permuted
    n = params["conv1.weight"].numel()
    assert torch.equal(lean.flat[:n], params["conv1.weight"].permute(0, 2, 3, 1).reshape(-1))


def test_batch_norm_models_keep_the_default_layout():
    lean = LeanModule(build_model("cnn_bn", (1, 12, 12), 10), channels_last=True)
    assert lean.channels_last == set()


def test_lean_step_equals_autograd_on_a_plain_copy():
    model = cnn_model()
    params, buffers = model.initial_state(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, 1, 12, 12, generator=g), torch.randint(0, 10, (16,), generator=g)
    plan = [torch.arange(0, 8), torch.arange(8, 16)]
    solved = local.local_sgd(model, params, buffers, x, y, plan, lr=0.1)
    p = {k: v.clone() for k, v in params.items()}
    for idx in plan:
        grads, _ = model.grad_and_loss(p, buffers, x[idx], y[idx])
        p = {k: v - 0.1 * grads[k] for k, v in p.items()}
    for k in p:
        assert torch.allclose(solved.params[k], p[k], atol=1e-6), k


def test_direct_backward_gives_the_public_paths_gradients():
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    x, y = torch.randn(7, 3), torch.randint(0, 5, (7,))
    F.cross_entropy(x @ w.T, y).backward()
    expected = w.grad.clone()
    w.grad = None
    backward(F.cross_entropy(x @ w.T, y))
    assert torch.equal(w.grad, expected)
    # non-scalar outputs go the public way (which then asks for a gradient argument)
    with pytest.raises(RuntimeError, match="scalar"):
        backward((x @ w.T).sum(dim=0))


@pytest.mark.parametrize("budget", [1 << 30, 1])
def test_minibatches_equal_indexing_each_step(monkeypatch, budget):
    monkeypatch.setattr(local, "GATHER_BYTES", budget)  # one gather for all, or one per step
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(23, 2, 3, generator=g), torch.randint(0, 4, (23,), generator=g)
    plan = local.batch_plan(23, 5, 11, g)  # two epochs and a bit, a short last batch each
    got = list(minibatches(x, y, plan))
    assert len(got) == len(plan)
    for (xb, yb), idx in zip(got, plan, strict=True):
        assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx])
    assert list(minibatches(x, y, [])) == []


def test_weighted_average_of_rows_of_one_tensor_equals_separate_tensors():
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(300, 4, 5, generator=g)
    rows = [{"w": r} for r in stacked.unbind(0)]
    copies = [{"w": r["w"].clone()} for r in rows]
    weights = [float(1 + i % 7) for i in range(300)]
    assert pytree._rows_of_one_tensor([r["w"] for r in rows]) is stacked
    assert pytree._rows_of_one_tensor([r["w"] for r in copies]) is None
    assert pytree._rows_of_one_tensor([r["w"] for r in reversed(rows)]) is None
    assert pytree._rows_of_one_tensor([r["w"] for r in rows[:-1]]) is None
    fast = pytree.weighted_average(rows, weights)["w"]
    loop = pytree.weighted_average(copies, weights)["w"]
    expected = (stacked.double() * torch.tensor(weights, dtype=torch.float64)[:, None, None]).sum(
        0
    ) / sum(weights)
    assert fast.dtype == torch.float32 and fast.shape == (4, 5)
    assert torch.allclose(fast.double(), expected, atol=1e-7)
    assert torch.allclose(fast, loop, atol=1e-7)


def test_the_heap_is_frozen_during_a_run_and_released_after():
    from fedloom.config import parse_config
    from fedloom.data import load_dataset
    from fedloom.engine.context import Callback
    from fedloom.engine.loop import Engine

    seen: list[int] = []

    class Spy(Callback):
        def on_round_end(self, ctx, state, report):
            seen.append(gc.get_freeze_count())
            return {}

    cfg = parse_config(
        {
            "data": {"name": "digits", "num_clients": 3},
            "model": {"name": "logreg"},
            "train": {"rounds": 1},
            "executor": {"kind": "sequential"},
        }
    )
    data = load_dataset(cfg.data, cfg.seed)
    module = build_model("logreg", data.input_shape, data.num_outputs)
    before = gc.get_freeze_count()
    Engine(cfg, data, module, callbacks=[Spy()]).run()
    assert seen and min(seen) > before
    assert gc.get_freeze_count() == before
