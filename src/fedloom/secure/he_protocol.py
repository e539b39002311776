"""The round protocol shared by the homomorphic-encryption aggregators
(docs/secure_aggregation.md, "Protocol details"): roles, messages, the key authority's policy
and the round driver.

Three roles exchange explicit messages: clients encrypt under the key authority's public key
and upload to the server; the server combines ciphertexts and asks the key authority (KA) to
decrypt the round aggregate; the KA, the only holder of the secret key, decrypts at most once
per round and only requests that declare at least ``min_contributors`` clients, and logs each
decryption (:class:`DecryptionPolicy`). Every message is recorded in a
:class:`~fedloom.secure.transcript.Transcript` (parties ``server``, ``key_authority`` and
``client:<id>``; stages ``public_key``, ``upload``, ``decryption``), so a test can check who
saw what. The KA cannot verify that the declared contributors really are in the ciphertext:
a server colluding with the KA, or one that sends a single client's ciphertext with a made-up
contributor list, defeats it (docs/secure_aggregation.md, "Protocol details").

:class:`EncryptedAggregation` runs one round (``SecureSum.sum`` and a weighted variant); the
backends (Paillier: ``encrypted_fedavg``; CKKS: ``ckks``) supply the three roles and the sizes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from fedloom.secure.base import (
    DROP_STAGES,
    DropStage,
    SecureAggregationAbort,
    SecureAggregationConfigError,
    SecureSumResult,
)
from fedloom.secure.transcript import SERVER, Transcript, client_party

KEY_AUTHORITY = "key_authority"
"""The key authority's party name in transcripts."""
SETUP_ROUND = -1
"""Round id of the messages sent once at setup (the KA publishing its public key)."""
PUBLIC_KEY, UPLOAD, DECRYPTION = "public_key", "upload", "decryption"
"""The stages of a round in the transcript."""


@dataclass(frozen=True)
class PublicKeyMessage:
    """KA -> server -> client: the public key (or public context) to encrypt under."""

    kind: ClassVar[str] = "public_key"
    round: int
    public_key: Any

    @property
    def payload(self) -> tuple[Any, ...]:
        return (self.public_key,)


class _CiphertextPayload:
    """Messages whose payload is their ``ciphertexts``."""

    ciphertexts: tuple[Any, ...]

    @property
    def payload(self) -> tuple[Any, ...]:
        return self.ciphertexts


@dataclass(frozen=True)
class CiphertextUpload(_CiphertextPayload):
    """Client -> server: the client's encrypted vector and its public integer weight."""

    kind: ClassVar[str] = "ciphertext_upload"
    round: int
    client: int
    ciphertexts: tuple[Any, ...]
    weight: int = 1


@dataclass(frozen=True)
class DecryptRequest(_CiphertextPayload):
    """Server -> KA: the round aggregate and the clients the server declares are in it."""

    kind: ClassVar[str] = "decrypt_request"
    round: int
    contributors: tuple[int, ...]
    ciphertexts: tuple[Any, ...]


@dataclass(frozen=True)
class DecryptedAggregate:
    """KA -> server: the plaintext of the round aggregate (packed integers or floats)."""

    kind: ClassVar[str] = "decrypted_aggregate"
    round: int
    contributors: tuple[int, ...]
    plaintexts: Any

    @property
    def payload(self) -> tuple[Any, ...]:
        items = self.plaintexts
        return tuple(items) if isinstance(items, tuple | list) else (items,)


HEMessage = PublicKeyMessage | CiphertextUpload | DecryptRequest | DecryptedAggregate


class DecryptionRefused(SecureAggregationAbort):
    """The key authority refused to decrypt: the round produces no output."""


@dataclass(frozen=True)
class DecryptionRecord:
    """One decryption the KA performed (its audit log)."""

    round: int
    contributors: tuple[int, ...]
    ciphertexts: int


