"""FedNTD, FedLC, FedGen and FedProto as client programs (algorithms/objective.py): the head's
features as a pure function, every objective over the real samples of a padded minibatch under
vmap (equal to the unpadded sequential step), FedGen's draws from each client's own stream, and
the vectorized executor running their clients in chunks, every term active, with the sequential
executor's numbers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad_and_value, vmap

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.algorithms.fedgen import generate
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.rng import generator
from fedloom.models import MLP
from fedloom.solvers.ops import AUTOGRAD, FUNC
from fedloom.solvers.program import Batch
from fedloom.solvers.sequential import run_client
from tests.algorithms.digits_setup import digits_ctx
from tests.engine.test_executor_equivalence import assert_same, config

HIDDEN, CLASSES = 6, 5


def features(params: dict, x: torch.Tensor) -> torch.Tensor:
    """h(x) of the MLP, the head's input, written out."""
    h = torch.relu(F.linear(x.flatten(1), params["fc1.weight"], params["fc1.bias"]))
    return torch.relu(F.linear(h, params["fc2.weight"], params["fc2.bias"]))


def test_forward_with_features_is_pure_under_vmap_and_grad():
    model = FunctionalModel(MLP((1, 4, 4), CLASSES, hidden=HIDDEN), "classification")
    params, buffers = model.initial_state(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 1, 4, 4, generator=gen)  # two clients' minibatches
    stacked = {
        k: torch.stack([v, v + 0.1 * torch.randn(v.shape, generator=gen)])
        for k, v in params.items()
    }

    def objective(p: dict, xb: torch.Tensor) -> torch.Tensor:
        out, h = model.forward_with_features(p, buffers, xb, "fc3")
        return out.square().sum() + h.sum()

    out, h = vmap(lambda p, xb: model.forward_with_features(p, buffers, xb, "fc3"))(stacked, x)
    grads, values = vmap(grad_and_value(objective))(stacked, x)
    for c in range(2):
        own = {k: v[c] for k, v in stacked.items()}
        expected = features(own, x[c])
        assert torch.allclose(h[c], expected, atol=1e-6)
        logits = F.linear(expected, own["fc3.weight"], own["fc3.bias"])
        assert torch.allclose(out[c], logits, atol=1e-6)
        leaves = {k: v.clone().requires_grad_(True) for k, v in own.items()}
        value = objective(leaves, x[c])
        by_hand = torch.autograd.grad(value, list(leaves.values()))
        assert float(values[c]) == pytest.approx(float(value.detach()), rel=1e-6)
        for k, g in zip(leaves, by_hand, strict=True):
            assert torch.allclose(grads[k][c], g, atol=1e-5), k
    assert not model.module.fc3._forward_pre_hooks  # the hook is gone


# -- every objective, one step: padded under vmap == unpadded one client at a time ---------
ACTIVE: dict[str, dict[str, Any]] = {
    "fedntd": {"tau": 2.0, "beta": 1.5},
    "fedlc": {"tau": 1.0, "prior_weight": 0.5},
    "fedgen": {"alpha_gen": 1.0, "latent_beta": 0.5, "noise_dim": 4, "generator_hidden": 8},
    "fedproto": {"lam": 1.0, "repel": 0.5},
}
"""Hyperparameters that switch every term of each objective on."""


