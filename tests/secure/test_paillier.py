"""Paillier-encrypted FedAvg (docs/secure_aggregation.md): exact packed sums, weights, the
overflow guard, the key authority's policy, dropouts and who sees what. 1024-bit keys (tests
only), one key pair for the module."""

from __future__ import annotations

import numpy as np
import pytest
from phe import paillier as phe_paillier

from fedloom.secure.base import SecureAggregationAbort, SecureAggregationConfigError
from fedloom.secure.encrypted_fedavg import PaillierAggregation
from fedloom.secure.he_protocol import (
    KEY_AUTHORITY,
    CiphertextUpload,
    DecryptionRefused,
    DecryptRequest,
)
from fedloom.secure.paillier import (
    FixedPoint,
    PackingOverflowError,
    PaillierKeypair,
    SlotPacking,
    add_ciphertexts,
    ciphertext_bytes,
    decrypt_packed,
    encrypt_packed,
    generate_keypair,
    scale_ciphertexts,
    slot_bits,
    sum_ciphertexts,
)
from fedloom.secure.transcript import CLIENTS, SERVER, Transcript

CLIP, FRAC_BITS = 1.0, 16


@pytest.fixture(scope="module")
def keypair() -> PaillierKeypair:
    return generate_keypair(1024)


def client_vectors(n: int, d: int, seed: int = 0) -> dict[int, np.ndarray]:
    """Uniform in [-1.5, 1.5]: about a third of the coordinates get clipped."""
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(-1.5, 1.5, d) for k in range(n)}


def test_paillier_fedavg_exact(keypair: PaillierKeypair) -> None:
    k, d = 10, 960
    vectors = client_vectors(k, d)
    transcript = Transcript(keep_messages=True)
    agg = PaillierAggregation(
        CLIP, FRAC_BITS, max_clients=k, keypair=keypair, transcript=transcript
    )
    result = agg.sum(0, vectors, {})

    q_sum = sum(agg.codec.encode(x) for x in vectors.values())
    assert np.array_equal(result.slot_sums, q_sum)
    (answer,) = [d.message for d in transcript.select(kind="decrypted_aggregate")]
    assert list(answer.plaintexts) == agg.packing.pack(q_sum)  # the packed integer sum, exact
    clipped_mean = np.mean([np.clip(x, -CLIP, CLIP) for x in vectors.values()], axis=0)
    assert np.max(np.abs(result.mean - clipped_mean)) <= 2.0**-FRAC_BITS
    assert result.included == list(range(k))
    n_ct = agg.packing.count(d)
    assert result.bytes_up == k * n_ct * ciphertext_bytes(keypair.public_key) == k * n_ct * 256
    assert set(result.seconds) >= {"encrypt", "aggregate", "decrypt", "total"}


def test_paillier_weighted(keypair: PaillierKeypair) -> None:
    k, d = 8, 300
    vectors = client_vectors(k, d, seed=1)
    rng = np.random.default_rng(2)
    weights = {c: int(rng.integers(1, 601)) for c in vectors}
    agg = PaillierAggregation(CLIP, FRAC_BITS, max_clients=k, max_weight=600, keypair=keypair)
    result = agg.weighted_sum(0, vectors, weights)

    assert result.weight_sum == sum(weights.values())
    assert np.array_equal(
        result.slot_sums, sum(weights[c] * agg.codec.encode(x) for c, x in vectors.items())
    )
    plain = sum(weights[c] * np.clip(x, -CLIP, CLIP) for c, x in vectors.items())
    assert np.max(np.abs(result.mean - plain / result.weight_sum)) <= 2.0**-FRAC_BITS


