"""A run's poisoning attack as one mechanism (core/mechanism.py; docs/security.md): the seeded
malicious clients (``selection``), their poisoned training data (``data``) and, for a model
attack, their crafted uploads (``updates``), which the server sees before any privacy
clipping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fedloom.attacks.data import poison
from fedloom.attacks.selection import malicious_clients
from fedloom.attacks.updates import MODEL_ATTACKS, ModelPoisoning
from fedloom.core.mechanism import Mechanism
from fedloom.core.protocol import Message
from fedloom.data.federated import FederatedData

if TYPE_CHECKING:
    from fedloom.attacks.config import AttackConfig


class Attack(Mechanism):
    """``attack`` of the run config over the training clients ``train_ids``."""

    key = "attack"

    def __init__(
        self, config: AttackConfig, seed: int, train_ids: Sequence[int], per_round: int
    ) -> None:
        self.config = config
        self.seed = seed
        self.malicious: list[int] = malicious_clients(seed, list(train_ids), config.fraction)
        self.poisoning = (
            ModelPoisoning(config, self.malicious, seed, per_round)
            if config.kind in MODEL_ATTACKS
            else None
        )

    def train_data(self, data: FederatedData) -> FederatedData:
        """The data the clients train on: the malicious clients' poisoned (data attacks)."""
        return poison(data, self.config, self.malicious, self.seed)

    def start_round(self, round: int, message: Message) -> None:
        if self.poisoning is not None:
            self.poisoning.start_round(round, message)

    def on_upload(self, upload: Message, client_id: int, round: int) -> Message:
        """The attacker crafts its upload (model attacks)."""
        return self.poisoning(upload, client_id, round) if self.poisoning is not None else upload

    def summary(self) -> dict[str, Any]:
        return {
            "kind": self.config.kind,
            "fraction": self.config.fraction,
            "malicious": self.malicious,
            **(self.poisoning.summary() if self.poisoning is not None else {}),
        }
