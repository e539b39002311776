"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, arXiv:2002.07948): the meta-gradients
of the three variants against finite differences of the MAML objective and an independent
Hessian, a client's local steps against a transcription of Algorithm 1, the server's uniform
mean, the deployed (adapted) model and the cold start at alpha, and learning on the shared
Fashion-MNIST shards setup.

Per-FedAvg keeps no client state (None), so there is no kill-and-resume test: a resumed run only
needs the server state, which every algorithm's checkpoint carries.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.algorithms.perfedavg import (
    PerFedAvgConfig,
    finite_difference_hvp,
    hessian_vector_product,
    meta_gradient,
)
from fedloom.core.pytree import Tree
from fedloom.errors import ConfigError
from fedloom.solvers.ops import AUTOGRAD
from fedloom.solvers.sequential import run_client
from tests.algorithms.meta_setup import (
    ALPHA,
    as_batch,
    batch,
    check_deployed_is_adapted,
    directional_fd,
    flat,
    grad_of,
    hessian,
    run,
    tiny_ctx,
    tiny_model,
    unflat,
    uniform_uploads,
)
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


def meta(model, params, inner, outer, hess, variant, alpha, steps=1) -> SimpleNamespace:
    """meta_gradient on plain (x, y) minibatches, one client (reverse-mode autograd)."""
    cfg = PerFedAvgConfig(name="perfedavg", alpha=alpha, variant=variant, inner_steps=steps)
    batches = (as_batch(inner), as_batch(outer), *([as_batch(hess)] if hess else []))
    grad, loss, meta_loss = meta_gradient(AUTOGRAD, model, params, {}, batches, cfg)
    return SimpleNamespace(grad=grad, loss=float(loss), meta_loss=float(meta_loss))


def maml_objective(model, params: Tree, inner, outer, steps: int = 1) -> float:
    """M(w) = f(u_K(w); D'), u_0 = w, u_{j+1} = u_j - alpha grad f(u_j; D)."""
    u = params
    for _ in range(steps):
        g = grad_of(model, u, inner)
        u = {k: u[k] - ALPHA * g[k] for k in u}
    return float(model.loss(u, {}, *outer))


# -- the meta-gradient ---------------------------------------------------------------------
@pytest.mark.parametrize(("variant", "steps"), [("hf", 1), ("so", 1), ("so", 2)])
def test_meta_gradient_equals_finite_differences_of_the_maml_objective(variant, steps):
    model, params = tiny_model()
    inner, outer = batch(1), batch(2)
    step = meta(model, params, inner, outer, inner, variant, ALPHA, steps)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        d = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
        numeric = directional_fd(lambda w: maml_objective(model, w, inner, outer, steps), params, d)
        analytic = float(sum((step.grad[k] * d[k]).sum() for k in d))
        # measured: relative error 6e-11 to 4.5e-9 (float64, central difference h = 1e-5)
        assert analytic == pytest.approx(numeric, rel=1e-6), (analytic, numeric)
    assert step.meta_loss == pytest.approx(maml_objective(model, params, inner, outer, steps))


def test_first_order_differs_by_exactly_the_curvature_term():
    model, params = tiny_model()
    inner, outer = batch(1), batch(2)
    fo = meta(model, params, inner, outer, None, "fo", ALPHA)
    so = meta(model, params, inner, outer, None, "so", ALPHA)
    g = grad_of(model, params, inner)
    temp = {k: params[k] - ALPHA * g[k] for k in params}
    g_out = flat(grad_of(model, temp, outer))
    assert torch.allclose(flat(fo.grad), g_out, rtol=0, atol=1e-14)  # fo is grad f(temp; D')
    expected = ALPHA * hessian(model, params, inner) @ g_out
    difference = flat(fo.grad) - flat(so.grad)
    # measured: 1.4e-17 apart (|alpha H g| up to 0.07)
    assert torch.allclose(difference, expected, rtol=0, atol=1e-12)
    assert expected.abs().max() > 1e-3  # the term is not negligible here


def test_hessian_vector_products_exact_and_finite_difference():
    model, params = tiny_model()
    data = batch(4)
    gen = torch.Generator().manual_seed(5)
    v = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
    expected = hessian(model, params, data) @ flat(v)
    exact = flat(hessian_vector_product(AUTOGRAD, model, params, {}, as_batch(data), v))
    assert torch.allclose(exact, expected, rtol=0, atol=1e-12)
    errors = [
        (
            flat(finite_difference_hvp(AUTOGRAD, model, params, {}, as_batch(data), v, delta))
            - expected
        )
        .abs()
        .max()
        for delta in (1e-4, 1e-5)
    ]
    # the paper's central difference is O(delta^2): measured 6.3e-8 and 6.3e-10
    assert errors[1] < 1e-8
    assert 50 < errors[0] / errors[1] < 200


