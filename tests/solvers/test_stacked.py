"""The stacked model (core/stacked.py): C clients' gradients and SGD steps without vmap equal
each client's own, one at a time; models it cannot run are refused; deployment fine-tuning
and pooled evaluation give the one-at-a-time numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedloom
from fedloom.core import stacked
from fedloom.core.functional import FunctionalModel
from fedloom.core.stacked import StackedModel, stackable
from fedloom.data.federated import from_arrays
from fedloom.engine.evaluation import evaluate_each, evaluate_pooled
from fedloom.models import build_model
from fedloom.models.base import FedModel
from fedloom.solvers.local import local_sgd
from fedloom.solvers.program import Batch
from fedloom.solvers.stacked_sgd import finetune_stacked, stacked_sgd_step

CLIENTS, WIDTH = 4, 6
SHAPES = {"logreg": (1, 8, 8), "mlp": (1, 8, 8), "cnn": (1, 8, 8), "cnn4": (1, 16, 16)}


def stacked_params(model: FunctionalModel, seed: int) -> dict[str, torch.Tensor]:
    """CLIENTS different parameter sets, stacked."""
    sets = [model.initial_state(seed + c)[0] for c in range(CLIENTS)]
    return {k: torch.stack([s[k] for s in sets]) for k in sets[0]}


def batch(shape: tuple[int, ...], padded: bool) -> Batch:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(CLIENTS, WIDTH, *shape, generator=g)
    y = torch.randint(0, 5, (CLIENTS, WIDTH), generator=g)
    w = torch.ones(CLIENTS, WIDTH)
    if padded:
        w[1, 4:] = 0.0  # client 1 has 4 real samples, client 3 none
        w[3] = 0.0
    return Batch(x, y, w)


def own_steps(model: FunctionalModel, params: dict, b) -> tuple[list[dict], list[float]]:
    """Each client's own autograd SGD step (lr 0.1) on its real samples, and its loss."""
    expected, losses = [], []
    for c in range(CLIENTS):
        own = {k: v[c].clone() for k, v in params.items()}
        real = b.w[c] > 0
        if real.any():
            grads, loss = model.grad_and_loss(own, {}, b.x[c][real], b.y[c][real])
        else:
            grads, loss = {k: torch.zeros_like(v) for k, v in own.items()}, torch.tensor(0.0)
        expected.append({k: own[k] - 0.1 * grads[k] for k in own})
        losses.append(float(loss))
    return expected, losses


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("padded", [False, True])
def test_stacked_gradient_step_equals_each_clients_own(name, padded):
    model = FunctionalModel(build_model(name, SHAPES[name], 5), "classification")
    params = stacked_params(model, 0)
    b = batch(SHAPES[name], padded)
    expected, losses = own_steps(model, params, b)
    got = stacked_sgd_step(model, params, b, 0.1)
    assert got.tolist() == pytest.approx(losses, abs=1e-5)
    for c in range(CLIENTS):
        for k in params:
            assert torch.allclose(params[k][c], expected[c][k], atol=1e-6), (c, k)


