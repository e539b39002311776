"""FedOpt (Reddi et al., ICLR 2021, Algorithm 2) and FedAvgM: server optimizers on Delta_t.

Each test fails if the server math deviates from the paper: a missing (1 - beta1) factor, a
squared root dropped, Yogi's sign flipped, unweighted averaging, a lost optimizer state on
resume, and so on.
"""

from __future__ import annotations

import pytest
import torch

from fedloom.algorithms import AlgorithmContext, ClientResult, build_algorithm
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import weighted_average
from fedloom.errors import ConfigError
from fedloom.models import build_model
from fedloom.solvers.local import PlanMaker
from tests.algorithms.oracle import (
    as_vector,
    fedavg_fixed_point,
    max_curvature,
    quadratic_data,
    run,
)
from tests.resume import killed_and_resumed

ADAPTIVE = ("fedadagrad", "fedyogi", "fedadam")


@pytest.fixture(scope="module")
def data():
    return quadratic_data(num_clients=5, seed=0)


@pytest.fixture(scope="module")
def lr(data) -> float:
    return 0.5 / max_curvature(data)


# -- limits that reduce to FedAvg ----------------------------------------------------------------


def test_fedavgm_without_momentum_and_unit_server_lr_is_fedavg(data, lr):
    fedavg = run(data, {"name": "fedavg"}, rounds=10, lr=lr, local_steps=5)
    fedavgm = run(
        data, {"name": "fedavgm", "server_lr": 1.0, "beta": 0.0}, rounds=10, lr=lr, local_steps=5
    )
    assert torch.equal(as_vector(fedavg.global_params), as_vector(fedavgm.global_params))
    assert fedavg.summary["communication"] == fedavgm.summary["communication"]


# With v_{-1} = tau^2 and tau >> |Delta|: sqrt(v_t) -> tau for Adagrad and Yogi (v_t stays near
# tau^2), so x_{t+1} - x_t -> server_lr * Delta_t / (2 tau): server_lr = 2 tau gives FedAvg.
# Adam's v_t = beta2^{t+1} tau^2 + O(Delta^2) has a round-dependent limit unless beta2 = 0; then
# v_t = Delta_t^2 and the step -> server_lr * Delta_t / tau: server_lr = tau gives FedAvg.
# Measured max |x - x_fedavg| after 10 rounds at tau = 1e6: Adam 7.5e-9, Yogi and Adagrad 0
# (|x| ~ 2); the gap shrinks like 1/tau (Adam: 1.4e-4 at tau = 1e2, 1.3e-6 at tau = 1e4).
@pytest.mark.parametrize(
    ("name", "extra", "lr_over_tau"),
    [("fedadagrad", {}, 2.0), ("fedyogi", {}, 2.0), ("fedadam", {"beta2": 0.0}, 1.0)],
)
def test_adaptive_with_huge_tau_is_fedavg(data, lr, name, extra, lr_over_tau):
    tau = 1e6
    algorithm = {"name": name, "beta1": 0.0, "tau": tau, "server_lr": lr_over_tau * tau, **extra}
    fedavg = run(data, {"name": "fedavg"}, rounds=10, lr=lr, local_steps=5)
    result = run(data, algorithm, rounds=10, lr=lr, local_steps=5)
    a, b = as_vector(fedavg.global_params), as_vector(result.global_params)
    assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    # the run moved far from its start: the agreement is not trivial
    init = as_vector(run(data, {"name": "fedavg"}, rounds=1, lr=1e-12).global_params)
    assert float((a - init).norm()) > 1.0


# -- two server steps by hand ----------------------------------------------------------------

HYPER = {
    "fedavgm": {"server_lr": 0.2, "beta": 0.5},
    "fedadagrad": {"server_lr": 0.2, "beta1": 0.5, "tau": 0.1},
    "fedyogi": {"server_lr": 0.2, "beta1": 0.5, "beta2": 0.75, "tau": 0.1},
    "fedadam": {"server_lr": 0.2, "beta1": 0.5, "beta2": 0.75, "tau": 0.1},
}

