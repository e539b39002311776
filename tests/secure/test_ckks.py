"""CKKS-encrypted FedAvg with TenSEAL (docs/secure_aggregation.md): close to plaintext FedAvg,
same key-authority policy and dropout semantics as Paillier, public contexts only outside
the authority."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal as ts

from fedloom.secure.base import SecureAggregationAbort
from fedloom.secure.ckks import CHUNK, CKKSAggregation
from fedloom.secure.he_protocol import KEY_AUTHORITY, DecryptionRefused, DecryptRequest
from fedloom.secure.transcript import CLIENTS, SERVER, Transcript


def client_vectors(n: int, d: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(-1.0, 1.0, d) for k in range(n)}


def test_ckks_fedavg_close() -> None:
    k, d = 10, 10_000
    vectors = client_vectors(k, d)
    agg = CKKSAggregation(clip=1.0, n_threads=1)
    result = agg.sum(0, vectors, {})

    plain = np.sum(list(vectors.values()), axis=0)
    assert result.total.shape == (d,)
    assert np.max(np.abs(result.total - plain)) <= 1e-6
    assert np.max(np.abs(result.mean - plain / k)) <= 1e-6
    assert result.included == list(range(k))
    n_ct = -(-d // CHUNK)
    assert result.bytes_up == agg.transcript.bytes_up(round=0)
    assert result.bytes_down == agg.transcript.bytes_down(round=0)
    assert 60 * n_ct * CHUNK * k < result.bytes_up < 120 * n_ct * CHUNK * k  # ~83 B/value
    assert set(result.seconds) >= {"encrypt", "aggregate", "decrypt", "total"}


def test_ckks_weighted_and_clipped() -> None:
    vectors = client_vectors(4, 5_000, seed=1)
    vectors[0][:10] = 5.0  # clipped to 1
    weights = {0: 3, 1: 600, 2: 17, 3: 250}
    agg = CKKSAggregation(clip=1.0, max_weight=600, n_threads=1)
    result = agg.weighted_sum(0, vectors, weights)

    plain = sum(w * np.clip(vectors[c], -1, 1) for c, w in weights.items())
    assert result.weight_sum == 870
    assert np.max(np.abs(result.mean - plain / 870)) <= 1e-6


def test_ckks_dropouts_and_key_authority() -> None:
    vectors = client_vectors(5, 100, seed=2)
    agg = CKKSAggregation(clip=1.0, min_contributors=3, n_threads=1)
    result = agg.sum(0, vectors, {0: "keys", 1: "shares", 2: "unmask"})
    assert result.included == [2, 3, 4]
    assert np.max(np.abs(result.total - sum(vectors[c] for c in (2, 3, 4)))) <= 1e-6

    ka = agg.key_authority
    assert [(r.round, r.contributors) for r in ka.log] == [(0, (2, 3, 4))]
    single = agg.client(2).upload(0, vectors[2]).ciphertexts
    with pytest.raises(DecryptionRefused, match="already decrypted"):
        ka.decrypt(DecryptRequest(0, (2, 3, 4), single))
    with pytest.raises(DecryptionRefused, match="fewer than min_contributors=3"):
        ka.decrypt(DecryptRequest(1, (2,), single))
    with pytest.raises(SecureAggregationAbort, match="min_contributors=3"):
        agg.sum(1, vectors, {0: "keys", 1: "keys", 2: "shares"})
    assert len(ka.log) == 1


def test_ckks_only_the_authority_can_decrypt() -> None:
    transcript = Transcript(keep_messages=True)
    agg = CKKSAggregation(clip=1.0, n_threads=1, transcript=transcript)
    vectors = client_vectors(3, 50, seed=3)
    agg.sum(0, vectors, {})

    public = ts.context_from(agg.key_authority.public_context)
    assert not public.has_secret_key()
    assert not agg.server.public_context.has_secret_key()
    assert not agg.client(0).public_context.has_secret_key()
    upload = agg.client(0).upload(1, vectors[0])
    with pytest.raises(ValueError, match="secret"):
        ts.ckks_vector_from(public, upload.ciphertexts[0]).decrypt()
    # fresh encryption noise each time: the same vector never gives the same ciphertext
    assert upload.ciphertexts != agg.client(0).upload(1, vectors[0]).ciphertexts

    uploads = transcript.select(sender=CLIENTS)
    assert {(e.receiver, e.kind, e.payload_types) for e in uploads} == {
        (SERVER, "ciphertext_upload", frozenset({"bytes"}))
    }
    to_ka = transcript.select(receiver=KEY_AUTHORITY)
    assert [(e.round, e.sender, e.kind) for e in to_ka] == [(0, SERVER, "decrypt_request")]
