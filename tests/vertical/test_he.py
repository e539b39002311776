"""The encrypted-array backend the vertical protocols run on: Paillier with fixed-point
encoding (scale tracking, masks) against the plaintext stand-in, and the generic signed-integer
helpers added to ``fedloom.secure.paillier``."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.secure.paillier import (
    PackingOverflowError,
    decrypt_ints,
    encrypt_ints,
    generate_keypair,
    linear_combination,
    rerandomize,
    subtract_ciphertexts,
)
from fedloom.vertical.he import PaillierBackend, PlainBackend
from fedloom.vertical.messages import Channel, payload_nbytes
from tests.vertical.conftest import KEY_BITS


@pytest.fixture(scope="module")
def keypair():
    return generate_keypair(KEY_BITS)


def test_signed_integer_helpers(keypair):
    pk, sk = keypair.public_key, keypair.private_key
    values = [5, -7, 0, 2**200, -(2**300)]
    cts = encrypt_ints(pk, values)
    assert decrypt_ints(sk, cts) == values
    assert decrypt_ints(sk, [linear_combination(cts[:3], [3, -2, 9])]) == [29]
    assert decrypt_ints(sk, subtract_ciphertexts(cts[:2], cts[1:3])) == [12, -7]
    fresh = rerandomize(cts[:2])
    assert decrypt_ints(sk, fresh) == values[:2]
    assert fresh[0].ciphertext(False) != cts[0].ciphertext(False)
    with pytest.raises(PackingOverflowError):
        encrypt_ints(pk, [pk.n // 2 + 1])


def test_paillier_backend_matches_plain(keypair):
    """Every operation a protocol uses, composed, equals the float path within fixed-point
    error; masks round-trip; scales add up and are aligned."""
    rng = np.random.default_rng(0)
    channel = Channel()
    enc, plain = PaillierBackend(channel, keypair=keypair), PlainBackend(channel)
    pub = enc.public()
    a, b = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    p, q = rng.normal(size=(4, 5)), rng.normal(size=(3, 2))

    def program(be, ea, eb):
        s = be.add(be.mul_plain(ea, b), be.add_plain(eb, 0.5))  # scales 2f and f
        left = be.matmul_plain(p, s)  # (4, 3)
        right = be.rmatmul_plain(be.take(s, np.array([0, 2])), q)  # (2, 2)
        col = be.stack([be.take(s, 1, axis=1), be.take(s, 2, axis=1)], axis=1)  # (5, 2)
        return be.sum(left, axis=0), right, be.sum(col)

    outs_e = program(pub, enc.encrypt(a), enc.encrypt(b))
    outs_p = program(plain, plain.encrypt(a), plain.encrypt(b))
    for e, pl in zip(outs_e, outs_p, strict=True):
        np.testing.assert_allclose(enc.decrypt(e), plain.decrypt(pl), atol=1e-8, rtol=0)
    assert outs_e[0].scale == 3 * 32
    masked, mask = pub.mask(outs_e[1])
    seen = enc.decrypt_masked(masked)
    np.testing.assert_allclose(pub.unmask(seen, mask), plain.decrypt(outs_p[1]), atol=1e-8)
    assert min(abs(int(v)) for v in seen.values.ravel()) > 2**800  # g + R: R dominates
    assert payload_nbytes(masked) == 4 * 256  # 1024-bit n: 256-byte ciphertexts
    with pytest.raises(PermissionError):
        pub.decrypt(masked)
    with pytest.raises(PackingOverflowError):
        enc.encrypt(np.array([2.0**40]))
    assert channel.crypto_seconds > 0
