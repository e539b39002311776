"""Asynchronous aggregation with every mechanism the config lets it combine with (attacks,
upload and download compression): asynchrony is a schedule over the same round pipeline
(engine/pipeline.py), so FedBuff's degenerate case (equal speeds, K = every client in flight)
equals synchronous FedAvg with the same mechanism, communication, mechanism state and all."""

from __future__ import annotations

import pytest
import torch

from fedloom.compression.downloads import DownloadCompression
from fedloom.config import parse_config
from fedloom.data import load_dataset
from fedloom.engine.loop import Engine
from fedloom.errors import ConfigError
from fedloom.models import build_model
from tests.asynchrony.test_aggregation import BASE, max_diff, run, with_

MECHANISMS = {
    "topk_feedback": {"compression": {"kind": "topk", "ratio": 0.2}},
    "qsgd": {"compression": {"kind": "qsgd", "levels": 4}},
    "scale_attack": {"attack": {"kind": "scale", "fraction": 0.25, "scale": 3.0}},
    "gaussian_attack": {"attack": {"kind": "gaussian", "fraction": 0.25}},
    "label_flip": {"attack": {"kind": "label_flip", "fraction": 0.25}},
}


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_fedbuff_degenerate_case_equals_sync_fedavg_under_each_mechanism(name):
    sync = with_(BASE, train={"clients_per_round": 4}, **MECHANISMS[name])
    buffered = with_(sync, asynchrony={"kind": "fedbuff", "buffer": 4})
    a, b = run(sync), run(buffered)
    assert max_diff(a.global_params, b.global_params) < 1e-6
    assert b.summary["communication"] == a.summary["communication"]
    for section in ("compression", "attack"):
        assert a.summary.get(section) == b.summary.get(section)
    for x, y in zip(a.history, b.history, strict=True):
        assert x["global"]["accuracy"] == pytest.approx(y["global"]["accuracy"], abs=1e-6)


def test_fedbuff_adds_updates_from_the_decoded_broadcast_to_the_exact_model():
    """Download compression: a client's update is its model minus the model it decoded, and
    FedBuff adds it to the server's exact model, where FedAvg averages the clients' models: one
    round apart by exactly x - decode(x)."""
    sync = with_(
        BASE,
        train={"clients_per_round": 4, "rounds": 1},
        eval={"every": 1},
        compression={"download": "int8"},
    )
    buffered = with_(sync, asynchrony={"kind": "fedbuff", "buffer": 4})
    a, b = run(sync), run(buffered)
    cfg = parse_config(sync)
    data = load_dataset(cfg.data, cfg.seed)
    engine = Engine(cfg, data, build_model(cfg.model.name, data.input_shape, data.num_outputs))
    x = engine.initial_state().server["params"]
    decoded = DownloadCompression("int8").transmit({"params": x})["params"]
    assert max_diff(x, decoded) > 1e-4  # the broadcast lost something
    expected = {k: a.global_params[k].double() + x[k].double() - decoded[k].double() for k in x}
    for key in x:
        assert torch.allclose(b.global_params[key].double(), expected[key], atol=1e-6), key
    assert b.summary["communication"] == a.summary["communication"]


@pytest.mark.parametrize(
    "section",
    [
        {"privacy": {"kind": "client_dp", "noise_multiplier": 0.5, "clip": 0.5}},
        {"secure_aggregation": {"kind": "secagg"}},
        {"aggregator": {"kind": "median"}},
    ],
)
def test_round_synchronous_mechanisms_are_refused_under_asynchrony(section):
    with pytest.raises(ConfigError, match=r"round-synchronous|asynchrony"):
        parse_config(
            with_(BASE, train={"clients_per_round": 4}, asynchrony={"kind": "fedbuff"}, **section)
        )
