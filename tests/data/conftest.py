"""Shared fixtures for the data tests: offline mode, the real-data root, a config factory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field


class DataCfg(BaseModel):
    """Stand-in for the engine's ``data`` config section (same attributes)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    root: str | None = None
    num_clients: int | None = None
    partition: dict[str, Any] | None = None
    test_fraction: float = 0.2
    options: dict[str, Any] = Field(default_factory=dict)


@pytest.fixture(autouse=True, scope="session")
def _offline() -> Iterator[None]:
    """Data tests never touch the network: downloads are disabled for the whole session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDLOOM_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real data folder from $FEDLOOM_DATA (relative to the cwd). Skips only when the
    variable is unset; a set variable with missing files makes the tests fail."""
    env = os.environ.get("FEDLOOM_DATA")
    if not env:
        pytest.skip(
            "FEDLOOM_DATA is not set: real-data tests need the shared data folder, "
            "e.g. FEDLOOM_DATA=../shared/data"
        )
    return Path(env).expanduser().absolute()


@pytest.fixture(scope="session")
def cfg() -> Callable[..., DataCfg]:
    def make(name: str, **kwargs: Any) -> DataCfg:
        return DataCfg(name=name, **kwargs)

    return make
