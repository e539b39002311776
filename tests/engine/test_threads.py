"""engine/threads.py: one place for torch's thread count and OpenMP's wait policy (issue #13).
The policy is checked in fresh processes against what libgomp itself reports."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from fedloom.engine.processes import MultiprocessExecutor
from fedloom.engine.threads import (
    OPENMP_WAIT_VARS,
    SMALL_STEP_MACS,
    default_openmp_wait,
    macs_per_sample,
    openmp_wait_policy,
    run_threads,
    torch_threads,
)
from fedloom.models import build_model
from fedloom.run_config.executor import ExecutorConfig
from tests.engine.test_auto import engine


def test_torch_threads_sets_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), torch_threads(other):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with torch_threads(None):  # None: the caller's count
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be >= 1"), torch_threads(0):
        pass
    assert torch.get_num_threads() == before


def test_default_wait_policy_only_where_the_user_chose_none() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert default_openmp_wait(env) is True
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_wait_policy(env) == "OMP_WAIT_POLICY=PASSIVE"
    for var in OPENMP_WAIT_VARS:
        chosen = {var: "7"}
        assert default_openmp_wait(chosen) is False
        assert chosen == {var: "7"}
    assert openmp_wait_policy({}) == "default"


def libgomp_settings(code: str, **env: str) -> dict[str, str]:
    """What libgomp reports (OMP_DISPLAY_ENV=VERBOSE) in a fresh process running ``code``."""
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env, "OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    settings = {}
    for line in proc.stderr.splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep:
            settings[key] = value.strip("'")
    return settings


def test_importing_fedloom_makes_openmp_threads_sleep_when_idle() -> None:
    settings = libgomp_settings("import fedloom, torch; torch.ones(8).sum()")
    assert settings["OMP_WAIT_POLICY"] == "PASSIVE"
    assert settings["GOMP_SPINCOUNT"] == "0"  # no spinning at all


def test_the_users_choice_and_the_import_order_are_respected() -> None:
    spin = libgomp_settings("import fedloom", GOMP_SPINCOUNT="1234")
    assert spin["GOMP_SPINCOUNT"] == "1234"
    # torch first: OpenMP started before fedloom could set anything (documented limitation)
    late = libgomp_settings("import torch, fedloom")
    assert late["GOMP_SPINCOUNT"] == "300000"


def test_worker_processes_inherit_the_policy() -> None:
    code = (
        "import fedloom, subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'import torch'], check=True)\n"
    )
    # the child imports torch alone: only the inherited environment can make it passive
    settings = libgomp_settings(code)
    assert settings["GOMP_SPINCOUNT"] == "0"


def test_macs_per_sample_counts_linear_conv_and_recurrent_layers() -> None:
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    assert macs_per_sample(mlp, torch.zeros(2, 3)) == 6 * 4 + 4 * 3
    conv = nn.Conv2d(2, 5, kernel_size=3, padding=1)
    assert macs_per_sample(conv, torch.zeros(2, 4, 4)) == 5 * 4 * 4 * 2 * 9
    lstm = nn.LSTM(3, 5, num_layers=2, batch_first=True)
    steps = 7
    expected = steps * 4 * 5 * (3 + 5) + steps * 4 * 5 * (5 + 5)
    assert macs_per_sample(lstm, torch.zeros(steps, 3)) == expected


def test_macs_per_sample_leaves_the_model_as_it_was() -> None:
    model = build_model("cnn_bn", (1, 28, 28), 10)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert macs_per_sample(model, torch.rand(1, 28, 28)) > 0
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("executor", "model", "batch", "expected"),
    [
        ({"kind": "sequential"}, "mlp", 32, 1),  # the 2NN: 6.4M MACs a step
        ({"kind": "sequential"}, "cnn", 32, None),  # the FedAvg CNN: hundreds of millions
        ({"kind": "sequential", "threads": 2}, "mlp", 32, 2),
        ({"kind": "sequential", "workers": 2}, "mlp", 32, None),  # the workers choose
        ({"kind": "vectorized"}, "mlp", 32, None),  # a chunk of clients per call
        ({"kind": "auto"}, "mlp", 32, None),  # auto sets its choice's count per round
    ],
)
def test_run_threads(executor: dict[str, Any], model: str, batch: int, expected: int | None):
    module = build_model(model, (1, 28, 28), 10)
    config = ExecutorConfig(**executor)
    assert run_threads(config, module, torch.rand(1, 28, 28), batch) == expected


def test_small_step_bound_separates_the_2nn_from_the_cnn() -> None:
    sample = torch.rand(1, 28, 28)
    mlp = 32 * macs_per_sample(build_model("mlp", (1, 28, 28), 10), sample)
    cnn = 32 * macs_per_sample(build_model("cnn", (1, 28, 28), 10), sample)
    assert mlp < SMALL_STEP_MACS / 5 and cnn > SMALL_STEP_MACS * 5


def test_the_engine_runs_a_small_sequential_model_on_one_thread() -> None:
    e = engine({"kind": "sequential"})
    assert e._threads() == 1
    assert engine({"kind": "sequential", "threads": 2})._threads() == 2


class ThreadReporter:
    """An inner executor whose 'results' are the worker's thread count."""

    name = "reporter"
    batches_clients = False

    def prepare(self, clients: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def run_round(self, algorithm: Any, message: Any, tasks: list, states: list) -> list[int]:
        return [torch.get_num_threads()] * len(tasks)


def test_worker_processes_run_at_their_thread_count() -> None:
    e = engine({"kind": "sequential"})
    tasks = e.tasks_for_round(1, e.train_ids)[:2]
    pool = MultiprocessExecutor(ThreadReporter(), workers=2, threads=2)  # here and 1 worker
    pool.prepare(dict(enumerate(e.data.clients)))
    try:
        with torch_threads(1):
            assert pool.run_round(e.algorithm, None, tasks, [None, None]) == [2, 2]
    finally:
        pool.close()
