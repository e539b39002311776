"""Learning tests on real data for the horizontal FL family, thresholds measured.

One small but real setup for every test: MNIST label-skewed over 20 clients by Dirichlet(0.1)
(most clients hold mostly one to three digits), all 20 clients in every round (no sampling
noise), multinomial logistic regression, 20 local steps of batch 32 at lr 0.05, 15 rounds. With
20 local steps on so skewed data client drift matters: FedAvg reaches 0.833 global accuracy after
15 rounds, FedSGD (one full-batch step per round) 0.714; chance is 0.1.

Thresholds are "measured minus a margin": each comment gives the final global accuracy for seeds
0 / 1 / 2 (the tests run seed 0; accuracy is deterministic for a fixed seed) and the threshold
sits about 0.02 below the smallest of them: above FedSGD-level progress everywhere and, for
SCAFFOLD, FedDyn and the server optimizers, above FedAvg's 0.833, so an algorithm whose extra
state or server step is broken (or silently reduces to FedAvg) fails.

FedBN is not here: it needs the ``cnn_bn`` model, and 5 rounds of 10 clients x 10 local steps
already took 74 s on the shared 2-core machine.
"""

from __future__ import annotations

from typing import Any

import pytest

import fedloom

pytestmark = pytest.mark.slow

ROUNDS = 15


def config(
    algorithm: dict[str, Any],
    *,
    seed: int = 0,
    eval_every: int = ROUNDS,
    local_steps: int | dict[str, Any] = 20,
    lr: float = 0.05,
) -> dict[str, Any]:
    return {
        "seed": seed,
        "data": {
            "name": "mnist",
            "num_clients": 20,
            "partition": {"kind": "dirichlet", "alpha": 0.1},
        },
        "model": {"name": "logreg"},
        "algorithm": algorithm,
        "train": {
            "rounds": ROUNDS,
            "clients_per_round": 20,
            "local_steps": local_steps,
            "batch_size": 32,
            "lr": lr,
        },
        "eval": {"every": eval_every},
        "checkpoint": {"every": None},
    }


def global_accuracy(result: fedloom.RunResult) -> list[float]:
    """Global accuracy of every evaluated round, in order."""
    return [row["global"]["accuracy"] for row in result.history]


def final_accuracy(algorithm: dict[str, Any], **kwargs: Any) -> float:
    """Global accuracy after the last round (evaluated only there)."""
    result = fedloom.run(config(algorithm, **kwargs), write=False, progress=False)
    return result.summary["final"]["global"]["accuracy"]


def rounds_to_target(accuracy: list[float], target: float) -> int | None:
    """The first round (1-based, eval.every 1) whose global accuracy reaches ``target``."""
    return next((r for r, acc in enumerate(accuracy, start=1) if acc >= target), None)


# -- SCAFFOLD and FedDyn against FedAvg: one run each, evaluated every round --------------------

# SCAFFOLD and FedDyn with the papers' settings (SCAFFOLD option II, server_lr 1; FedDyn
# mu = 0.01 from the paper's grid {0.1, 0.01, 0.001}) except the objective weights: p_k = n_k / n
# (``weighting: samples``), FedAvg's objective, which is also what the global accuracy on the
# pooled test data measures. Same local work (20 steps of batch 32) and lr (0.05) as FedAvg.
DRIFT_CORRECTED = {
    "scaffold": {"name": "scaffold", "weighting": "samples"},
    "feddyn": {"name": "feddyn", "mu": 0.01, "weighting": "samples"},
}


class Curves(dict[str, list[float]]):
    """Global accuracy after each of the 15 rounds (seed 0) by algorithm, run on first use, so
    each test pays only for the runs no earlier test needed."""

    def __missing__(self, name: str) -> list[float]:
        algorithm = DRIFT_CORRECTED.get(name, {"name": name})
        result = fedloom.run(config(algorithm, eval_every=1), write=False, progress=False)
        self[name] = accuracy = global_accuracy(result)
        assert len(accuracy) == ROUNDS
        return accuracy


@pytest.fixture(scope="module")
def curves(data_root) -> Curves:
    return Curves()


def test_fedavg_reference_learns_mnist_dirichlet(curves):
    # Measured final accuracy 0.833 / 0.831 / 0.825: the reference the others must beat.
    assert curves["fedavg"][-1] >= 0.80, curves["fedavg"]


def test_scaffold_learns_mnist_dirichlet(curves):
    # Measured final accuracy 0.863 / 0.867 / 0.868.
    assert curves["scaffold"][-1] >= 0.845, curves["scaffold"]


def test_feddyn_learns_mnist_dirichlet(curves):
    # Measured final accuracy 0.884 / 0.890 / 0.889.
    assert curves["feddyn"][-1] >= 0.865, curves["feddyn"]