def test_packing_overflow_guard(keypair: PaillierKeypair) -> None:
    # docs/secure_aggregation.md's example: 2048-bit, f = 16, c = 1, K = 10 -> b = 23, 88 slots
    width = slot_bits(FixedPoint(1.0, 16).value_bits, max_terms=10)
    assert width == 23 and SlotPacking.for_key(2048, width).slots == 88
    # K·w_max that cannot fit one slot in a 1024-bit plaintext: refused by the constructor,
    # before any key is generated or any client encodes anything
    with pytest.raises(PackingOverflowError, match="does not fit"):
        PaillierAggregation(CLIP, FRAC_BITS, key_bits=1024, max_clients=10, max_weight=2**1010)
    assert issubclass(PackingOverflowError, SecureAggregationConfigError)

    # a round beyond what the slots were sized for is refused before anyone encrypts
    agg = PaillierAggregation(CLIP, FRAC_BITS, max_clients=3, max_weight=5, keypair=keypair)
    with pytest.raises(PackingOverflowError, match="max_clients=3"):
        agg.sum(0, client_vectors(4, 10), {})
    with pytest.raises(SecureAggregationConfigError, match="max_weight=5"):
        agg.weighted_sum(0, client_vectors(3, 10), {0: 1, 1: 6, 2: 1})
    assert not agg.transcript.select(sender=CLIENTS)

    # the sized slots hold the worst case: K uploads of the largest encoding at weight w_max
    packing, worst = agg.packing, 3 * 5 * (2 * agg.codec.offset)
    assert worst < 2 ** (packing.slot_bits - 1)  # with the guard bit to spare


def test_key_authority_single_decrypt(keypair: PaillierKeypair) -> None:
    agg = PaillierAggregation(CLIP, FRAC_BITS, max_clients=5, min_contributors=3, keypair=keypair)
    vectors = client_vectors(3, 50)
    agg.sum(7, vectors, {})
    ka = agg.key_authority
    assert [(r.round, r.contributors) for r in ka.log] == [(7, (0, 1, 2))]

    ciphertexts = tuple(agg.client(0).upload(7, vectors[0]).ciphertexts)
    with pytest.raises(DecryptionRefused, match="already decrypted"):
        ka.decrypt(DecryptRequest(7, (0, 1, 2), ciphertexts))
    with pytest.raises(SecureAggregationAbort):  # the whole round again: refused too
        agg.sum(7, vectors, {})
    # a server asking for one client's ciphertext must declare too few contributors or lie
    with pytest.raises(DecryptionRefused, match="fewer than min_contributors=3"):
        ka.decrypt(DecryptRequest(8, (0, 1), ciphertexts))
    with pytest.raises(DecryptionRefused, match="fewer than min_contributors=3"):
        ka.decrypt(DecryptRequest(8, (0, 0, 0), ciphertexts))  # distinct clients count
    assert len(ka.log) == 1
    # too few uploads: the server aborts the round without asking the authority
    with pytest.raises(SecureAggregationAbort, match="min_contributors=3"):
        agg.sum(9, vectors, {2: "shares"})
    assert len(ka.log) == 1


def test_paillier_dropout_semantics(keypair: PaillierKeypair) -> None:
    vectors = client_vectors(6, 100, seed=3)
    drops = {1: "keys", 2: "shares", 3: "unmask", 9: "keys"}  # 9 vanished before computing
    agg = PaillierAggregation(CLIP, FRAC_BITS, max_clients=6, keypair=keypair)
    result = agg.sum(0, vectors, drops)

    assert result.included == [0, 3, 4, 5]  # "unmask": uploaded, so summed
    expected = sum(np.clip(vectors[c], -CLIP, CLIP) for c in result.included)
    assert np.max(np.abs(result.total - expected)) <= 4 * 2.0 ** -(FRAC_BITS + 1)
    assert result.bytes_up == 4 * agg.packing.count(100) * 256
    with pytest.raises(ValueError, match="drop stage"):
        agg.sum(1, vectors, {0: "late"})


