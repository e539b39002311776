"""Communication graphs of SecAgg (complete) and SecAgg+ (a random k-regular Harary graph;
Bell et al. CCS'20, Section 3.2): who exchanges keys, shares and pairwise masks with whom."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Graph = Mapping[int, frozenset[int]]
"""Client id -> its neighbours (never itself); symmetric."""


def complete_graph(clients: Sequence[int]) -> Graph:
    """Every client is every other client's neighbour (SecAgg)."""
    everyone = frozenset(clients)
    return {u: everyone - {u} for u in clients}


def harary_graph(clients: Sequence[int], k: int, rng: np.random.Generator) -> Graph:
    """The Harary graph H_{k,n} over a random permutation of ``clients``: placed on a ring in
    permuted order, each client is joined to the k/2 clients on either side (k even). With
    k >= n - 1 it is the complete graph."""
    n = len(clients)
    if k >= n - 1:
        return complete_graph(clients)
    if k < 2 or k % 2:
        raise ValueError(f"the number of neighbours k must be an even number >= 2, got {k}")
    ring = [clients[i] for i in rng.permutation(n)]
    half = k // 2
    return {
        ring[i]: frozenset(ring[(i + j) % n] for j in range(-half, half + 1) if j) for i in range(n)
    }


def default_neighbours(n: int) -> int:
    """SecAgg+'s default k for n clients: the smallest even number >= 3 log2 n, at most n - 1
    (n = 50 -> 18, 100 -> 20, 1,000 -> 30). Bell et al. need k = O(log n); the factor 3
    keeps a neighbourhood's k + 1 share holders above the k/2 + 1 threshold w.h.p. under 10%
    dropout. Flower has no default (``num_shares`` must be given)."""
    if n <= 2:
        return max(n - 1, 0)
    k = 2 * math.ceil(1.5 * math.log2(n))
    return min(k, n - 1)


def default_threshold(holders: int) -> int:
    """The default threshold: a strict majority, holders // 2 + 1, of the share holders (the
    client and its neighbours): n // 2 + 1 for SecAgg, k/2 + 1 for SecAgg+ with k even. This
    is the semi-honest bound t > n/2 of Bonawitz et al. (Section 4)."""
    return holders // 2 + 1
