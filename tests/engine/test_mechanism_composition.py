"""The mechanisms compose through the protocol (core/mechanism.py) in their declared order
(engine/mechanisms.py), equal to composing them by hand: client-level DP's release over secure
aggregation's masked sum, a robust rule over what compression's server decoded, an attacker's
upload clipped by DP; and the round loop knows none of them by type."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from fedloom.compression.uploads import UploadCompression
from fedloom.config import parse_config
from fedloom.core.mechanism import ServerStep
from fedloom.core.protocol import ClientResult
from fedloom.core.rng import generator
from fedloom.data import load_dataset
from fedloom.engine.loop import Engine
from fedloom.engine.mechanism_builders import ORDER
from fedloom.models import build_model
from fedloom.privacy.client_dp import clip_update, update_norm
from fedloom.privacy.distributed_dp import DistributedDP
from fedloom.rl.aggregate import build_chain
from fedloom.rl.config import parse_rl_config
from fedloom.robust.aggregation import RobustAggregation

ENGINE = Path(__file__).resolve().parents[2] / "src" / "fedloom" / "engine"


def engine_for(**sections: dict[str, Any]) -> Engine:
    config: dict[str, Any] = {
        "seed": 5,
        "data": {"name": "digits", "num_clients": 10, "partition": {"kind": "iid"}},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 2, "clients_per_round": 6, "local_steps": 2, "lr": 0.05},
        "executor": {"kind": "sequential"},
        **sections,
    }
    cfg = parse_config(config)
    data = load_dataset(cfg.data, cfg.seed)
    return Engine(cfg, data, build_model(cfg.model.name, data.input_shape, data.num_outputs))


def client_models(engine: Engine, scale: float) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """The round-1 message and six clients' models around it (updates of norm ~``scale``)."""
    server = engine.initial_state().server
    message = engine.algorithm.server_message(server, 1)
    gen = torch.Generator().manual_seed(0)
    models = []
    for k in range(6):
        models.append(
            {
                key: value + scale * (k + 1) / 6 * torch.randn(value.shape, generator=gen)
                for key, value in message["params"].items()
            }
        )
    return message, models


