"""Sample-level DP fails closed (docs/privacy.md, "Private by construction"): under
``privacy.kind: sample_dp`` a client step's only data gradient is DP-SGD's (Abadi et al.,
CCS 2016, Algorithm 1), so a step that takes one any other way is refused on both backends,
a step that calls ``loss_grad`` itself is the same private step as FedAvg's, k private
gradients a step are noised sigma sqrt(k) each, and every algorithm that declares
``supports_sample_dp`` is private: with a vanishing clipping bound and no noise its result
does not depend on the clients' data."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fedloom
from fedloom.algorithms import ALGORITHMS
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.core.functional import FunctionalModel
from fedloom.solvers.dpsgd import DPSGD
from fedloom.solvers.ops import AUTOGRAD, DP_BATCH, PrivacyRefused, private_update
from fedloom.solvers.program import Batch
from fedloom.solvers.steps import loss_grad, subset_loss_grad

EXECUTORS = [{"kind": "sequential"}, {"kind": "vectorized", "chunk_size": 2}]


NO_FINETUNING = {
    "fedavg_ft": {"finetune_steps": 0},
    "fedbabu": {"finetune_steps": 0},
    "reptile": {"adapt_steps": 0},
}
"""Algorithms whose deployed models are fine-tuned with non-private SGD, which sample_dp
refuses (docs/privacy.md): without the fine-tuning they are private."""


def tiny(algorithm: str = "fedavg", privacy: dict | None = None, **data: Any) -> dict:
    """1 round, 2 clients, 3 local steps of 16 on digits (no deployment fine-tuning)."""
    return {
        "seed": 5,
        "data": {"name": "digits", "num_clients": 2, "partition": {"kind": "iid"}, **data},
        "model": {"name": "mlp"},
        "algorithm": {"name": algorithm, **NO_FINETUNING.get(algorithm, {})},
        "train": {
            "rounds": 1,
            "clients_per_round": 2,
            "local_steps": 3,
            "batch_size": 16,
            "lr": 0.1,
        },
        "eval": {"every": 1},
        "executor": {"kind": "sequential"},
        **({"privacy": {"kind": "sample_dp", **privacy}} if privacy is not None else {}),
    }


# -- steps that take a gradient of their data some other way ---------------------------------


def reads_the_samples(program: SGDProgram, ops: Any, carry: dict, batch: Batch) -> dict:
    """torch.func.grad directly on the minibatch."""
    grad = torch.func.grad(program.model.weighted_loss)
    return grad(carry["params"], carry["buffers"], batch.x, batch.y, batch.w)


def takes_a_subset_gradient(program: SGDProgram, ops: Any, carry: dict, batch: Batch) -> dict:
    """ops.value_and_grad (through steps.subset_loss_grad, as FedRep's phases)."""
    keys = list(carry["params"])[:1]
    return subset_loss_grad(ops, program.model, carry["params"], keys, carry["buffers"], batch)[0]


def takes_two_but_declares_one(program: SGDProgram, ops: Any, carry: dict, batch: Batch) -> dict:
    """Two private gradients where the accountant was told one."""
    loss_grad(ops, program.model, carry["params"], carry["buffers"], batch)
    return loss_grad(ops, program.model, carry["params"], carry["buffers"], batch)[0]


def takes_none(program: SGDProgram, ops: Any, carry: dict, batch: Batch) -> dict:
    """No private gradient (the accountant would count a step that released nothing of it)."""
    return {k: torch.zeros_like(v) for k, v in carry["params"].items()}


def brings_its_own_batch(program: SGDProgram, ops: Any, carry: dict, batch: Batch) -> dict:
    """A private gradient of a minibatch the step was not handed (no Poisson sample)."""
    own = Batch(torch.zeros(4, 64), torch.zeros(4, dtype=torch.long), torch.ones(4))
    return loss_grad(ops, program.model, carry["params"], carry["buffers"], own)[0]


LEAKS = {
    reads_the_samples: "batch.x",
    takes_a_subset_gradient: "ops.value_and_grad",
    takes_two_but_declares_one: "more than the 1 private gradient",
    takes_none: "took 0 private gradient",
    brings_its_own_batch: "minibatch it was not handed",
}


def with_step(gradient: Any) -> type[SGDProgram]:
    """An SGDProgram whose ``step`` takes its gradient with ``gradient``."""

    class Program(SGDProgram):
        def step(self, ops, carry, batches, shared):  # type: ignore[no-untyped-def]
            (batch,) = batches
            grads = gradient(self, ops, carry, batch)
            params = ops.descend(carry["params"], grads, shared["lr"])
            return {**carry, "params": params}, {"loss": torch.zeros(())}

    return Program


@pytest.mark.parametrize("executor", EXECUTORS, ids=lambda e: e["kind"])
@pytest.mark.parametrize("leak", list(LEAKS), ids=lambda f: f.__name__)
def test_a_step_that_takes_a_gradient_another_way_is_refused(leak, executor, monkeypatch):
    program = with_step(leak)
    monkeypatch.setattr(FedAvg, "make_program", lambda self: program(self))
    config = {**tiny(privacy={"noise_multiplier": 1.0}), "executor": executor}
    with pytest.raises(PrivacyRefused, match=rf"fedavg's client step .*{LEAKS[leak]}"):
        fedloom.run(config, write=False, progress=False)
    del config["privacy"]  # the same program runs without DP
    fedloom.run(config, write=False, progress=False)


@pytest.mark.parametrize("executor", EXECUTORS, ids=lambda e: e["kind"])
def test_a_step_that_calls_loss_grad_itself_is_fedavgs_private_step(executor, monkeypatch):
    """The FedSAM pattern: an overridden step taking ``loss_grad`` directly gets DP-SGD's
    gradient, the same numbers as FedAvg's own private step."""
    config = {**tiny(privacy={"noise_multiplier": 1.0, "clip": 0.5}), "executor": executor}
    own = fedloom.run(config, write=False, progress=False)

    def direct(program: SGDProgram, ops: Any, carry: dict, batch: Batch) -> dict:
        return loss_grad(ops, program.model, carry["params"], carry["buffers"], batch)[0]

    program = with_step(direct)
    monkeypatch.setattr(FedAvg, "make_program", lambda self: program(self))
    overridden = fedloom.run(config, write=False, progress=False)
    for key, value in own.global_params.items():
        assert torch.allclose(value, overridden.global_params[key], atol=1e-6), key
    assert overridden.summary["privacy"]["steps"] == own.summary["privacy"]["steps"] > 0


def test_k_private_gradients_a_step_are_each_noised_sigma_sqrt_k():
    """Huge noise swamps the clipped sum: each of the two gradients is sqrt(2) sigma C / (q n)
    times its own standard normal draw, and the two draws differ."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model = FunctionalModel(module, "classification")
    params = {k: v.detach() for k, v in module.named_parameters()}
    shapes = [(k, v.shape) for k, v in params.items()]
    dp = DPSGD(clip=1.0, noise_multiplier=1e4, batch_size=4)
    seen: list[dict] = []

    def step(ops, carry, batches, shared):  # type: ignore[no-untyped-def]
        for _ in range(2):
            seen.append(loss_grad(ops, model, carry["params"], {}, batches[0])[0])
        return carry, {}

    update = private_update("step", ("batches",), step, dp, shapes, 2, "two")
    assert update.draw is not None
    draws = update.draw(torch.Generator().manual_seed(1))
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    carry = {"params": params, DP_BATCH: torch.tensor(4.0)}
    update.fn(AUTOGRAD, carry, (Batch(x, y, torch.ones(4), draws),), {})
    scale = math.sqrt(2) * 1e4 * 1.0 / 4.0
    for i, grads in enumerate(seen):
        for k, g in grads.items():
            assert torch.allclose(g / scale, draws[k][i], atol=1e-3), (i, k)
    assert not torch.allclose(draws["0.weight"][0], draws["0.weight"][1])


# -- every algorithm that declares it is private -----------------------------------------------

SUPPORTED = sorted(
    n for n in ALGORITHMS.names() if ALGORITHMS.get(n).capabilities.supports_sample_dp
)


def farthest(a: fedloom.RunResult, b: fedloom.RunResult) -> float:
    return max(
        float((v - b.client_params[c][k]).abs().max())
        for c, params in a.client_params.items()
        for k, v in params.items()
    )


@pytest.mark.parametrize("algorithm", SUPPORTED)
def test_with_a_vanishing_bound_the_result_does_not_depend_on_the_data(algorithm):
    """C = 1e-7, sigma = 0: every data gradient is a sum of clipped per-sample gradients, so
    each step moves the model by at most lr C |B| / (q n), and two runs on different client
    data (iid against a label-skewed split) end where they started, together; without DP
    they end far apart."""
    skew = {"partition": {"kind": "dirichlet", "alpha": 0.1}}
    private = {"noise_multiplier": 0.0, "clip": 1e-7}
    iid = fedloom.run(tiny(algorithm, private), write=False, progress=False)
    skewed = fedloom.run(tiny(algorithm, private, **skew), write=False, progress=False)
    assert farthest(iid, skewed) < 1e-5
    plain_iid = fedloom.run(tiny(algorithm), write=False, progress=False)
    plain_skewed = fedloom.run(tiny(algorithm, **skew), write=False, progress=False)
    assert farthest(plain_iid, plain_skewed) > 1e-3


@pytest.mark.parametrize("algorithm", sorted(NO_FINETUNING))
def test_deployment_fine_tuning_without_dp_is_refused(algorithm):
    """FedAvg-FT's and Reptile's deployed models take non-private SGD steps on the client's
    data: refused before the first round, naming the algorithm and the setting."""
    config = tiny(algorithm, {"noise_multiplier": 1.0})
    config["algorithm"] = {"name": algorithm}  # the default fine-tuning
    with pytest.raises(PrivacyRefused, match=rf"{algorithm} fine-tunes .* non-private"):
        fedloom.run(config, write=False, progress=False)
