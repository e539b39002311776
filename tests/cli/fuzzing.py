"""Hypothesis strategies for fuzzing fedloom's inputs (tests/cli/test_fuzz.py): ``--set``
mutations of a valid config (wrong types, out of range, non-finite, unknown keys, another
choice of a section's kind, several at once, so that sections clash) and command lines of
every command with hostile arguments.

Left out on purpose, each for a reason a user would accept: ``executor.*`` (Ray and worker
processes start services, a device that is absent is its own test), ``tracking.*`` (writes
mlruns/ into the working directory), ``data.root`` (a filesystem path; tests/data covers it),
and huge but valid counts (``train.rounds=10**30`` is a run that is long, not an input error).
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

from fedloom.algorithms import ALGORITHMS
from fedloom.config import RunConfig, parse_config
from fedloom.models import MODELS
from tests.cli.invoke import QUADRATIC

SKIPPED_PREFIXES = ("executor.", "tracking.", "data.root")

HOSTILE_TEXT = [
    ".inf",
    "-.inf",
    ".nan",
    "null",
    "true",
    "-1",
    "0",
    "1e300",
    "-1e300",
    "1180591620717411303424",
    "'text'",
    "'0.05'",
    '"3"',
    "[1, 2]",
    "{a: 1}",
    "[1",
    "!!python/object:os.system x",
    "!!binary AAAA",
    "''",
    "\u00e9\u00e8\u2603",
    "&a [*a]",
]
"""YAML texts that are wrong for almost every key, as ``--set KEY=TEXT`` gives them."""


def leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested mapping."""
    if isinstance(tree, dict) and tree:
        out: list[tuple[str, Any]] = []
        for key, value in tree.items():
            out += leaves(value, f"{prefix}{key}.")
        return out
    return [(prefix.rstrip("."), tree)]


def _literal_choices(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _literal_choices(arg)]
    return []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def section_choices(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, list]:
    """Every ``Literal`` key of the config (``privacy.kind``, ``attack.mode`` ...) with its
    choices: setting one to another choice is how sections come to clash."""
    out: dict[str, list] = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        choices = _literal_choices(field.annotation)
        if choices:
            out[key] = choices
        sub = _model_of(field.annotation)
        if sub is not None and sub is not model:
            out |= section_choices(sub, f"{key}.")
    return out


BASE_KEYS = [
    (key, value)
    for key, value in leaves(parse_config(QUADRATIC).to_dict())
    if not key.startswith(SKIPPED_PREFIXES)
]
CHOICES = {
    **{k: v for k, v in section_choices().items() if not k.startswith(SKIPPED_PREFIXES)},
    "algorithm.name": ALGORITHMS.names(),
    "model.name": [*MODELS.names(), "minilm"],
    "data.name": ["digits", "quadratic", "synthetic", "cartpole", "bogus"],
}


def _near(value: Any) -> st.SearchStrategy[str]:
    """Values of the key's own type that are out of range or just odd."""
    if isinstance(value, bool):
        return st.sampled_from(["false", "true", "2"])
    if isinstance(value, int):
        return st.sampled_from([str(-value - 1), "0", "-1", str(value + 1), "2.5", "true"])
    if isinstance(value, float):
        return st.sampled_from(
            [str(-value), "0.0", "1.0", "1e-300", str(value * 1e6), "false", f"'{value}'"]
        )
    return st.sampled_from(["bogus", "'1'"])


@st.composite
def mutation(draw: st.DrawFn) -> str:
    """One ``KEY=TEXT``."""
    how = draw(st.sampled_from(["hostile", "near", "choice", "unknown", "section"]))
    if how == "choice":
        key = draw(st.sampled_from(sorted(CHOICES)))
        return f"{key}={draw(st.sampled_from(CHOICES[key]))}"
    key, value = draw(st.sampled_from(BASE_KEYS))
    if how == "hostile":
        return f"{key}={draw(st.sampled_from(HOSTILE_TEXT))}"
    if how == "near":
        return f"{key}={draw(_near(value))}"
    if how == "unknown":
        section = key.split(".")[0]
        return f"{section}.{draw(st.sampled_from(['bogus', 'lrr', 'kind_', '']))}=1"
    return f"{key.split('.')[0]}={draw(st.sampled_from(['3', '[]', 'x', 'null']))}"


def config_arguments(config: Path, out: Path) -> st.SearchStrategy[list[str]]:
    """``run CONFIG --set ... --out OUT`` with one to three mutations."""
    return st.lists(mutation(), min_size=1, max_size=3).map(
        lambda sets: [
            "run",
            str(config),
            *[a for s in sets for a in ("--set", s)],
            "--out",
            str(out),
        ]
    )


@st.composite
def command_line(draw: st.DrawFn, files: dict[str, Path]) -> list[str]:
    """A command with hostile arguments. ``files``: 'config' (valid), 'run' (a finished run),
    'binary', 'missing', 'dir' (an empty folder), 'space' (a tune space)."""
    path = st.sampled_from([str(p) for p in files.values()])
    command = draw(
        st.sampled_from(
            ["run", "summary", "report", "audit", "export", "compare", "tune", "dashboard"]
        )
    )
    options: dict[str, st.SearchStrategy[list[str]]] = {
        "run": st.sampled_from(
            [
                ["--resume", str(files["binary"])],
                ["--resume", str(files["dir"])],
                ["--resume", str(files["run"]), "--out", str(files["dir"])],
                ["--accept-config-change"],
                ["--set", "="],
                ["--set", "train"],
                ["--set", "..x=1"],
                ["--bogus"],
            ]
        ),
        "summary": st.just([]),
        "report": st.just([]),
        "audit": st.sampled_from(
            [["--attack", "bogus"], ["--members", "0"], ["--members", "-3"], ["--client", "99"]]
        ),
        "export": st.sampled_from([["--out", str(files["binary"])], []]),
        "compare": st.sampled_from([["--out", str(files["binary"])], []]),
        "tune": st.sampled_from(
            [
                ["--space", str(files["binary"])],
                ["--space", str(files["config"])],
                ["--space", str(files["space"]), "--trials", "0"],
                ["--space", str(files["space"]), "--pruner", "bogus"],
                [],
            ]
        ),
        "dashboard": st.sampled_from([["--host", "8.8.8.8"], ["--port", "0"], ["--port", "70000"]]),
    }
    extra = draw(options[command])
    # the target: a config for run and tune, a run directory (or anything) for the others
    target = draw(path) if command != "run" or "--resume" not in extra else None
    if command == "run" and target is None:
        return [command, *extra]
    if command == "run" and target == str(files["run"]):
        target = str(files["binary"])  # a finished run's folder is not a config file
    if command == "dashboard" and "--host" not in extra:
        target = str(files["missing"])  # a valid folder would serve until interrupted
    return [command, target, *extra]
