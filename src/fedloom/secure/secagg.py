"""SecAgg (Bonawitz et al. CCS'17) and SecAgg+ (Bell et al. CCS'20) as ``SecureSum``
protocols: each client's float vector is clipped and stochastically quantised to Z_{2^32},
masked with pairwise and self masks, summed by the server, unmasked and decoded.

SecAgg masks every pair of clients (complete graph, O(n d + n^2) per client); SecAgg+ only
neighbours in a random k-regular Harary graph (O(k d + k^2)). Both implement the
semi-honest protocol (no signatures, no consistency round) in one process: role objects
(``secagg_client``, ``secagg_server``) exchange explicit messages (``secagg_messages``)
through a round (``secagg_round``) that records them in a ``transcript``. Keys are fresh
X25519 keys every round; ``key_seed`` derives them from a seed instead, for tests only (the
sum is bit-exact either way, so results are reproducible without it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedloom.secure.base import (
    DropStage,
    SecureAggregationAbort,
    SecureAggregationConfigError,
    SecureSumResult,
)
from fedloom.secure.quantize import check_capacity, dequantize_sum, quantize
from fedloom.secure.secagg_graph import (
    Graph,
    complete_graph,
    default_neighbours,
    default_threshold,
    harary_graph,
)
from fedloom.secure.secagg_round import MaskedSum, SecAggRound
from fedloom.secure.transcript import Transcript

SecAggAbort = SecureAggregationAbort
"""A shorter name for ``SecureAggregationAbort``."""

_QUANTIZE, _GRAPH = 1, 2  # purpose codes of the (seed, round, client, purpose) streams


@dataclass(frozen=True)
class _PairwiseMasking:
    """What SecAgg and SecAgg+ share: their common settings (documented on :class:`SecAgg`);
    quantise, run the masked round, decode. Subclasses add ``threshold`` (a field) and say
    which graph and threshold a round uses."""

    clip: float = 8.0
    bits: int = 22
    _: KW_ONLY
    max_clients: int = 1000
    seed: int = 0
    key_seed: int | None = None
    if TYPE_CHECKING:  # a field of each subclass, after its other positional settings
        threshold: int | None

    def __post_init__(self) -> None:
        self._check_settings()

    def graph(self, round: int, clients: Sequence[int]) -> Graph:
        raise NotImplementedError

    def round_threshold(self, graph: Graph) -> int:
        raise NotImplementedError

    def _check_settings(self) -> None:
        check_capacity(self.clip, self.bits, self.max_clients)
        if self.threshold is not None and (
            not isinstance(self.threshold, int) or self.threshold < 1
        ):
            raise SecureAggregationConfigError(
                f"threshold must be a positive integer or None (default), got {self.threshold!r}"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise SecureAggregationConfigError(f"seed must be an integer >= 0, got {self.seed!r}")

    def quantize(self, round: int, client: int, x: np.ndarray) -> np.ndarray:
        """Client ``client``'s clipped, stochastically rounded input for ``round``: a flat
        uint32 vector; its rounding stream is seeded by (seed, round, client, quantize)."""
        stream = np.random.SeedSequence([self.seed, round, client, _QUANTIZE])
        q = quantize(x, self.clip, self.bits, np.random.default_rng(stream))
        return q.reshape(-1)

    def masked_sum(
        self,
        round: int,
        inputs: Mapping[int, np.ndarray],
        drops: Mapping[int, DropStage],
        transcript: Transcript | None = None,
    ) -> MaskedSum:
        """One protocol round over already quantised uint32 ``inputs``: z = sum of the U3
        clients' inputs mod 2^32, bit-exact. The round's clients are those in ``inputs`` or
        ``drops``."""
        clients = sorted(set(inputs) | set(drops))
        if any(not isinstance(u, int | np.integer) or not 0 <= u < 2**32 - 1 for u in clients):
            raise ValueError(f"client ids must be integers in [0, 2^32 - 1), got {clients}")
        if len(clients) > self.max_clients:
            raise SecureAggregationConfigError(
                f"round {round} has {len(clients)} clients, more than max_clients="
                f"{self.max_clients} that {self.bits}-bit quantisation was sized for"
            )
        graph = self.graph(round, clients)
        threshold = self.round_threshold(graph)
        protocol = SecAggRound(round, inputs, drops, graph, threshold, self.key_seed, transcript)
        return protocol.run()

    def sum(
        self,
        round: int,
        vectors: Mapping[int, np.ndarray],
        drops: Mapping[int, DropStage],
    ) -> SecureSumResult:
        """``SecureSum``: quantise, run the round, decode the sum of the U3 clients."""
        start = time.perf_counter()
        senders = [u for u in sorted(vectors) if drops.get(u) not in ("keys", "shares")]
        shapes = {np.shape(vectors[u]) for u in vectors}
        if len(shapes) > 1:
            raise ValueError(f"client vectors differ in shape: {sorted(shapes)}")
        inputs = {u: self.quantize(round, u, vectors[u]) for u in senders}
        quantize_seconds = time.perf_counter() - start
        transcript = Transcript(keep_messages=False)
        result = self.masked_sum(round, inputs, drops, transcript)
        decode_start = time.perf_counter()
        total = dequantize_sum(result.total, self.clip, self.bits, len(result.included))
        shape = next(iter(shapes)) if shapes else total.shape
        total = total.reshape(shape)
        quantize_seconds += time.perf_counter() - decode_start
        seconds = dict(result.seconds)
        seconds["crypto"] = sum(result.seconds.values())
        seconds["quantize"] = quantize_seconds
        seconds["total"] = time.perf_counter() - start
        return SecureSumResult(
            total=total,
            included=result.included,
            bytes_up=transcript.bytes_up(),
            bytes_down=transcript.bytes_down(),
            seconds=seconds,
        )


@dataclass(frozen=True)
class SecAgg(_PairwiseMasking):
    """SecAgg (Bonawitz et al. CCS'17, Section 4, semi-honest): pairwise masks between all
    clients of the round.

    clip: coordinates are clipped to [-clip, clip] (Flower's default 8.0). bits: quantisation
    to 2^bits levels (Flower's 2^22); with ``max_clients`` (1,000, Flower's max_weight) it must
    satisfy max_clients (2^bits - 1) < 2^32, checked here. threshold: t, the shares needed to
    rebuild a secret and the fewest clients that may survive any step; default n // 2 + 1 of
    the round's n clients (t > n/2, semi-honest). seed: the stochastic-rounding streams.
    key_seed: derive keys from a seed, tests only; None (default) draws fresh keys.
    """

    threshold: int | None = None

    def graph(self, round: int, clients: Sequence[int]) -> Graph:
        return complete_graph(clients)

    def round_threshold(self, graph: Graph) -> int:
        return self.threshold if self.threshold is not None else default_threshold(len(graph))


@dataclass(frozen=True)
class SecAggPlus(_PairwiseMasking):
    """SecAgg+ (Bell et al. CCS'20, Section 3): SecAgg over a random k-regular Harary graph
    H_{k,n} on a random permutation of the round's clients (seeded by (seed, round)).

    neighbours: k, even; default the smallest even number >= 3 log2 n (n = 100 -> 20), at
    most n - 1 (then the graph is complete). Flower calls k + 1 ``num_shares`` and has no
    default. threshold: t per neighbourhood, out of k + 1 holders (a client and its
    neighbours); default k/2 + 1, a strict majority (Flower's ``reconstruction_threshold``).
    A round aborts when any neighbourhood needed for reconstruction has fewer than t
    survivors. Other settings as in :class:`SecAgg`.
    """

    neighbours: int | None = None
    threshold: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.neighbours
        if k is not None and (not isinstance(k, int) or k < 2 or k % 2):
            raise SecureAggregationConfigError(
                f"neighbours (k) must be an even integer >= 2 or None (default), got {k!r}"
            )
        if k is not None and self.threshold is not None and self.threshold > k + 1:
            raise SecureAggregationConfigError(
                f"threshold {self.threshold} exceeds the {k + 1} share holders of a "
                f"neighbourhood (k = {k} neighbours and the client itself)"
            )

    def round_neighbours(self, n: int) -> int:
        """k for a round of n clients."""
        k = self.neighbours if self.neighbours is not None else default_neighbours(n)
        return min(k, max(n - 1, 0))

    def graph(self, round: int, clients: Sequence[int]) -> Graph:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, round, _GRAPH]))
        return harary_graph(list(clients), self.round_neighbours(len(clients)), rng)

    def round_threshold(self, graph: Graph) -> int:
        holders = self.round_neighbours(len(graph)) + 1
        if self.threshold is None:
            return default_threshold(holders)
        return self.threshold