def test_paillier_transcript_server_sees_only_ciphertexts(keypair: PaillierKeypair) -> None:
    transcript = Transcript(keep_messages=True)
    agg = PaillierAggregation(
        CLIP, FRAC_BITS, max_clients=4, keypair=keypair, transcript=transcript
    )
    vectors = client_vectors(4, 200, seed=4)
    r0 = agg.sum(0, vectors, {})
    r1 = agg.sum(1, vectors, {3: "keys"})

    uploads = transcript.select(receiver=SERVER, sender=CLIENTS)
    assert len(uploads) == 4 + 3
    assert {(e.stage, e.kind, e.payload_types) for e in uploads} == {
        ("upload", "ciphertext_upload", frozenset({"EncryptedNumber"}))
    }
    for e in uploads:
        assert isinstance(e.message, CiphertextUpload)
        assert all(isinstance(c, phe_paillier.EncryptedNumber) for c in e.message.ciphertexts)
    # the server holds public material only
    assert not any(
        isinstance(v, phe_paillier.PaillierPrivateKey | PaillierKeypair)
        for v in vars(agg.server).values()
    )
    # the key authority hears only from the server, once per round, and only the aggregate
    to_ka = transcript.select(receiver=KEY_AUTHORITY)
    assert [(e.round, e.sender, e.kind) for e in to_ka] == [
        (0, SERVER, "decrypt_request"),
        (1, SERVER, "decrypt_request"),
    ]
    n_ct = agg.packing.count(200)
    assert all(e.nbytes == n_ct * 256 for e in to_ka)
    assert all(e.payload_types == {"EncryptedNumber"} for e in to_ka)
    # and sends back only plaintexts, to the server alone
    from_ka = transcript.select(sender=KEY_AUTHORITY)
    assert {(e.receiver, e.kind) for e in from_ka} == {
        (SERVER, "public_key"),
        (SERVER, "decrypted_aggregate"),
    }
    # bytes: uploads as counted in the results; the public key goes to each client once
    assert r0.bytes_up + r1.bytes_up == transcript.bytes_up()
    assert (r0.bytes_up, r1.bytes_up) == (transcript.bytes_up(0), transcript.bytes_up(1))
    assert r0.bytes_down == transcript.bytes_down(0) == 4 * 128
    assert r1.bytes_down == transcript.bytes_down(1) == 0
    assert transcript.bytes_by_stage(0) == {
        "public_key": (0, 4 * 128),
        "upload": (r0.bytes_up, 0),
        "decryption": (0, 0),
    }


@pytest.mark.parametrize("seed", range(6))
def test_pack_unpack_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    width = int(rng.choice([1, 7, 8, 23, 26, 32, 63, 64, 70, 130]))
    packing = SlotPacking.for_key(int(rng.choice([512, 1024, 2048])), width)
    for length in (0, 1, packing.slots - 1, packing.slots, packing.slots + 1, 1000):
        values = rng.integers(0, 2 ** min(width, 62), length, dtype=np.int64)
        plaintexts = packing.pack(values)
        assert len(plaintexts) == packing.count(length)
        assert all(0 <= p < 2 ** (packing.slots * width) for p in plaintexts)
        assert [int(v) for v in packing.unpack(plaintexts, length)] == values.tolist()
        if plaintexts:  # slot i of the first plaintext sits at bits [i·b, (i+1)·b)
            i = min(length, packing.slots) - 1
            assert (plaintexts[0] >> (i * width)) & ((1 << width) - 1) == values[i]


@pytest.mark.parametrize(("clip", "frac_bits"), [(1.0, 16), (0.3, 10), (8.0, 20), (2.5, 0)])
def test_fixed_point_round_trip_with_negatives(clip: float, frac_bits: int) -> None:
    codec = FixedPoint(clip, frac_bits)
    rng = np.random.default_rng(frac_bits)
    x = np.concatenate([rng.uniform(-2 * clip, 2 * clip, 500), [-clip, clip, 0.0, -1e-9]])
    q = codec.encode(x)
    assert q.dtype == np.int64 and q.min() >= 0 and int(q.max()).bit_length() <= codec.value_bits
    assert q[-4] == 0 and q[-3] == 2 * codec.offset  # -clip and clip: the range's two ends
    decoded = codec.decode_sum(q)
    assert np.max(np.abs(decoded - np.clip(x, -clip, clip))) <= 2.0 ** -(frac_bits + 1)
    packing = SlotPacking.for_key(1024, slot_bits(codec.value_bits, 1))
    assert np.array_equal(packing.unpack(packing.pack(q), q.size), q)


