"""The engine's secure aggregation slot: a round's weighted model average computed through a
``SecureSum`` protocol, so the server learns only the sum.

Each uploading client k sends the vector [w_k Delta_k, w_k] with Delta_k = w_k's model minus
the broadcast one, flattened over all parameters, and w_k = n_k / max_j n_j its sample count
over the round's largest (public: the server weighs clients by it in plain FedAvg too). The
protocol clips every coordinate to [-clip, clip], encodes and sums; the server divides the sum
of the weighted updates by the sum of the weights and adds the result to the broadcast model:

    theta_{t+1} = theta_t + sum_k w_k Delta_k / sum_k w_k       (k over the included clients)

which is FedAvg's weighted mean up to the protocol's encoding error. Who is included is the
protocol's answer: clients that vanished before uploading are not; those that vanished after
(SecAgg's round 3) are. Below the protocol's threshold the round aborts
(``SecureAggregationAbort``) and the engine keeps the server's state for that round.

With client-level DP (privacy.kind client_dp) the sum is of the clipped updates, uniformly
weighted (``sum_updates``), and the server adds the Gaussian noise to it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedloom.core.mechanism import Aggregator, Mechanism, ServerStep, UpdateSum
from fedloom.core.pytree import flatten64, unflatten
from fedloom.secure.base import DropStage, SecureAggregationAbort, SecureSum, SecureSumResult
from fedloom.secure.transcript import Transcript

if TYPE_CHECKING:
    from fedloom.secure.config import SecureAggregationConfig

Tree = dict[str, torch.Tensor]


def build_protocol(config: SecureAggregationConfig, seed: int, max_clients: int) -> SecureSum:
    """The ``SecureSum`` protocol ``config.kind`` names (imported only when asked for: the
    cryptographic libraries are the ``secure`` extra). ``max_clients``: the most clients a
    round can hold (sizes Paillier's slots when smaller than ``config.max_clients``)."""
    kind = config.kind
    try:
        if kind in ("secagg", "secagg_plus"):
            from fedloom.secure.secagg import SecAgg, SecAggPlus

            if kind == "secagg":
                return SecAgg(
                    config.clip,
                    config.bits,
                    config.threshold,
                    max_clients=config.max_clients,
                    seed=seed,
                )
            return SecAggPlus(
                config.clip,
                config.bits,
                config.neighbours,
                config.threshold,
                max_clients=config.max_clients,
                seed=seed,
            )
        if kind == "paillier":
            from fedloom.secure.encrypted_fedavg import PaillierAggregation

            return PaillierAggregation(
                config.clip,
                config.frac_bits,
                config.key_bits,
                max_clients=min(config.max_clients, max_clients),
                min_contributors=config.min_contributors,
            )
        if kind == "ckks":
            from fedloom.secure.ckks import CKKSAggregation

            return CKKSAggregation(config.clip, config.min_contributors)
    except ImportError as err:  # pragma: no cover - the test extra installs them
        from fedloom.errors import ConfigError

        raise ConfigError(
            f"secure_aggregation.kind {kind} needs the secure extra ({err.name} is missing): "
            "pip install 'fedloom[secure]'"
        ) from None
    raise ValueError(f"no secure aggregation protocol {kind!r}")


def flatten(tree: Mapping[str, torch.Tensor], keys: Sequence[str]) -> np.ndarray:
    """The tensors at ``keys`` in order, as one float64 NumPy vector (the protocols' input)."""
    return flatten64(tree, keys).numpy()


class SecureAggregation(Mechanism):
    """One run's secure aggregation (core/mechanism.py): ``begin`` a round with its clients
    and dropouts (``before_aggregate``), then the algorithm's ``ctx.aggregate`` runs the
    protocol: the weighted mean (``aggregate``) or, under client-level DP, the sum of the
    updates DP noises (``sum_updates``); the counters are what summary.json's
    ``secure_aggregation`` reports."""

    key = "secure"
    section = "secure_aggregation"

    def __init__(self, config: SecureAggregationConfig, protocol: SecureSum) -> None:
        self.config = config
        self.protocol = protocol
        self.round = 0
        self.anchor: Tree | None = None
        self.clients: list[int] = []
        self.drops: dict[int, DropStage] = {}
        self.counters = SecureCounters()
        self.last: dict[str, Any] = {}
        """The latest round: included clients, bytes, seconds, or why it aborted."""

    # -- the round ------------------------------------------------------------------------
    def begin(
        self,
        round: int,
        message: Mapping[str, Any],
        clients: Sequence[int],
        drops: Mapping[int, DropStage],
    ) -> None:
        """The round's broadcast model (``message['params']``), the clients whose uploads the
        algorithm will aggregate, in that order, and every client that vanished and when."""
        self.round = round
        self.anchor = dict(message["params"])
        self.clients = list(clients)
        self.drops = dict(drops)

    def before_aggregate(self, step: ServerStep) -> None:
        self.begin(step.round, step.message, [r.client_id for r in step.results], step.drops)

    def wrap_sum(self, inner: UpdateSum | None) -> UpdateSum | None:
        return self.sum_updates

    def wrap_aggregate(self, inner: Aggregator, update_sum: UpdateSum | None) -> Aggregator:
        return self.aggregate

    def round_bytes(self, up: int, down: int) -> tuple[int, int]:
        """The protocol's traffic in place of the plain uploads (when its round completed)."""
        if "bytes_up" not in self.last:
            return up, down
        return self.last["bytes_up"], down + self.last["bytes_down"]

    def aggregate(self, trees: Sequence[Tree], weights: Sequence[float]) -> Tree:
        """The weighted mean of ``trees`` (the clients' models) through the protocol."""
        anchor = self._anchor_for(trees)
        top = max(weights) if weights else 1.0
        scaled = [float(w) / top if top > 0 else 1.0 for w in weights]
        keys = list(anchor)
        base = flatten(anchor, keys)
        vectors = {
            c: np.append(w * (flatten(tree, keys) - base), w)
            for c, tree, w in zip(self.clients, trees, scaled, strict=True)
        }
        total = self._sum(vectors)
        mean = total[:-1] / total[-1] if total[-1] > 0 else np.zeros(len(base))
        return unflatten(torch.from_numpy(base + mean), anchor, keys)

    def sum_updates(self, trees: Sequence[Tree], anchor: Tree) -> Tree:
        """sum_k (tree_k - anchor) through the protocol (client-level DP's sum of clipped
        updates), in float64."""
        keys = list(anchor)
        base = flatten(anchor, keys)
        vectors = {
            c: flatten(tree, keys) - base for c, tree in zip(self.clients, trees, strict=True)
        }
        float64 = {k: v.double() for k, v in anchor.items()}
        return unflatten(torch.from_numpy(self._sum(vectors)), float64, keys)

    def _anchor_for(self, trees: Sequence[Tree]) -> Tree:
        anchor = self.anchor
        assert anchor is not None, "begin the round first"
        if not trees or set(trees[0]) != set(anchor) or len(trees) != len(self.clients):
            raise SecureAggregationAbort(
                "secure aggregation sums the clients' models once per round: the algorithm "
                "aggregated something else"
            )
        return anchor

    def sum_integers(self, inputs: Mapping[int, np.ndarray]) -> tuple[np.ndarray, int]:
        """The sum modulo 2^32 of already encoded uint32 vectors (distributed DP's; SecAgg and
        SecAgg+ only) through the masked round, and how many clients it holds."""
        masked_sum = getattr(self.protocol, "masked_sum", None)
        if masked_sum is None:
            raise SecureAggregationAbort(f"{self.config.kind} cannot sum integer vectors")

        def run(round: int, vectors: Mapping[int, np.ndarray], drops: Any) -> SecureSumResult:
            transcript = Transcript(keep_messages=False)
            out = masked_sum(round, vectors, drops, transcript)
            up, down = transcript.bytes_up(), transcript.bytes_down()
            return SecureSumResult(out.total, out.included, up, down, dict(out.seconds))

        total = self._sum(dict(inputs), run)
        return total.astype(np.int64), int(self.last["included"])

    def _sum(self, vectors: dict[int, np.ndarray], run: Any = None) -> np.ndarray:
        start = time.perf_counter()
        try:
            result = (run or self.protocol.sum)(self.round, vectors, self.drops)
        except SecureAggregationAbort as err:
            self.counters.rounds_aborted += 1
            self.last = {"round": self.round, "aborted": str(err)}
            raise
        counters = self.counters
        counters.rounds_completed += 1
        counters.bytes_up += result.bytes_up
        counters.bytes_down += result.bytes_down
        for phase, s in result.seconds.items():
            counters.seconds[phase] = counters.seconds.get(phase, 0.0) + s
        self.last = {
            "round": self.round,
            "included": len(result.included),
            "bytes_up": result.bytes_up,
            "bytes_down": result.bytes_down,
        }
        counters.seconds["round"] = counters.seconds.get("round", 0.0) + time.perf_counter() - start
        return np.asarray(result.total, dtype=np.float64)

    # -- run state and reports ------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """The metrics row's ``secure_aggregation``: counters so far and the latest round
        (no timings: rows of a resumed run equal the uninterrupted run's)."""
        out = {"kind": self.config.kind, **self.state_dict(), "last": dict(self.last)}
        del out["seconds"]
        return out

    def summary(self) -> dict[str, Any]:
        """summary.json's ``secure_aggregation``."""
        return {"kind": self.config.kind, **self.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        counters = asdict(self.counters)
        counters["seconds"] = dict(self.counters.seconds)
        return counters

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.counters = SecureCounters(**{**asdict(SecureCounters()), **saved})


@dataclass
class SecureCounters:
    """Secure aggregation's counters over a run (checkpointed; summary.json's section)."""

    rounds_completed: int = 0
    rounds_aborted: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    """Protocol seconds by phase, summed over the run."""
