"""Every example config is valid and runs end to end on the real data (one short round); the
datasets this machine has no copy of (CIFAR, Tiny-ImageNet) on small releases written in their
official layouts (tests/data/image_fixtures.py), with 4 clients."""

from __future__ import annotations

from pathlib import Path

import pytest

import fedloom
from fedloom.config import apply_overrides, load_yaml
from tests.data.image_fixtures import write_cifar10, write_cifar100, write_tinyimagenet

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
SHRINK = {
    "heterogeneous_mnist": ["train.local_epochs.high=2"],
    # the LSTM under vmap is slow per sample (no batching rule for its kernel): small batches,
    # 1% of each role's text held out (58 s -> 8 s on a loaded 2-core machine)
    "shakespeare": [
        *("data.num_clients=3", "train.clients_per_round=2", "train.local_steps=2"),
        *("train.batch_size=4", "data.test_fraction=0.01"),
    ],
    "peft_bbc_news": ["train.clients_per_round=2", "data.max_length=16", "monitor.enabled=false"],
}
FIXTURES = {
    "cifar10": lambda root: write_cifar10(root, per_file=40, test=20),
    "cifar100": lambda root: write_cifar100(root, train=400, test=20),
    "tinyimagenet": lambda root: write_tinyimagenet(root, per_class=30, val_per_class=5),
}
"""Datasets the examples run on fixtures, each written under the run's own data root."""


def test_there_is_an_example_per_dataset():
    names = {p.stem for p in EXAMPLES}
    assert names >= {
        "digits",
        "mnist",
        "fashion_mnist",
        "femnist",
        "shakespeare",
        "synthetic",
        "quadratic",
        *FIXTURES,
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path, data_root, tmp_path):
    overrides = ["train.rounds=1", "eval.every=1", *SHRINK.get(path.stem, [])]
    name = load_yaml(path)["data"]["name"]
    if name in FIXTURES:
        FIXTURES[name](tmp_path / "data")
        overrides += [f"data.root={tmp_path / 'data'}", "data.num_clients=4"]
        overrides += ["train.clients_per_round=2", "train.local_steps=2"]
        if load_yaml(path)["model"]["name"] == "resnet18":  # 16 channels wide, not 64
            overrides += ["model.width=16", "model.groups=4"]
    raw = apply_overrides(load_yaml(path), overrides)
    result = fedloom.run(raw, out=tmp_path / "run", progress=False)
    assert result.summary["dataset"] == raw["data"]["name"]
    assert (tmp_path / "run" / "report.html").is_file()
    final = result.summary["final"]
    pers = final["personalized"]  # RL runs (docs/rl.md) report greedy returns instead
    assert pers.get("loss_mean") is not None or pers.get("return_mean") is not None
