"""Sample-level DP-SGD inside clients (Abadi et al. 2016, Opacus's semantics): one step against
Opacus itself, Poisson minibatches, the vmapped clients against one at a time, per-client
accounting, config errors, executors and resume."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import fedloom
from fedloom.algorithms import ALGORITHMS
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError
from fedloom.privacy import SampleLevelDP, epsilon
from fedloom.privacy.accounting import frontier, noise_multiplier_for_all, worst_epsilon
from fedloom.privacy.config import PrivacyConfig
from fedloom.solvers.dpsgd import DPSGD, private_grad
from fedloom.solvers.local import poisson_plan
from fedloom.solvers.program import Batch
from tests.engine.test_executor_equivalence import assert_same
from tests.privacy.test_client_dp import dp_config
from tests.privacy.test_private_by_construction import NO_FINETUNING
from tests.resume import killed_and_resumed


def sample_dp_config(privacy: dict[str, Any], algorithm: str = "fedavg", **train: Any) -> dict:
    """dp_config with DP-SGD, on the sequential executor (``auto`` picks by timing, and two
    runs compared bit for bit must not pick differently), without non-private deployment
    fine-tuning (refused under sample_dp)."""
    config = dp_config(privacy, algorithm, **train)
    config["algorithm"].update(NO_FINETUNING.get(algorithm, {}))
    config["privacy"]["kind"] = "sample_dp"
    config["executor"] = {"kind": "sequential"}
    return config


class MLP(nn.Sequential):
    """The 10-16-3 MLP of docs/privacy.md's Opacus comparison."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def mlp_and_data(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = MLP()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(32, 10, generator=gen)
    y = torch.randint(0, 3, (32,), generator=gen)
    return model, x, y


