"""Persistent per-client state (personal models, control variates, dual variables) stored as
one stacked float tensor per state entry: row k is client k.

Stacking keeps 10,000 clients with a 2NN-sized personal model (199,210 float32 parameters,
0.8 MB each) at 8.0 GB in one allocation per parameter instead of 60,000 small tensors, makes
a chunk of clients' states one index away for the vectorized executor, and lets the rows live
in memory-mapped files under the run directory (``state.storage: mmap``) when RAM is short:
pages are only touched for clients that exist. Rows are created lazily the first time a
client's state is set.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

State = dict[str, Any]
SEP = "/"


def _flatten(state: State, prefix: str = "") -> dict[str, Any]:
    """Leaves by path; an empty sub-dict is kept as the leaf ``{}`` so it round-trips."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= _flatten(value, path + SEP)
        else:
            out[path] = value
    return out


def _unflatten(flat: dict[str, Any]) -> State:
    out: State = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(SEP)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


class ClientStateStore:
    """Mapping client id -> state, backed by stacked tensors (``memory``) or memory-mapped
    files (``mmap``, under ``directory``)."""

    def __init__(self, num_clients: int, storage: str = "memory", directory: Path | None = None):
        if storage not in ("memory", "mmap"):
            raise ValueError(f"state storage must be 'memory' or 'mmap', not {storage!r}")
        self.num_clients = num_clients
        self.storage = storage
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if storage == "mmap" and directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fedloom-state-")
            directory = Path(self._tmp.name)
        self.directory = directory
        self._present: set[int] = set()  # a Python set: membership is asked per client
        self.tables: dict[str, torch.Tensor] = {}
        self._none: set[int] = set()
        self._empty: set[str] = set()

    # -- mapping --------------------------------------------------------------------------
    def __contains__(self, client: object) -> bool:
        return client in self._present or client in self._none

    def get(self, client: int) -> State | None:
        """The client's state as views into the tables (None if never set, or set to None)."""
        if client not in self._present:
            return None
        flat: dict[str, Any] = {path: table[client] for path, table in self.tables.items()}
        return _unflatten(flat | {path: {} for path in self._empty})

    def get_many(self, clients: list[int]) -> list[State | None]:
        """``get`` of each client. When the clients are most of the table (W3: all 1,000 every
        round) each table's rows come from one ``unbind``, else from one indexing call per client
        and table. Measured on 7,850-float rows: 1,000 of 1,000 rows 0.37 ms by unbind against
        1.02 ms indexed; 5,000 of 10,000 3.9 ms against 2.8 ms; the two meet near two thirds."""
        if 3 * len(clients) < 2 * self.num_clients:
            return [self.get(c) for c in clients]
        rows = {path: table.unbind(0) for path, table in self.tables.items()}
        empty = {path: {} for path in self._empty}
        return [
            _unflatten({path: r[c] for path, r in rows.items()} | empty)
            if c in self._present
            else None
            for c in clients
        ]

    def set(self, client: int, state: State | None) -> None:
        self.set_many([client], [state])

    def set_many(self, clients: list[int], states: list[State | None]) -> None:
        """``set`` of each client: one gather of the new rows and one ``index_copy_`` per table
        when the states share their paths (the usual case), else client by client."""
        written: list[int] = []
        columns: dict[str, list[torch.Tensor]] = {}
        for client, state in zip(clients, states, strict=True):
            if state is None:
                self._none.add(client)
                self._present.discard(client)
                continue
            self._none.discard(client)
            written.append(client)
            for path, value in _flatten(state).items():
                if isinstance(value, dict):
                    self._empty.add(path)
                else:
                    columns.setdefault(path, []).append(value)
        if not written:
            return
        shared_paths = len(set(written)) == len(written) and all(
            len(values) == len(written) for values in columns.values()
        )  # (a client twice: in order, the last state wins, as with set)
        for path, values in columns.items():
            table = self.tables.get(path)
            if table is None:
                table = self.tables[path] = self._allocate(path, values[0])
            if shared_paths and len(values) > 1:
                table.index_copy_(0, torch.tensor(written), torch.stack(values))
            else:  # a client without this path or twice, or a single client
                owners = written if shared_paths else _owners(clients, states, path)
                for client, value in zip(owners, values, strict=True):
                    table[client].copy_(value)
        self._present.update(written)

    def __iter__(self) -> Iterator[int]:
        yield from sorted(self._present | self._none)

    def stacked(self, clients: list[int]) -> State:
        """The states of ``clients`` stacked along a leading dimension (for vmap)."""
        index = torch.tensor(clients)
        flat: dict[str, Any] = {p: t.index_select(0, index) for p, t in self.tables.items()}
        return _unflatten(flat | {path: {} for path in self._empty})

    # -- storage --------------------------------------------------------------------------
    def _allocate(self, path: str, like: torch.Tensor) -> torch.Tensor:
        shape = (self.num_clients, *like.shape)
        if self.storage == "memory":
            return torch.zeros(shape, dtype=like.dtype)
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        file = self.directory / (path.replace(SEP, "__") + ".bin")
        numel = math.prod(shape)
        table = torch.from_file(str(file), shared=True, size=numel, dtype=like.dtype)
        return table.view(shape)

    def _present_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.num_clients, dtype=torch.bool)
        mask[sorted(self._present)] = True
        return mask

    def nbytes(self) -> int:
        """Logical size of all tables (what they occupy once every client is set)."""
        return sum(t.numel() * t.element_size() for t in self.tables.values())

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "num_clients": self.num_clients,
            "present": self._present_mask(),
            "none": sorted(self._none),
            "empty": sorted(self._empty),
            "tables": dict(self.tables),  # the checkpoint writer reads them; no extra copy
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._present = set(torch.nonzero(saved["present"]).flatten().tolist())
        self._none = set(saved["none"])
        self._empty = set(saved["empty"])
        self.tables = {}
        for path, table in saved["tables"].items():
            self.tables[path] = self._allocate(path, table[0])
            self.tables[path].copy_(table)


def _owners(clients: list[int], states: list[State | None], path: str) -> list[int]:
    """The clients whose state has a tensor at ``path``, in order."""
    return [
        c
        for c, s in zip(clients, states, strict=True)
        if s is not None and not isinstance(_flatten(s).get(path, {}), dict)
    ]
