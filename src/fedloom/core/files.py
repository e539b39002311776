"""Files fedloom writes and reads back: strict JSON out, and run-directory files in, with every
input fault (a path leaving its folder, bytes that are not UTF-8, broken JSON or YAML) raised
as a ``RunDirError`` naming the file (exit status 2; README.md, "Exit status")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from fedloom.core.runpaths import under
from fedloom.core.validation import check_plain_tree
from fedloom.core.yaml_text import load_yaml_text
from fedloom.errors import RunDirError


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (a diverged loss, an exact recovery's infinite
    PSNR) replaced by None, so that it can be written as strict JSON (RFC 8259 has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """JSON text any strict parser accepts: non-finite floats become null (``finite_json``)."""
    return json.dumps(finite_json(value), allow_nan=False, **kwargs)


def inside(root: Path, name: str | Path, what: str) -> Path:
    """``root / name``, refused unless it stays inside ``root`` with no symbolic link on the
    way (core/runpaths.py, ``under``): a file name read from a run directory someone sent you
    must not reach outside it."""
    return under(root, name, what=what)


def read_text(path: Path) -> str:
    """A text file of a run directory, as UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RunDirError(f"{path}: not UTF-8 text; is it a file fedloom wrote?") from None
    except OSError as err:
        raise RunDirError(f"cannot read {path}: {err.strerror or err}") from None


def read_json(path: Path) -> Any:
    """A JSON file of a run directory."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise RunDirError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file of a run directory that must hold an object."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise RunDirError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file of a run directory that must hold a mapping (an empty file is {})."""
    try:
        value = load_yaml_text(read_text(path))
    except yaml.YAMLError as err:
        raise RunDirError(f"{path}: not valid YAML: {one_line(err)}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RunDirError(f"{path}: expected a YAML mapping, got {type(value).__name__}")
    check_plain_tree(value, str(path), RunDirError)
    return value


def one_line(err: BaseException | str) -> str:
    """An error's message on one line (YAML's and pydantic's span several)."""
    return " ".join(str(err).split())
