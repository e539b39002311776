"""Smoke test of benchmarks/conv_step.py: the stacked step (b) and fedloom's one-client loop
compute the same step as plain PyTorch (a), and every timed section runs at tiny sizes (the
full benchmark is not a test; benchmarks/README.md, "Convolution steps")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def conv_step() -> Any:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import conv_step

        yield conv_step
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.mark.parametrize("name", ["simple_cnn", "cnn4-mnist", "cnn-mnist"])
def test_stacked_and_lean_steps_equal_plain_pytorch(conv_step: Any, name: str) -> None:
    torch.manual_seed(0)
    cl = conv_step.Clients(name, clients=3, batch=4)
    losses = [
        torch.nn.functional.cross_entropy(m(cl.x[c]), cl.y[c]).item()
        for c, m in enumerate(cl.modules)
    ]
    cl.plain(cl.C)
    after = [{k: p.detach().clone() for k, p in m.named_parameters()} for m in cl.modules]
    moved = max(
        (after[c][k] - cl.start[c][k]).abs().max().item() for c in range(3) for k in after[c]
    )
    assert moved > 1e-4  # the step did something
    stacked = cl.stack(range(3))
    stacked_losses = cl.stacked_step(stacked)
    lean = cl.lean(3)
    for c in range(3):
        assert stacked_losses[c].item() == pytest.approx(losses[c], abs=1e-5)
        assert lean[c].loss == pytest.approx(losses[c], abs=1e-5)
        for k, want in after[c].items():
            torch.testing.assert_close(stacked[k][c], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(lean[c].params[k], want, atol=1e-5, rtol=0)
    # the benchmark's own check agrees, and puts every copy back at the start
    cl.reset()
    agree = cl.check()
    assert max(agree.values()) < 1e-5
    for c, m in enumerate(cl.modules):
        for k, p in m.named_parameters():
            assert torch.equal(p.detach(), cl.start[c][k])


def test_conv_variants_compute_the_same_gradients(conv_step: Any) -> None:
    layers = conv_step.conv_layers("cnn-mnist", batch=2)
    assert [(n, first) for n, _, _, first in layers] == [("conv1", True), ("conv2", False)]
    _, layer, in_shape, first = layers[1]
    variants, flops = conv_step.conv_variants(layer, in_shape, first, clients=3)
    assert set(variants) == {
        "grouped",
        "separate",
        "grouped_cl",
        "separate_cl",
        "stacked_conv",
        "stacked_separate",
    }
    # 3 clients x 2 samples x 64 x 14 x 14 outputs x 32 x 25 MACs, forward + 2 gradients
    assert flops == 2.0 * 3 * 2 * 64 * 14 * 14 * 32 * 25 * 3
    grouped_w = variants["grouped"]()[0].view(3, 64, 32, 5, 5)
    grouped_cl_w = variants["grouped_cl"]()[0].view(3, 64, 32, 5, 5)
    torch.testing.assert_close(grouped_cl_w, grouped_w, atol=1e-4, rtol=1e-4)


def test_sections_run_end_to_end(conv_step: Any, capsys: Any) -> None:
    code = conv_step.main(
        [
            "--sections",
            "steps,convs,compile,profile",
            "--models",
            "cnn-mnist",
            "--compile-models",
            "",
            "--threads",
            "1",
            "--clients",
            "2",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--gemm-size",
            "64",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for text in ("| cnn-mnist | 1 | stacked |", "grouped_cl", "lean/plain", "cProfile lean"):
        assert text in out