def active_round(name: str) -> tuple[Any, dict, list[dict | None]]:
    """(algorithm, message, client states) of a round where every term acts: FedGen's
    generator has trained, FedProto has prototypes for classes 0, 1, 2 and 5."""
    ctx = digits_ctx(hidden=HIDDEN)
    algo = build_algorithm({"name": name, **ACTIVE[name]}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    gen = torch.Generator().manual_seed(1)
    if name == "fedgen":
        server["adam"]["step"] = torch.tensor(1)
        server["label_counts"][0] = torch.tensor([5, 1, 0, 3, 2, 7, 1, 0, 4, 2])
    if name == "fedproto":
        server["protos"] = torch.rand(10, HIDDEN, generator=gen)
        server["known"][[0, 1, 2, 5]] = True
    states = [algo.init_client_state(server, c) for c in range(2)]
    return algo, algo.server_message(server), states


def digits_clients(sizes: list[int]) -> list[ClientData]:
    gen = torch.Generator().manual_seed(7)
    datas = []
    for n in sizes:
        x = torch.randn(n, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (n,), generator=gen)
        datas.append(ClientData(x, y, x[:1], y[:1]))
    return datas


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_objectives_ignore_padding_and_vmap_equals_one_client_at_a_time(name):
    algo, message, states = active_round(name)
    program = client_program(algo)
    assert program.regularized(message)
    sizes = [4, 7]
    datas = digits_clients(sizes)
    tasks = [
        ClientTask(c, d, [torch.arange(n)], 0.1, 2)
        for c, (d, n) in enumerate(zip(datas, sizes, strict=True))
    ]
    for state, task in zip(states, tasks, strict=True):  # the backends: every plan first
        program.plans(message, state, task)
    carries = [program.init(message, s, t) for s, t in zip(states, tasks, strict=True)]
    move = torch.Generator().manual_seed(5)
    for carry in carries:  # away from the broadcast model, where FedNTD's term is flat
        carry["params"] = {
            k: v + 0.1 * torch.randn(v.shape, generator=move) for k, v in carry["params"].items()
        }
    shared = program.shared(message, tasks[0])
    model = algo.ctx.model
    model.module.train()

    # one client at a time, real samples only (the sequential backend)
    with torch.no_grad():
        reference = [
            program.step(AUTOGRAD, carry, (Batch(d.x_train, d.y_train, torch.ones(n)),), shared)
            for carry, d, n in zip(carries, datas, sizes, strict=True)
        ]

    # both clients in one vmapped call, the first padded to 7 samples with junk of weight 0
    width = max(sizes)
    junk = torch.Generator().manual_seed(3)
    xs, ys, ws = [], [], []
    for d, n in zip(datas, sizes, strict=True):
        pad = width - n
        xs.append(torch.cat([d.x_train, 50 * torch.randn(pad, 1, 8, 8, generator=junk)]))
        ys.append(torch.cat([d.y_train, torch.randint(0, 10, (pad,), generator=junk)]))
        ws.append(torch.cat([torch.ones(n), torch.zeros(pad)]))
    x, y, w = torch.stack(xs), torch.stack(ys), torch.stack(ws)

    def stack(trees: list[Any]) -> Any:
        if isinstance(trees[0], dict):
            return {k: stack([t[k] for t in trees]) for k in trees[0]}
        return torch.stack(trees)

    def one(carry: dict, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor) -> Any:
        return program.step(FUNC, carry, (Batch(xb, yb, wb),), shared)

    with torch.no_grad():
        new, metrics = vmap(one)(stack(carries), x, y, w)
        # the same junk with weight 1 does change the step: the weights are what hides it
        counted, _ = vmap(one)(stack(carries), x, y, torch.ones_like(w))
    for c, (ref_carry, ref_metrics) in enumerate(reference):
        assert float(metrics["loss"][c]) == pytest.approx(float(ref_metrics["loss"]), rel=1e-5)
        for k, value in ref_carry["params"].items():
            assert torch.allclose(new["params"][k][c], value, atol=1e-6), (c, k)
    moved = (counted["params"]["fc1.weight"][0] - new["params"]["fc1.weight"][0]).abs().max()
    assert float(moved) > 1e-4


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_fused_sequential_path_equals_stepping_through_the_program(name):
    # run_lean (the lean flat-buffer trainer) against the program's own step, one client
    algo, message, states = active_round(name)
    program = client_program(algo)
    (data,) = digits_clients([27])
    plan = algo.ctx.make_plan(data, 5, "batches", 2, 1)  # batches of 8, 8, 8, 3, 8
    task = ClientTask(1, data, plan, 0.1, 2)
    fused = run_client(client_program(algo), message, states[1], task)
    program.run_lean = lambda *args: None  # the sequential backend steps through ``updates``
    stepped = run_client(client_program(algo), message, states[1], task)
    assert fused.loss == pytest.approx(stepped.loss, rel=1e-5)
    model = (fused.state or fused.upload)["params"]
    other = (stepped.state or stepped.upload)["params"]
    for k, value in model.items():
        assert torch.allclose(value, other[k], atol=1e-5), k
    start = (states[1] or message)["params"]  # FedProto starts from the client's own model
    assert max(float((v - start[k]).abs().max()) for k, v in model.items()) > 1e-3


# -- FedGen's draws ---------------------------------------------------------------------------
def test_fedgen_steps_use_each_steps_draws_from_the_clients_stream():
    algo, message, _ = active_round("fedgen")
    cfg, ctx = algo.config, algo.ctx
    (data,) = digits_clients([9])
    plan = [torch.arange(5), torch.arange(5, 9)]  # two steps of 5 and 4 samples
    lr, round_, client = 0.1, 4, 2
    result = run_client(
        client_program(algo), message, None, ClientTask(client, data, plan, lr, round_)
    )

    stream = generator(ctx.seed, "fedgen", round_, client)
    prior, gen = message["label_prior"]["p"], message["generator"]
    params = dict(message["params"])
    for idx in plan:
        n = idx.shape[0]
        y_hat = torch.multinomial(prior, n, True, generator=stream)
        z = torch.randn(n, cfg.noise_dim, generator=stream)
        z_latent = torch.randn(n, cfg.noise_dim, generator=stream)
        x, y = data.x_train[idx], data.y_train[idx]
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}

        def head(feats: torch.Tensor, p: dict = leaves) -> torch.Tensor:
            return F.linear(feats, p["fc3.weight"], p["fc3.bias"])

        out = head(features(leaves, x))
        target = F.softmax(head(generate(gen, z_latent, y)), dim=-1).detach()
        kl = (target * (target.log() - F.log_softmax(out, dim=-1))).sum(-1).mean()
        loss = (
            F.cross_entropy(out, y)
            + cfg.alpha_gen * F.cross_entropy(head(generate(gen, z, y_hat)), y_hat)
            + cfg.latent_beta * kl
        )
        grads = torch.autograd.grad(loss, list(leaves.values()))
        params = {k: p.detach() - lr * g for (k, p), g in zip(leaves.items(), grads, strict=True)}
    for k, value in params.items():
        assert torch.allclose(result.upload["params"][k], value, atol=1e-6), k
    # another client's stream: other draws, another model from the same data and plan
    other = run_client(
        client_program(algo), message, None, ClientTask(client + 1, data, plan, lr, round_)
    )
    assert not torch.allclose(other.upload["params"]["fc3.bias"], params["fc3.bias"], atol=1e-6)