def opacus_steps(
    sigma: float, steps: int, lr: float = 0.1
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(start, end) parameters of ``steps`` Opacus DP-SGD steps on the one full batch of 32
    (poisson_sampling off, loss_reduction mean, flat clipping C = 1, noise generator 123)."""
    from opacus import PrivacyEngine

    model, x, y = mlp_and_data()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            poisson_sampling=False,
            noise_generator=torch.Generator().manual_seed(123),
        )
        for _ in range(steps):
            for xb, yb in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(private(xb), yb).backward()
                optimizer.step()
    end = {k.removeprefix("_module."): v.detach().clone() for k, v in private.named_parameters()}
    return start, end


def ours(start: dict[str, torch.Tensor], sigma: float, steps: int, lr: float = 0.1) -> dict:
    model, x, y = mlp_and_data()
    fmodel = FunctionalModel(model, "classification")
    dp = DPSGD(clip=1.0, noise_multiplier=sigma, batch_size=32)
    draw = dp.noise_draw([(k, v.shape) for k, v in start.items()])
    gen = torch.Generator().manual_seed(123)
    params = dict(start)
    for _ in range(steps):
        batch = Batch(x, y, torch.ones(32), draw(gen))
        grads, _ = private_grad(fmodel, params, {}, batch, dp, dp.expected_batch(32))
        params = {k: params[k] - lr * grads[k] for k in params}
    return params


def test_dpsgd_equals_opacus():
    """docs/privacy.md's case: one step of the 10-16-3 MLP, B = 32, C = 1, sigma = 1.3, the same
    generator (seed 123) drawing the noise in parameter order; then 3 steps without noise."""
    start, theirs = opacus_steps(sigma=1.3, steps=1)
    mine = ours(start, sigma=1.3, steps=1)
    for k in start:
        assert torch.allclose(mine[k], theirs[k], atol=1e-6, rtol=0), k
        assert not torch.allclose(mine[k], start[k], atol=1e-3)
    start, theirs = opacus_steps(sigma=0.0, steps=3)
    mine = ours(start, sigma=0.0, steps=3)
    for k in start:
        assert torch.allclose(mine[k], theirs[k], atol=1e-6, rtol=0), k


def test_per_sample_clipping_bounds_each_sample_not_the_batch():
    """With one sample of a huge gradient the step is C / B per sample at most: the sum of
    clipped gradients has norm <= B' C for the B' real samples; padding counts nothing."""
    model, x, y = mlp_and_data()
    fmodel = FunctionalModel(model, "classification")
    params = {k: v.detach() * 50 for k, v in model.named_parameters()}  # large gradients
    dp = DPSGD(clip=0.5, noise_multiplier=0.0, batch_size=8)
    w = torch.zeros(32)
    w[:3] = 1.0
    grads, _ = private_grad(fmodel, params, {}, Batch(x, y, w), dp, 8.0)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    assert norm <= 3 * 0.5 / 8.0 + 1e-6
    assert norm > 0.5 / 8.0  # the three samples' gradients do not cancel entirely
    empty = Batch(x[:0], y[:0], torch.ones(0))
    grads, loss = private_grad(fmodel, params, {}, empty, dp, 8.0)
    assert all(float(g.abs().sum()) == 0 for g in grads.values()) and float(loss) == 0


def test_poisson_mask_rate():
    """Mean Poisson batch size over 1,000 steps within 3 standard errors of q n."""
    n, batch = 200, 16
    plan = poisson_plan(n, batch, 1000, torch.Generator().manual_seed(0))
    sizes = torch.tensor([float(b.shape[0]) for b in plan])
    q = batch / n
    assert abs(float(sizes.mean()) - q * n) < 3 * math.sqrt(n * q * (1 - q) / 1000)
    assert all(b.unique().shape == b.shape for b in plan)  # without replacement
    tiny = poisson_plan(5, 2, 200, torch.Generator().manual_seed(1))
    assert any(b.shape[0] == 0 for b in tiny)  # empty steps happen and are kept


def test_dpsgd_vmapped_equals_sequential():
    """8 clients (stragglers, so unequal step counts and a sequential tail), same seed: the
    vmap backend's parameters equal one client at a time within 1e-6."""
    config = sample_dp_config({"noise_multiplier": 1.1}, clients_per_round=8, stragglers=0.4)
    seq = fedloom.run(config, write=False, progress=False)
    for executor in ({"kind": "vectorized", "chunk_size": 8}, {"kind": "vectorized"}):
        vec = fedloom.run({**config, "executor": executor}, write=False, progress=False)
        for cid, params in seq.client_params.items():
            for key, value in params.items():
                assert torch.allclose(value, vec.client_params[cid][key], atol=1e-6, rtol=0)
        assert_same(seq, vec)


def test_without_noise_or_clipping_and_full_batches_it_is_plain_fedavg():
    """sigma 0, a bound no gradient reaches and B >= n (q = 1: every sample every step, the
    divisor q n = n): DP-SGD is full-batch gradient descent, so the run equals plain
    FedAvg's."""
    train = {"batch_size": 10_000, "local_epochs": 3}
    private = sample_dp_config({"noise_multiplier": 0.0, "clip": 1e9}, **train)
    plain = dp_config({}, **train)
    del plain["privacy"]
    a = fedloom.run(private, write=False, progress=False)
    b = fedloom.run(plain, write=False, progress=False)
    for key, value in a.global_params.items():
        assert torch.allclose(value, b.global_params[key], atol=1e-5), key
    assert a.summary["privacy"]["epsilon"] is None  # no noise: no finite guarantee


def test_a_run_reports_the_worst_clients_epsilon():
    result = fedloom.run(sample_dp_config({"noise_multiplier": 1.1}), write=False, progress=False)
    summary = result.summary["privacy"]
    q, steps = summary["sample_rate"], summary["steps"]
    assert summary["epsilon"] == pytest.approx(epsilon([(1.1, q, steps)], 1e-5), rel=1e-12)
    eps = [row["privacy"]["epsilon"] for row in result.history]
    assert eps == sorted(eps) and eps[-1] == summary["epsilon"]
    assert summary["kind"] == "sample_dp" and summary["accountant"] == "rdp"


def test_worst_epsilon_is_the_largest_over_the_clients():
    exposures = [(0.1, 100), (0.05, 400), (0.1, 50), (0.2, 30), (0.05, 100)]
    assert frontier(exposures) == [(0.2, 30), (0.1, 100), (0.05, 400)]
    each = [epsilon([(1.0, q, t)], 1e-5) for q, t in exposures]
    worst, at = worst_epsilon(1.0, exposures, 1e-5)
    assert worst == max(each) and at == exposures[each.index(max(each))]


def test_target_epsilon_holds_for_every_client():
    exposures = [(0.1, 200), (0.02, 1000), (0.5, 20)]
    sigma = noise_multiplier_for_all(4.0, 1e-5, exposures)
    assert worst_epsilon(sigma, exposures, 1e-5)[0] <= 4.0
    assert worst_epsilon(sigma - 0.02, exposures, 1e-5)[0] > 4.0  # and it is (nearly) tight
    result = fedloom.run(sample_dp_config({"target_epsilon": 6.0}), write=False, progress=False)
    assert 0 < result.summary["privacy"]["epsilon"] <= 6.0


def test_the_mechanism_counts_each_clients_steps_and_resumes_them():
    cfg = PrivacyConfig(kind="sample_dp", noise_multiplier=1.0)
    dp = SampleLevelDP(cfg, {0: 100, 1: 400}, batch_size=20, max_steps={0: 10, 1: 40})
    dp.record({0: 5, 1: 20})
    dp.record({1: 20})
    assert dp.rates == {0: 0.2, 1: 0.05} and dp.steps == {0: 5, 1: 40}
    again = SampleLevelDP(cfg, {0: 100, 1: 400}, batch_size=20, max_steps={0: 10, 1: 40})
    again.load_state_dict(dp.state_dict())
    assert again.steps == dp.steps and again.privacy_spent() == dp.privacy_spent()


def test_a_private_run_resumes_bit_for_bit(tmp_path):
    config = sample_dp_config({"noise_multiplier": 0.8}, rounds=4)
    config["checkpoint"] = {"every": 1}
    killed_and_resumed(config, tmp_path, crash_round=3)


@pytest.mark.parametrize(
    ("privacy", "algorithm", "message"),
    [
        ({"noise_multiplier": 1.0}, "ditto", r"sample_dp needs .* Supported: .*fedavg"),
        ({"noise_multiplier": 1.0}, "fedsgd", "sample_dp needs"),
        ({"noise_multiplier": 1.0, "adaptive_clip": {}}, "fedavg", "client_dp only"),
        ({}, "fedavg", "exactly one"),
    ],
)
def test_settings_it_cannot_honour_are_config_errors(privacy, algorithm, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(sample_dp_config(privacy, algorithm))


def test_models_with_buffers_are_refused():
    config = sample_dp_config({"noise_multiplier": 1.0})
    config["model"] = {"name": "cnn_bn"}
    with pytest.raises(ConfigError, match="buffers"):
        fedloom.run(config, write=False, progress=False)


SUPPORTED = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).capabilities.supports_sample_dp]


@pytest.mark.parametrize("algorithm", SUPPORTED)
def test_every_algorithm_that_declares_it_takes_private_steps_on_both_backends(algorithm):
    """Two rounds: the vectorized run equals the sequential one, and the noise moves it."""
    config = sample_dp_config({"noise_multiplier": 2.0}, algorithm, rounds=2)
    config["eval"] = {"every": 1}
    seq = fedloom.run(config, write=False, progress=False)
    vec = fedloom.run(
        {**config, "executor": {"kind": "vectorized", "chunk_size": 3}},
        write=False,
        progress=False,
    )
    assert_same(seq, vec)
    quiet = sample_dp_config({"noise_multiplier": 0.0}, algorithm, rounds=2)
    plain = fedloom.run(quiet, write=False, progress=False)
    moved = [
        float((seq.client_params[c][k] - plain.client_params[c][k]).abs().max())
        for c in seq.client_params
        for k in seq.client_params[c]
    ]
    assert max(moved) > 1e-4
