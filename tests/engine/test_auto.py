"""executor.kind: auto probes every candidate the way the round will run it and estimates the
round's cost per client from a short and a longer plan."""

from __future__ import annotations

import pytest
import torch

from fedloom.config import parse_config
from fedloom.data.federated import from_arrays
from fedloom.engine import auto
from fedloom.engine.loop import Engine
from fedloom.models import build_model

CLIENTS = 40


def engine(executor: dict, train: dict | None = None) -> Engine:
    g = torch.Generator().manual_seed(0)
    data = from_arrays(
        [(torch.rand(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g))] * CLIENTS,
        [(torch.rand(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g))] * CLIENTS,
    )
    cfg = parse_config(
        {
            "model": {"name": "logreg"},
            "train": train or {"rounds": 1, "batch_size": 5, "local_epochs": 1},
            "executor": executor,
        }
    )
    e = Engine(cfg, data, build_model("logreg", data.input_shape, data.num_outputs))
    e.executor.prepare(dict(enumerate(data.clients)))
    return e


def first_round(e: Engine) -> None:
    st = e.initial_state()
    tasks = e.tasks_for_round(1, e.train_ids)
    message = e.algorithm.server_message(st.server)
    e.executor.run_round(e.algorithm, message, tasks, [None] * len(tasks))


def test_candidates_are_both_thread_counts_and_one_process_per_core(monkeypatch):
    monkeypatch.setattr(auto.os, "cpu_count", lambda: 4)
    ex = engine({"kind": "auto"}).executor
    try:
        assert ex._candidates() == [
            ("sequential", 1),
            ("sequential", 4),
            ("vectorized", 1),
            ("vectorized", 4),
            ("processes=4", 1),
        ]
    finally:
        ex.close()
    pinned = engine({"kind": "auto", "threads": 2}).executor
    try:
        assert [t for _, t in pinned._candidates()] == [2, 2, 1]
    finally:
        pinned.close()


def test_vectorized_probe_runs_a_whole_chunk_and_the_others_a_few_clients(monkeypatch):
    e = engine({"kind": "auto", "chunk_size": 25})
    ex = e.executor
    sizes: dict[str, list[tuple[int, int]]] = {"sequential": [], "vectorized": []}

    def spy(kind: str):
        inner = ex._executor(kind).run_round

        def run_round(algorithm, message, tasks, states):
            sizes[kind].append((len(tasks), max(len(t.plan) for t in tasks)))
            return inner(algorithm, message, tasks, states)

        return run_round

    for kind in sizes:
        monkeypatch.setattr(ex._executor(kind), "run_round", spy(kind))
    try:
        first_round(e)
    finally:
        ex.close()
    assert {n for n, _ in sizes["sequential"][:-1]} <= {auto.PROBE_CLIENTS}
    assert {n for n, _ in sizes["vectorized"]} >= {auto.PROBE_CLIENTS, 25}
    assert {k for _, k in sizes["vectorized"]} >= {1, auto.PROBE_STEPS}
    assert set(ex.timings) == {f"{k}/threads={t}" for k, t in ex._candidates()}
    assert all(v > 0 for v in ex.timings.values())


@pytest.mark.parametrize(
    "once, per_step, local_steps",
    [(1.0, 0.0, None), (0.0, 1.0, None), (0.5, 0.25, None), (0.5, 0.25, 1)],
)
def test_estimate_separates_per_client_and_per_step_cost(monkeypatch, once, per_step, local_steps):
    """With a fake clock that charges ``once`` per client and ``per_step`` per step, every
    candidate's estimate is once + per_step * (the round's mean number of steps), also when
    every plan is a single step (FedSGD: nothing to fit, the one-step timing is the answer)."""
    train = {"rounds": 1, "batch_size": 5, "local_epochs": 1}
    if local_steps:
        train = {"rounds": 1, "batch_size": 5, "local_steps": local_steps}
    e = engine({"kind": "auto", "workers": 1}, train)
    ex = e.executor
    clock = [0.0]
    monkeypatch.setattr(auto.time, "perf_counter", lambda: clock[0])

    calls = [0]

    def fake(algorithm, message, tasks, states):
        calls[0] += 1
        jitter = 1e-7 * (calls[0] % 2)  # timings are never exactly equal
        clock[0] += sum(once + per_step * len(t.plan) for t in tasks) + jitter
        return []

    for kind, _ in ex._candidates():
        monkeypatch.setattr(ex._executor(kind.split("=")[0]), "run_round", fake)
    try:
        first_round(e)
    finally:
        ex.close()
    steps = local_steps or 30 // 5  # one epoch of 30 samples in batches of 5
    for value in ex.timings.values():
        assert value == pytest.approx(once + per_step * steps)