X0 = [0.0, 1.0, -2.0, 0.5]
DELTAS = ([0.05, -0.3, 0.2, -0.02], [0.2, 0.1, -0.05, 0.01])
"""Delta_0 and Delta_1. With tau = 0.1 and Yogi: v_{-1} - Delta_0^2 = 0.01 - Delta_0^2 is
(+, -, -, +), and v_0 - Delta_1^2 is (-, +, +, +): the sign term takes both values."""
SPREAD = [0.1, -0.2, 0.3, 0.05]
"""Client 0 (weight 1) uploads x + Delta + 3 SPREAD, client 1 (weight 3) x + Delta - SPREAD:
the sample-size weighted mean is x + Delta; an unweighted mean would be x + Delta + SPREAD."""


def expected_step(name: str, x, m, v, delta):
    """Algorithm 2 of Reddi et al. (and FedAvgM), written out in float64."""
    hp = HYPER[name]
    if name == "fedavgm":
        m = hp["beta"] * m + delta
        return x + hp["server_lr"] * m, m, None
    b1, tau = hp["beta1"], hp["tau"]
    m = b1 * m + (1 - b1) * delta
    if name == "fedadagrad":
        v = v + delta**2
    elif name == "fedyogi":
        v = v - (1 - hp["beta2"]) * delta**2 * torch.sign(v - delta**2)
    else:
        v = hp["beta2"] * v + (1 - hp["beta2"]) * delta**2
    return x + hp["server_lr"] * m / (v.sqrt() + tau), m, v


def make_algorithm(name: str, data):
    module = build_model("logreg", data.input_shape, data.num_outputs)
    ctx = AlgorithmContext(
        model=FunctionalModel(module, data.task),
        seed=0,
        num_clients=2,
        lr=0.1,
        batch_size=None,
        aggregate=weighted_average,
        make_plan=PlanMaker(0, None),
    )
    return build_algorithm({"name": name, **HYPER[name]}, ctx)


def uploads(x: torch.Tensor, delta: torch.Tensor, round: int) -> list[ClientResult]:
    spread = torch.tensor(SPREAD, dtype=torch.float64)
    models = [x + delta + 3 * spread, x + delta - spread]
    buffers = [torch.tensor([1.0, 2.0]) + round, torch.tensor([5.0, 6.0]) + round]
    return [
        ClientResult({"params": {"w": y.float()}, "buffers": {"b": b}}, weight=w, loss=0.0)
        for y, b, w in zip(models, buffers, (1.0, 3.0), strict=True)
    ]


@pytest.mark.parametrize("name", ["fedavgm", *ADAPTIVE])
def test_two_server_steps_match_the_formulas(data, name):
    algorithm = make_algorithm(name, data)
    x0 = torch.tensor(X0)
    server = algorithm.init_server_state({"w": x0}, {"b": torch.zeros(2)})
    assert set(algorithm.server_message(server)) == {"params", "buffers"}

    x, m = x0.double(), torch.zeros(4, dtype=torch.float64)
    v = torch.full((4,), HYPER[name]["tau"] ** 2).double() if "tau" in HYPER[name] else None
    for round, d in enumerate(DELTAS):
        delta = torch.tensor(d, dtype=torch.float64)
        results = uploads(server["params"]["w"].double(), delta, round)
        if name == "fedyogi":
            signs = torch.sign(v - delta**2)
            assert (signs > 0).any() and (signs < 0).any()
        server = algorithm.aggregate(server, results)
        x, m, v = expected_step(name, x, m, v, delta)
        assert torch.allclose(server["params"]["w"].double(), x, atol=1e-6, rtol=0), name
        assert torch.allclose(server["m"]["w"].double(), m, atol=1e-6, rtol=0), name
        if v is not None:
            assert torch.allclose(server["v"]["w"].double(), v, atol=1e-7, rtol=1e-6), name
        else:
            assert "v" not in server
        # buffers are averaged like FedAvg: (1 * [1, 2] + 3 * [5, 6]) / 4, shifted by round
        assert torch.equal(server["buffers"]["b"], torch.tensor([4.0, 5.0]) + round)
    assert server["params"]["w"].dtype == torch.float32


