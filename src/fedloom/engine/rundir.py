"""The run directory (DESIGN.md 3.5): config.yaml, metrics.jsonl, summary.json, report.html,
label_histogram.json and checkpoints/. A run never writes into another run's directory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from fedloom.errors import RunDirError


def default_run_dir(algorithm: str, dataset: str, base: str | Path = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / f"{algorithm}-{dataset}-{stamp}"
    suffix = 2
    while path.exists():
        path = Path(base) / f"{algorithm}-{dataset}-{stamp}-{suffix}"
        suffix += 1
    return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """A new, empty run directory; refuses an existing non-empty one."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise RunDirError(
                f"output directory {path} already exists and is not empty; a run never "
                "overwrites another run: choose a new --out, or resume it with --resume"
            )
        try:
            (path / "checkpoints").mkdir(parents=True, exist_ok=True)
            probe = path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise RunDirError(f"cannot write to output directory {path}: {err.strerror}") from None
        return cls(path)

    @classmethod
    def open_existing(cls, path: str | Path) -> RunDir:
        path = Path(path)
        if not (path / "config.yaml").is_file():
            raise RunDirError(f"{path} is not a fedloom run directory (no config.yaml)")
        return cls(path)

    # -- files ----------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    def write_config(self, yaml_text: str) -> None:
        _atomic_write(self.config_path, yaml_text)

    def write_json(self, name: str, obj: Any) -> None:
        _atomic_write(self.path / name, json.dumps(obj, indent=2))

    def append_metrics(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def rewrite_metrics(self, rows: list[dict[str, Any]]) -> None:
        _atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, round: int, payload: dict[str, Any], keep: int) -> Path:
        path = self.checkpoint_dir / f"round_{round:06d}.pt"
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
        for old in self.checkpoints()[:-keep]:
            old.unlink()
        return path

    def checkpoints(self) -> list[Path]:
        return sorted(self.checkpoint_dir.glob("round_*.pt"))

    def latest_checkpoint(self) -> dict[str, Any] | None:
        found = self.checkpoints()
        if not found:
            return None
        return torch.load(found[-1], weights_only=False)
