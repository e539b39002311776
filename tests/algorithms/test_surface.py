"""The algorithm interface stays small (docs/adding_an_algorithm.md): ten methods an author
decides, everything else declared in ``capabilities``, ``Deployment`` and ``wire``."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from fedloom.algorithms import ALGORITHMS, Algorithm
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.deployment import Deployment
from fedloom.algorithms.wire import Wire


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
