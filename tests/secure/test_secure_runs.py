"""Secure aggregation inside runs: every protocol against plain FedAvg over the same survivors,
dropouts, aborted rounds, client-level DP on top, executors, resume, config errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.engine.dropout import dropouts, uploads
from fedloom.errors import ConfigError
from tests.engine.test_executor_equivalence import assert_same
from tests.resume import killed_and_resumed


def config(secure: dict[str, Any] | None = None, **train: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "seed": 3,
        "data": {"name": "digits", "num_clients": 12, "partition": {"kind": "iid"}},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": 3,
            "clients_per_round": 10,
            "local_epochs": 1,
            "batch_size": 16,
            "lr": 0.05,
            **train,
        },
        "eval": {"every": 1},
        "executor": {"kind": "sequential"},
    }
    if secure is not None:
        cfg["secure_aggregation"] = secure
    return cfg


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def quantization_bound(clip: float, bits: int, clients: int, rounds: int) -> float:
    """Per coordinate and round, each client's value is off by at most one quantization step
    2c/(2^b - 1) (in the weighted update and its weight); over rounds the errors add."""
    return rounds * 4 * clients * 2 * clip / (2**bits - 1)


@pytest.mark.parametrize("dropout", [0.1, 0.3])
@pytest.mark.parametrize("kind", ["secagg", "secagg_plus"])
def test_secagg_fedavg_equals_plain_fedavg_over_the_survivors(kind, dropout):
    plain = fedloom.run(config(dropout=dropout), write=False, progress=False)
    secure = fedloom.run(config({"kind": kind}, dropout=dropout), write=False, progress=False)
    summary = secure.summary["secure_aggregation"]
    assert summary["rounds_completed"] == 3 and summary["rounds_aborted"] == 0
    assert (
        0
        < max_diff(secure.global_params, plain.global_params)
        <= quantization_bound(8.0, 22, 10, 3)
    )
    assert secure.summary["communication"]["bytes_up"] == summary["bytes_up"]


def test_the_same_clients_drop_at_the_same_stages_in_every_protocol():
    clients = list(range(40))
    drawn = dropouts(5, 7, clients, 0.3)
    assert len(drawn) == 12 and drawn == dropouts(5, 7, clients, 0.3)
    assert {"keys", "shares", "unmask"} >= set(drawn.values())
    assert uploads(None) and uploads("unmask") and not uploads("keys") and not uploads("shares")
    assert dropouts(5, 7, clients, 0.0) == {}


@pytest.mark.parametrize(
    ("secure", "tolerance"),
    [({"kind": "paillier", "key_bits": 1024}, 4 * 2.0**-16), ({"kind": "ckks"}, 1e-6)],
)
def test_encrypted_fedavg_equals_plain_fedavg(secure, tolerance):
    plain = fedloom.run(config(dropout=0.2), write=False, progress=False)
    encrypted = fedloom.run(config(secure, dropout=0.2), write=False, progress=False)
    assert max_diff(encrypted.global_params, plain.global_params) <= 3 * tolerance
    assert encrypted.summary["secure_aggregation"]["rounds_completed"] == 3


def test_a_round_below_threshold_aborts_and_leaves_the_model_unchanged():
    """Threshold 9 of 10 with 30% dropout: every round has fewer than 9 survivors after
    ShareKeys, so every round aborts: no output, the model stays the initial one."""
    result = fedloom.run(
        config({"kind": "secagg", "threshold": 9}, dropout=0.3), write=False, progress=False
    )
    summary = result.summary["secure_aggregation"]
    assert summary["rounds_aborted"] == 3 and summary["rounds_completed"] == 0
    untrained = fedloom.run(config(rounds=1, lr=1e-12), write=False, progress=False)
    assert max_diff(result.global_params, untrained.global_params) < 1e-9
    assert result.history[-1]["secure_aggregation"]["last"]["aborted"]


def test_client_level_dp_over_secure_aggregation_equals_it_in_the_clear():
    """client_dp sums the clipped updates through SecAgg+; the release equals the clear sum's
    up to quantization (the same noise is added)."""
    privacy = {"kind": "client_dp", "noise_multiplier": 0.5, "clip": 0.5, "sampling": "fixed"}
    clear = fedloom.run({**config(), "privacy": privacy}, write=False, progress=False)
    secure = fedloom.run(
        {**config({"kind": "secagg_plus"}), "privacy": privacy}, write=False, progress=False
    )
    assert max_diff(secure.global_params, clear.global_params) <= quantization_bound(8.0, 22, 10, 3)
    assert secure.summary["privacy"]["epsilon"] == clear.summary["privacy"]["epsilon"]


def test_executors_give_the_same_secure_run():
    cfg = config({"kind": "secagg_plus"}, dropout=0.2)
    seq = fedloom.run(cfg, write=False, progress=False)
    vec = fedloom.run(
        {**cfg, "executor": {"kind": "vectorized", "chunk_size": 4}}, write=False, progress=False
    )
    assert_same(seq, vec)


def test_a_secure_run_resumes_bit_for_bit(tmp_path):
    cfg = config({"kind": "secagg"}, rounds=4, dropout=0.2)
    cfg["checkpoint"] = {"every": 1}
    killed_and_resumed(cfg, tmp_path, crash_round=3)


@pytest.mark.parametrize(
    ("secure", "algorithm", "message"),
    [
        ({"kind": "secagg"}, "scaffold", "averages the clients' models"),
        ({"kind": "secagg", "key_bits": 1024}, "fedavg", "key_bits applies to kind paillier"),
        ({"kind": "secagg_plus", "neighbours": 5}, "fedavg", "neighbours must be even"),
        ({"kind": "paillier", "bits": 16}, "fedavg", "bits applies to kind"),
    ],
)
def test_settings_it_cannot_honour_are_config_errors(secure, algorithm, message):
    cfg = config(secure)
    cfg["algorithm"] = {"name": algorithm}
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg)


def test_models_with_buffers_are_refused():
    cfg = config({"kind": "secagg"})
    cfg["model"] = {"name": "cnn_bn"}
    with pytest.raises(ConfigError, match="buffers"):
        fedloom.run(cfg, write=False, progress=False)


def test_quantization_that_overflows_the_modulus_is_refused_before_training():
    cfg = config({"kind": "secagg", "bits": 30, "max_clients": 8})
    with pytest.raises(Exception, match=r"2\^32|overflow|capacity"):
        fedloom.run(cfg, write=False, progress=False)


def test_paillier_fedavg_converges_like_fedavg():
    """5 rounds of FedAvg on MNIST (300 clients, 5 a round, logistic regression), 1024-bit
    Paillier against the clear: test accuracy within 0.5 points."""
    cfg = config()
    cfg["data"] = {"name": "mnist", "num_clients": 300, "partition": {"kind": "iid"}}
    cfg["train"].update(rounds=5, clients_per_round=5, batch_size=32)
    cfg["eval"] = {"every": 5}
    plain = fedloom.run(cfg, write=False, progress=False)
    encrypted = fedloom.run(
        {**cfg, "secure_aggregation": {"kind": "paillier", "key_bits": 1024}},
        write=False,
        progress=False,
    )
    a = plain.summary["final"]["global"]["accuracy"]
    b = encrypted.summary["final"]["global"]["accuracy"]
    assert a > 0.5 and math.isclose(a, b, abs_tol=0.005)
