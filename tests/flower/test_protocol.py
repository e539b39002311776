"""The adapter's protocol on an in-process grid (tests/flower/grid.py): client states go down
once and live on the nodes, a resumed server sends them again, and failures are named."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "flwr", reason="the Flower adapter needs its extra: pip install 'fedloom[flower]'"
)

from flwr.app import Context, Message, RecordDict

import fedloom
from fedloom.errors import ConfigError
from fedloom.flower import FlowerError, client_app
from fedloom.flower.client import NODE_STATE
from fedloom.flower.protocol import TASK
from fedloom.flower.records import drop_trees
from fedloom.flower.runtime import ConfigSource
from fedloom.flower.server import FedloomServer
from tests.flower.grid import InProcessGrid

CLIENTS = 4
BASE: dict[str, Any] = {
    "seed": 2,
    "data": {
        "name": "digits",
        "num_clients": CLIENTS,
        "partition": {"kind": "dirichlet", "alpha": 0.5},
    },
    "model": {"name": "logreg"},
    "algorithm": {"name": "scaffold"},
    "train": {"rounds": 3, "clients_per_round": 3, "local_steps": 4, "batch_size": 16},
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
    "executor": {"kind": "sequential"},
}


def server_context() -> Context:
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})


def serve(cfg: dict[str, Any], grid: InProcessGrid, **kwargs: Any) -> FedloomServer:
    server = FedloomServer(ConfigSource.of(cfg), write=False, connect_timeout=1.0)
    for key, value in kwargs.items():
        setattr(server, key, value)
    server(grid, server_context())
    return server


def modes(grid: InProcessGrid) -> list[tuple[int, int, str]]:
    """(round, client, state mode) of every train message sent."""
    out = []
    for m in grid.sent:
        if m.metadata.message_type.startswith("train"):
            task = m.content.config_records[TASK]
            out.append((int(task["round"]), int(task["client"]), str(task["state"])))  # type: ignore[arg-type]
    return out


def assert_same_model(a: fedloom.RunResult, b: fedloom.RunResult) -> None:
    assert a.global_params is not None and b.global_params is not None
    for key, value in a.global_params.items():
        assert torch.equal(value, b.global_params[key]), key


def test_states_go_down_once_then_live_on_the_nodes() -> None:
    grid = InProcessGrid(client_app(BASE), range(CLIENTS))
    server = serve(BASE, grid)
    assert server.result is not None
    assert_same_model(server.result, fedloom.run(BASE, write=False, progress=False))
    seen: set[int] = set()
    for _, client, mode in modes(grid):
        assert mode == ("node" if client in seen else "sent")
        seen.add(client)
    assert server.result.extras["flower"]["states_sent"] == len(seen) < len(modes(grid))
    assert all(NODE_STATE + ".layout" in grid.contexts[1000 + c].state for c in seen)


def test_a_resumed_server_sends_the_states_again(tmp_path: Path) -> None:
    def crash_in_round_3(message: Message, context: Context) -> str | None:
        task = message.content.config_records.get(TASK)
        return "the node crashed" if task is not None and task["round"] == 3 else None

    first = InProcessGrid(client_app(BASE), range(CLIENTS), fail=crash_in_round_3)
    with pytest.raises(FlowerError, match=r"round 3: node 10\d\d failed: the node crashed"):
        serve(BASE, first, write=True, out=tmp_path / "run")
    fresh = InProcessGrid(client_app(BASE), range(CLIENTS))  # restarted nodes hold nothing
    server = serve(BASE, fresh, resume=tmp_path / "run")
    assert server.result is not None
    assert_same_model(server.result, fedloom.run(BASE, write=False, progress=False))
    assert {r for r, _, _ in modes(fresh)} == {3}
    assert all(mode == "sent" for _, _, mode in modes(fresh))


def test_a_node_that_lost_its_state_says_so() -> None:
    def restart_before_round_2(message: Message, context: Context) -> None:
        task = message.content.config_records.get(TASK)
        if task is not None and task["round"] == 2:
            drop_trees(context.state, NODE_STATE)

    grid = InProcessGrid(client_app(BASE), range(CLIENTS), fail=restart_before_round_2)
    with pytest.raises(FlowerError, match=r"has none \(the node restarted during the run\)"):
        serve(BASE, grid)


def test_missing_nodes_and_pooled_training_are_named() -> None:
    with pytest.raises(FlowerError, match=r"client\(s\) 3 after 1 s.*partition-id=K"):
        serve(BASE, InProcessGrid(client_app(BASE), range(CLIENTS - 1)))
    pooled = {**copy.deepcopy(BASE), "algorithm": {"name": "centralized"}}
    with pytest.raises(ConfigError, match="pooled data"):
        serve(pooled, InProcessGrid(client_app(pooled), range(CLIENTS)))
