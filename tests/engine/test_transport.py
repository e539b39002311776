"""Packing a call for a forked worker (engine/transport.py): every tensor's values, dtype,
shape and kind come back, whatever its storage (a memory-mapped state row included)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from fedloom.core.protocol import ClientResult
from fedloom.engine.state_store import ClientStateStore
from fedloom.engine.transport import ALIGN, Packed, pack


def _same(a: object, b: object) -> None:
    """Equal trees: tensors of equal values, dtype, shape, type and requires_grad."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        assert torch.equal(a.detach(), b.detach())
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_round_trip_keeps_every_kind_of_tensor() -> None:
    table = torch.arange(60, dtype=torch.float64).view(10, 6)
    obj = {
        "row": table[3],  # a view into a larger storage
        "column": table[:, 2],  # not contiguous
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False, True]),
        "ints": torch.arange(7, dtype=torch.int64),
        "half": torch.randn(5).half(),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "grad": torch.randn(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "nested": [(1, "a", None), {"x": torch.ones(1)}],
    }
    packed = pack(obj)
    back = packed.unpack()
    _same(obj, back)
    assert back["row"].is_contiguous() and back["column"].is_contiguous()
    assert packed.buffer is not None and packed.buffer.is_shared()
    row = pack(table[3]).buffer
    assert row is not None and row.numel() < 6 * 8 + ALIGN  # the row's bytes, not the table's


def test_a_tensor_used_twice_is_one_object_again() -> None:
    shared = torch.randn(4)
    back = pack({"a": shared, "b": [shared]}).unpack()
    assert back["a"] is back["b"][0]
    assert len(pack({"a": shared, "b": [shared]}).refs) == 1


def test_tensors_keep_their_alignment() -> None:
    """Each tensor comes back at its address modulo 64 bytes (kernels may sum in another
    order at another alignment): a row of a table anywhere, a fresh tensor at 0."""
    table = torch.randn(9, 3)
    sent = [table[k] for k in range(9)] + [torch.randn(5, dtype=torch.float64), torch.ones(1)]
    back = pack(sent).unpack()
    assert [t.data_ptr() % ALIGN for t in back] == [t.data_ptr() % ALIGN for t in sent]


def test_no_tensors_no_buffer() -> None:
    packed = pack(("plain", 1, [2.0]))
    assert packed.buffer is None and packed.unpack() == ("plain", 1, [2.0])


def _echo(work: Packed) -> Packed:
    return pack(work.unpack())


def test_memory_mapped_state_rows_cross_to_a_forked_worker(tmp_path: Path) -> None:
    """The bug of issue #26: a row of the mmap store, pickled by torch's own route, offered
    file descriptor -1 ('OSError: [Errno 9] Bad file descriptor')."""
    store = ClientStateStore(5, "mmap", tmp_path / "state")
    store.set_many([0, 3], [{"w": torch.randn(4), "n": torch.tensor(2)}] * 2)
    states = store.get_many([0, 3])
    upload = {"params": {"w": torch.randn(4)}}
    result = ClientResult(upload=upload, weight=2.0, loss=0.5, state=states[1])
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
    try:
        back = pool.submit(_echo, pack((states, result))).result(timeout=60).unpack()
    finally:
        pool.shutdown(cancel_futures=True)
    _same(states, back[0])
    _same(result.upload, back[1].upload)
    _same(result.state, back[1].state)
    assert (back[1].weight, back[1].loss) == (2.0, 0.5)


def test_kept_objects_travel_by_name() -> None:
    table = {c: c + 1 for c in range(1000)}
    algorithm = {"population": table, "w": torch.ones(2)}
    packed = pack(("call", algorithm, torch.zeros(3)), kept={id(algorithm): "algorithm"})
    assert len(packed.skeleton) < 200 and len(packed.refs) == 1  # neither the table nor w
    theirs = {"population": {}, "w": torch.ones(2)}
    back = packed.unpack({"algorithm": theirs})
    assert back[1] is theirs
