"""A sweep's SPEC: a base config, a grid of dotted keys to lists of values, and the seeds
(docs/benchmarks.md, "Sweep files").

```yaml
base: ../mnist.yaml            # or a config mapping; a path is relative to this file
grid:
  algorithm.name: [fedavg, ditto]
  data.partition.alpha: [0.1, 0.5]
seeds: [0, 1, 2]
```

The grid is the cartesian product of its lists, in the order the keys are listed (the first
key varies slowest). Each cell's values are applied to the base config as ``--set`` overrides
are (``fedloom.config.apply_overrides``, through ``fedloom.tune.space.apply_params``), so a cell
with another ``algorithm.name`` keeps the base's algorithm keys, each of which must be one of
the new algorithm's (docs/inputs.md); each seed sets ``seed``.
Every cell's config, for every seed, is validated before anything runs.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StrictInt, ValidationError, field_validator

from fedloom.api import run_kind
from fedloom.config import RunConfig, apply_overrides, load_yaml, parse_config
from fedloom.core.settings import StrictModel
from fedloom.core.validation import format_validation_error
from fedloom.errors import ConfigError
from fedloom.horizontal import resolve_defaults
from fedloom.models import MODELS
from fedloom.tune.space import override_items

NAME_LIMIT = 100
"""The longest cell directory name; a longer one is cut and given a hash of its values."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")


class SweepSpec(StrictModel):
    """The SPEC file: ``base`` (a config mapping, or a config file's path relative to the
    SPEC), ``grid`` (dotted config key -> non-empty list of values) and ``seeds``."""

    base: dict[str, Any] | str
    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(default_factory=dict)
    seeds: Annotated[list[Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]], Field(min_length=1)]

    @field_validator("grid")
    @classmethod
    def _keys(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not key or any(not part for part in key.split(".")):
                raise ValueError(f"{key!r} is not a dotted config key (train.lr)")
            if key == "seed":
                raise ValueError("'seed' is set by seeds:, not by the grid")
            shown = [_canonical(v) for v in values]
            if len(set(shown)) != len(shown):
                raise ValueError(f"{key}: the values {values} repeat one")
        return grid

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"the seeds {seeds} repeat one")
        return seeds


@dataclass(frozen=True)
class Cell:
    """One point of the grid: its directory name and its values (grid key -> value)."""

    index: int
    name: str
    values: dict[str, Any]


@dataclass(frozen=True)
class Sweep:
    """A parsed SPEC with its base loaded: what DIR/sweep.yaml stores and what runs."""

    base: dict[str, Any]
    grid: dict[str, list[Any]]
    seeds: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "grid": self.grid, "seeds": self.seeds}

    def cells(self) -> list[Cell]:
        """The grid's cells in order (one cell, ``base``, for an empty grid)."""
        keys = list(self.grid)
        combos = [dict(zip(keys, combo, strict=True)) for combo in _product(self.grid)]
        names = _unique([cell_name(values) for values in combos], combos)
        return [Cell(i, n, v) for i, (n, v) in enumerate(zip(names, combos, strict=True))]

    def config(self, cell: Cell, seed: int) -> dict[str, Any]:
        """The raw config of ``cell`` at ``seed`` (ConfigError when a key ``base`` wrote is not
        one of the cell's algorithm, dataset or partition)."""
        items = override_items({**cell.values, "seed": seed})
        return apply_overrides(self.base, items, written_in="the sweep's base")

    def validate(self) -> None:
        """ConfigError naming the cell and key when any cell's config, at any seed, is
        invalid."""
        for cell in self.cells():
            for seed in self.seeds:
                where = f"cell {cell.name} (seed {seed})"
                try:
                    raw = self.config(cell, seed)
                except ConfigError as err:
                    raise ConfigError(f"{where}: {err}") from None
                check_cell_config(raw, where)


def _product(grid: dict[str, list[Any]]) -> list[tuple[Any, ...]]:
    return list(itertools.product(*grid.values()))


def _canonical(value: Any) -> str:
    return override_items({"v": value})[0]


def value_texts(values: dict[str, Any]) -> dict[str, str]:
    """Each grid value as the YAML text a ``--set`` would give it (results.csv's cells)."""
    return {
        k: item.split("=", 1)[1] for k, item in zip(values, override_items(values), strict=True)
    }


def cell_name(values: dict[str, Any]) -> str:
    """``key=value,key=value`` without spaces, other characters a file name should not hold
    replaced by ``_`` (``data.partition=_alpha_0.1,kind_dirichlet_``); ``base`` for the empty
    grid."""
    if not values:
        return "base"
    text = ",".join(override_items(values)).replace(" ", "")
    return _UNSAFE.sub("_", text).strip("._") or "cell"


def _unique(names: list[str], combos: list[dict[str, Any]]) -> list[str]:
    """Names cut to NAME_LIMIT, with a hash of the values where cut or where two collide."""
    out = []
    for name, values in zip(names, combos, strict=True):
        if len(name) > NAME_LIMIT or names.count(name) > 1:
            digest = hashlib.sha256(",".join(override_items(values)).encode()).hexdigest()[:8]
            name = f"{name[: NAME_LIMIT - 9]}-{digest}"
        out.append(name)
    return out


def check_cell_config(raw: dict[str, Any], where: str) -> RunConfig:
    """The resolved config of one run, or ConfigError prefixed with ``where``."""
    try:
        if run_kind(raw) != "horizontal":
            raise ConfigError(
                "kind: fedloom sweep runs horizontal configs (a federated RL or vertical config "
                "runs with fedloom run)"
            )
        cfg = resolve_defaults(parse_config(raw))
        if cfg.peft is None:  # the model's name, as fedloom.run checks it before loading data
            MODELS.get(cfg.model.name)
        return cfg
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def parse_spec(raw: Any, where: str, root: Path) -> Sweep:
    """A SPEC mapping validated (errors name ``where`` and the key); a ``base`` path is read
    relative to ``root``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with base, grid and seeds")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{where}: {format_validation_error(err, SweepSpec)}") from None
    if isinstance(spec.base, str):
        path = Path(spec.base)
        base = load_yaml(path if path.is_absolute() else root / path)
    else:
        base = spec.base
    return Sweep(base=base, grid=dict(spec.grid), seeds=list(spec.seeds))


EMPTY_SPEC = 'empty sweep spec: give base, grid and seeds (docs/benchmarks.md, "Sweep files")'


def load_spec(path: str | Path) -> Sweep:
    """The SPEC file at ``path`` (its base loaded, not yet validated against the config)."""
    path = Path(path)
    return parse_spec(load_yaml(path, EMPTY_SPEC), str(path), path.parent)


def first_difference(old: Any, new: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(key path, old value, new value) of the first place two SPECs differ, in the old one's
    key order (then the new one's added keys), or None when they are equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            sub = f"{path}[{key!r}]" if "." in str(key) else f"{path}.{key}" if path else key
            found = first_difference(old.get(key), new.get(key), sub)
            if found is not None:
                return found
        return None
    return None if old == new else (path or "sweep", old, new)
