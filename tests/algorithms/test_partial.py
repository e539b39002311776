"""Partial model sharing (algorithms/partial.py, HeadBodySplit) as FedPer, FedRep and LG-FedAvg
use it (Arivazhagan et al., 2019; Collins et al., ICML 2021; Liang et al., 2020): which part of
the model is shared and which is personal, the part new clients fine-tune, the bytes, the
server's weighted averages, the one-client reduction to FedAvg, the refusal of a model without
a body, and kill-and-resume."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.algorithms import ClientResult, ClientTask, build_algorithm
from fedloom.core.protocol import ClientData
from fedloom.errors import ConfigError
from fedloom.models import MLP
from tests.algorithms.digits_setup import (
    BODY,
    HEAD,
    NEW,
    TRAINED,
    digits_config,
    flat,
    initial_params,
)
from tests.algorithms.digits_setup import digits_ctx as make_ctx
from tests.algorithms.digits_setup import run_digits as run
from tests.resume import killed_and_resumed


def part_bytes(keys: list[str]) -> int:
    model = MLP((1, 8, 8), 10)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in keys)


# -- what is shared and what is personal ----------------------------------------------------
@pytest.mark.parametrize(
    ("algorithm", "shared", "personal"),
    [
        ({"name": "fedper"}, BODY, HEAD),
        ({"name": "fedrep", "head_steps": 5}, BODY, HEAD),
        ({"name": "lgfedavg"}, HEAD, BODY),
    ],
)
def test_shared_part_is_the_servers_and_the_personal_part_is_each_clients(
    algorithm, shared, personal, tmp_path
):
    config = digits_config(algorithm, clients_per_round=None)  # every client trains
    config["checkpoint"] = {"every": 3}
    result = fedloom.run(config, out=tmp_path, progress=False)
    assert result.run_dir is not None
    server = result.run_dir.latest_checkpoint()["server"]
    assert sorted(server["params"]) == sorted(shared)
    models = result.client_params
    # every deployed model, the new client's included, holds the server's shared part
    for c in [*TRAINED, NEW]:
        for key in shared:
            assert torch.equal(models[c][key], server["params"][key]), (c, key)
    # the personal parts are each client's own
    parts = [flat(models[c], personal) for c in TRAINED]
    for i in range(len(parts)):
        for j in range(i + 1, len(parts)):
            assert (parts[i] - parts[j]).abs().max() > 1e-3, (i, j)
    # the new client never trained: the initial personal part
    init = initial_params()
    for key in personal:
        assert torch.equal(models[NEW][key], init[key]), key
    assert result.global_params is None and result.summary["final"]["global"] is None


def test_new_clients_fine_tune_the_personal_part():
    ctx = make_ctx()
    assert build_algorithm({"name": "fedrep"}, ctx).deployment.adaptation_keys() == HEAD
    assert build_algorithm({"name": "lgfedavg"}, ctx).deployment.adaptation_keys() == BODY


# -- communication and the server ------------------------------------------------------------
@pytest.mark.parametrize(("name", "shared"), [("fedrep", BODY), ("lgfedavg", HEAD)])
def test_bytes_count_only_the_shared_part(name, shared):
    result = run({"name": name, **({"head_steps": 5} if name == "fedrep" else {})}, stragglers=0)
    comm = result.summary["communication"]
    # 3 rounds x 3 reporters x the shared part: body 212,800 bytes, head 8,040 bytes
    assert comm["bytes_up"] == 3 * 3 * part_bytes(shared)
    assert comm["bytes_down"] == 3 * 3 * part_bytes(shared)
    assert part_bytes(shared) == {"fedrep": 212_800, "lgfedavg": 8_040}[name]


@pytest.mark.parametrize(
    ("algorithm", "shared", "weighting"),
    [
        ({"name": "fedrep"}, BODY, "uniform"),  # Algorithm 1's 1/(rn) mean
        ({"name": "fedrep", "weighting": "samples"}, BODY, "samples"),
        ({"name": "lgfedavg"}, HEAD, "samples"),
        ({"name": "lgfedavg", "weighting": "uniform"}, HEAD, "uniform"),
    ],
)
def test_server_averages_the_shared_part_with_the_client_weights(algorithm, shared, weighting):
    ctx = make_ctx()
    algo = build_algorithm(algorithm, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    assert sorted(algo.server_message(server)["params"]) == sorted(shared)
    gen = torch.Generator().manual_seed(1)
    uploads = [
        {k: torch.randn(v.shape, generator=gen) for k, v in server["params"].items()}
        for _ in range(2)
    ]
    empty = ClientData(*[torch.zeros(0)] * 4)  # the weight depends on the client id only
    results = [
        ClientResult(
            {"params": p, "buffers": {}}, algo.client_weight(ClientTask(c, empty, [], 0.1, 1)), 0.0
        )
        for c, p in zip([0, 1], uploads, strict=True)
    ]
    new = algo.aggregate(server, results)
    n0, n1 = (ctx.population[0], ctx.population[1]) if weighting == "samples" else (1, 1)
    for key in shared:
        expected = (n0 * uploads[0][key] + n1 * uploads[1][key]) / (n0 + n1)
        assert torch.allclose(new["params"][key], expected, atol=1e-6), key
    assert sorted(new["params"]) == sorted(shared)


@pytest.mark.parametrize("name", ["lgfedavg", "fedper"])
def test_with_one_training_client_partial_sharing_is_fedavg(name):
    # the shared part comes back from the server as the client left it, the personal part
    # from its state: one uninterrupted run of local SGD, FedAvg's with one client
    config = digits_config({"name": name}, clients_per_round=None)
    config["data"] = {"name": "digits", "num_clients": 2, "partition": {"kind": "iid"}}
    # client 1 is held out: client 0 trains alone
    partial = fedloom.run(config, write=False, progress=False)
    config["algorithm"] = {"name": "fedavg"}
    fedavg = fedloom.run(config, write=False, progress=False)
    assert fedavg.global_params is not None
    for key, value in fedavg.global_params.items():
        # measured: bit-identical (the server's weighted mean of one upload is the upload)
        assert torch.allclose(partial.client_params[0][key], value, atol=1e-6), key


@pytest.mark.parametrize("name", ["fedrep", "lgfedavg"])
def test_a_model_without_body_is_refused(name):
    config = digits_config({"name": name})
    config["model"] = {"name": "logreg"}  # all of it is the head
    with pytest.raises(ConfigError, match=r"algorithm\.name: .*body"):
        fedloom.run(config, write=False, progress=False)


# -- resume ----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", [{"name": "fedrep", "head_epochs": 1}, {"name": "lgfedavg"}])
def test_killed_and_resumed_equals_uninterrupted(algorithm, tmp_path):
    # the client states (FedRep's heads, LG-FedAvg's bodies) must survive a checkpoint
    config = digits_config(algorithm, rounds=4, stragglers=0.3)
    config["checkpoint"] = {"every": 2}
    config["eval"] = {"every": 2, "new_clients": 1}
    killed_and_resumed(config, tmp_path, crash_round=3)
