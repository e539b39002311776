"""FedAsync and FedBuff in the engine (engine/asynchrony.py) against oracles: synchronous FedAvg
in FedBuff's degenerate case, the papers' server rules on a hand-worked timeline, sequential
application for FedAsync with alpha = 1; determinism, executors, resume and the sync clock."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.algorithms.client import client_program
from fedloom.config import asynchronous_algorithms, parse_config
from fedloom.core.protocol import Message
from fedloom.data import load_dataset
from fedloom.engine.clock import staleness_weight
from fedloom.engine.loop import Engine
from fedloom.engine.nonfinite import DivergenceError
from fedloom.engine.sampling import sample_clients
from fedloom.models import build_model
from fedloom.solvers.sequential import run_client
from tests.conftest import metrics_without_time
from tests.resume import killed_and_resumed

BASE = {
    "seed": 3,
    "data": {"name": "digits", "num_clients": 8, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 6, "local_steps": 5, "batch_size": 16, "lr": 0.05},
    "eval": {"every": 2},
    "checkpoint": {"every": 2},
    "executor": {"kind": "sequential"},
}


def with_(config: dict, **sections: dict) -> dict:
    out = dict(config)
    for key, value in sections.items():
        out[key] = {**config.get(key, {}), **value}
    return out


def run(config: dict) -> fedloom.RunResult:
    return fedloom.run(config, write=False, progress=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize(
    ("per_round", "algorithm"),
    [(None, {"name": "fedavg"}), (4, {"name": "fedavg"}), (None, {"name": "fedprox", "mu": 0.1})],
)
def test_fedbuff_with_equal_speeds_and_a_full_buffer_is_fedavg(per_round, algorithm):
    """Issue #20: equal speeds and K = every client in flight: one server step per wave of
    clients, all fresh, averaged with FedAvg's weights; with clients_per_round the waves
    are the same sampled clients as the synchronous rounds'."""
    sync = with_(BASE, train={"clients_per_round": per_round}, algorithm=algorithm)
    buffered = with_(sync, asynchrony={"kind": "fedbuff", "buffer": per_round or 8})
    a, b = run(sync), run(buffered)
    assert max_diff(a.global_params, b.global_params) < 1e-6
    assert len(a.history) == len(b.history) == 3
    for x, y in zip(a.history, b.history, strict=True):
        assert x["round"] == y["round"]
        assert x["global"]["accuracy"] == pytest.approx(y["global"]["accuracy"], abs=1e-6)
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-6)
        assert y["asynchrony"]["staleness_max"] == 0
        assert y["clock"] == 5.0 * y["round"]  # 5 steps of unit time per wave
    assert b.summary["communication"] == a.summary["communication"]


def oracle_setup(asynchrony: dict):
    """Two clients with per-step times 1 and 2.5, both in flight, 4 local steps each:
    arrivals (time, client, dispatch event, version sent) are, by hand,
    t=4 (0, e1, v0) -> step 1; t=8 (0, e2, v1) -> step 2; t=10 (1, e1, v0) -> step 3
    (staleness 2); t=12 (0, e3, v2) -> step 4 (staleness 1)."""
    config = with_(
        BASE,
        data={"num_clients": 2},
        model={"name": "logreg"},
        train={"rounds": 4, "local_steps": 4},
        eval={"every": 1},
        asynchrony={"speeds": {"kind": "per_client", "values": [1.0, 2.5]}, **asynchrony},
    )
    cfg = parse_config(config)
    data = load_dataset(cfg.data, cfg.seed)
    engine = Engine(cfg, data, build_model(cfg.model.name, data.input_shape, data.num_outputs))
    x0 = engine.initial_state().server

    def trained(server: dict, client: int, event: int) -> Message:
        task = engine.tasks_for_round(event, [client])[0]
        message = engine.algorithm.server_message(server, event)
        return run_client(client_program(engine.algorithm), message, None, task).upload

    timeline = [(0, 1, 0, 0), (0, 2, 1, 0), (1, 1, 0, 2), (0, 3, 2, 1)]
    return config, x0, trained, timeline


