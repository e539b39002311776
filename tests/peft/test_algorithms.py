"""The PEFT strategies with personal state under every personalization algorithm (FedAvg,
FedPer, FedRep, Ditto, APFL, pFedMe; docs/peft.md, "Algorithms"): sequential == vectorized,
what travels, HetLoRA's bytes at each client's rank and its self-pruning, the audit's rebuilt
models, resume. On the tiny random BERT (about a second a run once the session is warm)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fedloom
from fedloom.audit.finished_run import load_finished_run
from fedloom.config import parse_config
from fedloom.data import load_dataset
from fedloom.engine.loop import Engine
from fedloom.errors import ConfigError
from fedloom.models.transformer import PeftSpec
from fedloom.peft import build_peft_model
from fedloom.peft.sharing import RANK, Pruning, StrategySharing
from tests.peft.helpers import TINY_CLIENTS, resume_matches, tiny_config

HIDDEN, R, LAYERS, TARGETS, CLASSES = 32, 4, 2, 2, 5
HEAD_BYTES = (CLASSES * HIDDEN + CLASSES) * 4

STRATEGIES: dict[str, dict[str, Any]] = {
    "a": {"share": "a"},  # FedSA-LoRA: B personal
    "b": {"share": "b"},
    "hetlora": {"share": "both", "rank_by_size": True},
    "flora": {"share": "flora"},
    "fedex": {"share": "fedex"},
    "prompt": {"share": "a", "kind": "prompt", "personal_prompt_length": 2},
}
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedper": {},
    "fedrep": {"head_steps": 2},
    "ditto": {},
    "apfl": {},
    "pfedme": {"inner_steps": 2},
}
CHEAP = [("a", "fedrep"), ("hetlora", "ditto")]
"""Two pairs in the default run (every algorithm runs there with FedSA, sequentially); the
full matrix is heavy."""
MATRIX = [(s, a) for s in STRATEGIES for a in ALGORITHMS if (s, a) not in CHEAP and a != "fedavg"]


def config(strategy: str, algorithm: str, rounds: int = 1, **train: Any) -> dict[str, Any]:
    spec = dict(STRATEGIES[strategy])
    share = spec.pop("share")
    cfg = tiny_config(share, algorithm=algorithm, rounds=rounds, **spec)
    cfg["algorithm"].update(ALGORITHMS.get(algorithm, {}))
    cfg["train"].update({"local_steps": 2, **train})
    return cfg


def both_backends(cfg: dict[str, Any]) -> list[fedloom.RunResult]:
    runs = []
    for executor in ("sequential", "vectorized"):
        cfg["executor"]["kind"] = executor
        runs.append(fedloom.run(cfg, write=False, progress=False))
    return runs


def check_backends_agree(strategy: str, algorithm: str) -> None:
    seq, vec = both_backends(config(strategy, algorithm, rounds=2))
    a, b = seq.client_params, vec.client_params
    worst = max(float((a[c][k] - b[c][k]).abs().max()) for c in a for k in a[c])
    assert worst < 1e-4, (strategy, algorithm, worst)
    loss = [r.summary["final"]["personalized"]["loss_mean"] for r in (seq, vec)]
    assert abs(loss[0] - loss[1]) < 1e-4
    assert seq.summary["communication"] == vec.summary["communication"]


@pytest.mark.parametrize("strategy, algorithm", CHEAP)
def test_strategy_x_algorithm_sequential_equals_vectorized(strategy, algorithm):
    check_backends_agree(strategy, algorithm)


@pytest.mark.heavy(budget=240)
@pytest.mark.parametrize("strategy, algorithm", MATRIX)
def test_strategy_x_algorithm_matrix(strategy, algorithm):
    check_backends_agree(strategy, algorithm)


@pytest.mark.parametrize("algorithm", ["fedper", "fedrep", "ditto", "apfl", "pfedme"])
def test_fedsa_keeps_b_home_under_every_algorithm(algorithm):
    """Share a: the upload is A (and the body's other shared keys), never B; each client's
    deployed B is its own."""
    result = fedloom.run(config("a", algorithm), write=False, progress=False)
    factor = LAYERS * TARGETS * R * HIDDEN * 4
    head = 0 if algorithm in ("fedper", "fedrep") else HEAD_BYTES  # their head is personal
    assert result.summary["communication"]["bytes_up"] == TINY_CLIENTS * (factor + head)
    b_keys = [k for k in result.client_params[0] if k.endswith("lora_B")]
    deployed = result.client_params
    assert not all(torch.equal(deployed[1][k], deployed[0][k]) for k in b_keys)


def test_hetlora_bytes_count_each_clients_rank():
    """HetLoRA uploads A[:r_k] and B[:, :r_k] and downloads the global factors truncated at
    r_k: 2 x layers x targets x r_k x hidden floats plus the head, per client and way."""
    result = fedloom.run(config("hetlora", "fedavg"), write=False, progress=False)
    ranks = result.summary["extras"]["peft"]["ranks"]
    assert sorted(set(ranks.values())) != [R]  # heterogeneous ranks below r_max
    per_client = [HEAD_BYTES + 2 * LAYERS * TARGETS * r * HIDDEN * 4 for r in ranks.values()]
    comm = result.summary["communication"]
    assert comm["bytes_up"] == sum(per_client)
    assert comm["bytes_down"] == sum(per_client)


def _sharing(strength: float, decay: float) -> StrategySharing:
    spec = PeftSpec(r=R, share="both")
    keys = [f"lora.0.query.{f}" for f in ("lora_A", "lora_B")] + ["classifier.weight"]
    return StrategySharing(
        spec,
        keys,
        [],
        head="shared",
        scale=2.0,
        seed=0,
        population={},
        num_clients=2,
        rank_by_size=False,
        aggregation="mean",
        pruning=Pruning(strength, decay),
    )


def test_self_pruning_penalty_gradient_is_autograds():
    """The correction is the gradient of lambda ||B[:, t:r_k] A[t:r_k]||_F (t = floor(gamma
    r_k)), zero outside the tail and on the head."""
    sharing = _sharing(0.7, 0.5)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(R, HIDDEN, generator=g, requires_grad=True)
    b = torch.randn(HIDDEN, R, generator=g, requires_grad=True)
    head = torch.randn(CLASSES, HIDDEN, generator=g)
    rank = 3  # tail [1, 3)
    penalty = 0.7 * (b[:, 1:3] @ a[1:3]).norm()
    grad_a, grad_b = torch.autograd.grad(penalty, (a, b))
    params = {"lora.0.query.lora_A": a.detach(), "lora.0.query.lora_B": b.detach()}
    params["classifier.weight"] = head
    out = sharing.correction(params, {RANK: torch.tensor(rank)})
    assert out is not None
    torch.testing.assert_close(out["lora.0.query.lora_A"], grad_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["lora.0.query.lora_B"], grad_b, rtol=1e-5, atol=1e-6)
    assert float(out["classifier.weight"].abs().sum()) == 0.0
    # the tail's norm dropped below the received model's: prune to t; grew: keep r_k
    shrunk = {k: v.clone() for k, v in params.items()}
    shrunk["lora.0.query.lora_B"][:, 1:3] *= 0.5
    assert sharing.prune(rank, params, shrunk) == 1
    assert sharing.prune(rank, shrunk, params) == rank
    assert _sharing(0.0, 0.5).prune(rank, params, shrunk) == rank  # off


def test_self_pruning_lowers_ranks_and_bytes():
    """With a strong penalty (lambda 1, gamma 1/2) every client prunes once within 3 rounds
    (r_k -> max(1, floor(r_k / 2)); never in round 1, where the received tail is zero:
    measured, the largest client prunes in round 3, the others in round 2), trains nothing
    past its rank, and uploads at the pruned rank."""
    cfg = config("hetlora", "fedavg", rounds=3)
    cfg["peft"].update({"prune_strength": 1.0, "prune_decay": 0.5})
    result = fedloom.run(cfg, write=False, progress=False)
    peft = result.summary["extras"]["peft"]
    initial, ranks = peft["initial_ranks"], peft["ranks"]
    assert ranks == {c: max(1, r // 2) for c, r in initial.items()}
    for c, params in result.client_params.items():
        r = ranks[str(c)]
        for k, v in params.items():
            if k.endswith("lora_A"):
                assert float(v[r:].abs().sum()) == 0.0
    plain = fedloom.run(config("hetlora", "fedavg", rounds=3), write=False, progress=False)
    assert plain.summary["extras"]["peft"]["ranks"] == initial  # no penalty: no pruning
    assert result.summary["communication"]["bytes_up"] < plain.summary["communication"]["bytes_up"]


@pytest.mark.parametrize(
    "strategy, algorithm, extra, match",
    [
        ("a", "fedprox", {}, "share: a keeps state on each client"),
        ("a", "ditto", {"global_algorithm": "scaffold"}, "global_algorithm"),
        ("fedex", "apfl", {"final_averaging": True}, "final_averaging"),
        ("fedex", "pfedme", {"beta": 2.0}, "algorithm.beta"),
        ("hetlora", "fedrep", {}, None),
    ],
)
def test_refused_combinations_name_the_key(strategy, algorithm, extra, match):
    cfg = config(strategy, algorithm)
    cfg["algorithm"].update(extra)
    if match is None:  # self-pruning's penalty enters FedAvg's SGD only
        cfg["peft"]["prune_strength"] = 0.1
        match = "peft.prune_strength"
    parsed = parse_config(cfg)
    data = load_dataset(parsed.data, parsed.seed)
    with pytest.raises(ConfigError, match=match):
        Engine(parsed, data, build_peft_model(parsed, data.num_outputs))


def test_audit_rebuilds_the_peft_models(tmp_path):
    """``fedloom audit``'s finished run: the PEFT model rebuilt from config.yaml, each
    client's deployed model bit for bit the run's own."""
    result = fedloom.run(config("a", "ditto"), out=tmp_path / "run", progress=False)
    run = load_finished_run(tmp_path / "run")
    assert run.global_model is None  # FedSA: B is personal, no global model
    for c, (params, _) in run.deployed.items():
        assert set(params) == set(result.client_params[c])
        for k, v in result.client_params[c].items():
            assert torch.equal(params[k], v), (c, k)
    final = result.summary["final"]["personalized"]["accuracy_mean"]
    assert run.evaluation["personalized"]["accuracy_mean"] == pytest.approx(final, abs=1e-12)


def test_resume_fedsa_ditto_with_adamw(tmp_path):
    resume_matches(tmp_path, config("a", "ditto", rounds=2, optimizer="adamw", lr=0.01))


@pytest.mark.heavy(budget=60)
@pytest.mark.parametrize(
    "strategy, algorithm",
    [
        ("hetlora", "fedavg"),
        ("hetlora", "ditto"),
        ("a", "fedrep"),
        ("fedex", "apfl"),
        ("a", "pfedme"),
        ("b", "fedper"),
        ("flora", "ditto"),
    ],
)
def test_resume_each_new_combination(tmp_path, strategy, algorithm):
    cfg = config(strategy, algorithm, rounds=3)
    if strategy == "hetlora":
        cfg["peft"].update({"prune_strength": 1.0, "prune_decay": 0.5})
    resume_matches(tmp_path, cfg)


def test_fedrep_refuses_persistent_adamw_moments():
    cfg = config("a", "fedrep", optimizer={"kind": "adamw", "moments": "client"}, lr=0.01)
    with pytest.raises(ConfigError, match="moments: client"):
        fedloom.run(cfg, write=False, progress=False)
