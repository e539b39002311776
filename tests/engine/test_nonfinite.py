"""train.nonfinite: a diverging client is never averaged or evaluated as if it were fine."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.algorithms import ClientResult
from fedloom.data.federated import FederatedData, from_arrays
from fedloom.engine.nonfinite import DivergenceError, nonfinite_part


def regression_clients(scales: list[float]) -> FederatedData:
    """Least-squares clients; client k's features scaled by ``scales[k]`` (curvature
    ~ 2 scale^2): at lr 0.05 and 60 full-batch steps a client with scale 10 (lr L ~ 20)
    overflows float32, the others (lr L ~ 0.2) converge."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, generator=gen)
    train, test = [], []
    for s in scales:
        x = s * torch.randn(40, 3, generator=gen)
        xt = torch.randn(10, 3, generator=gen)
        train.append((x, x @ w + 0.1 * torch.randn(40, generator=gen)))
        test.append((xt, xt @ w))
    return from_arrays(train, test)


def config(algorithm: dict, nonfinite: str | None = None, rounds: int = 2) -> dict:
    train = {"rounds": rounds, "lr": 0.05, "batch_size": None, "local_steps": 60}
    if nonfinite is not None:
        train["nonfinite"] = nonfinite
    return {
        "seed": 0,
        "model": {"name": "logreg"},
        "algorithm": algorithm,
        "train": train,
        "eval": {"every": 1},
        "executor": {"kind": "sequential"},
    }


def test_nonfinite_part_names_what_diverged():
    fine = {"params": {"w": torch.ones(2)}, "classes": {"ids": torch.tensor([0, 1])}}
    assert nonfinite_part(ClientResult(fine, 1.0, 0.5)) is None
    assert nonfinite_part(ClientResult(fine, 1.0, float("nan"))) == "loss nan"
    bad = {"params": {"w": torch.tensor([1.0, float("inf")])}}
    assert nonfinite_part(ClientResult(bad, 1.0, 0.5)) == "upload 'params.w'"
    state = {"params": {"w": torch.tensor([float("nan")])}}
    assert nonfinite_part(ClientResult(fine, 1.0, 0.5, state=state)) == "state 'params.w'"


@pytest.mark.parametrize(
    ("algorithm", "coefficient"),
    [({"name": "fedprox", "mu": 0.01}, "algorithm.mu: 0.01"), ({"name": "fedavg"}, None)],
)
def test_error_names_client_round_algorithm_and_what_to_lower(algorithm, coefficient):
    data = regression_clients([1.0, 1.0, 10.0])
    with pytest.raises(DivergenceError) as err:
        fedloom.run(config(algorithm), data=data, write=False, progress=False)
    message = str(err.value)
    for needle in (
        "client 2 diverged in round 1",
        f"algorithm {algorithm['name']}",
        "train.lr: 0.05",
        "train.local_steps: 60",
        "train.nonfinite: drop",
    ):
        assert needle in message, message
    assert (coefficient in message) if coefficient else "coefficients" not in message


def test_cli_reports_divergence_as_a_config_error(tmp_path):
    """Exit status 2, the message, no traceback: a diverging run is a settings problem."""
    from tests.cli.test_cli import fedloom as cli
    from tests.cli.test_cli import write_config

    path = write_config(
        tmp_path,
        data={"name": "quadratic", "num_clients": 3},
        train={"lr": 10.0, "local_steps": 50, "rounds": 1},
    )
    proc = cli("run", str(path), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "diverged in round 1" in proc.stderr and "Traceback" not in proc.stderr


def test_drop_leaves_the_client_out_and_counts_it():
    """drop: the diverging client is left out of every round (2 rounds, 1 drop each): the global
    model equals the run without that client, and metrics/summary count the drops."""
    data = regression_clients([1.0, 1.0, 10.0])
    result = fedloom.run(config({"name": "fedavg"}, "drop"), data=data, write=False, progress=False)
    alone = fedloom.run(
        config({"name": "fedavg"}), data=data.subset([0, 1]), write=False, progress=False
    )
    for key, value in result.global_params.items():
        assert torch.equal(value, alone.global_params[key]), key
    assert [row["dropped_nonfinite"] for row in result.history] == [1, 2]
    assert [row["reported"] for row in result.history] == [2, 2]
    # the dropped client's upload still crossed the network: 3 uploads a round, as without drops
    sent = [row["communication"]["bytes_up_round"] for row in result.history]
    assert sent == [3 * 4 * 4, 3 * 4 * 4]  # 3 clients x (3 weights + 1 bias) float32
    assert result.summary["dropped_nonfinite"] == 2
    assert alone.summary["dropped_nonfinite"] == 0


def test_dropped_client_keeps_its_previous_personalized_state():
    """A personalized algorithm (pFedMac: the state is omega_k): the diverged omega is not
    stored, so the client is evaluated with a finite model, never a NaN one."""
    data = regression_clients([1.0, 1.0, 10.0])
    result = fedloom.run(
        config({"name": "pfedmac"}, "drop", rounds=3), data=data, write=False, progress=False
    )
    assert result.summary["dropped_nonfinite"] == 3
    for client, params in result.client_params.items():
        for key, value in params.items():
            assert torch.isfinite(value).all(), (client, key)
    personalized = result.history[-1]["personalized"]
    assert all(v == v for k, v in personalized.items() if isinstance(v, float))  # no NaN statistic
