"""The random streams of fedloom.core.rng: the key layout of the seed (BLAKE2b of the packed
(seed, round, client) and the purpose), distinct keys giving distinct streams, and a stream
independent of the draws made from any other."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from fedloom.core import rng


def test_seed_is_blake2b_of_the_little_endian_key_shifted_to_63_bits():
    """seed 7, round 3, client -1 (no id), purpose "sample": the three int64 fields little
    endian, then the UTF-8 purpose; the 8-byte digest read little endian, shifted right once."""
    key = (
        ((7).to_bytes(8, "little") + (3).to_bytes(8, "little", signed=True))
        + (-1).to_bytes(8, "little", signed=True)
        + b"sample"
    )
    digest = hashlib.blake2b(key, digest_size=8).digest()
    assert rng.seed_for(7, "sample", round=3) == int.from_bytes(digest, "little") >> 1
    assert 0 <= rng.seed_for(7, "sample", round=3) < 2**63


def test_every_field_of_the_key_changes_the_stream():
    base = rng.seed_for(0, "train", round=1, client=2)
    others = {
        rng.seed_for(1, "train", round=1, client=2),
        rng.seed_for(0, "eval", round=1, client=2),
        rng.seed_for(0, "train", round=2, client=2),
        rng.seed_for(0, "train", round=1, client=3),
        rng.seed_for(0, "train", round=2, client=1),  # round and client swapped
    }
    assert base not in others and len(others) == 5


def test_a_stream_does_not_depend_on_draws_from_other_streams():
    alone = torch.rand(4, generator=rng.generator(0, "a", client=1))
    other = rng.generator(0, "a", client=2)
    torch.rand(100, generator=other)
    again = torch.rand(4, generator=rng.generator(0, "a", client=1))
    assert torch.equal(alone, again)
    assert not torch.equal(alone, torch.rand(4, generator=rng.generator(0, "a", client=2)))
    a = rng.numpy_rng(0, "a", round=5).integers(0, 2**31, size=3)
    expected = np.random.default_rng(rng.seed_for(0, "a", round=5)).integers(0, 2**31, size=3)
    assert np.array_equal(a, expected)