def through_pipeline(
    engine: Engine, message: dict, models: list[dict[str, torch.Tensor]], round: int = 1
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The models through the mechanisms' hooks in the pipeline's order, then the algorithm's
    aggregation rule: (the aggregate, each upload's bytes on the wire)."""
    mechanisms = engine.mechanisms
    sent = mechanisms.start_round(round, message)
    results, sizes = [], []
    for c, params in enumerate(models):
        result = ClientResult({"params": params, "buffers": {}}, 1.0 + c, 0.0, client_id=c)
        sizes.append(mechanisms.send(round, result))
        result.upload = mechanisms.on_upload(result.upload, c, round)
        results.append(result)
    server = engine.initial_state().server
    mechanisms.before_aggregate(ServerStep(round, sent, results, {}, server))
    rule = engine.algorithm.ctx.aggregate
    trees = [r.upload["params"] for r in results]
    return rule(trees, [r.weight for r in results]), sizes


def test_client_dp_releases_secure_aggregations_sum_as_composed_by_hand():
    """theta + (sum_k clip(Delta_k) + N(0, z^2 C^2)) / (q N), the sum through SecAgg: equal to
    the formula computed here in the clear, up to the protocol's fixed-point quantization."""
    privacy = {"kind": "client_dp", "noise_multiplier": 0.5, "clip": 0.5, "sampling": "fixed"}
    engine = engine_for(privacy=privacy, secure_aggregation={"kind": "secagg"})
    message, models = client_models(engine, scale=1.0)
    out, _ = through_pipeline(engine, message, models)

    anchor = message["params"]
    clipped = [clip_update(m, anchor, 0.5, update_norm(m, anchor)) for m in models]
    gen = generator(5, "dp/noise", 1)
    expected = {}
    for key in sorted(anchor):
        total = sum((c[key].double() - anchor[key].double()) for c in clipped)
        noise = 0.25 * torch.randn(anchor[key].shape, generator=gen, dtype=torch.float64)
        expected[key] = anchor[key].double() + (total + noise) / 6
    assert engine.mechanisms.secure is not None
    secure = engine.mechanisms.secure
    assert secure.counters.rounds_completed == 1  # the sum went through the protocol
    for key in anchor:
        assert torch.allclose(out[key].double(), expected[key], atol=1e-5), key
    assert any(update_norm(m, anchor) > 0.5 for m in models)  # clipping was exercised


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_a_robust_rule_aggregates_what_compressions_server_decoded(rule):
    """Compression is the client's last step: the robust rule sees the decoded uploads, and
    the wire carries the encoded bytes."""
    engine = engine_for(compression={"kind": "topk", "ratio": 0.1}, aggregator={"kind": rule})
    message, models = client_models(engine, scale=0.3)
    out, sizes = through_pipeline(engine, message, models)

    cfg = engine.config
    codec = UploadCompression(cfg.compression, cfg.seed)
    codec.start_round(1, message)
    decoded, encoded = [], []
    for c, params in enumerate(models):
        upload, size = codec.transmit({"params": params, "buffers": {}}, c, 1)
        decoded.append(upload["params"])
        encoded.append(size)
    robust = RobustAggregation(cfg.aggregator, cfg.seed, cfg.byzantine_f(6))
    robust.start_round(1, message)
    expected = robust.aggregate(decoded, [1.0 + c for c in range(6)])
    assert sizes == encoded
    assert sizes[0] < sum(v.numel() * v.element_size() for v in models[0].values()) / 2
    for key in expected:
        assert torch.equal(out[key], expected[key]), key


def test_an_attackers_upload_is_clipped_by_client_dp_after_it_is_crafted():
    """The attack comes before privacy in the declared order: a scaled (boosted) update is
    clipped to C like any other."""
    privacy = {"kind": "client_dp", "noise_multiplier": 0.0, "clip": 0.5, "sampling": "fixed"}
    attack = {"kind": "scale", "fraction": 0.5, "scale": 50.0}
    engine = engine_for(privacy=privacy, attack=attack)
    message, models = client_models(engine, scale=0.01)
    mechanisms = engine.mechanisms
    mechanisms.start_round(1, message)
    anchor = message["params"]
    for c, params in enumerate(models):
        upload = mechanisms.on_upload({"params": params, "buffers": {}}, c, 1)
        norm = update_norm(upload["params"], anchor)
        if c in mechanisms.malicious:
            assert norm == pytest.approx(0.5, rel=1e-5)  # boosted 50x, then clipped
        else:
            assert norm == pytest.approx(update_norm(params, anchor), rel=1e-6)
    assert mechanisms.malicious


def test_the_declared_order_and_no_type_switch_in_the_engine():
    """Every built-in mechanism in ORDER; no ``isinstance`` on a mechanism anywhere in the
    engine's round loop, pipeline or mechanism composition."""
    privacy = {"kind": "client_dp", "noise_multiplier": 0.5, "clip": 0.5, "sampling": "fixed"}
    engine = engine_for(
        privacy=privacy, secure_aggregation={"kind": "secagg"}, compression={"download": "fp16"}
    )
    assert [m.key for m in engine.mechanisms.all] == ["compression", "secure", "privacy"]
    assert list(ORDER) == ["attack", "compression", "secure", "robust", "privacy"]
    for name in (
        "loop.py",
        "pipeline.py",
        "mechanisms.py",
        "mechanism_builders.py",
        "asynchrony.py",
    ):
        tree = ast.parse((ENGINE / name).read_text())
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance"
        ]
        assert not calls, f"engine/{name} switches on types"


def test_one_builder_for_the_engine_and_rl_distributed_dp_over_secure_aggregation():
    """The engine and RL's server step build their mechanisms with the one builder
    (engine/mechanism_builders.py); distributed DP noises the secure aggregation built before
    it, and the attack's poisoned data is what the clients train on."""
    privacy = {"kind": "distributed_dp", "noise_multiplier": 0.5, "clip": 0.5}
    engine = engine_for(privacy=privacy, secure_aggregation={"kind": "secagg"})
    mechanisms = engine.mechanisms
    assert isinstance(mechanisms.privacy, DistributedDP)
    assert mechanisms.privacy.secure is mechanisms.secure
    attacked = engine_for(attack={"kind": "label_flip", "fraction": 0.5}).mechanisms
    first = attacked.malicious[0]
    assert not torch.equal(
        attacked.data.clients[first].y_train, engine.mechanisms.data.clients[first].y_train
    )
    rl = parse_rl_config(
        {
            "kind": "rl",
            "data": {"name": "cartpole", "num_clients": 4},
            "train": {"clients_per_round": 3},
            "aggregator": {"kind": "median"},
            "compression": {"kind": "int8"},
        }
    )
    assert [m.key for m in build_chain(rl, 4).all] == ["compression", "robust"]
