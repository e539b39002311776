"""eval.validation_fraction: a validation split no client trains on, evaluated beside the test
metrics (data/validation.py)."""

from __future__ import annotations

import copy

import torch

import fedloom
from fedloom.data.load import load_dataset
from fedloom.data.validation import hold_out_validation

CONFIG = {
    "seed": 1,
    "data": {"name": "digits", "num_clients": 6, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp"},
    "algorithm": {"name": "ditto", "lam": 0.1},
    "train": {"rounds": 2, "local_steps": 3, "batch_size": 16, "lr": 0.05},
    "eval": {"every": 1, "validation_fraction": 0.2},
    "executor": {"kind": "sequential"},
}


def _data():
    return load_dataset(fedloom.config.resolve_config(CONFIG).data, seed=1)


def test_split_is_disjoint_deterministic_and_leaves_test_sets_alone():
    data = _data()
    split, held = hold_out_validation(data, 0.2, seed=1, clients=range(5))
    again, held_again = hold_out_validation(data, 0.2, seed=1, clients=range(5))
    for cid, (orig, kept, val) in enumerate(zip(data.clients, split.clients, held, strict=True)):
        n_val = int(0.2 * orig.num_train) if cid < 5 else 0
        assert val.num_test == n_val and kept.num_train == orig.num_train - n_val
        assert val.num_train == 0
        assert kept.x_test is orig.x_test and kept.y_test is orig.y_test
        # together they are the original train set, each sample once
        both = torch.cat([kept.x_train, val.x_test]).flatten(1)
        rows = sorted(map(tuple, both.tolist()))
        assert rows == sorted(map(tuple, orig.x_train.flatten(1).tolist()))
        assert torch.equal(val.x_test, held_again[cid].x_test)
        assert torch.equal(kept.x_train, again.clients[cid].x_train)
    other, _ = hold_out_validation(data, 0.2, seed=2, clients=range(5))
    assert not torch.equal(other.clients[0].x_train, split.clients[0].x_train)


def test_runs_report_validation_and_train_on_less():
    result = fedloom.run(CONFIG, write=False, progress=False)
    rows = [r for r in result.history if "validation" in r]
    assert len(rows) == 2
    val = rows[-1]["validation"]
    assert 0.0 <= val["global"]["accuracy"] <= 1.0
    assert 0.0 <= val["personalized"]["accuracy_mean"] <= 1.0
    plain = copy.deepcopy(CONFIG)
    plain["eval"]["validation_fraction"] = 0.0
    without = fedloom.run(plain, write=False, progress=False)
    assert all("validation" not in r for r in without.history)
    # the held-out samples were not trained on: the models differ
    key = next(iter(result.global_params))
    assert not torch.equal(result.global_params[key], without.global_params[key])
