"""executor.device: cuda (runs where a GPU exists; skipped cleanly elsewhere)."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.errors import ConfigError
from tests.engine.test_executor_equivalence import assert_same, config

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@needs_gpu
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "local"])
def test_vectorized_on_cuda_equals_sequential_on_cpu(algorithm):
    cpu = fedloom.run(
        config(algorithm, "mlp", {"kind": "sequential"}, 16), write=False, progress=False
    )
    gpu = fedloom.run(
        config(algorithm, "mlp", {"kind": "vectorized", "device": "cuda"}, 16),
        write=False,
        progress=False,
    )
    assert_same(cpu, gpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match=r"executor\.device"):
        fedloom.run(
            config("fedavg", "mlp", {"kind": "vectorized", "device": "cuda"}, 16), write=False
        )
