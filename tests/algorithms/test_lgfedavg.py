"""LG-FedAvg (Liang et al., 2020, arXiv:2001.01523): configuration errors, the refusal of a model
without a declared head, and learning on the shared Fashion-MNIST shards setup. What it shares
with FedPer and FedRep (the shared head, the bytes, the server's weighted averages, resume) is
tested in tests/algorithms/test_partial.py."""

from __future__ import annotations

import re

import pytest
import torch

import fedloom
from fedloom.errors import ConfigError
from tests.algorithms.digits_setup import digits_config
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "lgfedavg", "weighting": "size"}, "algorithm.weighting"),
        ({"name": "lgfedavg", "head_steps": 5}, "algorithm.head_steps"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


def test_lgfedavg_refuses_a_model_without_a_declared_head():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with pytest.raises(ConfigError, match=r"algorithm\.name: lgfedavg .* declares no head"):
        fedloom.run(digits_config({"name": "lgfedavg"}), model=model, write=False, progress=False)


@pytest.mark.slow
def test_lgfedavg_beats_fedavg_on_label_shards(data_root):
    # Measured (seed 0): personalized mean 0.9593, P10 0.9155 (local-only training: 0.957);
    # FedAvg's global model on the same clients 0.6215.
    result = run_pfl({"name": "lgfedavg"})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.30, accuracy
