"""The Python API (README.md, "Python API"): ``fedloom.run(config, data=None, model=None)``.

``run`` picks the config's run family from a small registry (``FAMILIES``: horizontal, rl,
vertical) and hands it to the one run shell (engine/shell.py), which keeps the run directory,
resume, metrics, trackers, progress and summary of every family; the report is written last."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from fedloom.audit.auditor import audit
from fedloom.config import RunConfig, load_yaml
from fedloom.core.functional import FunctionalModel
from fedloom.data import FederatedData
from fedloom.engine.callbacks import Callback
from fedloom.engine.executor import Executor
from fedloom.engine.rundir import RunDir
from fedloom.engine.shell import RunFamily, RunInputs, RunResult, run_family
from fedloom.errors import ConfigError


def _horizontal() -> RunFamily:
    from fedloom.horizontal import HorizontalFamily

    return HorizontalFamily()


def _rl() -> RunFamily:
    from fedloom.rl.run import RLFamily

    return RLFamily()


def _vertical() -> RunFamily:
    from fedloom.vertical.run import VerticalFamily

    return VerticalFamily()


FAMILIES: dict[str, Callable[[], RunFamily]] = {
    "horizontal": _horizontal,  # docs/architecture.md
    "rl": _rl,  # docs/rl.md
    "vertical": _vertical,  # docs/vertical.md
}
"""The run families by ``kind``, each imported when a run of it starts."""

RUN_KINDS = tuple(FAMILIES)


def run_kind(config: Any) -> str:
    """The run family of a config (path, mapping or parsed): its top-level ``kind:``
    (horizontal, rl or vertical). Without one it is inferred here, and only here, from the
    names a config of that family uses: an RL environment or algorithm, a vertical algorithm
    or partition (docs/rl.md and docs/vertical.md, "The kind key")."""
    from fedloom.rl.config import RLRunConfig, is_rl_config
    from fedloom.vertical.config import VerticalRunConfig, is_vertical_config

    if config is None or isinstance(config, RunConfig):
        return "horizontal"
    if isinstance(config, RLRunConfig | VerticalRunConfig):
        return config.kind
    raw = load_yaml(config) if isinstance(config, str | Path) else config
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind is not None and kind not in RUN_KINDS:
        raise ConfigError(f"kind: expected one of {', '.join(RUN_KINDS)}, got {kind!r}")
    if kind is not None:
        return kind
    return "rl" if is_rl_config(raw) else "vertical" if is_vertical_config(raw) else "horizontal"


def _check_path(name: str, value: object) -> None:
    """ConfigError unless ``value`` (``out``, ``resume``) is None or a path."""
    if value is not None and not isinstance(value, str | os.PathLike):
        raise ConfigError(
            f"{name}: expected a directory path (str or pathlib.Path), got {type(value).__name__}"
        )


def run(
    config: RunConfig | dict[str, Any] | str | Path | None = None,
    *,
    data: FederatedData | None = None,
    model: nn.Module | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    accept_config_change: bool = False,
    progress: bool | None = None,
    write: bool = True,
    executor: Callable[[FunctionalModel], Executor] | None = None,
    callbacks: list[Callback] | None = None,
) -> RunResult:
    """Run one experiment and return its summary, history and models.

    ``config`` is a path, a dict or a parsed config (None: the embedded default). ``data`` and
    ``model`` replace the configured dataset and model. ``out`` is the run directory (default
    ``runs/<algorithm>-<dataset>-<time>``); ``resume`` continues a run directory from its last
    checkpoint, refusing one whose config.yaml changed since that checkpoint was written unless
    ``accept_config_change``. The run directory is locked for this call: a second run of it
    (``out`` or ``resume``), here or in another process, raises ``fedloom.errors.RunDirLocked``
    (the CLI's exit 2) naming the writer's PID. ``write=False`` keeps everything in memory.
    ``executor(model)`` makes the executor instead of the config (the Flower adapter's, which
    sends clients' work to nodes). ``callbacks`` run after every round of a horizontal run, the
    one way to extend a run (engine/context.py; ``fedloom tune``'s reporter).
    """
    _check_path("out", out)
    _check_path("resume", resume)
    # a run directory to resume is checked (no symbolic link in it) before its config is read
    saved = RunDir.open_existing(resume).config_path if resume is not None else None
    family = FAMILIES[run_kind(config if saved is None else saved)]()
    show = sys.stderr.isatty() if progress is None else progress
    inputs = RunInputs(data, model, executor, list(callbacks or []), show)
    result = run_family(
        family,
        config,
        inputs,
        out=out,
        resume=resume,
        write=write,
        accept_config_change=accept_config_change,
    )
    if result.run_dir is not None:
        from fedloom.report import write_report

        write_report(result.run_dir.path)
    return result


__all__ = ["ConfigError", "RunResult", "audit", "run"]
