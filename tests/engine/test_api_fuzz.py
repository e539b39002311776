"""Generated wrong inputs to the Python API (``fedloom.run``, ``fedloom.data.from_arrays``):
every one is a fedloom.errors exception (ConfigError, DataError, RunDirError: what the CLI
turns into exit 2), never an IndexError, AttributeError or TypeError from deep inside. The
hand-written cases with their messages are tests/engine/test_api_inputs.py; these are made by
crossing each argument with values of the wrong type or shape."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fedloom
from fedloom.data import from_arrays
from fedloom.errors import FedloomInputError
from tests.engine.test_api_inputs import CONFIG, _pairs, _xy

WRONG_TYPES: list[Any] = [None, 3, -1.5, True, "text", b"bytes", {"a": 1}, object(), [], [[]]]
"""Values of the wrong type for almost every argument."""


def _features() -> list[Any]:
    """Feature arrays that cannot train: wrong types, NaN and inf, ragged, empty, 0-d."""
    x, _ = _xy()
    nan, inf = x.copy(), x.copy()
    nan[3, 1], inf[0, 0] = np.nan, -np.inf
    return [
        *WRONG_TYPES,
        nan,
        inf,
        torch.from_numpy(nan),
        np.float32(1.0),
        np.zeros((0, 4), np.float32),
        [[1.0, 2.0], [3.0]],
        np.array(["a"] * 10),
        np.zeros((10, 4), dtype=complex),
        x[:7],  # fewer rows than targets
    ]


def _targets() -> list[Any]:
    """Targets that cannot train: wrong types, negative or huge labels, NaN, wrong shapes."""
    _, y = _xy()
    return [
        *WRONG_TYPES,
        np.full(10, -3),
        np.full(10, 2**40),
        np.full(10, np.nan),
        np.full(10, np.inf, dtype=np.float32),
        y.reshape(5, 2),
        y[:4],
        np.array(list("abcdefghij")),
        torch.full((10,), -1),
        np.zeros(10, dtype=bool),
    ]


def _raises_an_input_error(call: Callable[[], Any]) -> str | None:
    """None when ``call`` raises a fedloom.errors exception (or succeeds: a value it accepts),
    else what it raised."""
    try:
        call()
    except FedloomInputError:
        return None
    except Exception as err:
        return f"{type(err).__name__}: {str(err)[:200]}"
    return None


def _collect(cases: list[tuple[str, Callable[[], Any]]]) -> None:
    wrong = []
    for name, call in cases:
        got = _raises_an_input_error(call)
        if got is not None:
            wrong.append(f"{name}: {got}")
    assert not wrong, f"{len(wrong)} of {len(cases)}:\n" + "\n".join(wrong[:15])


def test_from_arrays_with_generated_wrong_features_and_targets():
    x, y = _xy()
    good = _xy(seed=1)
    cases: list[tuple[str, Callable[[], Any]]] = []
    for i, bad in enumerate(_features()):
        cases.append(
            (f"features #{i} {type(bad).__name__}", lambda b=bad: from_arrays([(b, y), good]))
        )
    for i, bad in enumerate(_targets()):
        cases.append(
            (f"targets #{i} {type(bad).__name__}", lambda b=bad: from_arrays([(x, b), good]))
        )
    for bad in WRONG_TYPES:
        cases += [
            (f"train={bad!r}", lambda b=bad: from_arrays(b)),
            (f"train=[{bad!r}]", lambda b=bad: from_arrays([b, good])),
            (f"test={bad!r}", lambda b=bad: from_arrays([good, good], test=b)),
            (f"test=[{bad!r}]", lambda b=bad: from_arrays([good, good], test=[b, good])),
            (f"test_fraction={bad!r}", lambda b=bad: from_arrays([good], test_fraction=b)),
            (f"seed={bad!r}", lambda b=bad: from_arrays([good], seed=b)),
            (f"name={bad!r}", lambda b=bad: from_arrays([good], name=b)),
        ]
    for fraction in (-0.1, 1.0, 1.5, float("nan"), float("inf")):
        cases.append(
            (f"test_fraction={fraction}", lambda f=fraction: from_arrays([good], test_fraction=f))
        )
    _collect(cases)


def _run(**kw: Any) -> Any:
    kw.setdefault("write", False)
    return fedloom.run(kw.pop("config", CONFIG), progress=False, **kw)


@pytest.mark.parametrize("argument", ["config", "data", "model", "out", "resume"])
def test_run_with_a_generated_wrong_argument(argument, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a value that is a valid path ("text") stays in tmp_path
    data = from_arrays(_pairs())
    cases: list[tuple[str, Callable[[], Any]]] = []
    for bad in WRONG_TYPES:
        if bad is None or (argument in ("out", "resume") and isinstance(bad, str)):
            continue  # None is each one's default; a string is a path
        kw: dict[str, Any] = {argument: bad}
        if argument != "data":
            kw.setdefault("data", data)
        if argument == "out":
            kw["write"] = True
        cases.append((f"{argument}={bad!r}", lambda kw=kw: _run(**kw)))
    _collect(cases)


def _config_leaves(config: dict[str, Any], prefix: str = "") -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += [(key, *rest) for rest in _config_leaves(value)]
        else:
            out.append((key,))
    return out


def _with(config: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**config, path[0]: value}
    return {**config, path[0]: _with(config.get(path[0], {}), path[1:], value)}


def test_run_with_a_generated_wrong_config_value_and_data_built_by_hand():
    data = from_arrays(_pairs())
    cases: list[tuple[str, Callable[[], Any]]] = []
    values = [None, "text", -1, 2.5, True, [], {"a": 1}, float("nan")]
    for n, (path, value) in enumerate(itertools.product(_config_leaves(CONFIG), values)):
        if n % 2:  # half of the cross product: each key still gets four kinds
            continue
        config = _with(CONFIG, path, value)
        cases.append((f"{'.'.join(path)}={value!r}", lambda c=config: _run(config=c, data=data)))
    clients = data.clients[0]
    for field, bad in [
        ("x_train", torch.full_like(clients.x_train, float("nan"))),
        ("y_train", clients.y_train.to(torch.float64)),
        ("y_train", clients.y_train[:-1]),
        ("x_test", clients.x_test[:, :2]),
        ("y_test", torch.full_like(clients.y_test, 99)),
        ("x_train", None),
        ("y_test", "labels"),
    ]:

        def hand_built(field: str = field, bad: Any = bad) -> Any:
            built = from_arrays(_pairs())
            setattr(built.clients[0], field, bad)
            return _run(data=built)

        cases.append((f"client 0 {field} damaged", hand_built))
    _collect(cases)
