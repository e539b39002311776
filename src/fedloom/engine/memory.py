"""Memory arithmetic for the vectorized executor: budgets, per-client footprints, chunk sizes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MALLOC_MMAP_THRESHOLD = 32 * 2**20
"""glibc serves allocations above 32 MiB (its dynamic mmap threshold's ceiling) with fresh
mmap'd pages, which are page-faulted again on every step: a stacked per-chunk tensor above this
size makes each step pay for zeroing new memory. Chunks are kept below it."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_malloc_tuned: bool | None = None


def keep_large_blocks_in_heap() -> bool:
    """Ask glibc to serve large blocks from the heap and keep freed ones (mallopt), so the
    stacked per-chunk tensors of successive steps reuse memory instead of faulting in fresh
    mmap'd pages every step (benchmarks/README.md, Design measurements). Process-wide and
    harmless; returns False where glibc is not available, and then chunks are kept under the
    mmap threshold instead."""
    global _malloc_tuned
    if _malloc_tuned is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
            ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
            _malloc_tuned = bool(ok)
        except (OSError, AttributeError):
            _malloc_tuned = False
    return _malloc_tuned


def activation_bytes_per_sample(module: nn.Module, sample: torch.Tensor) -> int:
    """Bytes of every module output for one sample (forward hooks on the leaves)."""
    total = 0

    def hook(_m: nn.Module, _i: object, out: object) -> None:
        nonlocal total
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor):
                total += o.numel() * o.element_size()
            elif isinstance(o, tuple):  # LSTM (h, c)
                total += sum(t.numel() * t.element_size() for t in o if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(hook) for m in module.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            module.eval()
            module(sample.unsqueeze(0))
            module.train()
    finally:
        for h in handles:
            h.remove()
    return total


def tree_bytes(tree: Any) -> int:
    """Bytes of every tensor in nested dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tree_bytes(v) for v in tree)
    return 0


def client_footprint(
    param_bytes: int, activation_bytes: int, batch_size: int, carry_bytes: int | None = None
) -> int:
    """Working memory of one client in a vmapped step: its carry (the client program's
    variables: the model, a personal model, momentum, iterate averages, FedCR's noise tables;
    two model copies when not given), gradients, update and correction temporaries (about 4
    model copies), plus activations kept for the backward pass and their gradients (about 3
    copies per sample)."""
    carry = 2 * param_bytes if carry_bytes is None else carry_bytes
    return carry + 4 * param_bytes + 3 * activation_bytes * max(1, batch_size)


def choose_chunk_size(
    footprint: int,
    param_bytes: int,
    budget: int,
    num_clients: int,
    requested: int | None,
    heap_tuned: bool = True,
) -> int:
    """Clients per vmapped chunk: the requested size, else as many as the budget allows
    (and, where glibc could not be tuned, while one stacked parameter tensor stays under its
    mmap threshold)."""
    if requested is not None:
        return max(1, min(requested, num_clients))
    by_budget = budget // max(1, footprint)
    by_allocator = num_clients if heap_tuned else MALLOC_MMAP_THRESHOLD // max(1, param_bytes)
    return int(max(1, min(by_budget, by_allocator, num_clients)))