FORMS = {"grouped": 0, "separate_first": 3, "separate_all": 10**6}
"""core/stacked.py's SEPARATE_CONV_MAX_IN_CHANNELS forcing each convolution form: every layer
grouped; the default (1- or 3-channel first layers separate, 32-channel layers grouped);
every layer separate."""


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(
    ("name", "shape"), [("cnn", (1, 8, 8)), ("cnn", (3, 8, 8)), ("cnn4", (3, 16, 16))]
)
def test_both_convolution_forms_step_each_client_as_its_own(monkeypatch, form, name, shape):
    """A stacked step of a model whose first convolution has 1 or 3 input channels equals each
    client's own autograd step, whether a convolution runs as one grouped convolution or as C
    separate ones; the form taken is the one the threshold asks for."""
    monkeypatch.setattr(stacked, "SEPARATE_CONV_MAX_IN_CHANNELS", FORMS[form])
    calls: list[tuple[int, int]] = []  # (input channels, groups) of each conv2d call
    conv2d = torch.nn.functional.conv2d

    def counted(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        calls.append((weight.shape[1], groups))
        return conv2d(x, weight, bias, stride, padding, dilation, groups)

    model = FunctionalModel(build_model(name, shape, 5), "classification")
    params = stacked_params(model, 3)
    b = batch(shape, padded=True)
    expected, losses = own_steps(model, params, b)
    monkeypatch.setattr(stacked.F, "conv2d", counted)
    got = stacked_sgd_step(model, params, b, 0.1)
    monkeypatch.setattr(stacked.F, "conv2d", conv2d)
    assert got.tolist() == pytest.approx(losses, abs=1e-6)
    for c in range(CLIENTS):
        for k in params:
            torch.testing.assert_close(params[k][c], expected[c][k], atol=1e-6, rtol=0)
    first, second = shape[0], 32
    want = {
        "grouped": [(first, CLIENTS), (second, CLIENTS)],
        "separate_first": [(first, 1)] * CLIENTS + [(second, CLIENTS)],
        "separate_all": [(first, 1)] * CLIENTS + [(second, 1)] * CLIENTS,
    }[form]
    assert calls == want


def test_momentum_correction_and_trainable_subset():
    """Heavy ball with an extra gradient term, as SGDProgram.step; a frozen key stays put."""
    model = FunctionalModel(build_model("mlp", SHAPES["mlp"], 5), "classification")
    params = stacked_params(model, 2)
    velocity = {k: torch.full_like(v, 0.01) for k, v in params.items()}
    extra = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    b = batch(SHAPES["mlp"], padded=False)
    before = {k: v.clone() for k, v in params.items()}
    v_before = {k: v.clone() for k, v in velocity.items()}
    stacked_sgd_step(model, params, b, 0.1, extra, velocity, momentum=0.9)
    for c in range(CLIENTS):
        own = {k: v[c] for k, v in before.items()}
        grads, _ = model.grad_and_loss(own, {}, b.x[c], b.y[c])
        for k in params:
            v = 0.9 * v_before[k][c] + grads[k] + 0.5
            assert torch.allclose(velocity[k][c], v, atol=1e-6)
            assert torch.allclose(params[k][c], own[k] - 0.1 * v, atol=1e-6)
    frozen = stacked_params(model, 3)
    head_before = frozen["fc1.weight"].clone()
    stacked_sgd_step(model, frozen, b, 0.1, trainable={"fc3.weight", "fc3.bias"})
    assert torch.equal(frozen["fc1.weight"], head_before)


class MeanOverBatch(FedModel):
    """A linear model whose forward mixes samples (centres each batch): not sample-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x - x.mean(0))


def test_only_declared_samplewise_linear_and_convolution_models_run_stacked():
    assert stackable(build_model("mlp", (1, 8, 8), 5))
    assert stackable(build_model("cnn", (1, 8, 8), 5))
    assert not stackable(build_model("cnn_bn", (1, 8, 8), 5))  # batch statistics
    assert not stackable(build_model("char_lstm", (20,), 30))  # recurrent weights
    assert not stackable(MeanOverBatch())  # does not declare samplewise
    declared = MeanOverBatch()
    declared.samplewise = True  # type: ignore[misc]
    assert stackable(declared)  # the declaration is the user's promise
    # dropout runs stacked with each client's masks (core/client_dropout.py); alpha dropout not
    assert stackable(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    assert not stackable(nn.Sequential(nn.Linear(4, 4), nn.AlphaDropout(0.5)))
    # a plain nn.Sequential of sample-wise layers needs no declaration; normalization does not pass
    assert stackable(nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert not stackable(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match="cannot run stacked"):
        StackedModel(MeanOverBatch())


def clients(n: int = 5) -> list:
    g = torch.Generator().manual_seed(4)
    return from_arrays(
        [
            (
                torch.rand(6 + 3 * c, 1, 8, 8, generator=g),
                torch.randint(0, 5, (6 + 3 * c,), generator=g),
            )
            for c in range(n)
        ],
        [
            (torch.rand(2 + c, 1, 8, 8, generator=g), torch.randint(0, 5, (2 + c,), generator=g))
            for c in range(n)
        ],
    ).clients


def test_finetuning_many_clients_stacked_equals_one_at_a_time():
    model = FunctionalModel(build_model("cnn", (1, 8, 8), 5), "classification")
    start = model.initial_state(0)
    datas = clients()
    g = torch.Generator().manual_seed(5)
    plans = [
        [torch.randperm(d.num_train, generator=g)[:4] for _ in range(2 + c)]
        for c, d in enumerate(datas)
    ]
    plans[2] = []  # a client with nothing to train on keeps the start
    got = finetune_stacked(model, [start] * len(datas), datas, plans, 0.05, chunk=3)
    for (params, _), d, plan in zip(got, datas, plans, strict=True):
        solved = local_sgd(model, *start, d.x_train, d.y_train, plan, 0.05)
        for k in params:
            assert torch.allclose(params[k], solved.params[k], atol=1e-5), k


def test_pooled_evaluation_equals_one_client_at_a_time():
    model = FunctionalModel(build_model("mlp", (1, 8, 8), 5), "classification")
    params, buffers = model.initial_state(1)
    datas = clients(6)
    one = evaluate_each(model, [(params, buffers)] * len(datas), datas, 4)
    pooled = evaluate_pooled(model, params, buffers, datas, 4)
    for a, b in zip(one, pooled, strict=True):
        assert a.n == b.n and a.correct == b.correct
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold", "fednova"])
def test_cnn_runs_stacked_and_equals_sequential(algorithm):
    """The FedAvg family on the CNN: the vectorized executor's stacked steps (grouped
    convolutions) give the sequential executor's models. (FedDyn is left out here: in this
    setting a ReLU input of one client sits within float rounding of zero in round 2, and the
    lean trainer's channels-last convolutions flip it against both vmap and the stacked path,
    which agree to 7e-8; FedDyn's equivalence is tested on the 2NN in
    tests/engine/test_executor_equivalence.py.)"""
    hyper = {"fedprox": {"mu": 0.1}, "fednova": {"local_solver": "momentum", "rho": 0.5}}.get(
        algorithm, {}
    )
    cfg = {
        "seed": 2,
        "data": {
            "name": "digits",
            "num_clients": 6,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
        },
        "model": {"name": "cnn"},
        "algorithm": {"name": algorithm, **hyper},
        "train": {"rounds": 2, "clients_per_round": 4, "batch_size": 16, "lr": 0.05},
        "eval": {"every": 2},
    }
    runs = [
        fedloom.run({**cfg, "executor": ex}, write=False, progress=False)
        for ex in ({"kind": "sequential"}, {"kind": "vectorized"})
    ]
    a, b = (r.global_params or {} for r in runs)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4), k


@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_cold_start_curve_stacked_equals_one_client_at_a_time(algorithm):
    """The new clients' fine-tuning curve (all parameters for FedAvg, the head for FedPer)
    is the same whether they fine-tune one at a time or stacked."""
    cfg = {
        "seed": 4,
        "data": {
            "name": "digits",
            "num_clients": 9,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": algorithm},
        "train": {"rounds": 2, "clients_per_round": 3, "batch_size": 16, "lr": 0.05},
        "eval": {"every": 2, "new_clients": 3, "adaptation_steps": [0, 1, 4]},
    }
    a, b = (
        fedloom.run({**cfg, "executor": ex}, write=False, progress=False).summary["cold_start"]
        for ex in ({"kind": "sequential"}, {"kind": "vectorized"})
    )
    assert a.keys() == b.keys() and a["steps"] == [0, 1, 4]
    for key, values in a.items():
        if isinstance(values, list) and values and isinstance(values[0], float):
            assert values == pytest.approx(b[key], abs=1e-5), key
    assert a["accuracy_mean"][2] != a["accuracy_mean"][0]  # the clients did fine-tune


def test_gradient_dissimilarity_stacked_equals_one_client_at_a_time(monkeypatch):
    from fedloom.engine.monitoring import gradient_dissimilarity

    model = FunctionalModel(build_model("mlp", (1, 8, 8), 5), "classification")
    params, buffers = model.initial_state(2)
    datas = dict(enumerate(clients(5)))
    stacked = gradient_dissimilarity(model, params, buffers, datas)
    monkeypatch.setattr(model, "stacked", lambda: None)
    looped = gradient_dissimilarity(model, params, buffers, datas)
    assert stacked == pytest.approx(looped, rel=1e-5) and looped > 0


@pytest.mark.parametrize("name", ["logreg", "mlp"])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_relu_chain_backward_by_hand_equals_autograd(name, task):
    """core/stacked_chain.py: the hand-written backward of a declared ReLU chain gives the
    generic (autograd) stacked path's factors, bias gradients and losses, padded clients
    included, also for a trainable subset."""
    outputs = 5 if task == "classification" else 1
    model = FunctionalModel(build_model(name, SHAPES[name], outputs), task)
    stacked = model.stacked()
    assert stacked is not None and stacked.chain is not None
    params = stacked_params(model, 3)
    b = batch(SHAPES[name], padded=True)
    y = b.y if task == "classification" else b.y.float() / 4
    loss = model.per_sample_loss
    for trainable in (None, {k for k in params if k.endswith("bias")}):
        by_hand, hand_losses = stacked.value_and_grad(params, b.x, y, b.w, loss, trainable, task)
        auto, auto_losses = stacked.value_and_grad(params, b.x, y, b.w, loss, trainable)
        assert sorted(by_hand.names()) == sorted(auto.names())
        assert torch.allclose(hand_losses, auto_losses, atol=1e-6)
        for key in auto.names():
            assert torch.allclose(by_hand.materialize(key), auto.materialize(key), atol=1e-6), key


def test_relu_chain_is_not_inherited_by_a_forward_of_its_own():
    from fedloom.core.stacked_chain import relu_chain
    from fedloom.models.simple import MLP

    class Residual(MLP):  # another forward over the same layers: the chain no longer holds
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc1(x.flatten(1)))
            return self.fc3(h + torch.relu(self.fc2(h)))

    assert relu_chain(MLP((1, 8, 8), 5)) is not None
    assert relu_chain(Residual((1, 8, 8), 5)) is None
    assert relu_chain(build_model("cnn", (1, 8, 8), 5)) is None  # declares none
