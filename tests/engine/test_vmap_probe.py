"""A user's module on the vectorized executor (issue #37, item 1): pooling, flattening,
LayerNorm, GroupNorm and an undeclared BatchNorm give the sequential executor's numbers; a
module vmap cannot run is refused before training with the failing layer named and the
executor that runs it, and auto leaves the vectorized candidates out (engine/vmap_probe.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedloom
from fedloom.core.functional import FunctionalModel
from fedloom.core.stacked import stackable
from fedloom.engine.vmap_probe import NotVmappable, check_vmappable
from fedloom.errors import ConfigError
from tests.engine.test_executor_equivalence import assert_same, config


def pooled_norms() -> nn.Module:
    """Convolutions with GroupNorm, LayerNorm, average, max and adaptive pooling, flattening:
    no batch statistics, a plain nn.Sequential with parameters in norm layers (vmap path)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.LayerNorm([8, 4, 4]),
        nn.GELU(),
        nn.AvgPool2d(2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def undeclared_batch_norm() -> nn.Module:
    """BatchNorm in a plain nn.Sequential (no ``norm_modules`` declaration): padding a partial
    minibatch would change its batch statistics, so the vectorized executor must group clients
    by exact batch size for it as for a declared one."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)
    )


class Gate(nn.Module):
    """Data-dependent control flow: a Python branch on a tensor's value, which vmap refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


def gated() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Gate(), nn.ReLU(), nn.Linear(32, 10))


def run(model: nn.Module, algorithm: str, executor: dict) -> fedloom.RunResult:
    """3 rounds on 8 clients of 60 to 250 samples at batch 13: last minibatches are partial."""
    return fedloom.run(
        config(algorithm, "mlp", executor, 13), model=model, write=False, progress=False
    )


@pytest.mark.parametrize("algorithm", ["fedavg", "ditto"])
@pytest.mark.parametrize("make", [pooled_norms, undeclared_batch_norm])
def test_users_layers_on_vectorized_equal_sequential(make, algorithm):
    assert not stackable(make())  # norm layers hold parameters: the vmap path
    seq = run(make(), algorithm, {"kind": "sequential"})
    for executor in ({"kind": "vectorized", "chunk_size": 3}, {"kind": "vectorized"}):
        assert_same(seq, run(make(), algorithm, executor))


def test_undeclared_batch_norm_would_differ_if_padded(monkeypatch):
    """The grouping matters: with padding (the executor reading only the declaration) the
    batch statistics of partial minibatches change and the runs part."""
    from fedloom.engine import vectorized

    seq = run(undeclared_batch_norm(), "fedavg", {"kind": "sequential"})
    original = vectorized.VectorizedExecutor.__init__

    def declaration_only(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.has_norm = False

    monkeypatch.setattr(vectorized.VectorizedExecutor, "__init__", declaration_only)
    vec = run(undeclared_batch_norm(), "fedavg", {"kind": "vectorized", "chunk_size": 3})
    differences = [
        float((value - vec.client_params[cid][key]).abs().max())
        for cid, params in seq.client_params.items()
        for key, value in params.items()
    ]
    assert max(differences) > 1e-3


def test_a_module_vmap_cannot_run_is_refused_naming_the_layer():
    with pytest.raises(ConfigError, match=r"layer 2 \(Gate\).*workers") as err:
        run(gated(), "fedavg", {"kind": "vectorized"})
    assert isinstance(err.value, NotVmappable)


def test_auto_leaves_out_vectorized_for_such_a_module():
    seq = run(gated(), "fedavg", {"kind": "sequential"})
    auto = run(gated(), "fedavg", {"kind": "auto"})
    choice = auto.summary["executor_choice"]
    assert "vectorized" not in choice
    assert_same(seq, auto)


def test_probe_passes_models_vmap_runs_and_leaves_them_untouched():
    """The probe draws nothing from torch's global generator and changes no weight or
    running statistic."""
    model = FunctionalModel(undeclared_batch_norm(), "classification")
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    x = torch.randn(3, 1, 8, 8)
    state = torch.get_rng_state()
    check_vmappable(model, x, torch.tensor([1, 2, 3]))
    assert torch.equal(state, torch.get_rng_state())
    after = model.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_probe_names_the_root_when_the_models_own_code_fails():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x.flatten(1))
            return out if out.max() > 0 else -out

    model = FunctionalModel(Branchy(), "classification")
    with pytest.raises(NotVmappable, match=r"layer <root> \(Branchy\)"):
        check_vmappable(model, torch.randn(2, 1, 8, 8), torch.tensor([0, 1]))


def test_the_executor_probes_with_two_samples_when_a_client_has_them():
    """A first client with one sample would make BatchNorm refuse the probe's batch (more than
    one value per channel is needed): the executor takes a client with two."""
    from fedloom.core.protocol import ClientData
    from fedloom.engine.vectorized import VectorizedExecutor

    def client(n: int) -> ClientData:
        return ClientData(
            torch.randn(n, 1, 8, 8), torch.randint(0, 10, (n,)), torch.zeros(0), torch.zeros(0)
        )

    model = FunctionalModel(undeclared_batch_norm(), "classification")
    with pytest.raises(NotVmappable, match="BatchNorm1d"):
        check_vmappable(model, client(1).x_train, client(1).y_train)
    VectorizedExecutor(model).prepare({0: client(1), 1: client(5)})  # no refusal