@pytest.mark.parametrize("kind", ["fedbuff", "fedasync"])
def test_server_rules_on_a_hand_worked_timeline(kind):
    """FedBuff (K = 1): x <- x + eta_g s(d) (x_k - x_tau); FedAsync: x <- (1 - alpha s(d)) x
    + alpha s(d) x_k, with s(d) = (d + 1)^-0.5, computed here in float64 from each client's
    own update on the model version it was sent."""
    eta, alpha = 0.7, 0.6
    config, x0, trained, timeline = oracle_setup(
        {"kind": kind, "buffer": 1, "server_lr": eta, "alpha": alpha, "staleness": "polynomial"}
    )
    versions = [x0]  # the server's model after each step
    for client, event, sent, staleness in timeline:
        start = versions[sent]
        model = trained(start, client, event)["params"]
        s = staleness_weight("polynomial", staleness, 0.5, 4.0)
        x = versions[-1]["params"]
        if kind == "fedbuff":
            new = {
                k: x[k].double() + eta * s * (model[k].double() - start["params"][k].double())
                for k in x
            }
        else:
            new = {k: (1 - alpha * s) * x[k].double() + alpha * s * model[k].double() for k in x}
        versions.append({"params": {k: v.float() for k, v in new.items()}, "buffers": {}})
    result = run(config)
    assert max_diff(result.global_params, versions[-1]["params"]) < 1e-6
    clocks = [row["clock"] for row in result.history]
    assert clocks == [4.0, 8.0, 10.0, 12.0]
    assert [row["asynchrony"]["staleness_max"] for row in result.history] == [0, 0, 2, 1]
    assert result.summary["asynchrony"]["staleness_mean"] == pytest.approx(3 / 4)


def test_fedasync_with_alpha_one_and_one_client_at_a_time_is_sequential_sgd():
    """Concurrency 1, alpha = 1: every update is fresh and replaces the model: client after
    client, each from the previous one's model (bitwise)."""
    config = with_(
        BASE,
        asynchrony={
            "kind": "fedasync",
            "alpha": 1.0,
            "concurrency": 1,
            "speeds": {"kind": "lognormal"},
        },
    )
    cfg = parse_config(config)
    data = load_dataset(cfg.data, cfg.seed)
    engine = Engine(cfg, data, build_model(cfg.model.name, data.input_shape, data.num_outputs))
    server = engine.initial_state().server
    for event in range(1, cfg.train.rounds + 1):
        (client,) = sample_clients(cfg.seed, event, list(range(8)), 1)
        task = engine.tasks_for_round(event, [client])[0]
        upload = run_client(
            client_program(engine.algorithm),
            engine.algorithm.server_message(server, event),
            None,
            task,
        ).upload
        server = {"params": upload["params"], "buffers": upload["buffers"]}
    result = run(config)
    for key, value in server["params"].items():
        assert torch.equal(result.global_params[key], value), key
    assert all(row["asynchrony"]["staleness_max"] == 0 for row in result.history)


ASYNC = with_(
    BASE,
    train={"clients_per_round": 4},
    asynchrony={"kind": "fedbuff", "buffer": 2, "speeds": {"kind": "lognormal", "jitter": 0.2}},
)


def test_same_config_same_run_and_seed_changes_it():
    a, b = run(ASYNC), run(ASYNC)
    assert metrics_without_time(a.history) == metrics_without_time(b.history)
    for key in a.global_params:
        assert torch.equal(a.global_params[key], b.global_params[key])
    c = run({**ASYNC, "seed": 4})
    assert [r["clock"] for r in c.history] != [r["clock"] for r in a.history]


@pytest.mark.parametrize("kind", ["fedbuff", "fedasync"])
def test_sequential_and_vectorized_executors_agree(kind):
    config = with_(ASYNC, asynchrony={"kind": kind})
    a = run(config)
    b = run(with_(config, executor={"kind": "vectorized"}))
    assert max_diff(a.global_params, b.global_params) < 1e-4
    assert [r["clock"] for r in a.history] == [r["clock"] for r in b.history]
    for x, y in zip(a.history, b.history, strict=True):
        assert x["global"]["accuracy"] == pytest.approx(y["global"]["accuracy"], abs=1e-3)