def test_encrypted_packed_round_trip_and_homomorphism(keypair: PaillierKeypair) -> None:
    """The generic helpers (reused by vertical FL): ⊕ and ⊗ on packed plaintexts."""
    pk, sk = keypair.public_key, keypair.private_key
    packing = SlotPacking.for_key(keypair.key_bits, slot_bits(20, max_terms=2, max_weight=7))
    assert 2 ** (packing.slots * packing.slot_bits) <= pk.n // 2  # sums never wrap mod n
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 2**20, (2, 3 * packing.slots + 5))
    ca, cb = encrypt_packed(pk, packing.pack(a)), encrypt_packed(pk, packing.pack(b))
    assert packing.unpack(decrypt_packed(sk, ca), a.size).tolist() == a.tolist()
    combined = add_ciphertexts(scale_ciphertexts(ca, 7), cb)
    assert packing.unpack(decrypt_packed(sk, combined), a.size).tolist() == (7 * a + b).tolist()
    assert decrypt_packed(sk, sum_ciphertexts([ca, ca, cb])) == decrypt_packed(
        sk, add_ciphertexts(scale_ciphertexts(ca, 2), cb)
    )


def test_invalid_settings_and_inputs(keypair: PaillierKeypair) -> None:
    with pytest.raises(SecureAggregationConfigError, match="clip"):
        FixedPoint(0.0, 16)
    with pytest.raises(SecureAggregationConfigError, match="frac_bits"):
        FixedPoint(1.0, -1)
    with pytest.raises(SecureAggregationConfigError, match="bits"):
        FixedPoint(1.0, 70)
    with pytest.raises(SecureAggregationConfigError, match="key_bits"):
        generate_keypair(1000)
    with pytest.raises(SecureAggregationConfigError, match="min_contributors"):
        PaillierAggregation(CLIP, FRAC_BITS, min_contributors=0, keypair=keypair)
    agg = PaillierAggregation(CLIP, FRAC_BITS, max_clients=3, max_weight=9, keypair=keypair)
    with pytest.raises(ValueError, match="non-finite"):
        agg.sum(0, {0: np.array([0.0, np.nan]), 1: np.zeros(2)}, {})
    with pytest.raises(SecureAggregationConfigError, match="one length"):
        agg.sum(0, {0: np.zeros(3), 1: np.zeros(2)}, {})
    with pytest.raises(SecureAggregationConfigError, match="weight"):
        agg.weighted_sum(0, {0: np.zeros(3), 1: np.zeros(3)}, {0: 1, 1: 0.5})


def test_weights_beyond_int64_slots(keypair: PaillierKeypair) -> None:
    """Slots wider than 63 bits fall back to Python integers and stay exact."""
    agg = PaillierAggregation(CLIP, FRAC_BITS, max_clients=2, max_weight=2**50, keypair=keypair)
    assert agg.packing.slot_bits > 63
    vectors = client_vectors(2, 20, seed=6)
    weights = {0: 2**50, 1: 3}
    result = agg.weighted_sum(0, vectors, weights)
    assert result.slot_sums.dtype == object
    q0, q1 = (agg.codec.encode(x) for x in vectors.values())
    expected = [int(a) * 2**50 + int(b) * 3 for a, b in zip(q0, q1, strict=True)]
    assert result.slot_sums.tolist() == expected
    plain = sum(w * np.clip(vectors[c], -CLIP, CLIP) for c, w in weights.items())
    assert np.max(np.abs(result.mean - plain / result.weight_sum)) <= 2.0**-FRAC_BITS


@pytest.mark.slow
def test_paillier_2048_spec_setting() -> None:
    """The example of docs/secure_aggregation.md: 2048-bit, f = 16, c = 1, K = 10: exact sum."""
    agg = PaillierAggregation(CLIP, FRAC_BITS, key_bits=2048, max_clients=10)
    assert (agg.packing.slot_bits, agg.packing.slots) == (23, 88)
    vectors = client_vectors(10, 2 * 88 + 1, seed=7)
    result = agg.sum(0, vectors, {})
    assert np.array_equal(result.slot_sums, sum(agg.codec.encode(x) for x in vectors.values()))
    clipped_mean = np.mean([np.clip(x, -CLIP, CLIP) for x in vectors.values()], axis=0)
    assert np.max(np.abs(result.mean - clipped_mean)) <= 2.0 ** -(FRAC_BITS + 1)
    assert result.bytes_up == 10 * 3 * 512
