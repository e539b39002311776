"""Shared pieces of the Per-FedAvg and Reptile tests (tests/algorithms/test_perfedavg.py,
test_reptile.py): a tiny smooth network in float64, its exact gradients and Hessian, a one-client
context, the digits runs, and the check that a client deploys theta after its adaptation steps
(algorithms/meta.py, the deployment both share)."""

from __future__ import annotations

import torch
from torch import nn

import fedloom
from fedloom.algorithms import AlgorithmContext, ClientResult, ClientTask, build_algorithm
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree, weighted_average
from fedloom.models.base import FedModel
from fedloom.solvers.local import PlanMaker
from fedloom.solvers.program import Batch
from tests.algorithms import digits_setup

ALPHA = 0.3


class TanhNet(FedModel):
    """A tiny smooth network (tanh), so that its Hessian is continuous everywhere."""

    head_modules = ("fc2",)

    def __init__(self, d_in: int = 5, hidden: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def tiny_model() -> tuple[FunctionalModel, Tree]:
    model = FunctionalModel(TanhNet().double(), "classification")
    params, _ = model.initial_state(0)
    return model, params


def batch(seed: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 5, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (n,), generator=gen),
    )


def flat(tree: Tree) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in tree.values()])


def unflat(vector: torch.Tensor, like: Tree) -> Tree:
    out, offset = {}, 0
    for k, v in like.items():
        out[k] = vector[offset : offset + v.numel()].view_as(v)
        offset += v.numel()
    return out


def grad_of(model: FunctionalModel, params: Tree, data) -> Tree:
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    grads = torch.autograd.grad(model.loss(leaves, {}, *data), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def as_batch(data) -> Batch:
    x, y = data
    return Batch(x, y, torch.ones(y.shape[0], dtype=x.dtype))


def directional_fd(fn, params: Tree, direction: Tree, h: float = 1e-5) -> float:
    plus = {k: params[k] + h * direction[k] for k in params}
    minus = {k: params[k] - h * direction[k] for k in params}
    return (fn(plus) - fn(minus)) / (2 * h)


def hessian(model: FunctionalModel, params: Tree, data) -> torch.Tensor:
    """The full Hessian of f(.; data) at ``params`` (torch.autograd.functional.hessian)."""
    return torch.autograd.functional.hessian(
        lambda v: model.loss(unflat(v, params), {}, *data), flat(params).detach()
    )


def tiny_ctx(n: int = 40, batch_size: int | None = 8) -> tuple[AlgorithmContext, ClientData]:
    model, _ = tiny_model()
    x, y = batch(5, n)
    data = ClientData(x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    ctx = AlgorithmContext(
        model=model,
        seed=0,
        num_clients=4,
        lr=0.2,
        batch_size=batch_size,
        aggregate=weighted_average,
        make_plan=PlanMaker(0, batch_size),
        population={0: n, 1: 10, 2: 30, 3: 20},
    )
    return ctx, data


def digits_config(algorithm: dict, **train) -> dict:
    return digits_setup.digits_config(
        algorithm, partition=digits_setup.DIRICHLET, **{"stragglers": 0.3, **train}
    )


def run(algorithm: dict, **train) -> fedloom.RunResult:
    return fedloom.run(digits_config(algorithm, **train), write=False, progress=False)


def uniform_uploads(
    ctx: AlgorithmContext, like: Tree, count: int, seed: int
) -> tuple[list[Tree], list[ClientResult]]:
    """``count`` random models shaped like ``like`` and their uploads, each weighted 1/K."""
    gen = torch.Generator().manual_seed(seed)
    models = [
        {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in like.items()}
        for _ in range(count)
    ]
    results = [
        ClientResult({"params": m, "buffers": {}}, ctx.objective_weight(c, "uniform"), 0.0)
        for c, m in enumerate(models)
    ]
    return models, results


def check_deployed_is_adapted(name: str, lr: float, **extra) -> None:
    """A client deploys theta after ``adapt_steps`` SGD steps at ``lr`` on its own minibatches
    (0 steps: theta itself); one step by default."""
    ctx, data = tiny_ctx()
    for steps in (0, 1, 3):
        algo = build_algorithm({"name": name, "adapt_steps": steps, **extra}, ctx)
        server = algo.init_server_state(*ctx.model.initial_state(0))
        task = ClientTask(0, data, [], ctx.lr, 7)
        params, _ = algo.deployed_model(server, None, task)
        if steps == 0:
            assert params is server["params"]
            continue
        w = server["params"]
        for idx in ctx.make_plan(data, steps, "adapt", 7, 0):
            g = grad_of(ctx.model, w, (data.x_train[idx], data.y_train[idx]))
            w = {k: w[k] - lr * g[k] for k in w}
        assert torch.allclose(flat(params), flat(w), rtol=0, atol=1e-12), steps
        assert (flat(params) - flat(server["params"])).abs().max() > 1e-3
    assert build_algorithm({"name": name, **extra}, ctx).config.adapt_steps == 1
