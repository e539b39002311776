"""What the Python API checks (docs/inputs.md, "What the Python API checks"): the data and
model it is handed, each failure a fedloom.errors exception naming the client and the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedloom
from fedloom.data import FederatedData, from_arrays
from fedloom.data.checks import MAX_CLASSES
from fedloom.errors import ConfigError, DataError
from tests.cli.invoke import fedloom as fedloom_cli

CONFIG = {
    "seed": 0,
    "data": {"name": "arrays", "num_clients": 2},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 1, "local_steps": 1, "batch_size": 4, "lr": 0.1},
    "executor": {"kind": "sequential"},
}


def _xy(n: int = 10, d: int = 4, classes: int = 3, seed: int = 0):
    g = np.random.default_rng(seed)
    return g.normal(size=(n, d)).astype(np.float32), g.integers(0, classes, size=n)


def _pairs():
    return [_xy(seed=0), _xy(seed=1)]


def _run(data=None, model=None, config=CONFIG):
    return fedloom.run(config, data=data, model=model, write=False, progress=False)


def _labels(value):
    x, y = _xy()
    y = y.copy()
    y[:] = value
    return [(x, y), _xy(seed=1)]


@pytest.mark.parametrize(
    ("train", "words"),
    [
        (_labels(-1), ["client 0 (train)", "a label is -1", "remap"]),
        (_labels(10**9), ["client 0 (train)", f"{MAX_CLASSES} classes", "remap"]),
        (
            [_xy(), (_xy()[0], _xy()[1].astype(np.float32))],
            ["client 1", "float32 targets", "int64"],
        ),
        ([_xy(), _xy(d=5)], ["client 1", "shape [5]", "[4]", "one feature shape"]),
        ([(_xy()[0], np.array(list("abcabcabca"))), _xy()], ["targets are not numbers"]),
        ([(np.where(np.eye(10, 4) > 0, np.nan, 1.0), _xy()[1]), _xy()], ["NaN or infinite"]),
        ([(np.full((10, 4), np.inf), _xy()[1]), _xy()], ["client 0", "NaN or infinite"]),
    ],
)
def test_from_arrays_refuses_data_that_cannot_train_naming_the_client(train, words):
    with pytest.raises(DataError) as err:
        from_arrays(train)
    for word in words:
        assert word in str(err.value)


def _built(**change) -> FederatedData:
    data = from_arrays(_pairs())
    client = data.clients[1]
    for key, value in change.items():
        setattr(client, key, value)
    return data


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (_built(y_train=torch.full((8,), 3)), ["client 1 (train)", "a label is 3", "3 classes"]),
        (_built(y_test=torch.tensor([0, -2])), ["client 1 (test)", "a label is -2"]),
        (_built(y_train=torch.zeros(8, 2)), ["client 1 (train)", "torch.float32 targets"]),
        (_built(x_train=torch.zeros(8, 6)), ["client 1 (train)", "shape [6]"]),
        (_built(x_test=torch.full((2, 4), float("nan"))), ["client 1 (test)", "NaN"]),
        (
            _built(x_train=torch.zeros(0, 4), y_train=torch.zeros(0, dtype=torch.int64)),
            ["client 1: no training sample", "eval.new_clients"],
        ),
    ],
)
def test_run_checks_a_federated_data_built_by_hand(data, words):
    with pytest.raises(DataError) as err:
        _run(data)
    for word in words:
        assert word in str(err.value)


def test_a_client_held_out_as_new_may_have_no_training_sample():
    data = _built(x_train=torch.zeros(0, 4), y_train=torch.zeros(0, dtype=torch.int64))
    config = {**CONFIG, "eval": {"new_clients": 1}}
    assert len(_run(data, config=config).history) >= 1


@pytest.mark.parametrize(
    ("data", "model", "words"),
    [
        (
            [(np.zeros((4, 2)), np.zeros(4))],
            None,
            ["data: expected a FederatedData", "list", "from_arrays"],
        ),
        ({"train": 1}, None, ["got dict"]),
        (None, "mlp", ["model: expected a torch.nn.Module", "got str", "model.name: mlp"]),
        (None, 3, ["got int"]),
    ],
)
def test_data_and_model_of_the_wrong_type_are_config_errors(data, model, words):
    if data is None:
        data = from_arrays(_pairs())
    with pytest.raises(ConfigError) as err:
        _run(data, model)
    for word in words:
        assert word in str(err.value)


class Wide(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.fc = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize(
    ("module", "words"),
    [
        (Wide(4, 7), ["model (Wide, the module you gave)", "7 outputs", "3 classes", "3 wide"]),
        (Wide(4, 2), ["2 outputs", "3 classes"]),
        (
            Wide(9, 3),
            ["model (Wide, the module you gave) cannot take", "shape [4]", "give a module"],
        ),
    ],
)
def test_a_user_module_must_fit_the_data(module, words):
    with pytest.raises(ConfigError) as err:
        _run(from_arrays(_pairs()), module)
    message = str(err.value)
    for word in words:
        assert word in message
    assert "model.name" not in message


def test_a_fitting_user_module_and_data_still_train():
    result = _run(from_arrays(_pairs()), Wide(4, 3))
    assert len(result.history) >= 1


def test_cli_set_num_clients_true_is_exit_2_without_a_client_count():
    out = fedloom_cli(["run", "--set", "data.num_clients=true"])
    assert out.is_clear_input_error(), out.stderr
    assert "data.num_clients" in out.stderr and "training clients" not in out.stderr