def test_yogi_second_moment_by_hand(data):
    """Round 0 of Yogi with beta2 = 0.75, tau = 0.1, Delta_0 = (0.05, -0.3, 0.2, -0.02):
    v_0 = 0.01 - 0.25 Delta_0^2 sign(0.01 - Delta_0^2) = (0.009375, 0.0325, 0.02, 0.0099)."""
    algorithm = make_algorithm("fedyogi", data)
    server = algorithm.init_server_state({"w": torch.tensor(X0)}, {"b": torch.zeros(2)})
    server = algorithm.aggregate(
        server, uploads(torch.tensor(X0).double(), torch.tensor(DELTAS[0]), 0)
    )
    assert torch.allclose(server["v"]["w"], torch.tensor([0.009375, 0.0325, 0.02, 0.0099]))
    assert torch.allclose(server["m"]["w"], 0.5 * torch.tensor(DELTAS[0]))


# -- convergence ---------------------------------------------------------------------------------


# Measured distance to the closed-form FedAvg fixed point after 200 rounds (start: 2.78):
# fedadam 5.9e-5, fedyogi 3.7e-5, fedadagrad 4.9e-5, fedavgm 3.3e-5. Delta_t = 0 exactly at
# FedAvg's fixed point, so every server optimizer has it as its fixed point too.
@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "fedadam", "server_lr": 0.1},
        {"name": "fedyogi", "server_lr": 0.1},
        {"name": "fedadagrad", "server_lr": 0.3},
        {"name": "fedavgm"},
    ],
    ids=lambda a: a["name"],
)
def test_server_optimizers_reach_the_fedavg_fixed_point(data, lr, algorithm):
    steps = 5
    result = run(data, algorithm, rounds=200, lr=lr, local_steps=steps)
    fixed = fedavg_fixed_point(data, lr, steps)
    distance = float((as_vector(result.global_params) - fixed).norm())
    assert distance < 2e-4, distance


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedadam", "beta1": 1.0}, "algorithm.beta1"),
        ({"name": "fedyogi", "beta2": -0.1}, "algorithm.beta2"),
        ({"name": "fedadam", "tau": 0.0}, "algorithm.tau"),
        ({"name": "fedadagrad", "server_lr": 0.0}, "algorithm.server_lr"),
        ({"name": "fedavgm", "beta": 1.0}, "algorithm.beta"),
        ({"name": "fedadagrad", "beta2": 0.99}, "algorithm.beta2"),
        ({"name": "fedavgm", "beta1": 0.9}, "algorithm.beta1"),
    ],
)
def test_invalid_hyperparameters_are_config_errors(data, algorithm, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run(data, algorithm, rounds=1, lr=0.1)


# -- resume ----------------------------------------------------------------------------------


def test_fedadam_killed_and_resumed_equals_uninterrupted(tmp_path):
    config = {
        "seed": 1,
        "data": {"name": "quadratic", "num_clients": 5},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedadam", "server_lr": 0.1},
        "train": {"rounds": 6, "clients_per_round": 3, "local_steps": 3, "lr": 0.02},
        "eval": {"every": 1},
        "checkpoint": {"every": 3},
        "executor": {"kind": "sequential"},
    }
    _, _, saved = killed_and_resumed(config, tmp_path, crash_round=4)
    assert saved["round"] == 3 and {"m", "v"} <= set(saved["server"])
    assert float(saved["server"]["m"]["linear.weight"].abs().sum()) > 0
