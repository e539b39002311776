"""The mechanism protocol: what differential privacy, secure aggregation, attacks, robust
rules, compression and contribution evaluation may do to a round, as hooks at the fixed points
of the round pipeline (docs/architecture.md, "Mechanisms"), in the shape of pfl-research's
postprocessors and Flower's strategy wrappers.

The pipeline (engine/pipeline.py) calls every hook of every mechanism of a run, in the run's
declared order (engine/mechanism_builders.py, ``ORDER``), and knows none of them by type:

    start_round -> broadcast -> on_dispatch -> (clients train) -> on_send -> (screening)
    -> on_upload -> before_aggregate -> aggregate (wrap_sum, wrap_aggregate) -> round_bytes

Each hook's default leaves the round as it is, so a mechanism overrides only the points it
acts at; ``state_dict``/``load_state_dict`` carry its state through checkpoints and
``summary`` is its part of summary.json.

A run's mechanisms are built by one builder per package (``build(section, facts)`` of
attacks/, compression/, secure/, robust/, privacy/), called in the declared order by
engine/mechanism_builders.py; :class:`BuildFacts` is what a builder reads besides its
section, the mechanisms built before it included."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fedloom.core import pytree
from fedloom.core.protocol import ClientResult, ClientTask, Message, State

if TYPE_CHECKING:
    import torch

    from fedloom.data.federated import FederatedData

Aggregator = Callable[[list[pytree.Tree], list[float]], pytree.Tree]
"""(trees, weights) -> tree: the server's aggregation rule (robust rules plug in here)."""

UpdateSum = Callable[[Sequence[pytree.Tree], pytree.Tree], pytree.Tree]
"""(trees, anchor) -> sum_k (tree_k - anchor): how the server obtains the sum of the updates
(in the clear, or secure aggregation's masked sum)."""


@dataclass(frozen=True)
class ServerStep:
    """What the server is about to aggregate: the round, the message its clients were sent,
    their results in aggregation order, the clients that vanished (and when; secure/base.py's
    ``DropStage``) and the server state before the step."""

    round: int
    message: Message
    results: Sequence[ClientResult]
    drops: Mapping[int, Any]
    server: State


@dataclass(frozen=True)
class BuildFacts:
    """What the mechanisms' builders read besides their own config section (docs/architecture.md,
    "Mechanisms"): the run's seed, training clients and rounds, and, where the run family has
    them, the model, the data the clients train on and the algorithm's traits. ``built`` holds
    the mechanisms built before, by key (distributed DP noises secure aggregation's sum)."""

    seed: int
    train_ids: tuple[int, ...]
    clients_per_round: int | None
    """As configured (None: every training client)."""
    rounds: int
    byzantine_f: int
    """The Byzantine clients a robust rule tolerates among a round's."""
    buffers: tuple[str, ...] = ()
    """The model's buffer names (released without noise, summed apart)."""
    module: torch.nn.Module | None = None
    data: FederatedData | None = None
    """The data the clients train on (after the mechanisms built so far, ``train_data``)."""
    batch_size: int | None = None
    pooled_client: int | None = None
    """The one virtual client's id when the algorithm pools every client's data, else None."""
    run_steps: Callable[[int, int], int] | None = None
    """(client, training samples) -> an upper bound on its local steps over the run."""
    built: Mapping[str, Mechanism] = field(default_factory=dict)

    @property
    def per_round(self) -> int:
        """The clients a round (every training client when not configured)."""
        return self.clients_per_round or len(self.train_ids)


Builder = Callable[[Any, BuildFacts], "Mechanism | None"]
"""(config section, facts) -> the mechanism, or None when the section leaves it off."""


