"""Every scheme runs with FedAvg and SCAFFOLD (uploads of a model, and of two deltas) on the
sequential and the vectorized executor with the same numbers (within 1e-4); communication
counts the encoded bytes, which match each scheme's payload layout; bad configs get a clear
error."""

from __future__ import annotations

import math

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.errors import ConfigError

TOL = 1e-4
SCHEMES = {
    "topk": {"kind": "topk", "ratio": 0.05},
    "randk": {"kind": "randk", "ratio": 0.05},
    "qsgd": {"kind": "qsgd", "levels": 4},
    "fp16": {"kind": "fp16"},
    "int8": {"kind": "int8"},
}
ROUNDS, PER_ROUND = 4, 4


def config(scheme: dict, algorithm: str, executor: str) -> dict:
    return {
        "seed": 3,
        "data": {"name": "digits", "num_clients": 6},
        "model": {"name": "mlp"},
        "algorithm": {"name": algorithm},
        "train": {
            "rounds": ROUNDS,
            "clients_per_round": PER_ROUND,
            "local_steps": 3,
            "batch_size": 16,
            "lr": 0.1,
        },
        "eval": {"every": ROUNDS},
        "monitor": {"enabled": False},
        "executor": {"kind": executor},
        "compression": scheme,
    }


def encoded_bytes(kind: str, shapes: list[torch.Size]) -> int:
    """One model-shaped tree's bytes as each scheme's payload lays them out."""
    total = 0
    for shape in shapes:
        d = math.prod(shape)
        k = min(d, max(1, math.ceil(0.05 * d)))
        index = 2 if d <= 1 << 15 else 4
        total += {
            "topk": k * (4 + index),
            "randk": k * 4,
            "qsgd": 4 + math.ceil(d * 4 / 8),  # s = 4: 9 symbols, 4 bits
            "fp16": 2 * d,
            "int8": 4 + d,
        }[kind]
    return total


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
@pytest.mark.parametrize("kind", list(SCHEMES))
def test_scheme_runs_on_both_executors_and_counts_encoded_bytes(kind: str, algorithm: str):
    seq = fedloom.run(config(SCHEMES[kind], algorithm, "sequential"), write=False, progress=False)
    vec = fedloom.run(config(SCHEMES[kind], algorithm, "vectorized"), write=False, progress=False)
    for key, value in seq.global_params.items():
        assert torch.allclose(value, vec.global_params[key], atol=TOL, rtol=0), key
    for cid, params in seq.client_params.items():
        for key, value in params.items():
            assert torch.allclose(value, vec.client_params[cid][key], atol=TOL, rtol=0)
    shapes = [v.shape for v in seq.global_params.values()]
    trees = 2 if algorithm == "scaffold" else 1  # delta and control_delta; params (mlp: no buffers)
    per_upload = trees * encoded_bytes(kind, shapes)
    comm, comp = seq.summary["communication"], seq.summary["compression"]
    assert comm["bytes_up"] == ROUNDS * PER_ROUND * per_upload == comp["bytes_encoded"]
    dense = trees * sum(4 * math.prod(s) for s in shapes)
    assert comp["bytes_dense"] == ROUNDS * PER_ROUND * dense
    assert comm["bytes_up"] < comp["bytes_dense"]
    assert math.isfinite(seq.summary["final"]["global"]["loss"])


def test_compression_changes_only_the_uploads():
    """fp16 of the update moves the model by at most fp16's rounding of it; without
    compression the uploads are counted as dense float32."""
    plain = fedloom.run(
        config({"kind": "none"}, "fedavg", "sequential"), write=False, progress=False
    )
    half = fedloom.run(config(SCHEMES["fp16"], "fedavg", "sequential"), write=False, progress=False)
    assert "compression" not in plain.summary
    assert (
        plain.summary["communication"]["bytes_up"] == 2 * half.summary["communication"]["bytes_up"]
    )
    for key, value in plain.global_params.items():
        assert torch.allclose(value, half.global_params[key], atol=1e-3), key


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"compression": {"kind": "zip"}}, "compression.kind"),
        ({"compression": {"kind": "topk", "ratio": 0}}, "compression.ratio"),
        ({"compression": {"kind": "qsgd", "error_feedback": True}}, "does not apply to qsgd"),
        (
            {"compression": {"kind": "topk"}, "secure_aggregation": {"kind": "secagg"}},
            "does not combine with secure_aggregation",
        ),
        ({"compression": {"kind": "fp16"}, "algorithm": {"name": "local"}}, "sends nothing"),
    ],
)
def test_bad_compression_configs_name_the_key(extra: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        parse_config({"data": {"name": "digits"}, **extra})


@pytest.mark.parametrize("download", ["fp16", "int8"])
def test_downloads_count_the_encoded_model_and_clients_train_from_it(download: str):
    both = {"kind": "topk", "ratio": 0.05, "download": download}
    seq = fedloom.run(config(both, "scaffold", "sequential"), write=False, progress=False)
    vec = fedloom.run(config(both, "scaffold", "vectorized"), write=False, progress=False)
    dense = fedloom.run(
        config(SCHEMES["topk"], "scaffold", "sequential"), write=False, progress=False
    )
    for key, value in seq.global_params.items():
        # int8 of the model: a weight 1e-8 from a rounding boundary on one executor and past it
        # on the other differs by one step, max|w| / 127, however close the executors are
        step = float(value.abs().max()) / 127 if download == "int8" else 0.0
        # top-k uploads: a coordinate at the k-th largest magnitude on one executor and just
        # below it on the other (float summation order: the stacked step forms G^T H where the
        # sequential one lets autograd do it) is sent by one and not the other, so a handful of
        # coordinates may differ by about one update; every other one agrees to TOL
        apart = (value - vec.global_params[key]).abs() > TOL + 2 * step
        assert int(apart.sum()) <= max(1, value.numel() // 1000), key
        assert torch.allclose(value, vec.global_params[key], atol=0.01, rtol=0), key
        assert not torch.equal(value, dense.global_params[key])  # clients got the rounded model
        assert torch.allclose(value, dense.global_params[key], atol=0.05), key
    shapes = [v.shape for v in seq.global_params.values()]
    params = sum(math.prod(s) for s in shapes)
    model = 2 * params if download == "fp16" else sum(4 + math.prod(s) for s in shapes)
    # SCAFFOLD sends the model (encoded) and the server control variate (dense float32)
    per_client = model + 4 * params
    assert seq.summary["communication"]["bytes_down"] == ROUNDS * PER_ROUND * per_client
    assert dense.summary["communication"]["bytes_down"] == ROUNDS * PER_ROUND * 8 * params
    assert seq.summary["compression"]["download"] == download
