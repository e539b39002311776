"""``load_dataset``: validate the ``data`` config, pick the root, call the dataset's loader."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedloom.data.config import validate
from fedloom.data.federated import FederatedData
from fedloom.data.partition import KEY, PARTITIONS, Partition
from fedloom.data.spec import DATASETS, DataRequest, DatasetSpec
from fedloom.errors import ConfigError

DATA_ENV = "FEDLOOM_DATA"
CACHE_DIR = Path("~/.cache/fedloom")


def default_root() -> Path:
    """``$FEDLOOM_DATA`` (relative paths against the cwd) if set, else ``~/.cache/fedloom``."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser().absolute()
    return CACHE_DIR.expanduser().absolute()


def _root(cfg: Any) -> tuple[Path, str]:
    root = getattr(cfg, "root", None)
    if root is not None:
        return Path(root).expanduser().absolute(), "data.root"
    if os.environ.get(DATA_ENV):
        return default_root(), f"${DATA_ENV}"
    return default_root(), "the default ~/.cache/fedloom"


def _partition(spec: DatasetSpec, raw: Mapping[str, Any] | None) -> Partition:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{KEY}: must be a mapping with a 'kind', got {raw!r}")
    raw = dict(raw)
    kind = raw.setdefault("kind", spec.default_partition)
    cls = PARTITIONS.get(str(kind))
    if kind not in spec.partitions:
        raise ConfigError(
            f"{KEY}.kind: dataset '{spec.name}' does not support partition '{kind}'; "
            f"allowed: {', '.join(spec.partitions)}"
        )
    return validate(cls, raw, KEY)


def _num_clients(spec: DatasetSpec, value: Any) -> int | None:
    if value is None:
        return spec.default_num_clients
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"data.num_clients: must be an integer >= 1, got {value!r}")
    return value


def _test_fraction(value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"data.test_fraction: must be a number, got {value!r}") from None
    if not 0.0 < f < 1.0:
        raise ConfigError(f"data.test_fraction: must be > 0 and < 1, got {value!r}")
    return f


def load_dataset(cfg: Any, seed: int) -> FederatedData:
    """Build the federated dataset that the ``data`` config ``cfg`` describes.

    ``cfg`` has ``name``, ``root``, ``num_clients``, ``partition``, ``test_fraction`` and
    ``options`` (see the package docstring). Config problems raise ConfigError naming the key;
    missing or corrupt files raise DataError naming the file.
    """
    spec = DATASETS.get(str(cfg.name))
    partition = _partition(spec, getattr(cfg, "partition", None))
    options = validate(spec.options, getattr(cfg, "options", None) or {}, f"data.{spec.name}")
    root, source = _root(cfg)
    max_length = getattr(cfg, "max_length", None)
    if max_length is not None and not spec.text:
        raise ConfigError(f"data.max_length: applies to text datasets only, not {spec.name}")
    req = DataRequest(
        name=spec.name,
        root=root,
        root_source=source,
        num_clients=_num_clients(spec, getattr(cfg, "num_clients", None)),
        partition=partition,
        test_fraction=_test_fraction(getattr(cfg, "test_fraction", 0.2)),
        options=options,
        seed=int(seed),
        max_length=max_length,
    )
    return spec.build(req)


def resolve_data_config(cfg: Any) -> dict[str, Any]:
    """The data section with every default filled in (partition parameters, dataset options,
    the default client count), as written to the run directory's config.yaml."""
    spec = DATASETS.get(str(cfg.name))
    partition = _partition(spec, getattr(cfg, "partition", None))
    options = validate(spec.options, getattr(cfg, "options", None) or {}, f"data.{spec.name}")
    return {
        "partition": partition.params(),
        "options": options.model_dump(),
        "num_clients": _num_clients(spec, getattr(cfg, "num_clients", None)),
    }
