"""FedPAC (Xu et al., ICLR 2023, arXiv:2306.11867): the feature statistics and the body's
aligned step against hand-written ones, the server's head combination against the enumerated
QP, the reduction to FedRep (one client a round, lamda = 0), that alignment and combination
change the models, refusals, resume, and learning on the shared Fashion-MNIST shards setup.
The QP solver itself: tests/algorithms/test_simplex_qp.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.base import ClientResult
from fedloom.algorithms.client import client_program
from fedloom.algorithms.fedpac import feature_statistics
from fedloom.errors import ConfigError
from fedloom.solvers.ops import AUTOGRAD
from fedloom.solvers.program import Batch
from tests.algorithms.digits_setup import BODY, HEAD, TRAINED, digits_config
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl
from tests.algorithms.test_simplex_qp import brute_force
from tests.algorithms.tiny_2nn_setup import (
    CLASSES,
    HELD,
    HIDDEN,
    client_data,
    features,
    logits,
    make_ctx,
)
from tests.resume import killed_and_resumed


def tiny_fedpac(**keys):
    datas = [client_data(labels, seed=c) for c, labels in enumerate(HELD)]
    ctx = make_ctx({c: d.num_train for c, d in enumerate(datas)}, batch_size=3)
    algo = build_algorithm({"name": "fedpac", **keys}, ctx)
    return ctx, algo, datas


def test_fedpac_feature_statistics_by_hand():
    ctx, _, datas = tiny_fedpac()
    params, buffers = ctx.model.initial_state(0)
    data = datas[2]  # classes 2 (3 samples), 5 (6 samples)
    task = ClientTask(2, data, [], 0.1, 0)
    v, h = feature_statistics(ctx.model, "fc3", params, buffers, task, CLASSES, HIDDEN)
    z = features(params, data.x_train).double()
    n = data.num_train
    expected_v, expected_h = 0.0, torch.zeros(CLASSES, HIDDEN, dtype=torch.float64)
    for c in (2, 5):
        rows = z[data.y_train == c]
        p = rows.shape[0] / n
        mu = rows.mean(0)
        expected_h[c] = p * mu
        expected_v += p * float((rows**2).sum(1).mean()) - p**2 * float((mu**2).sum())
    assert float(v) == pytest.approx(expected_v / n, rel=1e-10)
    assert torch.allclose(h, expected_h, atol=1e-12)
    assert float(v) > 0


def test_fedpac_server_combines_the_heads_with_the_qp_weights():
    ctx, algo, _ = tiny_fedpac()
    server = algo.init_server_state(*ctx.model.initial_state(0))
    gen = torch.Generator().manual_seed(3)
    params, _ = ctx.model.initial_state(0)
    results = []
    for cid, weight in ((0, 6.0), (2, 9.0)):
        body = {k: torch.randn(v.shape, generator=gen) for k, v in params.items() if "fc3" not in k}
        head = {k: torch.randn(v.shape, generator=gen) for k, v in params.items() if "fc3" in k}
        upload = {
            "params": body,
            "buffers": {},
            "head": head,
            "protos": {
                "ids": torch.tensor([cid]),
                "mean": torch.rand(1, HIDDEN, generator=gen),
                "count": torch.tensor([4]),
            },
            "stats": {
                "v": torch.rand((), generator=gen),
                "h": torch.rand(CLASSES, HIDDEN, generator=gen),
            },
        }
        results.append(ClientResult(upload, weight, 0.0, client_id=cid, round=0))
    new = algo.aggregate(server, results)

    v = torch.stack([r.upload["stats"]["v"] for r in results]).double()
    hs = [r.upload["stats"]["h"].double().flatten() for r in results]
    for i, cid in enumerate((0, 2)):
        gram = [[float((hs[i] - hs[j]) @ (hs[i] - hs[k])) for k in range(2)] for j in range(2)]
        p = torch.diag(v) + torch.tensor(gram, dtype=torch.float64)
        alpha = brute_force(p)
        assert 0.0 < float(alpha[0]) < 1.0  # both heads take part
        for key in HEAD:
            expected = sum(alpha[j] * results[j].upload["head"][key].double() for j in range(2))
            assert torch.allclose(new["heads"][key][cid], expected.float(), atol=1e-6), key
    for key in ("fc3.weight", "fc3.bias"):  # client 1 did not take part: its head stays
        assert torch.equal(new["heads"][key][1], server["heads"][key][1])
    for key in results[0].upload["params"]:  # the body: sample-weighted mean
        mean = (6 * results[0].upload["params"][key] + 9 * results[1].upload["params"][key]) / 15
        assert torch.allclose(new["params"][key], mean, atol=1e-6)
    assert new["known"].tolist() == [c in (0, 2) for c in range(CLASSES)]
    assert torch.equal(new["protos"][2], results[1].upload["protos"]["mean"][0])


def test_fedpac_body_step_is_ce_plus_lamda_mse_to_the_centroids_with_the_head_frozen():
    lamda, lr = 2.0, 0.1
    ctx, algo, _ = tiny_fedpac(lamda=lamda)
    data = client_data([0, 1, 1, 2, 3, 3], seed=4)  # class 3 has no centroid
    server = algo.init_server_state(*ctx.model.initial_state(0))
    server["protos"] = torch.rand(CLASSES, HIDDEN, generator=torch.Generator().manual_seed(2))
    server["known"][[0, 1, 2, 5]] = True
    message = algo.server_message(server)
    state = algo.init_client_state(server, 0)
    task = ClientTask(0, data, [torch.arange(data.num_train)], lr, 1)
    program = client_program(algo)
    carry, shared = program.init(message, state, task), program.shared(message, task)
    batch = Batch(data.x_train, data.y_train, torch.ones(data.num_train))
    after, metrics = program.body_step(AUTOGRAD, carry, (batch,), shared)

    start = carry["params"]
    leaves = {k: start[k].clone().requires_grad_(True) for k in BODY}
    full = {**start, **leaves}
    h = features(full, data.x_train)
    has = (data.y_train != 3).float()[:, None]
    mse = (((h - server["protos"][data.y_train]) * has) ** 2).sum() / (data.num_train * HIDDEN)
    loss = F.cross_entropy(logits(full, data.x_train), data.y_train) + lamda * mse
    grads = torch.autograd.grad(loss, list(leaves.values()))
    assert float(metrics["loss"]) == pytest.approx(float(loss.detach()), rel=1e-6)
    for k, g in zip(BODY, grads, strict=True):
        assert torch.allclose(after["params"][k], start[k] - lr * g, atol=1e-6), k
    for k in HEAD:
        assert torch.equal(after["params"][k], start[k]), k


def test_fedpac_with_one_client_a_round_and_no_alignment_is_fedrep():
    # alpha = [1]: each client's head is its own; lamda = 0: the body's steps are FedRep's
    fedpac = run({"name": "fedpac", "lamda": 0.0, "head_steps": 3}, clients_per_round=1, rounds=4)
    fedrep = run(
        {"name": "fedrep", "head_steps": 3, "weighting": "samples"}, clients_per_round=1, rounds=4
    )
    for c in range(6):
        for key, value in fedrep.client_params[c].items():
            assert torch.allclose(fedpac.client_params[c][key], value, atol=1e-7, rtol=0), (c, key)
    assert fedpac.summary["final"]["personalized"] == pytest.approx(
        fedrep.summary["final"]["personalized"]
    )


def test_fedpac_alignment_and_combination_change_the_models():
    plain = run({"name": "fedrep", "head_steps": 3, "weighting": "samples"}, rounds=3)
    combined = run({"name": "fedpac", "lamda": 0.0, "head_steps": 3}, rounds=3)
    aligned = run({"name": "fedpac", "head_steps": 3}, rounds=3)

    def gap(a, b, keys):
        return max(
            float((a.client_params[c][k] - b.client_params[c][k]).abs().max())
            for c in TRAINED
            for k in keys
        )

    # measured: heads 1.3e-3 apart (combined vs own), bodies 3.2e-4 (aligned vs not)
    assert gap(plain, combined, HEAD) > 3e-4
    assert gap(combined, aligned, BODY) > 8e-5


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedpac", "lamda": -1.0}, "algorithm.lamda"),
        ({"name": "fedpac", "head_epochs": -1}, "algorithm.head_epochs"),
        ({"name": "fedpac", "weighting": "size"}, "algorithm.weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


def test_fedpac_refuses_sample_dp():
    config = digits_config({"name": "fedpac"})
    config["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
    with pytest.raises(ConfigError, match="sample_dp"):
        fedloom.run(config, write=False, progress=False)


def test_fedpac_killed_and_resumed_equals_uninterrupted(tmp_path):
    # the server state holds the body, the centroids and the head table
    config = digits_config({"name": "fedpac", "head_steps": 3}, rounds=4, stragglers=0.3)
    config["checkpoint"] = {"every": 2}
    config["eval"] = {"every": 2, "new_clients": 1}
    killed_and_resumed(config, tmp_path, crash_round=3)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
@pytest.mark.heavy(budget=300)
def test_fedpac_beats_fedavg_on_label_shards(data_root):
    # Measured (seed 0): personalized mean 0.9632, P10 0.912 (204 s on a busy shared machine:
    # the head's epoch is ~94 steps a client beside the body's 20); FedAvg's global model on the
    # same clients 0.6215.
    result = run_pfl({"name": "fedpac"})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.20, accuracy


# -- the stacked aligned body step (the vectorized executor on a stackable model) -------------
@pytest.mark.parametrize("optimizer", [None, "adamw"])
def test_fedpacs_stacked_aligned_body_step_equals_its_vmapped_step(optimizer):
    """eq. 5-6 for three clients at once without vmap (``stacked_body_step``, the alignment
    term on the head's input features: core/stacked.py's ``FeaturePenalty``) takes the steps
    ``body_step`` takes under vmap: padded minibatches (zero-weight samples pull nothing) and
    a class without a centroid included. Measured over 4 steps: SGD 1.5e-8; AdamW, which
    divides each step by the gradient's own size, 7.4e-6."""

    from fedloom.solvers.adamw import AdamW
    from tests.algorithms.digits_setup import digits_ctx
    from tests.algorithms.stacked_setup import step_both
    from tests.algorithms.test_fedrep import digits_client

    ctx = digits_ctx()
    ctx.optimizer = AdamW(weight_decay=0.05) if optimizer else None
    algo = build_algorithm({"name": "fedpac", "lamda": 2.0}, ctx)
    program = client_program(algo)
    assert program.updates[-1].stacked is not None
    server = algo.init_server_state(*ctx.model.initial_state(0))
    gen = torch.Generator().manual_seed(3)
    server["protos"] = torch.rand(server["protos"].shape, generator=gen)
    server["known"][:] = True
    server["known"][7] = False  # samples of class 7 are pulled nowhere
    message = algo.server_message(server)
    carries, xs, ys = [], [], []
    for c in range(3):
        data = digits_client(c)
        task = ClientTask(c, data, [], 0.05, 1)
        carries.append(program.init(message, algo.init_client_state(server, c), task))
        xs.append(data.x_train[:16])
        ys.append(data.y_train[:16])
    shared = program.shared(message, task)
    assert shared["aligned"]
    x, y, w = torch.stack(xs), torch.stack(ys), torch.ones(3, 16)
    w[1, 10:] = 0.0  # client 1's minibatch is padded
    assert bool((y == 7).any())
    stacked, vmapped = step_both(
        carries, (x, y, w), program.stacked_body_step, program.body_step, shared
    )
    gap = max(float((stacked["params"][k] - v).abs().max()) for k, v in vmapped["params"].items())
    before = carries[0]["params"]
    moved = max(float((v[0] - before[k]).abs().max()) for k, v in vmapped["params"].items())
    assert gap <= (1e-4 if optimizer else 1e-6), gap
    assert moved > 1e-3
    for k in HEAD:  # the head is frozen in the body's phase
        assert torch.equal(stacked["params"][k][0], before[k]), k
