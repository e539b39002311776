"""What crosses between this process and its forked workers (engine/processes.py): one pickle
of the structure, with every tensor replaced by a reference, and one shared-memory buffer
holding all the tensors' bytes.

Pickled as they are, tensors take torch's own route (torch.multiprocessing): each storage is
moved into shared memory and its file descriptor handed over a socket, one per tensor. A
client's state, though, is a row of the state store's stacked table (engine/state_store.py):
its storage is the whole table, which that route moves into shared memory entire (the
``memory`` store) or cannot hand over at all (the ``mmap`` store: a file mapping whose
descriptor torch closed once mapped, so the descriptor it offers is -1 and the send fails with
``OSError: [Errno 9] Bad file descriptor``). Here only the bytes of the tensors themselves
travel, whatever their storage, in one buffer per message: 1,000 clients' rows, plans and
results are then one descriptor each way instead of thousands (docs/population.md).

The receiver's tensors are views into the buffer, as torch's route gives views into the
shared storages, and each keeps its address modulo 64 bytes (what torch's route kept too):
kernels may sum in another order at another alignment, and a row of the state store sits
at any alignment, so results stay bit for bit those of the sequential executor.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

ALIGN = 64
"""Each tensor keeps its address modulo this many bytes in the buffer (torch's allocator
aligns every allocation to it)."""
_PAD = torch.zeros(ALIGN, dtype=torch.uint8)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class TensorRef(NamedTuple):
    """Where one tensor's bytes lie in the buffer, and what it was."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    parameter: bool
    requires_grad: bool


@dataclass(frozen=True)
class Packed:
    """A packed object: ``unpack()`` gives it back."""

    skeleton: bytes
    refs: list[TensorRef]
    buffer: torch.Tensor | None
    """uint8, in shared memory: torch's pickling hands it over as one file descriptor."""

    def unpack(self, kept: Mapping[str, Any] | None = None) -> Any:
        """The object back; ``kept``: the objects ``pack`` was told the receiver has, by name."""
        return _Unpickler(io.BytesIO(self.skeleton), self, kept or {}).load()

    def tensor(self, index: int) -> torch.Tensor:
        """The ``index``-th tensor: a contiguous view into the buffer."""
        ref = self.refs[index]
        if self.buffer is None or not ref.nbytes:  # no elements: nothing was stored
            value = torch.empty(ref.shape, dtype=ref.dtype)
        else:
            raw = self.buffer[ref.offset : ref.offset + ref.nbytes]
            value = raw.view(ref.dtype).view(ref.shape)
        if ref.parameter:
            return torch.nn.Parameter(value, requires_grad=ref.requires_grad)
        return value.requires_grad_(ref.requires_grad)


def _packable(value: object) -> bool:
    """Plain dense CPU tensors and parameters; anything else pickles as torch pickles it."""
    return (
        type(value) in _TENSOR_TYPES
        and isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and not value.is_quantized
    )


class _Pickler(pickle.Pickler):
    """Pickles the structure; collects the tensors (a tensor object met twice is one entry,
    so it is one object again when unpacked) and names the objects the receiver keeps."""

    def __init__(self, file: io.BytesIO, kept: Mapping[int, str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self._kept = kept

    def persistent_id(self, obj: Any) -> int | str | None:
        name = self._kept.get(id(obj))
        if name is not None:
            return name
        if not _packable(obj):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)  # alive until packed: its id() is not reused
        return index


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, packed: Packed, kept: Mapping[str, Any]) -> None:
        super().__init__(file)
        self.packed = packed
        self._made: dict[int, torch.Tensor] = {}
        self._kept = kept

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, str):
            return self._kept[pid]
        if pid not in self._made:
            self._made[pid] = self.packed.tensor(pid)
        return self._made[pid]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in order, as bytes (a copy only where not contiguous)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_complex():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous().view(-1).view(torch.uint8)


def pack(obj: Any, kept: Mapping[int, str] | None = None) -> Packed:
    """``obj`` as one pickle and one shared-memory buffer of its tensors' bytes. ``kept``:
    objects (by ``id``) that the receiver already has, under the name it knows them by: they
    travel as that name (``unpack`` is given them)."""
    file = io.BytesIO()
    pickler = _Pickler(file, kept or {})
    pickler.dump(obj)
    refs, parts, offset = [], [], 0
    for t in pickler.tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            pad = (t.data_ptr() - offset) % ALIGN  # the same address modulo ALIGN
            parts += [_PAD[:pad], _bytes_of(t)]
            offset += pad
        parameter = type(t) is torch.nn.Parameter
        refs.append(TensorRef(t.dtype, tuple(t.shape), offset, nbytes, parameter, t.requires_grad))
        offset += nbytes
    buffer = None
    if offset:
        buffer = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(offset))
        torch.cat(parts, out=buffer)
    return Packed(file.getvalue(), refs, buffer)
