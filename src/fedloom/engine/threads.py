"""Torch's intra-op thread count and OpenMP's wait policy, set in one place.

Why the wait policy matters (issue #13; numbers in benchmarks/README.md, ``contention.py``):
torch's CPU build runs its intra-op threads on GNU OpenMP, whose threads spin for a while
at the end of every parallel region before they sleep. A federated round is thousands of
small operations, so with two threads on two cores both cores spin all the time; beside
another busy process, each parallel region then waits for a thread the kernel has
descheduled, and a round took many times longer than on a quiet machine. With
``OMP_WAIT_POLICY=PASSIVE`` the idle threads sleep at once and a busy neighbour slows a run
about in proportion to the cores it takes.

OpenMP reads the variable once, when torch loads it, so ``fedloom/__init__`` calls
:func:`default_openmp_wait` before anything imports torch (a program that imported torch
first keeps OpenMP's default in its own process; processes it starts inherit the variable).
This module imports torch only inside functions for that reason.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fedloom.run_config.executor import ExecutorConfig

OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""Variables that choose how idle OpenMP threads wait (GNU libgomp, Intel/LLVM libomp): if
the user set any of them, fedloom leaves all of them alone."""
DEFAULT_WAIT_POLICY = "PASSIVE"
SMALL_STEP_MACS = 50_000_000
"""A sequential local step below this many multiply-accumulates (batch x MACs per sample)
runs on one thread when ``executor.threads`` is null. The FedAvg 2NN at batch 32 (6.4M)
runs faster on one thread than on two, quiet or not (benchmarks/README.md, contention); the
FedAvg CNN at batch 32 (about 400M) gains from a second core."""


def default_openmp_wait(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` unless one of OPENMP_WAIT_VARS is set;
    True if it was set here. Worker processes (forked, Ray's) inherit it."""
    if any(var in environ for var in OPENMP_WAIT_VARS):
        return False
    environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    return True


def openmp_wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """The wait settings in ``environ``, e.g. ``'OMP_WAIT_POLICY=PASSIVE'`` (``'default'``
    if none is set), for reports and benchmarks."""
    chosen = [f"{var}={environ[var]}" for var in OPENMP_WAIT_VARS if var in environ]
    return ",".join(chosen) or "default"


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads (None: leave the current count)
    and restore the caller's count afterwards, also when the block raises."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"torch_threads: threads must be >= 1 or None, got {threads}")
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def set_worker_threads(threads: int) -> None:
    """A worker process's thread count for its whole life (forked and Ray workers)."""
    import torch

    torch.set_num_threads(threads)


def macs_per_sample(module: nn.Module, sample: torch.Tensor) -> int:
    """Multiply-accumulates of one sample's forward pass through the linear, convolution and
    recurrent layers (others are cheap next to them), counted with forward hooks; ``sample``
    has no batch dimension. The module runs in eval mode under no_grad (no running
    statistics move, no randomness is drawn) and gets its mode back."""
    import torch
    from torch import nn

    total = 0

    def hook(m: nn.Module, _inp: object, out: object) -> None:
        nonlocal total
        if isinstance(m, nn.Linear):
            assert isinstance(out, torch.Tensor)
            total += out.numel() * m.in_features
        elif isinstance(m, nn.modules.conv._ConvNd):
            assert isinstance(out, torch.Tensor)
            total += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
        elif isinstance(m, nn.RNNBase):
            seq = out[0]  # (1, steps, directions x hidden) or (steps, 1, ...)
            assert isinstance(seq, torch.Tensor)
            gates = {"LSTM": 4, "GRU": 3}.get(m.mode, 1)
            dirs = 2 if m.bidirectional else 1
            steps = seq.numel() // (dirs * m.hidden_size)
            for layer in range(m.num_layers):
                inputs = m.input_size if layer == 0 else dirs * m.hidden_size
                total += steps * dirs * gates * m.hidden_size * (inputs + m.hidden_size)

    training = module.training
    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        module.eval()
        with torch.no_grad():
            module(sample.unsqueeze(0))
    finally:
        module.train(training)
        for h in handles:
            h.remove()
    return total


def run_threads(
    config: ExecutorConfig, module: nn.Module, sample: torch.Tensor, batch_size: int
) -> int | None:
    """The intra-op threads of a run's own process: ``executor.threads`` if set; with it
    null, 1 for the in-process sequential executor when a local step is small (below
    SMALL_STEP_MACS), else None (torch's default, every core). Auto times its candidates at
    their own thread counts; worker processes and Ray actors set theirs
    (:func:`set_worker_threads`)."""
    if config.threads is not None:
        return config.threads
    in_process_sequential = config.kind == "sequential" and not (config.workers or 0) > 1
    if in_process_sequential and batch_size * macs_per_sample(module, sample) < SMALL_STEP_MACS:
        return 1
    return None
