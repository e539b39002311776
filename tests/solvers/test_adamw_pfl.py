"""``train.optimizer: adamw`` for the personalization algorithms with local steps of their own
(algorithms/local_optimizer.py, docs/optimizers.md): APFL, pFedMe, Per-FedAvg, pFedMac,
FedCR's stochastic program and FedRep run with AdamW identically on the sequential and vectorized
backends (1e-4); AdamW changes the run (vs SGD at the same lr); moments kept in the client
state (``moments: client``) change the run and survive a resume (Per-FedAvg, which keeps no
client state, refuses them: tests/solvers/test_adamw.py)."""

from __future__ import annotations

import pytest

import fedloom
from tests.engine.test_executor_equivalence import assert_same
from tests.resume import killed_and_resumed

ADAMW = {"kind": "adamw", "weight_decay": 0.05}

HYPER = {
    "apfl": {"adaptive_alpha": True},
    "pfedme": {"inner_steps": 2, "inner_lr": 0.003, "lam": 5.0},
    "perfedavg": {"variant": "hf"},
    "pfedmac": {"inner_steps": 2, "lam": 0.01, "gamma": 0.001},
    "fedcr": {"num_samples": 2, "beta": 0.001},
    "fedrep": {"head_epochs": 2},
}
"""Options that make each algorithm's steps the interesting ones: APFL's adaptive alpha,
two AdamW inner steps per local step (pFedMe, pFedMac with its soft threshold), Per-FedAvg's
Hessian-free meta-gradient, FedCR's stochastic representation with the KL term, FedRep's two
phases (the head's on the frozen body's features, algorithms/frozen_body.py, stacked over a
chunk on the vectorized backend)."""


def config(algorithm: str, executor: str, rounds: int = 2, **optimizer) -> dict:
    """Digits, 6 clients of Dirichlet(0.5) sizes, 4 a round, the MLP, at most 6 local steps of
    16 samples, stragglers (fewer steps for some clients)."""
    return {
        "seed": 7,
        "data": {
            "name": "digits",
            "num_clients": 6,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": algorithm, **HYPER[algorithm]},
        "train": {
            "rounds": rounds,
            "clients_per_round": 4,
            "local_steps": 6,
            "batch_size": 16,
            "lr": 0.003,
            "stragglers": 0.3,
            "optimizer": {**ADAMW, **optimizer},
        },
        "eval": {"every": 1},
        "executor": {"kind": executor, **({"chunk_size": 3} if executor == "vectorized" else {})},
    }


def run(cfg: dict) -> fedloom.RunResult:
    return fedloom.run(cfg, write=False, progress=False)


@pytest.mark.parametrize("algorithm", list(HYPER))
def test_sequential_equals_vectorized_with_adamw(algorithm):
    assert_same(run(config(algorithm, "sequential")), run(config(algorithm, "vectorized")))


@pytest.mark.parametrize("algorithm", list(HYPER))
def test_adamw_changes_the_run(algorithm):
    """The same run with SGD's steps at the same lr ends elsewhere: AdamW's steps are taken."""
    adamw = run(config(algorithm, "sequential", rounds=1))
    sgd = config(algorithm, "sequential", rounds=1)
    sgd["train"]["optimizer"] = "sgd"
    plain = run(sgd)
    assert abs(adamw.history[-1]["train_loss"] - plain.history[-1]["train_loss"]) > 0.01


@pytest.mark.parametrize("algorithm", ["apfl", "pfedme", "pfedmac", "fedcr"])
def test_kept_moments_sequential_equals_vectorized(algorithm):
    seq = run(config(algorithm, "sequential", moments="client"))
    assert_same(seq, run(config(algorithm, "vectorized", moments="client")))
    per_round = run(config(algorithm, "sequential"))
    assert seq.history[-1]["train_loss"] != per_round.history[-1]["train_loss"]


def test_kept_moments_survive_a_resume(tmp_path):
    cfg = config("apfl", "sequential", rounds=4, moments="client")
    cfg["train"]["clients_per_round"] = 2  # clients that sit out rounds keep their moments
    cfg["checkpoint"] = {"every": 2}
    killed_and_resumed(cfg, tmp_path, crash_round=3)
