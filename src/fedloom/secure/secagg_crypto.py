"""The cryptographic primitives of SecAgg (Bonawitz et al. CCS'17, Section 3), all from the
``cryptography`` package: X25519 key agreement (KA), HKDF-SHA256 key derivation, AES-256-CTR
as the mask generator (PRG) and AES-256-GCM as the authenticated share channel (AE).

Every derived key binds the round id, a purpose and the ordered pair min(u, v) || max(u, v),
so a PRG key is used once and its zero nonce is safe. NumPy random generators are never
seeded from key material (Flower's ``pseudo_rand_gen`` folds its seed to 32 bits, which makes
its masks brute-forceable): masks are AES keystreams read as little-endian uint32.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
CHANNEL = b"channel"
"""HKDF purpose of the share channel's AES-GCM key (from the c-keys)."""
PAIR_MASK = b"pair-mask"
"""HKDF purpose of the pairwise mask's PRG key (from the s-keys)."""
SELF_MASK = b"self-mask"
"""HKDF purpose of the self mask's PRG key (from b_u)."""
_ZERO_BLOCK = bytes(16)


def private_key(key_seed: int | None, round: int, client: int, purpose: str) -> X25519PrivateKey:
    """A fresh X25519 private key; with ``key_seed`` (tests and reproducibility only: anyone
    who knows the seed knows every key) it is SHA-256 of (key_seed, round, client, purpose)."""
    if key_seed is None:
        return X25519PrivateKey.generate()
    return X25519PrivateKey.from_private_bytes(_test_bytes(key_seed, round, client, purpose))


def private_key_from_bytes(data: bytes) -> X25519PrivateKey:
    """The X25519 private key with raw bytes ``data`` (a rebuilt s_v^sk)."""
    return X25519PrivateKey.from_private_bytes(data)


def random_seed(key_seed: int | None, round: int, client: int, purpose: str) -> bytes:
    """32 fresh random bytes (the self-mask seed b_u); deterministic with ``key_seed``."""
    if key_seed is None:
        return secrets.token_bytes(KEY_BYTES)
    return _test_bytes(key_seed, round, client, purpose)


def _test_bytes(key_seed: int, round: int, client: int, purpose: str) -> bytes:
    label = f"fedloom/secagg/test-key/{purpose}".encode()
    return hashlib.sha256(struct.pack("<qqq", key_seed, round, client) + label).digest()


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of ``key``'s public key."""
    return key.public_key().public_bytes_raw()


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of ``key`` (what is Shamir-shared as s_u^sk)."""
    return key.private_bytes_raw()


def agree(key: X25519PrivateKey, peer_public: bytes) -> bytes:
    """KA(key, peer): the X25519 shared secret."""
    return key.exchange(X25519PublicKey.from_public_bytes(peer_public))


def derive(secret: bytes, round: int, purpose: bytes, u: int, v: int) -> bytes:
    """HKDF-SHA256 to 32 bytes, info = round || purpose || min(u, v) || max(u, v)."""
    lo, hi = min(u, v), max(u, v)
    info = b"fedloom/secagg/" + struct.pack("<q", round) + purpose + struct.pack("<qq", lo, hi)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def prg(key: bytes, length: int) -> np.ndarray:
    """PRG(key): ``length`` uint32 words of the AES-256-CTR keystream (zero nonce, key used
    once), read little-endian. Read-only."""
    encryptor = Cipher(algorithms.AES(key), modes.CTR(_ZERO_BLOCK)).encryptor()
    stream = encryptor.update(bytes(4 * length))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32, copy=False)


def self_mask(b: bytes, round: int, u: int, length: int) -> np.ndarray:
    """PRG(b_u): client u's self mask."""
    return prg(derive(b, round, SELF_MASK, u, u), length)


def pair_mask(secret: bytes, round: int, u: int, v: int, length: int) -> np.ndarray:
    """PRG(s_{u,v}) from the X25519 secret s_{u,v}, the same for u and v."""
    return prg(derive(secret, round, PAIR_MASK, u, v), length)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AE_key(plaintext): random 12-byte nonce || AES-256-GCM ciphertext || tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of ``seal``'s output; raises ``cryptography.exceptions.InvalidTag`` if it
    was tampered with or sealed under another key."""
    nonce, body = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:]
    return AESGCM(key).decrypt(nonce, body, associated)