class Mechanism:
    """One mechanism of a run. ``key`` names its state in checkpoints (``RunState.mechanisms``)
    and its section in summary.json (module docstring for the hooks' order)."""

    key: ClassVar[str]
    section: ClassVar[str | None] = None
    """Its section of summary.json, when not ``key``."""

    # -- before training -------------------------------------------------------------------
    def train_data(self, data: FederatedData) -> FederatedData:
        """The data the clients train on, given ``data`` (a data attack poisons it)."""
        return data

    def start_round(self, round: int, message: Message) -> None:
        """A round (a dispatch, asynchronously) begins with ``message`` as its clients get it."""

    def broadcast(self, message: Message) -> Message:
        """What the clients receive of the server's ``message`` (as decoded)."""
        return message

    def on_dispatch(self, round: int, tasks: Sequence[ClientTask]) -> None:
        """The work orders about to run (how many steps each client takes on its data)."""

    # -- the uploads -----------------------------------------------------------------------
    def on_send(self, result: ClientResult, size: int, round: int) -> int:
        """One client's upload leaves it: returns its bytes on the wire (``size`` so far) and
        may replace ``result.upload`` by what the server receives (the client's last step,
        before screening)."""
        return size

    def on_upload(self, upload: Message, client_id: int, round: int) -> Message:
        """A screened upload as the server will aggregate it."""
        return upload

    # -- the server step -------------------------------------------------------------------
    def before_aggregate(self, step: ServerStep) -> None:
        """The server's step on ``step.results`` comes next."""

    def wrap_sum(self, inner: UpdateSum | None) -> UpdateSum | None:
        """How the server sums updates (``inner``: None for in the clear)."""
        return inner

    def wrap_aggregate(self, inner: Aggregator, update_sum: UpdateSum | None) -> Aggregator:
        """The server's aggregation rule, given the rule so far and the composed sum."""
        return inner

    def download_bytes(self, dense: int) -> int:
        """The round's bytes down, from the algorithm's dense count."""
        return dense

    def round_bytes(self, up: int, down: int) -> tuple[int, int]:
        """The round's bytes up and down after the server step."""
        return up, down

    # -- state and reports -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s output."""

    def summary(self) -> dict[str, Any]:
        """This mechanism's section of summary.json (under ``key``; empty: none)."""
        return {}


class MechanismChain:
    """Mechanisms in their declared order (``all``); each hook of the round pipeline calls
    every mechanism's, in that order (the engine's: engine/mechanisms.py; federated RL's
    server step: rl/aggregate.py)."""

    def __init__(self, mechanisms: Sequence[Mechanism]) -> None:
        self.all: list[Mechanism] = list(mechanisms)

    def named(self, key: str) -> Mechanism | None:
        """The run's mechanism under ``key`` (``incentives``, ``compression`` ...), if any."""
        return next((m for m in self.all if m.key == key), None)

    def aggregator(self, default: Aggregator) -> Aggregator:
        """The server's rule: ``default`` wrapped by each mechanism in order, over the sum of
        updates they compose (core/mechanism.py)."""
        update_sum: UpdateSum | None = None
        for mechanism in self.all:
            update_sum = mechanism.wrap_sum(update_sum)
        rule = default
        for mechanism in self.all:
            rule = mechanism.wrap_aggregate(rule, update_sum)
        return rule

    def start_round(self, round: int, message: Message) -> Message:
        """What the clients receive of ``message`` (as decoded), each mechanism told."""
        for mechanism in self.all:
            message = mechanism.broadcast(message)
        for mechanism in self.all:
            mechanism.start_round(round, message)
        return message

    def on_dispatch(self, round: int, tasks: Sequence[ClientTask]) -> None:
        for mechanism in self.all:
            mechanism.on_dispatch(round, tasks)

    def send(self, round: int, result: ClientResult) -> int:
        """One client's upload leaves it: its bytes on the wire (the dense size, or as a
        mechanism encodes it), ``result.upload`` what the server receives."""
        size = sum(pytree.num_bytes(tree) for tree in result.upload.values())
        for mechanism in self.all:
            size = mechanism.on_send(result, size, round)
        return size

    def on_upload(self, upload: Message, client_id: int, round: int) -> Message:
        for mechanism in self.all:
            upload = mechanism.on_upload(upload, client_id, round)
        return upload

    def before_aggregate(self, step: ServerStep) -> None:
        for mechanism in self.all:
            mechanism.before_aggregate(step)

    def download_bytes(self, dense: int) -> int:
        """The round's bytes down (``dense``: the algorithm's count), as encoded."""
        for mechanism in self.all:
            dense = mechanism.download_bytes(dense)
        return dense

    def round_bytes(self, up: int, down: int) -> tuple[int, int]:
        """The round's bytes up and down after the server step (secure aggregation's protocol
        traffic in place of the plain uploads)."""
        for mechanism in self.all:
            up, down = mechanism.round_bytes(up, down)
        return up, down

    # -- state and reports -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {m.key: m.state_dict() for m in self.all}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for mechanism in self.all:
            if saved.get(mechanism.key):
                mechanism.load_state_dict(saved[mechanism.key])

    def summary(self) -> dict[str, Any]:
        """summary.json's sections: ``attack``, ``compression``, ``secure_aggregation``,
        ``aggregator``, ``privacy``."""
        out: dict[str, Any] = {}
        for mechanism in self.all:
            part = mechanism.summary()
            if part:
                out[mechanism.section or mechanism.key] = part
        return out
