"""What crosses the network in a round, as the engine counts and monitors it: the bytes the
clients download of the server's message (engine/pipeline.py; uploads are counted by the
mechanisms that send them) and what a client's upload moved, for the update norms and cosine
similarities of the monitoring (docs/monitoring.md).

An algorithm declares its :class:`Wire` as data (``wire = Wire(...)``; one that depends on the
config or the population is set in ``__init__``). By default the message is sent whole to
every client and an upload holds ``params``, a ``delta`` or a ``grad``. The engine hands one
message to all of a round's clients, so a per-client (or per-cluster) table travels whole
and each client reads its rows; the declaration counts what a real deployment sends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fedloom.algorithms.clusters import pick
from fedloom.core.protocol import ClientResult, Message
from fedloom.core.pytree import Tree, num_bytes, select


def table_bytes(table: Tree, rows_each: int, clients: Sequence[int]) -> int:
    """Bytes ``clients`` download when each receives ``rows_each`` rows of ``table``, a tree
    of (rows, *shape) tensors."""
    first = next(iter(table.values()), None)
    if first is None or first.shape[0] == 0:
        return 0
    return len(clients) * rows_each * (num_bytes(table) // first.shape[0])


@dataclass(frozen=True)
class Wire:
    """The declared traffic of an algorithm (see the module doc)."""

    rows: Mapping[str, int] = field(default_factory=dict)
    """Message keys holding a table (a row per client or per cluster) and how many of its rows
    each client downloads: FPFC its own zeta_i (1), FedFomo its M peers' models."""
    routing: tuple[str, ...] = ()
    """Message keys the server routes by and never sends (CFL's cluster identities)."""
    only: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Message keys of which the clients download these entries only (FedBABU's body, with
    the head frozen at the initialization every client holds)."""
    delta_from: str | None = None
    """The table of models a client's uploaded ``params`` moved from: the row of the upload's
    ``cluster`` index (IFCA), else the client's entry of the message's ``identity`` (CFL)."""

    def download_bytes(self, message: Message, clients: Sequence[int]) -> int:
        """Bytes ``clients`` download of ``message`` together. Once per round, not per client:
        1,000 clients a round (W3)."""
        total = 0
        for key, tree in message.items():
            if key in self.rows:
                total += table_bytes(tree, self.rows[key], clients)
            elif key in self.only:
                total += len(clients) * num_bytes(select(tree, self.only[key]))
            elif key not in self.routing:
                total += len(clients) * num_bytes(tree)
        return total

    def delta(self, message: Message, result: ClientResult) -> Tree | None:
        """What a client's round moved: the uploaded ``params`` minus its start (its row of
        ``delta_from``, else the broadcast ``params`` on the keys both have), an uploaded
        ``delta``, or minus an uploaded gradient; None when the upload holds no model-shaped
        update (FedProto's prototypes)."""
        upload = result.upload
        if self.delta_from is not None and "params" in upload:
            start = pick(message[self.delta_from], self._row(message, result))
            return {key: p - start[key] for key, p in upload["params"].items()}
        if "delta" in upload:
            return upload["delta"]
        if "grad" in upload:
            return {k: -g for k, g in upload["grad"].items()}
        if "params" in upload and "params" in message:
            sent = message["params"]
            common = [k for k in upload["params"] if k in sent]
            if common:
                return {k: upload["params"][k] - sent[k] for k in common}
        return None

    @staticmethod
    def _row(message: Message, result: ClientResult) -> int:
        """The row of ``delta_from`` a client started from."""
        if "cluster" in result.upload:
            return int(result.upload["cluster"]["index"])
        return int(message["identity"][result.client_id])
