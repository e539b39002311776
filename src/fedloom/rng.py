"""Deterministic random streams derived from (run seed, round, client, purpose).

Every random draw in fedloom comes from :func:`generator` or :func:`numpy_rng`, keyed by the
run seed and a purpose string plus optional round and client ids. Two streams with different
keys are statistically independent (NumPy's SeedSequence hashing), and a stream never depends
on how many draws other streams made: this is what makes a resumed run equal an
uninterrupted one and lets every executor reproduce the same numbers.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

NO_ID = -1


def _purpose_code(purpose: str) -> int:
    return zlib.crc32(purpose.encode("utf-8"))


def seed_for(seed: int, purpose: str, round: int = NO_ID, client: int = NO_ID) -> int:
    """A 63-bit integer seed for the stream (seed, round, client, purpose)."""
    entropy = [int(seed) & 0xFFFFFFFF, _purpose_code(purpose), int(round) + 1, int(client) + 1]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def generator(seed: int, purpose: str, round: int = NO_ID, client: int = NO_ID) -> torch.Generator:
    """A CPU ``torch.Generator`` for the stream (seed, round, client, purpose)."""
    gen = torch.Generator()
    gen.manual_seed(seed_for(seed, purpose, round, client))
    return gen


def numpy_rng(
    seed: int, purpose: str, round: int = NO_ID, client: int = NO_ID
) -> np.random.Generator:
    """A NumPy ``Generator`` for the stream (seed, round, client, purpose)."""
    return np.random.default_rng(seed_for(seed, purpose, round, client))