class DecryptionPolicy:
    """The KA's rules (docs/secure_aggregation.md): one decryption per round, only of
    requests declaring at least ``min_contributors`` distinct clients; every decryption is
    logged."""

    def __init__(self, min_contributors: int) -> None:
        if min_contributors < 1:
            raise SecureAggregationConfigError(
                f"min_contributors={min_contributors}: must be at least 1"
            )
        self.min_contributors = min_contributors
        self.log: list[DecryptionRecord] = []
        self._decrypted_rounds: set[int] = set()

    def authorize(self, request: DecryptRequest) -> None:
        """Raise :class:`DecryptionRefused` or log the request as decrypted."""
        if request.round in self._decrypted_rounds:
            raise DecryptionRefused(
                f"key authority: round {request.round} was already decrypted once"
            )
        declared = len(set(request.contributors))
        if declared < self.min_contributors:
            raise DecryptionRefused(
                f"key authority: round {request.round} declares {declared} contributor(s), "
                f"fewer than min_contributors={self.min_contributors}"
            )
        self._decrypted_rounds.add(request.round)
        self.log.append(
            DecryptionRecord(request.round, tuple(request.contributors), len(request.ciphertexts))
        )


def uploaders(vectors: Mapping[int, Any], drops: Mapping[int, DropStage]) -> list[int]:
    """Clients whose input reaches the server, ascending: those in ``vectors`` that did not
    vanish at ``keys`` or ``shares`` (a client vanishing at ``unmask`` has uploaded)."""
    for client, stage in drops.items():
        if stage not in DROP_STAGES:
            raise ValueError(f"client {client}: drop stage {stage!r} not in {DROP_STAGES}")
    return sorted(c for c in vectors if drops.get(c) not in ("keys", "shares"))


def check_weights(
    weights: Mapping[int, int], clients: list[int], max_weight: int | None
) -> dict[int, int]:
    """Positive integer weights for ``clients``, each at most ``max_weight`` (when given)."""
    checked: dict[int, int] = {}
    for client in clients:
        if client not in weights:
            raise SecureAggregationConfigError(f"client {client} has no weight")
        weight = weights[client]
        if isinstance(weight, bool) or not isinstance(weight, int | np.integer):
            raise SecureAggregationConfigError(
                f"client {client}: weight {weight!r} must be a positive integer"
            )
        weight = int(weight)
        if weight < 1 or (max_weight is not None and weight > max_weight):
            bound = f" and at most max_weight={max_weight}" if max_weight is not None else ""
            raise SecureAggregationConfigError(
                f"client {client}: weight {weight} must be at least 1{bound}"
            )
        checked[client] = weight
    return checked


def common_length(vectors: Mapping[int, Any], clients: list[int]) -> int:
    """The one length of the clients' 1-D vectors (0 when there are none)."""
    shapes = {c: np.shape(vectors[c]) for c in clients}
    distinct = set(shapes.values())
    if len(distinct) > 1 or any(len(s) != 1 for s in distinct):
        raise SecureAggregationConfigError(
            f"client vectors must be 1-D and of one length, got shapes {shapes}"
        )
    return next(iter(distinct))[0] if distinct else 0


@dataclass
class EncryptedSumResult(SecureSumResult):
    """A round's output plus what the weighted variant adds: Σ n_k, and (Paillier) the
    decrypted integer slot sums Σ n_k·q_k that the key authority returned, unpacked."""

    weight_sum: int = 0
    slot_sums: np.ndarray | None = field(default=None, repr=False)

    @property
    def mean(self) -> np.ndarray:
        """The (weighted) mean Σ n_k x_k / Σ n_k: FedAvg's aggregate."""
        return self.total / self.weight_sum


class KeyAuthorityRole(Protocol):
    policy: DecryptionPolicy

    def decrypt(self, request: DecryptRequest) -> DecryptedAggregate: ...


class PolicyKeyAuthority(ABC):
    """The key authority both HE backends share: the only holder of the secret key, it
    decrypts a round aggregate if its :class:`DecryptionPolicy` allows it (``decrypt``); the
    backend supplies the decryption itself (``decrypt_ciphertexts``)."""

    def __init__(self, min_contributors: int) -> None:
        self.policy = DecryptionPolicy(min_contributors)

    @property
    def log(self) -> list[DecryptionRecord]:
        return self.policy.log

    def decrypt(self, request: DecryptRequest) -> DecryptedAggregate:
        self.policy.authorize(request)
        plaintexts = self.decrypt_ciphertexts(request.ciphertexts)
        return DecryptedAggregate(request.round, request.contributors, plaintexts)

    @abstractmethod
    def decrypt_ciphertexts(self, ciphertexts: tuple[Any, ...]) -> Any:
        """The plaintexts of the round aggregate's ``ciphertexts``."""