# Rounds to reach the target (seeds 0 / 1 / 2; "-": not within the 15 rounds):
#   target 0.80: FedAvg 10 / 10 / 11, SCAFFOLD 5 / 5 / 5, FedDyn 4 / 4 / 4;
#   target 0.83: FedAvg 15 / 15 / -,  SCAFFOLD 7 / 6 / 7, FedDyn 5 / 5 / 5.
# With the papers' uniform weights (p_k = 1/20: their objective, not the one the pooled accuracy
# measures) FedDyn still wins clearly (0.80: 5 / 4 / 3; 0.83: 6 / 5 / 5; final 0.877 / 0.883 /
# 0.887) but SCAFFOLD only narrowly (0.80: 10 / 7 / 5; 0.83: 14 / 9 / 8; final 0.834 / 0.858 /
# 0.862): seed 0 ties FedAvg at 0.80, so that variant is not asserted.
@pytest.mark.parametrize("target", [0.80, 0.83])
@pytest.mark.parametrize("name", sorted(DRIFT_CORRECTED))
def test_drift_correction_beats_fedavg_in_rounds_to_target(curves, name, target):
    fedavg = rounds_to_target(curves["fedavg"], target) or ROUNDS + 1  # not reached: > 15
    rounds = rounds_to_target(curves[name], target)
    assert rounds is not None, f"{name} never reached {target}: {curves[name]}"
    assert rounds < fedavg, (name, target, rounds, fedavg, curves[name], curves["fedavg"])


# -- server optimizers (Reddi et al., 2021; Hsu et al., 2019) -----------------------------------


# Server lr tuned lightly over {0.01, 0.03, 0.1} at the fixed client lr 0.05 (Reddi et al. tune
# both); beta1 0.9, beta2 0.99, tau 1e-3 are the paper's defaults. Seed 0, final accuracy by
# server lr 0.01 / 0.03 / 0.1: FedAdam 0.852 / 0.884 / 0.894, FedYogi 0.851 / 0.884 / 0.894,
# FedAdagrad 0.721 / 0.823 / 0.878. FedAdam / FedYogi use 0.03 (0.1 is a little better here but
# oscillates by +-0.02 between rounds when 10 of the 20 clients are sampled), FedAdagrad 0.1.
# FedAvgM: Hsu et al.'s server_lr 1, beta 0.9 (0.881; beta 0.5: 0.862; server_lr 0.1: 0.762).
# Measured final accuracy for seeds 0 / 1 / 2:
#   fedadam 0.884 / 0.888 / 0.889, fedyogi 0.884 / 0.888 / 0.888,
#   fedadagrad 0.878 / 0.882 / 0.882, fedavgm 0.881 / 0.883 / 0.884.
# All beat FedAvg (0.833 / 0.831 / 0.825), and the thresholds lie above it.
@pytest.mark.parametrize(
    ("algorithm", "threshold"),
    [
        ({"name": "fedadam", "server_lr": 0.03}, 0.86),
        ({"name": "fedyogi", "server_lr": 0.03}, 0.86),
        ({"name": "fedadagrad", "server_lr": 0.1}, 0.855),
        ({"name": "fedavgm", "server_lr": 1.0, "beta": 0.9}, 0.86),
    ],
    ids=lambda v: v["name"] if isinstance(v, dict) else str(v),
)
def test_server_optimizer_learns_mnist_dirichlet(data_root, algorithm, threshold):
    accuracy = final_accuracy(algorithm)
    assert accuracy >= threshold, (algorithm, accuracy)


# -- FedNova: heterogeneous local work -----------------------------------------------------------

# Each client draws its local steps uniformly from 2..50 every round, so FedAvg's implicit
# objective is skewed toward the clients that happen to work more; FedNova normalizes it. With
# equal local steps FedNova (sgd) is FedAvg exactly, hence the heterogeneous work here.
# Measured final accuracy for seeds 0 / 1 / 2:
#   sgd, lr 0.05: 0.858 / 0.846 / 0.843 (FedAvg with the same work: 0.839 / 0.833 / 0.819);
#   momentum rho 0.9, lr 0.01: 0.864 / 0.838 / 0.839 (FedAvg, plain SGD at lr 0.01: 0.791 /
#   0.806 / 0.780).
HETEROGENEOUS_STEPS = {"kind": "uniform", "low": 2, "high": 50}


@pytest.mark.parametrize(
    ("algorithm", "lr", "threshold"),
    [
        ({"name": "fednova", "local_solver": "sgd"}, 0.05, 0.825),
        ({"name": "fednova", "local_solver": "momentum", "rho": 0.9}, 0.01, 0.82),
    ],
    ids=["sgd", "momentum"],
)
def test_fednova_learns_mnist_with_heterogeneous_local_work(data_root, algorithm, lr, threshold):
    accuracy = final_accuracy(algorithm, local_steps=HETEROGENEOUS_STEPS, lr=lr)
    assert accuracy >= threshold, (algorithm, accuracy)
