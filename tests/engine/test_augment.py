"""Train-time augmentation in runs (data/augment.py, docs/data.md): every executor trains on
the same augmented samples (sequential == vectorized == worker processes), it changes
training, reproduces bit for bit and survives a resume; sample-level DP composes with it."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.data import from_arrays
from fedloom.data.augment import AugmentSpec
from tests.resume import killed_and_resumed

TOL = 1e-4


def image_data(augment: bool = True):
    g = torch.Generator().manual_seed(0)
    train = [
        (torch.rand(n, 3, 10, 10, generator=g), torch.randint(0, 4, (n,), generator=g))
        for n in (30, 40, 25, 35, 45)
    ]
    data = from_arrays(train, seed=0)
    if augment:
        data.augment = AugmentSpec(crop_padding=2)
    return data


def config(executor: dict, algorithm: str = "fedavg", **train) -> dict:
    return {
        "seed": 3,
        "model": {"name": "cnn"},
        "algorithm": {"name": algorithm},
        "train": {
            "rounds": 2,
            "clients_per_round": 4,
            "local_epochs": 1,
            "batch_size": 8,
            "lr": 0.05,
            "stragglers": 0.4,
            **train,
        },
        "eval": {"every": 1},
        "executor": executor,
    }


def run(cfg: dict, augment: bool = True) -> fedloom.RunResult:
    return fedloom.run(cfg, data=image_data(augment), write=False, progress=False)


def max_diff(a: fedloom.RunResult, b: fedloom.RunResult) -> float:
    ga, gb = a.global_params or {}, b.global_params or {}
    diffs = [(ga[k] - gb[k]).abs().max().item() for k in ga]
    for cid, params in a.client_params.items():
        diffs += [(v - b.client_params[cid][k]).abs().max().item() for k, v in params.items()]
    return max(diffs)


SEQ = {"kind": "sequential"}
VEC = {"kind": "vectorized", "chunk_size": 3}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep", "ditto", "fedavg_ft"])
def test_sequential_equals_vectorized_with_augmentation(algorithm):
    """fedavg: the lean trainer vs the chunked vmap/stacked step; fedrep and ditto: the
    program's steps with two plans each; fedavg_ft: the fine-tuned deployments too."""
    seq, vec = run(config(SEQ, algorithm)), run(config(VEC, algorithm))
    assert max_diff(seq, vec) < TOL
    assert seq.history[-1]["train_loss"] == pytest.approx(vec.history[-1]["train_loss"], abs=TOL)
    plain = run(config(SEQ, algorithm), augment=False)
    assert max_diff(seq, plain) > 1e-3  # augmentation changes the training


def test_worker_processes_see_the_same_augmented_samples():
    seq = run(config(SEQ))
    workers = run(config({"kind": "sequential", "workers": 2, "threads": 1}))
    assert max_diff(seq, workers) < TOL


def test_a_run_with_augmentation_reproduces_bit_for_bit():
    a, b = run(config(VEC)), run(config(VEC))
    assert max_diff(a, b) == 0.0


def test_sample_dp_composes_with_augmentation():
    """Poisson plans (some minibatches empty) get one draw per sampled entry; DP-SGD clips the
    per-sample gradients of the augmented samples (each still one sample's)."""
    cfg = config(SEQ, rounds=1)
    cfg["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
    seq, vec = run(cfg), run({**cfg, "executor": VEC})
    gap = max_diff(seq, vec)
    assert gap < TOL
    assert max_diff(seq, run(cfg, augment=False)) > max(1e-5, 10 * gap)


def test_resumed_run_with_augmentation_equals_uninterrupted(tmp_path):
    cfg = config(SEQ, rounds=3)
    cfg["checkpoint"] = {"every": 1}
    killed_and_resumed(cfg, tmp_path, crash_round=2, data=image_data())
