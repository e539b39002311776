"""Client-level DP with noise 0, a bound no update reaches and fixed-size sampling is FedAvg
(McMahan et al., ICLR 2018, arXiv:1710.06963, Algorithm 1: with sigma 0, every update within
S and m = qN clients of equal size, theta + sum_k Delta_k / (qN) is the uniform model average).

Both servers sum the uploads in float64 and cast once, so the releases agree to float32
round-off: the two float64 formulas (theta + sum_k Delta_k / m, sum_k w_k theta_k) can round an
exact float32 tie differently, one unit in the last place (1.5% of a 2NN's weights in one
round; measured here: bit for bit on this problem). Before, an update within the bound was
recomputed as anchor + (params - anchor) * 1 in float32, which moved a client's model by a
unit wherever that round trip is not exact (privacy/client_dp.py, ``clip_update``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fedloom

ROUND_OFF = 1e-7
"""About one float32 unit in the last place of these parameters (|w| <= 2.2)."""


def quadratic_run(rounds: int, executor: str, private: bool) -> dict[str, torch.Tensor]:
    """20 least-squares clients of equal size, 10 a round, 5 local steps: the final model."""
    config: dict[str, Any] = {
        "seed": 3,
        "data": {"name": "quadratic", "num_clients": 20},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "clients_per_round": 10, "local_steps": 5, "lr": 0.02},
        "eval": {"every": rounds},
        "checkpoint": {"every": None},
        "monitor": {"enabled": False},
        "executor": {"kind": executor},
    }
    if private:
        config["privacy"] = {
            "kind": "client_dp",
            "noise_multiplier": 0.0,
            "clip": 1e6,
            "sampling": "fixed",
        }
    return fedloom.run(config, write=False, progress=False).global_params


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("rounds", [5, 50])
def test_noise_zero_and_an_unreached_bound_release_fedavgs_model(rounds, executor):
    private = quadratic_run(rounds, executor, private=True)
    plain = quadratic_run(rounds, executor, private=False)
    assert set(private) == set(plain)
    for key, value in plain.items():
        gap = float((private[key].double() - value.double()).abs().max())
        assert gap <= ROUND_OFF, f"{key}: {gap:.2e} apart after {rounds} rounds"


def test_an_update_within_the_bound_is_uploaded_as_it_came():
    """No float32 round trip anchor + (params - anchor): values where it changes the bits."""
    from fedloom.privacy.client_dp import clip_update

    anchor = {"w": torch.tensor([1.0e-3, 3.0, -7.25], dtype=torch.float32)}
    params = {"w": torch.tensor([1.1, 3.0 + 2.0**-20, 1.0e-4], dtype=torch.float32)}
    roundtrip = anchor["w"] + (params["w"] - anchor["w"]) * 1.0
    assert not torch.equal(roundtrip, params["w"])  # the old computation moved them
    assert torch.equal(clip_update(params, anchor, bound=100.0)["w"], params["w"])