# -- one client's round: Algorithm 1, transcribed --------------------------------------------
@pytest.mark.parametrize("straggler", [False, True])
def test_perfedavg_hf_client_round_is_algorithm_1(straggler):
    ctx, data = tiny_ctx()
    algo = build_algorithm({"name": "perfedavg", "alpha": ALPHA, "beta": 0.1}, ctx)
    params, buffers = ctx.model.initial_state(0)
    server = algo.init_server_state(params, buffers)
    full = ctx.make_plan(data, 6, "batches", 2, 0)
    plan = full[:3] if straggler else full
    result = run_client(
        client_program(algo), algo.server_message(server), None, ClientTask(0, data, plan, 0.2, 2)
    )
    # the transcription: D from the task's plan, D' and D'' from their own streams
    outer = ctx.make_plan(data, 6, "perfedavg/outer", 2, 0)
    hess = ctx.make_plan(data, 6, "perfedavg/hessian", 2, 0)
    x, y = data.x_train, data.y_train
    w = params
    for d, d1, d2 in zip(plan, outer, hess, strict=False):
        g = grad_of(ctx.model, w, (x[d], y[d]))
        temp = {k: w[k] - ALPHA * g[k] for k in w}
        g_out = flat(grad_of(ctx.model, temp, (x[d1], y[d1])))
        direction = g_out - ALPHA * hessian(ctx.model, w, (x[d2], y[d2])) @ g_out
        w = unflat(flat(w) - 0.1 * direction, w)
    assert torch.allclose(flat(result.upload["params"]), flat(w), rtol=0, atol=1e-12)
    assert result.weight == 0.25  # weighting: uniform, 1/K
    assert result.state is None
    assert not torch.equal(outer[0], plan[0]) and not torch.equal(hess[0], outer[0])


def test_perfedavg_server_is_the_uniform_mean_of_the_uploads():
    ctx, _ = tiny_ctx()
    algo = build_algorithm({"name": "perfedavg"}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    models, results = uniform_uploads(ctx, server["params"], 3, seed=0)
    new = algo.aggregate(server, results)
    for k in server["params"]:
        assert torch.allclose(new["params"][k], sum(m[k] for m in models) / 3, atol=1e-12)


# -- deployment: theta adapted to the client at alpha ---------------------------------------
def test_deployed_model_is_theta_after_adapt_steps_sgd_steps_at_alpha():
    check_deployed_is_adapted("perfedavg", ALPHA, alpha=ALPHA)


def test_cold_start_adapts_at_alpha_from_theta():
    ctx, data = tiny_ctx()
    algo = build_algorithm({"name": "perfedavg", "alpha": 0.07}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    assert algo.deployment.adaptation_lr() == 0.07
    params, _ = algo.deployment.new_client_model(server, ClientTask(3, data, [], ctx.lr, 1))
    assert params is server["params"]
    assert build_algorithm({"name": "reptile"}, ctx).deployment.adaptation_lr() is None  # train.lr


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "perfedavg", "variant": "hf", "inner_steps": 2}, "algorithm.inner_steps"),
        ({"name": "perfedavg", "variant": "fo", "hvp_delta": 1e-3}, "algorithm.hvp_delta"),
        ({"name": "perfedavg", "variant": "exact"}, "algorithm.variant"),
        ({"name": "perfedavg", "alpha": 0}, "algorithm.alpha"),
        ({"name": "perfedavg", "adapt_steps": -1}, "algorithm.adapt_steps"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


def test_perfedavg_variants_run_end_to_end():
    losses = {}
    for variant in ({"variant": "fo"}, {"variant": "hf", "hvp_delta": 1e-3}, {"variant": "so"}):
        result = run({"name": "perfedavg", "alpha": 0.05, **variant})
        assert math.isfinite(result.history[-1]["train_loss"])
        losses[variant["variant"]] = result.history[-1]["client_info"]["meta_loss"]
    assert len(set(losses.values())) == 3  # the variants take different steps


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
def test_perfedavg_beats_fedavg_on_label_shards(data_root):
    # Half the setup's rounds: an exact-HVP step costs about 3.5x a plain one. Measured (seed 0,
    # alpha 0.01, one adaptation step at alpha): personalized mean 0.8837 (P10 0.667) after 10
    # rounds, 0.9441 (P10 0.898) after the setup's 20; fo: 0.9103 / 0.9362, so: 0.9182 after
    # 10. FedAvg's global model on the same clients: 0.6215; FedAvg + one step at 0.01 (the
    # same adaptation, fedavg_ft): 0.9075 after 20 rounds.
    result = run_pfl({"name": "perfedavg", "variant": "hf", "alpha": 0.01}, rounds=10)
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.2, accuracy