class ClientRole(Protocol):
    def upload(self, round: int, x: np.ndarray, weight: int = 1) -> CiphertextUpload: ...


class AggregatingServer(ABC):
    """The server role both HE backends share: it holds only public material and folds each
    upload of the round, times its weight, into the encrypted aggregate (``fold``), then asks
    the key authority to decrypt that aggregate (``decrypt_request``)."""

    def __init__(self) -> None:
        self._round: int | None = None
        self._aggregate: Any = None
        self._contributors: list[int] = []
        self._weight_sum = 0

    @abstractmethod
    def fold(self, aggregate: Any, upload: CiphertextUpload) -> Any:
        """The aggregate with ``upload`` (times its weight) added; ``aggregate`` None: the
        round's first upload."""

    @abstractmethod
    def serialize(self, aggregate: Any) -> tuple[Any, ...]:
        """The aggregate's ciphertexts as the decryption request carries them."""

    def begin(self, round: int) -> None:
        self._round, self._aggregate = round, None
        self._contributors, self._weight_sum = [], 0

    def receive(self, upload: CiphertextUpload) -> None:
        if upload.round != self._round:
            raise SecureAggregationAbort(
                f"upload for round {upload.round} arrived in round {self._round}"
            )
        self._aggregate = self.fold(self._aggregate, upload)
        self._contributors.append(upload.client)
        self._weight_sum += upload.weight

    @property
    def weight_sum(self) -> int:
        return self._weight_sum

    def decrypt_request(self) -> DecryptRequest:
        if self._aggregate is None or self._round is None:
            raise SecureAggregationAbort("no uploads to aggregate")
        return DecryptRequest(
            self._round, tuple(self._contributors), self.serialize(self._aggregate)
        )


