"""executor.kind: auto picks from the workload's shape with a cost model: the same config always
gets the same choice (no timing), so two runs of one config under auto are bitwise equal."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.data.federated import from_arrays
from fedloom.engine import auto
from fedloom.engine.auto import Shape, estimate
from fedloom.engine.loop import Engine
from fedloom.models import build_model
from tests.conftest import metrics_without_time

CLIENTS = 40


def engine(executor: dict, train: dict | None = None, model: str = "logreg") -> Engine:
    g = torch.Generator().manual_seed(0)
    data = from_arrays(
        [(torch.rand(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g))] * CLIENTS,
        [(torch.rand(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g))] * CLIENTS,
    )
    cfg = parse_config(
        {
            "model": {"name": model},
            "train": train or {"rounds": 1, "batch_size": 5, "local_epochs": 1},
            "executor": executor,
        }
    )
    e = Engine(cfg, data, build_model(model, data.input_shape, data.num_outputs))
    e.executor.prepare(dict(enumerate(data.clients)))
    return e


def first_round(e: Engine) -> None:
    st = e.initial_state()
    tasks = e.tasks_for_round(1, e.train_ids)
    message = e.algorithm.server_message(st.server)
    e.executor.run_round(e.algorithm, message, tasks, [None] * len(tasks))


def shape(**changes: float) -> Shape:
    base = {
        "clients": 10,
        "steps": 48,
        "updates": 1,
        "batch": 10,
        "params": 199_210,
        "macs": 199_000,
        "conv": False,
        "stacked": True,
    }
    return Shape(**{**base, **changes})  # type: ignore[arg-type]


def test_candidates_are_both_thread_counts_and_one_process_per_core(monkeypatch):
    monkeypatch.setattr(auto, "usable_cores", lambda: 4)
    ex = engine({"kind": "auto"}).executor
    small, big = shape(), shape(batch=32, macs=12_000_000, conv=True)
    try:
        assert ex._candidates(small) == [
            ("sequential", 1),  # a small step does not gain from threads: 1 thread only
            ("vectorized", 1),
            ("vectorized", 4),
            ("processes=4", 1),
            ("vectorized-processes=4", 1),
        ]
        assert ex._candidates(big)[:2] == [("sequential", 1), ("sequential", 4)]
    finally:
        ex.close()
    pinned = engine({"kind": "auto", "threads": 2}).executor
    try:
        assert [t for _, t in pinned._candidates(big)] == [2, 2, 1, 1]
    finally:
        pinned.close()


def test_the_cost_model_prefers_stacking_for_small_steps_and_processes_for_large_ones():
    """The FedAvg paper's B = 10 2NN clients run stacked; the FedAvg CNN at B = 32 on 28x28
    images (about 400M multiply-accumulates a step) runs one client per core."""
    small = shape()
    stacked = min(estimate("vectorized", t, small, 10) for t in (1, 2))
    assert stacked < estimate("sequential", 1, small, 10)
    assert stacked < estimate("processes=2", 1, small, 10)
    # ten clients' small batched step does not gain from a second thread; a thousand's does
    assert estimate("vectorized", 1, small, 10) < estimate("vectorized", 2, small, 10)
    many = shape(clients=1000, steps=6, params=7850, macs=7840)
    assert estimate("vectorized", 2, many, 1000) < estimate("vectorized", 1, many, 1000)
    cnn = shape(batch=32, macs=12_000_000, conv=True, params=1_663_370, steps=19)
    assert estimate("processes=2", 1, cnn, 10) < estimate("vectorized", 2, cnn, 10)
    assert estimate("processes=2", 1, cnn, 10) < estimate("sequential", 1, cnn, 10)
    # under vmap a batched step costs more than stacked, all else equal
    vmapped = shape(stacked=False)
    assert estimate("vectorized", 1, vmapped, 10) > estimate("vectorized", 1, small, 10)


def test_the_choice_is_a_function_of_the_config(monkeypatch):
    """No timing: the choice and the estimates are the same for two engines of one config,
    also when the clock is erratic."""
    choices = []
    for jitter in (0.0, 5.0):
        ticks = iter(range(10**6))
        monkeypatch.setattr("time.perf_counter", lambda j=jitter, t=ticks: next(t) * (1 + j))
        e = engine({"kind": "auto"})
        try:
            first_round(e)
            choices.append((e.executor.choice, dict(e.executor.estimates)))
        finally:
            e.executor.close()
    assert choices[0] == choices[1]
    assert choices[0][0] in choices[0][1]
    assert choices[0][1][choices[0][0]] == min(choices[0][1].values())


def test_auto_runs_its_choice_at_its_thread_count(monkeypatch):
    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    e = engine({"kind": "auto"})
    ex = e.executor
    seen: list[int] = []
    inner = ex.vectorized.run_round

    def spy(*args):
        seen.append(torch.get_num_threads())
        return inner(*args)

    monkeypatch.setattr(ex.vectorized, "run_round", spy)
    monkeypatch.setattr(ex, "choose", lambda *args: "vectorized/threads=2")
    before = torch.get_num_threads()
    try:
        first_round(e)
    finally:
        ex.close()
    assert seen == [2] and torch.get_num_threads() == before
    assert ex.pools == {}  # not chosen: no worker process was ever started


def digits(executor: dict) -> dict:
    return {
        "seed": 3,
        "data": {
            "name": "digits",
            "num_clients": 12,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg_ft", "finetune_steps": 3},
        "train": {"rounds": 3, "clients_per_round": 5, "batch_size": 10, "lr": 0.05},
        "eval": {"every": 1},
        "executor": executor,
    }


def test_two_runs_of_one_config_under_auto_are_bitwise_equal():
    a = fedloom.run(digits({"kind": "auto"}), write=False, progress=False)
    b = fedloom.run(digits({"kind": "auto"}), write=False, progress=False)
    assert a.summary["executor_choice"] == b.summary["executor_choice"]
    assert metrics_without_time(a.history) == metrics_without_time(b.history)
    assert a.global_params is not None and b.global_params is not None
    for key, value in a.global_params.items():
        assert torch.equal(value, b.global_params[key]), key
    for cid, params in a.client_params.items():
        for key, value in params.items():
            assert torch.equal(value, b.client_params[cid][key]), (cid, key)


FIXED = {
    "sequential/threads=1": {"kind": "sequential", "threads": 1},
    "vectorized/threads=2": {"kind": "vectorized", "threads": 2},
    "vectorized-processes=2/threads=1": {"kind": "vectorized", "workers": 2, "threads": 1},
    # a choice stored by a run on another core count (resume): its own worker count
    "processes=3/threads=1": {"kind": "sequential", "workers": 3, "threads": 1},
}


@pytest.mark.parametrize("choice", list(FIXED))
def test_auto_equals_the_fixed_executor_it_picked(monkeypatch, choice):
    """Whatever auto picks, its run is that executor's run, bit for bit."""
    monkeypatch.setattr(auto.AutoExecutor, "choose", lambda self, *args: choice)
    a = fedloom.run(digits({"kind": "auto"}), write=False, progress=False)
    b = fedloom.run(digits(FIXED[choice]), write=False, progress=False)
    assert a.summary["executor_choice"] == choice
    assert metrics_without_time(a.history) == metrics_without_time(b.history)
    for key, value in (a.global_params or {}).items():
        assert torch.equal(value, (b.global_params or {})[key]), key
