"""Deterministic random streams derived from (run seed, round, client, purpose).

Every random draw in fedloom comes from :func:`generator` or :func:`numpy_rng`, keyed by the
run seed and a purpose string plus optional round and client ids. Two streams with different
keys are statistically independent (a BLAKE2b hash of the key), and a stream never depends
on how many draws other streams made: this is what makes a resumed run equal an
uninterrupted one and lets every executor reproduce the same numbers.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

NO_ID = -1


def seed_for(seed: int, purpose: str, round: int = NO_ID, client: int = NO_ID) -> int:
    """A 63-bit integer seed for the stream (seed, round, client, purpose).

    BLAKE2b of the packed key: cheaper per stream than NumPy's SeedSequence, which matters
    when every one of 1,000 clients gets its own stream each round (benchmarks/README.md,
    Design measurements)."""
    key = struct.pack("<qqq", int(seed), int(round), int(client)) + purpose.encode("utf-8")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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
