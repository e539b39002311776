"""Smoke test of benchmarks/roofline.py: the FLOP count against a hand count, and one tiny
workload end to end (the full benchmark is not a test; benchmarks/README.md, "roofline.py")."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def roofline() -> Any:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import roofline

        yield roofline
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_flop_count_equals_the_hand_count(roofline: Any) -> None:
    # conv 1->2 3x3 on 5x5: 2x3x3 outputs x 9 MACs = 162; Linear 18->4: 72 MACs.
    # Forward 2 x (162 + 72); weight gradients the same; input gradient of the Linear only
    # (the convolution's input is the data, which needs no gradient).
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 4))
    count = roofline.count_flops(model, torch.zeros(1, 5, 5))
    assert count.forward == 2 * (162 + 72)
    assert count.weight_grad == 2 * (162 + 72)
    assert count.input_grad == 2 * 72
    assert count.total == 2 * (2 * 162 + 3 * 72)
    assert count.conv == 2 * 2 * 162 and count.gemm == 3 * 2 * 72
    # weight bytes a client step: 3 passes over the first layer's 20 float32 parameters (no
    # input gradient), 4 over the Linear's 76
    assert [(c.kind, c.flops, c.weight_bytes) for c in count.costs] == [
        ("conv", 2 * 2 * 162, 3 * 4 * 20),
        ("gemm", 3 * 2 * 72, 4 * 4 * 76),
    ]
    assert model.training  # its mode is given back
    # a first layer that is Linear (after a Flatten) gets no input gradient either
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2))
    count = roofline.count_flops(mlp, torch.zeros(2, 3))
    assert (count.forward, count.input_grad) == (2 * (18 + 6), 2 * 6)


def test_simple_cnn_round_count(roofline: Any) -> None:
    # pfl's simple_cnn: conv1 30x30x32 x 27, conv2 28x28x64 x 288, fc 12544x128, fc 128x10
    setting = roofline.peer_settings.SETTINGS["pfl_cifar10"]
    count = roofline.count_flops(setting.model(), torch.zeros(setting.input_shape))
    macs = 30 * 30 * 32 * 27 + 28 * 28 * 64 * 288 + 12544 * 128 + 128 * 10
    assert count.total == 2 * (3 * macs - 30 * 30 * 32 * 27)


def test_tiny_workloads_run_end_to_end(roofline: Any) -> None:
    settings = roofline.peer_settings.SETTINGS
    tiny_2nn = replace(settings["fedavg_2nn"], clients=4, samples=20, per_round=2, real_mnist=False)
    tiny_cnn = replace(settings["pfl_cifar10"], clients=3, samples=10, per_round=2)
    benches = [roofline.peer_bench(tiny_2nn, False), roofline.peer_bench(tiny_cnn, False)]
    results = roofline.run(
        benches,
        ["sequential/t1", "vectorized/t1"],
        rounds=1,
        gemm_size=128,
        conv_shapes=((2, 4, 8, 4),),
    )
    assert results["peaks"]["gemm_gflops"] > 0 and results["peaks"]["conv_gflops"] > 0
    two_nn = results["workloads"]["fedavg_2nn"]
    assert results["peaks"]["bandwidth_gbs"] > 0
    for spec in ("sequential/t1", "vectorized/t1"):
        entry = two_nn["executors"][spec]
        assert entry["s_per_round"] > 0 and entry["share_of_peak"] > 0
        # each layer at the longer of its compute and its weight traffic: never below the
        # compute roofline (summed per layer, so equal up to float rounding when no layer is
        # bound by its traffic)
        assert entry["memory_roofline_s"] >= entry["roofline_s"] * (1 - 1e-12)
        assert entry["share_of_memory_roof"] >= entry["share_of_peak"] * (1 - 1e-12)
    # 2 clients x 20 samples through the 2NN, first layer without an input gradient
    macs = 784 * 200 + 200 * 200 + 200 * 10
    assert two_nn["round_gflop"] == pytest.approx(40 * 2 * (3 * macs - 784 * 200) / 1e9)
    cnn = results["workloads"]["pfl_cifar10"]["executors"]
    # simple_cnn's dropout runs on the vectorized executor too (core/client_dropout.py)
    for spec in ("sequential/t1", "vectorized/t1"):
        assert "refused" not in cnn[spec] and cnn[spec]["s_per_round"] > 0
    assert "pfl_cifar10" in roofline.format_table(results)
