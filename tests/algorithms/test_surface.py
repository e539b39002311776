"""The algorithm interface stays small (docs/adding_an_algorithm.md): ten methods an author
decides, everything else declared in ``capabilities``, ``Deployment`` and ``wire``."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from fedloom.algorithms import ALGORITHMS, Algorithm
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.deployment import Deployment
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult


def public_methods(cls: type) -> set[str]:
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or isinstance(value, (classmethod, property)))
    }


def test_the_algorithm_base_class_has_at_most_ten_public_methods():
    assert public_methods(Algorithm) == {
        "model_for",
        "init_server_state",
        "server_message",
        "aggregate",
        "global_model",
        "summary_extras",
        "init_client_state",
        "client_plan",
        "make_program",
        "deployed_model",
    }


def test_every_algorithm_declares_its_traits_deployment_and_wire():
    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        assert isinstance(cls.capabilities, Capabilities), name
        assert issubclass(cls.Deployment, Deployment), name
        assert isinstance(cls.wire, Wire), name


def test_capabilities_are_frozen_and_changed_by_copy():
    base = Capabilities()
    changed = base.but(supports_sample_dp=True)
    assert changed.supports_sample_dp and not base.supports_sample_dp
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.pooled = True  # type: ignore[misc]


def test_wire_is_a_declaration_of_rows_routing_parts_and_the_delta_start():
    """rows of a table per client, routing keys not sent, a part of a tree, the update
    measured from the client's row (docs/adding_an_algorithm.md)."""
    table = {"w": torch.arange(12.0).reshape(4, 3)}  # 4 rows of 12 bytes
    message = {"table": table, "identity": torch.tensor([1, 0]), "params": {"a": torch.ones(2)}}
    plain = {k: message[k] for k in ("table", "params")}
    assert Wire().download_bytes(plain, [0, 1]) == 2 * (48 + 8)
    wire = Wire(rows={"table": 3}, routing=("identity",), only={"params": ()})
    assert wire.download_bytes(message, [0, 1]) == 2 * 3 * 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        wire.rows = {}  # type: ignore[misc]
    moved = {"params": {"w": torch.zeros(3)}}
    by_cluster = Wire(delta_from="table")
    from_identity = by_cluster.delta(message, ClientResult(moved, 1.0, 0.0, client_id=0))
    assert torch.equal(from_identity["w"], -table["w"][1])
    chosen = {**moved, "cluster": {"index": torch.tensor(2)}}
    from_upload = by_cluster.delta(message, ClientResult(chosen, 1.0, 0.0, client_id=0))
    assert torch.equal(from_upload["w"], -table["w"][2])