# -- the vectorized executor: whole chunks, every term active --------------------------------
@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_vectorized_executor_runs_them_in_chunks_like_sequential(name, monkeypatch):
    def make(executor: dict) -> dict:
        cfg = config(name, "mlp", executor, 16)
        cfg["algorithm"].update(ACTIVE[name])
        train = cfg["train"]
        del train["local_epochs"]
        train.update({"local_steps": 3, "stragglers": 0.0, "rounds": 3})
        return cfg

    sequential = fedloom.run(make({"kind": "sequential"}), write=False, progress=False)

    import fedloom.engine.sequential as sequential_executor
    import fedloom.solvers.sequential as sequential_backend
    import fedloom.solvers.vmap as vmap_backend

    def one_at_a_time(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a client ran one at a time")

    widths: list[int] = []
    step = vmap_backend.ChunkRunner._step

    def spy(self, update, leaves, spec, index, buffers, s, rows, *args):
        widths.append(len(rows) if isinstance(rows, list) else rows.stop - (rows.start or 0))
        return step(self, update, leaves, spec, index, buffers, s, rows, *args)

    monkeypatch.setattr(sequential_backend, "run_client", one_at_a_time)
    monkeypatch.setattr(sequential_executor, "run_client", one_at_a_time)
    monkeypatch.setattr(vmap_backend, "run_steps", one_at_a_time)
    monkeypatch.setattr(vmap_backend.ChunkRunner, "_step", spy)
    vectorized = fedloom.run(
        make({"kind": "vectorized", "chunk_size": 8}), write=False, progress=False
    )
    # 3 rounds x 3 steps, each one vmapped call over the 5 sampled clients
    assert widths == [5] * 9
    assert_same(sequential, vectorized)