class EncryptedAggregation(ABC):
    """One round between the roles, messages recorded in ``transcript``: the server sends
    the public key to clients that lack it, clients upload, the server folds each upload into
    the aggregate as it arrives, the key authority decrypts the aggregate, the server decodes.

    Subclasses set ``key_authority``, ``server``, ``transcript``, ``max_weight`` and provide
    the backend hooks below.
    """

    key_authority: KeyAuthorityRole
    server: AggregatingServer
    transcript: Transcript
    max_weight: int | None

    def __init__(self) -> None:
        self._clients_with_key: set[int] = set()

    @abstractmethod
    def client(self, client: int) -> ClientRole:
        """The role object of one client."""

    @abstractmethod
    def public_key_message(self) -> tuple[Any, int]:
        """The public key (or context) clients encrypt under, and its serialised size."""

    def message_bytes(self, message: CiphertextUpload | DecryptRequest | DecryptedAggregate) -> int:
        """Serialised size of the ciphertexts (or plaintexts) in ``message``."""
        if isinstance(message, DecryptedAggregate):
            return self.plaintexts_nbytes(message.plaintexts)
        return self.ciphertexts_nbytes(message.ciphertexts)

    @abstractmethod
    def ciphertexts_nbytes(self, ciphertexts: tuple[Any, ...]) -> int:
        """Serialised size of ``ciphertexts``."""

    @abstractmethod
    def plaintexts_nbytes(self, plaintexts: Any) -> int:
        """Serialised size of a decrypted aggregate's ``plaintexts``."""

    @abstractmethod
    def decode(
        self, answer: DecryptedAggregate, length: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(Σ n_k x_k as float64, integer slot sums or None) from the authority's answer."""

    def check_capacity(self, round: int, senders: list[int]) -> None:
        """Raise ``SecureAggregationConfigError`` if the round exceeds what was set up for
        (before any client encrypts); by default any round fits."""
        return None

    def sum(
        self, round: int, vectors: Mapping[int, np.ndarray], drops: Mapping[int, DropStage]
    ) -> EncryptedSumResult:
        """Σ_k clip(x_k) over the clients that uploaded (``SecureSum``)."""
        return self._run(round, vectors, drops, weights=None)

    def weighted_sum(
        self,
        round: int,
        vectors: Mapping[int, np.ndarray],
        weights: Mapping[int, int],
        drops: Mapping[int, DropStage] | None = None,
    ) -> EncryptedSumResult:
        """Σ_k n_k·clip(x_k) with public integer weights n_k applied to the ciphertexts by
        the server; ``.mean`` of the result is weighted FedAvg's aggregate."""
        return self._run(round, vectors, drops or {}, weights=weights)

    def publish_key(self) -> None:
        """Setup: the key authority hands its public key to the server."""
        public_key, nbytes = self.public_key_message()
        message = PublicKeyMessage(SETUP_ROUND, public_key)
        self._record(PUBLIC_KEY, message, KEY_AUTHORITY, SERVER, nbytes)

    def _run(
        self,
        round: int,
        vectors: Mapping[int, np.ndarray],
        drops: Mapping[int, DropStage],
        weights: Mapping[int, int] | None,
    ) -> EncryptedSumResult:
        start = time.perf_counter()
        senders = uploaders(vectors, drops)
        length = common_length(vectors, senders)
        self.check_capacity(round, senders)
        weight_of = (
            check_weights(weights, senders, self.max_weight)
            if weights is not None
            else dict.fromkeys(senders, 1)
        )
        min_contributors = self.key_authority.policy.min_contributors
        if len(senders) < min_contributors:
            raise SecureAggregationAbort(
                f"round {round}: {len(senders)} upload(s), fewer than the key authority's "
                f"min_contributors={min_contributors}"
            )
        bytes_down = self._send_public_key(round, sorted(vectors))

        seconds = dict.fromkeys(("encrypt", "aggregate", "decrypt", "decode"), 0.0)
        self.server.begin(round)
        bytes_up = 0
        for client in senders:
            tick = time.perf_counter()
            upload = self.client(client).upload(round, vectors[client], weight_of[client])
            seconds["encrypt"] += time.perf_counter() - tick
            nbytes = self.message_bytes(upload)
            bytes_up += nbytes
            self._record(UPLOAD, upload, client_party(client), SERVER, nbytes)
            tick = time.perf_counter()
            self.server.receive(upload)
            seconds["aggregate"] += time.perf_counter() - tick

        tick = time.perf_counter()
        request = self.server.decrypt_request()
        seconds["aggregate"] += time.perf_counter() - tick
        self._record(DECRYPTION, request, SERVER, KEY_AUTHORITY, self.message_bytes(request))
        tick = time.perf_counter()
        answer = self.key_authority.decrypt(request)
        seconds["decrypt"] = time.perf_counter() - tick
        self._record(DECRYPTION, answer, KEY_AUTHORITY, SERVER, self.message_bytes(answer))
        tick = time.perf_counter()
        total, slot_sums = self.decode(answer, length)
        seconds["decode"] = time.perf_counter() - tick
        seconds["total"] = time.perf_counter() - start
        return EncryptedSumResult(
            total=total,
            included=senders,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            seconds=seconds,
            weight_sum=self.server.weight_sum,
            slot_sums=slot_sums,
        )

    def _send_public_key(self, round: int, clients: list[int]) -> int:
        """Send the public key to the round's clients that do not hold it yet; bytes sent."""
        public_key, nbytes = self.public_key_message()
        sent = 0
        for client in clients:
            if client not in self._clients_with_key:
                message = PublicKeyMessage(round, public_key)
                self._record(PUBLIC_KEY, message, SERVER, client_party(client), nbytes)
                self._clients_with_key.add(client)
                sent += nbytes
        return sent

    def _record(
        self, stage: str, message: HEMessage, sender: str, receiver: str, nbytes: int
    ) -> None:
        self.transcript.record(
            message,
            round=message.round,
            stage=stage,
            sender=sender,
            receiver=receiver,
            nbytes=nbytes,
        )
