"""The automatic chunk size keeps a chunk's measured peak memory within executor.memory_budget."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from fedloom.config import parse_config
from fedloom.engine.memory import choose_chunk_size, client_footprint
from fedloom.errors import ConfigError
from fedloom.run_config.executor import parse_bytes

PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from fedloom.config import parse_config
    from fedloom.data.federated import from_arrays
    from fedloom.engine.loop import Engine
    from fedloom.models import build_model

    budget = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    data = from_arrays(
        [(torch.rand(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g))
         for _ in range(64)],
        [(torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))) for _ in range(64)],
    )
    cfg = parse_config({"model": {"name": "mlp"}, "train": {"local_epochs": 1, "batch_size": 64},
                        "executor": {"kind": "vectorized", "memory_budget": budget, "threads": 1}})
    torch.set_num_threads(1)
    engine = Engine(cfg, data, build_model("mlp", data.input_shape, data.num_outputs))
    ex = engine.executor
    ex.prepare(dict(enumerate(data.clients)))
    st = engine.initial_state()
    tasks = engine.tasks_for_round(1, list(range(64)))
    message = engine.algorithm.server_message(st.server)
    size = ex.chunk_size(tasks, 64)
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    # one client first: torch.func's first call allocates ~70-100 MB once per process
    ex.run_round(engine.algorithm, message, tasks[:1], [None])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    before = status("VmRSS")
    results = ex.run_round(engine.algorithm, message, tasks[:size], [None] * size)
    peak = status("VmHWM")
    print(json.dumps({"chunk": size, "peak_bytes": peak - before, "budget": ex.budget}))
    """
)


def _probe(budget: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, budget], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("budget", ["48MB", "96MB"])
def test_chunk_peak_memory_stays_within_budget(budget):
    measured = _probe(budget)
    assert measured["chunk"] > 1  # the budget, not the client count, sets the chunk
    assert measured["chunk"] < 64
    assert measured["peak_bytes"] <= measured["budget"], measured


def test_chunk_size_grows_with_the_budget():
    footprint = client_footprint(param_bytes=800_000, activation_bytes=4_800, batch_size=32)
    small = choose_chunk_size(footprint, 800_000, parse_bytes("50MB"), 1000, None)
    large = choose_chunk_size(footprint, 800_000, parse_bytes("500MB"), 1000, None)
    assert 1 <= small < large <= 1000
    assert choose_chunk_size(footprint, 800_000, parse_bytes("50MB"), 1000, 7) == 7
    # without a tuned heap, one stacked parameter tensor stays under glibc's mmap threshold
    capped = choose_chunk_size(
        footprint, 800_000, parse_bytes("50GB"), 1000, None, heap_tuned=False
    )
    assert capped * 800_000 <= 32 * 2**20


def test_memory_budget_parsing():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1000) == 1000
    with pytest.raises(ConfigError, match="memory_budget"):  # checked once, at parse time
        parse_config({"executor": {"kind": "vectorized", "memory_budget": "lots"}})


def test_the_chunk_size_counts_each_client_programs_carry(monkeypatch):
    """APFL's carry (final averaging) holds four models (theta, omega and both iterate
    averages), FedAvg's one:
    under the same budget APFL's chunks are smaller, sized from the carry measured."""
    import fedloom
    from fedloom.engine.vectorized import VectorizedExecutor
    from tests.engine.test_executor_equivalence import config

    seen: dict[str, list[tuple[int | None, int]]] = {}
    original = VectorizedExecutor.chunk_size

    def spy(self, tasks, max_batch, carry_bytes=None):  # type: ignore[no-untyped-def]
        size = original(self, tasks, max_batch, carry_bytes)
        seen.setdefault(name, []).append((carry_bytes, size))
        return size

    monkeypatch.setattr(VectorizedExecutor, "chunk_size", spy)
    for name in ("fedavg", "apfl"):
        cfg = config(name, "mlp", {"kind": "vectorized", "memory_budget": "6MB"}, 16)
        if name == "apfl":
            cfg["algorithm"]["final_averaging"] = True
        fedloom.run(cfg, write=False, progress=False)
    (avg_carry, avg_size), (apfl_carry, apfl_size) = seen["fedavg"][0], seen["apfl"][0]
    assert apfl_carry > 3 * avg_carry
    assert 1 < apfl_size < avg_size
