"""APPLE (Luo and Wu, IJCAI 2022, arXiv:2110.08394; algorithms/apple.py).

* the loss scheduler lambda(r) mu (cosine and exponential) by hand;
* one local step (Eq. 5-6) by hand with autograd on (theta_i, p_i): the downloaded cores
  replace the client's copies, the own core and p_i move, the other copies stay;
* the reduction: with p_i^0 = e_i and a fixed p_i (dr_learning_rate 0), APPLE is local
  training; with learned p_i it is not;
* the download rule: never-downloaded cores first, then draws favouring large |p_ij|;
* bytes: M cores down per client; sample-level DP and AdamW are refused;
* a learning test on Fashion-MNIST against FedAvg (heavy).

Measured numbers are in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fedloom
from fedloom.algorithms.apple import APPLE, APPLEConfig, scheduler
from fedloom.algorithms.client import client_program
from fedloom.config import parse_config
from fedloom.core.protocol import ClientData, ClientTask
from fedloom.errors import ConfigError
from fedloom.solvers.sequential import run_client
from tests.algorithms.digits_setup import TRAINED, digits_config, digits_ctx
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


def apple(**keys) -> APPLE:
    return APPLE(APPLEConfig(name="apple", **keys), digits_ctx())


def test_loss_scheduler_by_hand():
    cos = APPLEConfig(name="apple", mu=0.5, L=0.2, decay="cosine")
    exp = APPLEConfig(name="apple", mu=0.5, L=0.2, decay="exponential")
    # T = 50 rounds: the scheduler decays over the first 10
    assert scheduler(0, 50, cos) == pytest.approx(0.5)
    assert scheduler(5, 50, cos) == pytest.approx(0.25)
    assert scheduler(3, 50, cos) == pytest.approx((math.cos(math.pi * 0.3) + 1) / 2 * 0.5)
    assert scheduler(10, 50, cos) == 0.0 and scheduler(30, 50, cos) == 0.0
    assert scheduler(0, 50, exp) == pytest.approx(0.5)
    assert scheduler(5, 50, exp) == pytest.approx(0.001**0.5 * 0.5)
    assert scheduler(10, 50, exp) == 0.0


def test_local_step_is_eq_5_and_6_by_hand():
    algorithm = apple(mu=0.1, L=1.0, dr_learning_rate=0.2)  # ctx: T = 1, lambda(0) mu = 0.1
    module = algorithm.ctx.model.module
    init, buffers = algorithm.ctx.model.initial_state(0)
    gen = torch.Generator().manual_seed(0)

    def table(scale: float) -> dict:
        return {
            k: torch.stack([v + scale * torch.randn(v.shape, generator=gen) for _ in range(4)])
            for k, v in init.items()
        }

    i = 1
    copies, latest = table(0.05), table(0.05)  # the client's stale copies, the server's
    state = algorithm.init_client_state({"params": init, "buffers": buffers}, i)
    p = torch.tensor([0.1, 0.5, 0.3, 0.1])
    state = {**state, "cores": copies, "p": p.clone()}
    x = torch.randn(12, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (12,), generator=gen)
    data = ClientData(x, y, x[:2], y[:2])
    task = ClientTask(i, data, [torch.arange(12)], 0.3, 0)
    result = run_client(client_program(algorithm), {"cores": latest}, state, task)

    # by hand: every other core downloaded (M: all), the own core the client's copy
    cores = [{k: (copies if j == i else latest)[k][j] for k in init} for j in range(4)]
    theta = {k: v.clone().requires_grad_(True) for k, v in cores[i].items()}
    pp = p.clone().requires_grad_(True)
    mixed = {k: sum(pp[j] * (theta[k] if j == i else cores[j][k]) for j in range(4)) for k in init}
    p0 = torch.tensor([30.0, 50.0, 20.0, 40.0]) / 140.0
    loss = F.cross_entropy(functional_call(module, mixed, (x,)), y)
    loss = loss + 0.1 * ((pp - p0) ** 2).sum()
    grads = torch.autograd.grad(loss, [*theta.values(), pp])
    after = result.state
    for (k, v), g in zip(theta.items(), grads[:-1], strict=True):
        assert torch.allclose(after["cores"][k][i], v - 0.3 * g, atol=1e-6), k
        assert torch.allclose(result.upload["params"][k], v - 0.3 * g, atol=1e-6), k
        for j in (0, 2, 3):  # the other copies: the downloaded cores, unchanged by training
            assert torch.equal(after["cores"][k][j], latest[k][j])
    assert torch.allclose(after["p"], p - 0.2 * grads[-1], atol=1e-6)
    assert after["seen"].all()


def test_fixed_one_hot_relationships_are_local_training():
    local = fedloom.run(digits_config({"name": "local"}), write=False, progress=False)
    own = {"name": "apple", "p_init": "own", "dr_learning_rate": 0.0, "mu": 1.0}
    fixed = fedloom.run(digits_config(own), write=False, progress=False)
    for c in TRAINED:
        for k, v in local.client_params[c].items():
            assert torch.allclose(fixed.client_params[c][k], v, atol=1e-6), (c, k)
    learned = fedloom.run(
        digits_config({**own, "dr_learning_rate": 0.05}), write=False, progress=False
    )
    gaps = [
        max((learned.client_params[c][k] - v).abs().max().item() for k, v in p.items())
        for c, p in local.client_params.items()
        if c in TRAINED
    ]
    assert max(gaps) > 1e-2  # measured 0.14: p_i learns to mix in the others' cores


def test_downloads_take_unseen_cores_first_then_favour_large_relationships():
    algorithm = apple(M=2)
    params, buffers = algorithm.ctx.model.initial_state(0)
    state = algorithm.init_client_state({"params": params, "buffers": buffers}, 0)
    first = algorithm.downloads(state, 0, 0)
    assert len(set(first.tolist())) == 2 and 0 not in first.tolist()
    assert torch.equal(first, algorithm.downloads(state, 0, 0))  # from the client's stream
    seen = state["seen"].clone()
    seen[first] = True
    (unseen,) = [j for j in range(4) if not bool(seen[j])]
    second = algorithm.downloads({**state, "seen": seen}, 1, 0)
    assert unseen in second.tolist() and 0 not in second.tolist()
    # all seen: draws without replacement, with probability base^|p_ij| (base 1.5 here)
    everything = {**state, "seen": torch.ones(4, dtype=torch.bool)}
    everything["p"] = torch.tensor([0.0, 0.0, 30.0, 0.0])
    picks = [algorithm.downloads(everything, r, 0).tolist() for r in range(2, 12)]
    assert all(2 in ids and 0 not in ids and len(set(ids)) == 2 for ids in picks)
    full = apple()  # M: all
    assert full.downloads(state, 0, 3).tolist() == [0, 1, 2]


def test_download_bytes_count_m_cores():
    result = fedloom.run(digits_config({"name": "apple", "M": 2}), write=False, progress=False)
    params = result.client_params[0]
    model_bytes = sum(v.numel() * v.element_size() for v in params.values())
    communication = result.history[-1]["communication"]
    assert communication["bytes_down_round"] == 3 * 2 * model_bytes  # 3 clients a round


def test_sample_dp_and_adamw_are_refused():
    private = digits_config({"name": "apple"})
    private["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
    with pytest.raises(ConfigError, match="apple"):
        parse_config(private)
    adamw = digits_config({"name": "apple"})
    adamw["train"]["optimizer"] = {"kind": "adamw"}
    with pytest.raises(ConfigError, match="apple"):
        fedloom.run(adamw, write=False, progress=False)


@pytest.mark.heavy(budget=600)  # measured 265 s on the loaded 2-core machine
def test_apple_learns_fashion_mnist_shards_and_beats_fedavg(data_root):
    result = run_pfl({"name": "apple", "dr_learning_rate": 0.05})
    accuracy = float(result.summary["final"]["personalized"]["accuracy_mean"])
    # measured 0.968 against FedAvg's 0.621 (local training: 0.957; the authors'
    # dr_learning_rate 0.001, tuned for their 160 rounds of 5 epochs: 0.88 with 0.01)
    assert accuracy > 0.94
    assert accuracy > fedavg_accuracy_on_clients() + 0.25


def test_stacked_step_equals_the_vmapped_step():
    """Eq. 5-6 for three clients at once without vmap (``stacked_step``: the mixtures and
    <g, theta_j> as batched products, the gradient at the mixtures stacked) takes the steps
    ``step`` takes under vmap, from relationship vectors and copies of their own and with a
    padded minibatch. Measured over 4 steps: cores 1.5e-8, p 3.0e-8."""

    from tests.algorithms.stacked_setup import step_both

    algorithm = apple(mu=0.1, L=1.0, dr_learning_rate=0.2)
    program = client_program(algorithm)
    assert program.updates[0].stacked is not None
    init, buffers = algorithm.ctx.model.initial_state(0)
    gen = torch.Generator().manual_seed(0)
    latest = {
        k: torch.stack([v + 0.05 * torch.randn(v.shape, generator=gen) for _ in range(4)])
        for k, v in init.items()
    }
    carries, xs, ys = [], [], []
    for i in range(3):
        state = algorithm.init_client_state({"params": init, "buffers": buffers}, i)
        p = torch.rand(4, generator=gen)
        state = {**state, "p": p / p.sum()}
        x = torch.randn(12, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (12,), generator=gen)
        task = ClientTask(i, ClientData(x, y, x[:2], y[:2]), [], 0.3, 0)
        carries.append(program.init({"cores": latest}, state, task))
        xs.append(x)
        ys.append(y)
    shared = program.shared({"cores": latest}, task)
    x, y, w = torch.stack(xs), torch.stack(ys), torch.ones(3, 12)
    w[2, 7:] = 0.0  # client 2's minibatch is padded
    stacked, vmapped = step_both(carries, (x, y, w), program.stacked_step, program.step, shared)
    gap = max(float((stacked["core"][k] - v).abs().max()) for k, v in vmapped["core"].items())
    gap_p = float((stacked["p"] - vmapped["p"]).abs().max())
    moved = max(
        float((vmapped["core"][k] - leaf).abs().max()) for k, leaf in carries_core(carries).items()
    )
    assert gap <= 1e-6 and gap_p <= 1e-6, (gap, gap_p)
    assert moved > 1e-3
    assert float((vmapped["p"] - torch.stack([c["p"] for c in carries])).abs().max()) > 1e-4


def carries_core(carries: list[dict]) -> dict[str, torch.Tensor]:
    """The chunk's own cores before any step, stacked."""
    return {k: torch.stack([c["core"][k] for c in carries]) for k in carries[0]["core"]}
