"""`fedloom flower CONFIG`: config errors exit 2 with a message naming the key, before Flower
or Ray start."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

pytest.importorskip(
    "flwr", reason="the Flower adapter needs its extra: pip install 'fedloom[flower]'"
)

from fedloom.cli import app


def test_config_errors_exit_2_and_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"name": "digits", "num_clients": 4}}))
    result = CliRunner().invoke(app, ["flower", str(path), "--set", "train.rouds=2"])
    assert result.exit_code == 2, result.output
    assert "train.rouds" in result.output and "rounds" in result.output
    missing = CliRunner().invoke(app, ["flower", str(tmp_path / "missing.yaml")])
    assert missing.exit_code == 2 and "missing.yaml" in missing.output
