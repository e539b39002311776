"""Acceptance test 2 (strategy contract and bytes), executor equivalence and resume with PEFT
on the tiny random BERT; every algorithm the issue names runs over the PEFT parameters."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.core.protocol import ClientResult
from fedloom.data import load_dataset
from fedloom.engine.loop import Engine
from fedloom.errors import ConfigError
from fedloom.peft import build_peft_model
from tests.peft.helpers import TINY_CLIENTS, resume_matches, tiny_config

HIDDEN, R, LAYERS, TARGETS, CLASSES = 32, 4, 2, 2, 5
HEAD_BYTES = (CLASSES * HIDDEN + CLASSES) * 4
FACTOR_BYTES = LAYERS * TARGETS * R * HIDDEN * 4  # A (r x in) or B (out x r), in = out = 32


def _engine(config: dict) -> Engine:
    cfg = parse_config(config)
    data = load_dataset(cfg.data, cfg.seed)
    return Engine(cfg, data, build_peft_model(cfg, data.num_outputs))


@pytest.mark.parametrize("share", ["a", "b", "both", "ffa", "fedex"])
def test_bytes_are_the_shared_factors_and_head(share):
    result = fedloom.run(tiny_config(share, rounds=1), write=False, progress=False)
    per_client = {
        "a": FACTOR_BYTES,
        "b": FACTOR_BYTES,
        "ffa": FACTOR_BYTES,
        "both": 2 * FACTOR_BYTES,
        "fedex": 2 * FACTOR_BYTES,
    }[share] + HEAD_BYTES
    comm = result.summary["communication"]
    assert comm["bytes_up"] == TINY_CLIENTS * per_client
    residual = LAYERS * TARGETS * HIDDEN * HIDDEN * 4 if share == "fedex" else 0
    assert comm["bytes_down"] == TINY_CLIENTS * (per_client + residual)


def test_shared_factor_identical_personal_untouched_by_server():
    engine = _engine(tiny_config("a"))
    algorithm = engine.algorithm
    server = algorithm.init_server_state(*engine.model.initial_state(0))
    assert not any(k.endswith("lora_B") for k in server["params"])  # B never reaches it
    g = torch.Generator().manual_seed(0)
    uploads = []
    for _ in range(3):
        params = {k: v + torch.randn(v.shape, generator=g) for k, v in server["params"].items()}
        uploads.append(ClientResult({"params": params, "buffers": {}}, 10.0, 0.0))
    new = algorithm.aggregate(server, uploads)
    assert set(new["params"]) == set(server["params"])
    result = fedloom.run(tiny_config("a"), write=False, progress=False)
    clients = result.client_params
    a_keys = [k for k in clients[0] if k.endswith("lora_A")]
    b_keys = [k for k in clients[0] if k.endswith("lora_B")]
    assert a_keys and b_keys
    for c in range(1, TINY_CLIENTS):
        assert all(torch.equal(clients[c][k], clients[0][k]) for k in a_keys)  # bitwise
        assert not all(torch.equal(clients[c][k], clients[0][k]) for k in b_keys)


@pytest.mark.parametrize(
    "share, kind, extra",
    [
        ("a", "lora", {}),
        ("fedex", "lora", {}),
        ("both", "lora", {"rank_by_size": True}),
        ("a", "adapter", {}),
        ("a", "prompt", {"personal_prompt_length": 2}),
    ],
)
def test_sequential_equals_vectorized(share, kind, extra):
    runs = [
        fedloom.run(tiny_config(share, kind=kind, executor=e, **extra), write=False, progress=False)
        for e in ("sequential", "vectorized")
    ]
    seq, vec = (r.client_params for r in runs)
    worst = max(float((seq[c][k] - vec[c][k]).abs().max()) for c in seq for k in seq[c])
    assert worst < 1e-4
    a, b = (r.summary["final"]["personalized"]["loss_mean"] for r in runs)
    assert abs(a - b) < 1e-4


def test_resume_equals_uninterrupted(tmp_path):
    resume_matches(tmp_path, tiny_config("a", rounds=3))


@pytest.mark.parametrize("algorithm", ["fedprox", "ditto", "fedrep", "pfedme"])
def test_other_algorithms_train_the_peft_parameters(algorithm):
    config = tiny_config("both", algorithm=algorithm, rounds=1)
    if algorithm == "fedrep":
        config["algorithm"]["head_steps"] = 3  # the paper's 10 head epochs: slow here
    result = fedloom.run(config, write=False, progress=False)
    params = result.client_params[0]
    assert all(k.startswith(("lora.", "classifier.")) for k in params)
    assert any(float(v.abs().sum()) > 0 for k, v in params.items() if k.endswith("lora_B"))


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"peft": {"kind": "lora", "targets": ["quer"]}}, "peft.targets: unknown quer"),
        ({"peft": {"kind": "adapter", "rank_by_size": True}}, "rank_by_size"),
        ({"peft": {"share": "a", "prune_strength": 0.1}}, "peft.prune_strength"),
        ({"peft": {"prune_decay": 1.0}}, "prune_decay"),
        ({"peft": None}, "add a peft section"),
        ({"model": {"name": "mlp"}}, "peft: needs a pretrained model"),
    ],
)
def test_config_errors(raw, match):
    config = tiny_config()
    config.update(raw)
    with pytest.raises(ConfigError, match=match):
        parse_config(config)


def test_hetlora_clients_train_their_rank_only():
    result = fedloom.run(
        tiny_config("both", rank_by_size=True, rounds=1), write=False, progress=False
    )
    ranks = result.summary["extras"]["peft"]["ranks"]
    assert len(set(ranks.values())) > 1 and max(ranks.values()) == R
    for c, params in result.client_params.items():
        r = ranks[str(c)]
        for k, v in params.items():
            if k.endswith("lora_A"):
                assert float(v[r:].abs().sum()) == 0.0 and float(v[:r].abs().sum()) > 0
            if k.endswith("lora_B"):
                assert float(v[:, r:].abs().sum()) == 0.0


def test_adapters_start_as_identity_and_prompts_run():
    for kind in ("adapter", "prompt"):
        result = fedloom.run(
            tiny_config("a", kind=kind, rounds=1, personal_prompt_length=2),
            write=False,
            progress=False,
        )
        keys = set(result.client_params[0])
        assert all(k.startswith(("adapters.", "prompts.", "classifier.")) for k in keys)


def test_compare_shows_strategies_side_by_side(tmp_path):
    from fedloom.report.compare import write_comparison

    for share in ("a", "both"):
        fedloom.run(tiny_config(share, rounds=1), out=tmp_path / share, progress=False)
    page = write_comparison([tmp_path / "a", tmp_path / "both"], tmp_path / "compare.html")
    html = page.read_text()
    assert "peft.share" in html and ">a<" in html and ">both<" in html