@pytest.mark.parametrize(
    ("asynchrony", "crash"),
    [
        ({"kind": "fedbuff"}, 5),
        ({"kind": "fedasync", "staleness": "hinge", "a": 1.0, "b": 1.0}, 5),
        ({"kind": "none", "speeds": {"kind": "stragglers"}}, 5),
    ],
    ids=["fedbuff", "fedasync", "sync"],
)
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, asynchrony, crash):
    """The clock, the clients in flight (trained, not yet arrived) and the buffer are saved;
    with FedAvgM's server momentum as the server step."""
    config = with_(ASYNC, asynchrony=asynchrony, algorithm={"name": "fedavgm"})
    _, resumed, saved = killed_and_resumed(config, tmp_path, crash_round=crash)
    assert saved["round"] in (2, 4)
    assert saved["asynchrony"]["clock"] > 0
    if asynchrony["kind"] != "none":
        assert saved["asynchrony"]["in_flight"]  # clients in flight were saved and resumed
    assert resumed.summary["clock"] == resumed.history[-1]["clock"]


def test_synchronous_rounds_last_as_long_as_the_slowest_client():
    values = [1.0, 2.0, 3.0, 1.5, 1.0, 1.0, 1.0, 6.0]
    config = with_(
        BASE,
        train={"clients_per_round": 3},
        asynchrony={"speeds": {"kind": "per_client", "values": values}},
    )
    result = run(config)
    expected, clock = [], 0.0
    for rnd in range(1, 7):
        clock += 5 * max(values[c] for c in sample_clients(3, rnd, list(range(8)), 3))
        expected.append(clock)
    assert [row["clock"] for row in result.history] == expected[1::2]
    assert result.summary["clock"] == expected[-1]
    plain = run(with_(config, asynchrony={"speeds": None}))
    assert "clock" not in plain.history[-1]
    assert max_diff(plain.global_params, result.global_params) == 0.0  # the clock only watches


def test_report_plots_accuracy_against_the_clock(tmp_path):
    run_dir = tmp_path / "run"
    fedloom.run(with_(ASYNC, train={"rounds": 2}), out=run_dir, progress=False)
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    assert '<div id="fig-clock"' in html
    assert "Accuracy against virtual time" in html


def test_a_server_that_only_receives_diverged_updates_stops_with_a_clear_error():
    with pytest.raises(DivergenceError, match="non-finite"):
        run(with_(ASYNC, train={"lr": 1e9, "nonfinite": "drop"}))


NEEDS_A_BODY = {"moon"}
"""Algorithms that read the representation before the head: run on the mlp, not logreg."""


@pytest.mark.parametrize("name", asynchronous_algorithms())
@pytest.mark.parametrize("kind", ["fedasync", "fedbuff"])
def test_every_supported_algorithm_takes_asynchronous_steps(name, kind):
    config = with_(
        ASYNC,
        algorithm={"name": name},
        model={"name": "mlp" if name in NEEDS_A_BODY else "logreg"},
        train={"rounds": 2, "local_steps": 2},
        eval={"every": 2},
        asynchrony={"kind": kind},
    )
    result = run(config)
    (row,) = result.history
    assert result.summary["asynchrony"]["updates"] == (2 if kind == "fedasync" else 4)
    assert row["clock"] > 0 and 0 <= row["global"]["accuracy"] <= 1


def test_compressed_uploads_are_counted_as_encoded_in_asynchronous_rounds():
    """compression with FedBuff: same number of server steps and updates as the dense run,
    top-k's encoded bytes up, and the same FedBuff == FedAvg structure otherwise."""
    buffered = with_(BASE, asynchrony={"kind": "fedbuff", "buffer": 4})
    sparse = with_(buffered, compression={"kind": "topk", "ratio": 0.1})
    dense, compressed = run(buffered), run(sparse)
    assert [r["round"] for r in dense.history] == [r["round"] for r in compressed.history]
    up_dense = dense.summary["communication"]["bytes_up"]
    up_sparse = compressed.summary["communication"]["bytes_up"]
    assert 0 < up_sparse < 0.25 * up_dense  # 10% of the values plus their int32 indices
    assert max_diff(dense.global_params, compressed.global_params) > 1e-4
