"""examples/flower_app is a valid Flower App (Flower's own checks and loader) whose
components are fedloom's ServerApp and ClientApp, and whose run config overrides the run."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "flwr", reason="the Flower adapter needs its extra: pip install 'fedloom[flower]'"
)

from flwr.cli.config_utils import load_and_validate
from flwr.clientapp import ClientApp
from flwr.common.config import get_fused_config_from_dir
from flwr.serverapp import ServerApp
from flwr.supercore.object_ref import load_app

from fedloom.flower.runtime import ConfigSource

APP = Path(__file__).resolve().parents[2] / "examples" / "flower_app"


@pytest.fixture
def app_modules() -> Iterator[None]:
    """Flower's loader puts the app on sys.path: undone afterwards."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name in [m for m in sys.modules if m == "fedloom_app" or m.startswith("fedloom_app.")]:
        del sys.modules[name]


def test_flower_validates_and_loads_the_components(app_modules: None) -> None:
    config, _ = load_and_validate(APP / "pyproject.toml", check_module=True)
    components = config["tool"]["flwr"]["app"]["components"]
    server = load_app(components["serverapp"], ValueError, APP)
    client = load_app(components["clientapp"], ValueError, APP)
    assert isinstance(server, ServerApp) and isinstance(client, ClientApp)
    source = server.fedloom_server.source  # type: ignore[attr-defined]
    assert source.raw["data"]["name"] == "digits"  # its config.yaml, found beside the module


def test_run_config_overrides_reach_the_fedloom_config() -> None:
    source = ConfigSource.of(APP / "fedloom_app" / "config.yaml")
    default = source.resolve(get_fused_config_from_dir(APP, {}))
    assert (default.algorithm.name, default.train.rounds) == ("scaffold", 3)
    overridden = source.resolve(
        get_fused_config_from_dir(
            APP, {"fedloom.algorithm.name": "fedavg", "fedloom.train.rounds": 1}
        )
    )
    assert (overridden.algorithm.name, overridden.train.rounds) == ("fedavg", 1)
