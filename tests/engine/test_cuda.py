"""executor.device: cuda (runs where a GPU exists; skipped cleanly elsewhere)."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.algorithms import ALGORITHMS
from fedloom.engine.vectorized import to_device
from fedloom.errors import ConfigError
from tests.engine.test_executor_equivalence import NEEDS_NORM_LAYERS, assert_same, config

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.fixture
def exact_cuda_float32():
    """Full float32 products on the GPU (no TF32 in cuDNN convolutions or cuBLAS): the
    comparison with the CPU is at 1e-4."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@needs_gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS.names())
def test_every_algorithm_vectorized_on_cuda_equals_sequential_on_cpu(algorithm, exact_cuda_float32):
    """Each client program, run in chunks on the GPU, against the CPU's sequential backend."""
    model, batch = ("cnn_bn", 121) if algorithm in NEEDS_NORM_LAYERS else ("mlp", 16)
    cpu = fedloom.run(
        config(algorithm, model, {"kind": "sequential"}, batch), write=False, progress=False
    )
    gpu = fedloom.run(
        config(algorithm, model, {"kind": "vectorized", "device": "cuda"}, batch),
        write=False,
        progress=False,
    )
    assert_same(cpu, gpu)


@needs_gpu
def test_dpsgd_vectorized_on_cuda_equals_sequential_on_cpu(exact_cuda_float32):
    """Sample-level DP-SGD: per-client noise drawn on the CPU and moved with the chunk, the
    per-sample gradients on the GPU."""
    runs = []
    for executor in ({"kind": "sequential"}, {"kind": "vectorized", "device": "cuda"}):
        cfg = config("fedavg", "mlp", executor, 16)
        cfg["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
        runs.append(fedloom.run(cfg, write=False, progress=False))
    assert_same(*runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match=r"executor\.device"):
        fedloom.run(
            config("fedavg", "mlp", {"kind": "vectorized", "device": "cuda"}, 16), write=False
        )


def test_messages_and_states_follow_the_chunk_to_its_device():
    """What the corrections read (the server message, stacked client states) moves with the
    chunk: checked here with the meta device, which every machine has."""
    message = {"params": {"w": torch.ones(2)}, "mu": 0.1, "pair": (torch.zeros(1), 3)}
    moved = to_device(message, torch.device("meta"))
    assert moved["params"]["w"].is_meta and moved["pair"][0].is_meta
    assert moved["mu"] == 0.1 and moved["pair"][1] == 3 and isinstance(moved["pair"], tuple)
    assert to_device(message, torch.device("cpu")) is message
