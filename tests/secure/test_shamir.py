"""Shamir t-of-n sharing over GF(2^521 - 1) (privacy_secagg.md, section 4, Shamir)."""

from __future__ import annotations

import random
import secrets

import pytest

from fedloom.secure import shamir

N, T = 20, 11
XS = [shamir.x_of(client) for client in range(N)]


def test_any_t_shares_recover_the_secret() -> None:
    secret = secrets.token_bytes(32)
    shares = shamir.split(secret, XS, T)
    pick = random.Random(0)
    for _ in range(20):
        subset = pick.sample(shares, T)
        assert shamir.combine(subset) == secret
    assert shamir.combine(shares) == secret  # more than t shares: same polynomial


@pytest.mark.parametrize("secret", [bytes(32), b"\xff" * 32, bytes(range(32))])
def test_edge_secrets_round_trip(secret: bytes) -> None:
    assert shamir.combine(shamir.split(secret, XS, T)[-T:]) == secret


def test_t_minus_1_shares_do_not_recover() -> None:
    secret = secrets.token_bytes(32)
    shares = shamir.split(secret, XS, T)
    pick = random.Random(1)
    for _ in range(20):
        subset = pick.sample(shares, T - 1)
        assert shamir.combine_int(subset) != int.from_bytes(secret, "big")
        with pytest.raises(ValueError, match="do not reconstruct"):
            shamir.combine(subset)


def test_share_serialisation_round_trip() -> None:
    shares = shamir.split(secrets.token_bytes(32), XS, T)
    for share in shares:
        data = shamir.share_to_bytes(share)
        assert len(data) == shamir.SHARE_BYTES == 66
        assert shamir.share_from_bytes(share.x, data) == share
    with pytest.raises(ValueError, match="66 bytes"):
        shamir.share_from_bytes(1, bytes(65))
    with pytest.raises(ValueError, match="field element"):
        shamir.share_from_bytes(1, b"\xff" * 66)


def test_seeded_coefficients_are_deterministic() -> None:
    secret = bytes(range(32))
    first = shamir.split(secret, XS, T, rng=random.Random(7).randrange)
    second = shamir.split(secret, XS, T, rng=random.Random(7).randrange)
    other = shamir.split(secret, XS, T, rng=random.Random(8).randrange)
    assert first == second != other
    assert shamir.combine(other[:T]) == secret


def test_split_rejects_bad_arguments() -> None:
    secret = bytes(32)
    with pytest.raises(ValueError, match="32 bytes"):
        shamir.split(bytes(16), XS, T)
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(secret, XS, N + 1)
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(secret, XS, 0)
    with pytest.raises(ValueError, match="distinct"):
        shamir.split(secret, [1, 1, 2], 2)
    with pytest.raises(ValueError, match="distinct"):
        shamir.split(secret, [0, 1, 2], 2)
    with pytest.raises(ValueError, match=">= 0"):
        shamir.x_of(-1)
    with pytest.raises(ValueError, match="distinct"):
        shamir.combine_int([shamir.Share(1, 5), shamir.Share(1, 6)])
