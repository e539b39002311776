"""The run's mechanisms around aggregation, built once from the config: differential privacy
(``privacy``), secure aggregation (``secure_aggregation``), poisoning attacks (``attack``) and
robust or feature-aware aggregation (``aggregator``) and upload compression (``compression``).
The round loop asks them, in one place, for the data the clients train on, what the uploads
cost on the wire, the upload transforms, the server's aggregation rule, and what to do at the
start of a round and before the server step; their state goes into checkpoints and their
reports into metrics rows and summary.json."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedloom.algorithms import ALGORITHMS
from fedloom.attacks.data import poison
from fedloom.attacks.selection import malicious_clients
from fedloom.attacks.updates import MODEL_ATTACKS, ModelPoisoning
from fedloom.compression import UploadCompression
from fedloom.compression.downloads import DownloadCompression
from fedloom.config import RunConfig
from fedloom.core import pytree
from fedloom.core.protocol import ClientResult, Message
from fedloom.data.federated import FederatedData
from fedloom.data.missing import observed
from fedloom.engine.sampling import POOLED_CLIENT
from fedloom.engine.workload import most_steps
from fedloom.errors import ConfigError
from fedloom.privacy import ClientLevelDP, SampleLevelDP
from fedloom.robust.aggregation import RobustAggregation
from fedloom.robust.feature_aware import FeatureAwareAggregation, first_layer_key
from fedloom.secure.aggregation import SecureAggregation, build_protocol
from fedloom.secure.base import DropStage

UploadTransform = Callable[[Message, int, int], Message]
"""(upload, client_id, round) -> upload: clipping, noise, masking, poisoning plug in here."""

Aggregator = Callable[[list[pytree.Tree], list[float]], pytree.Tree]
"""(trees, weights) -> tree: the server's aggregation rule (robust rules plug in here)."""


class Mechanisms:
    """The mechanisms one run's config asks for (each None when off)."""

    def __init__(
        self,
        config: RunConfig,
        data: FederatedData,
        module: torch.nn.Module,
        train_ids: Sequence[int],
    ) -> None:
        self.config = config
        self.train_ids = list(train_ids)
        attack = config.attack
        self.malicious: list[int] = (
            malicious_clients(config.seed, self.train_ids, attack.fraction)
            if attack.kind != "none"
            else []
        )
        self.data = poison(data, attack, self.malicious, config.seed)
        """The data the clients train on: the malicious clients' poisoned (data attacks)."""
        per_round = config.train.clients_per_round or len(self.train_ids)
        self.poisoning = (
            ModelPoisoning(attack, self.malicious, config.seed, per_round)
            if attack.kind in MODEL_ATTACKS
            else None
        )
        buffers = [n for n, _ in module.named_buffers()]
        self.privacy = self._privacy(buffers)
        self.secure = self._secure(buffers)
        self.robust = self._robust(module, per_round)
        self.compression = (
            UploadCompression(config.compression, config.seed)
            if config.compression.kind != "none"
            else None
        )
        download = config.compression.download
        self.download = DownloadCompression(download) if download != "none" else None
        if isinstance(self.privacy, ClientLevelDP) and self.secure is not None:
            self.privacy.update_sum = self.secure.sum_updates  # DP's sum of clipped updates

    # -- what the engine builds the run with --------------------------------------------------
    @property
    def sample_dp(self) -> SampleLevelDP | None:
        return self.privacy if isinstance(self.privacy, SampleLevelDP) else None

    @property
    def poisson_clients(self) -> bool:
        """Whether clients are drawn by Poisson sampling (client-level DP's accounting)."""
        return isinstance(self.privacy, ClientLevelDP) and self.config.privacy.sampling == "poisson"

    def upload_transforms(self, others: Sequence[UploadTransform]) -> list[UploadTransform]:
        """In order: the attacker crafts its upload, then DP clips it, then the caller's."""
        first: list[UploadTransform] = []
        if self.poisoning is not None:
            first.append(self.poisoning)
        if isinstance(self.privacy, ClientLevelDP):
            first.append(self.privacy.clip_upload)
        return [*first, *others]

    def aggregator(self, default: Aggregator) -> Aggregator:
        """The server's rule: client-level DP's noised estimator (over secure aggregation's sum
        when both are on), secure aggregation's, a robust rule's, or ``default``."""
        if isinstance(self.privacy, ClientLevelDP):
            return self.privacy.aggregate
        if self.secure is not None:
            return self.secure.aggregate
        if self.robust is not None:
            return self.robust.aggregate
        return default

    # -- the round -------------------------------------------------------------------------
    def start_round(self, round: int, message: Message) -> None:
        for mechanism in (self.privacy, self.poisoning, self.robust, self.compression):
            if mechanism is not None:
                mechanism.start_round(round, message)

    def before_aggregate(
        self,
        round: int,
        message: Message,
        results: Sequence[ClientResult],
        drops: dict[int, DropStage],
    ) -> None:
        if self.secure is not None:
            self.secure.begin(round, message, [r.client_id for r in results], drops)
        if isinstance(self.robust, FeatureAwareAggregation):
            self.robust.begin([r.client_id for r in results])

    def broadcast(self, message: Message) -> Message:
        """What the clients receive: with ``compression.download`` the message as decoded."""
        return self.download.transmit(message) if self.download is not None else message

    def download_bytes(self, dense: int) -> int:
        """The round's bytes down (``dense``: the algorithm's count), as encoded."""
        return self.download.download_bytes(dense) if self.download is not None else dense

    def send_upload(self, round: int, result: ClientResult) -> int:
        """The bytes of one client's upload on the wire. With ``compression`` the client
        encodes its upload, the encoded size counts, and ``result.upload`` becomes what the
        server decodes (before screening and the upload transforms: the client's last step)."""
        if self.compression is None:
            return sum(pytree.num_bytes(tree) for tree in result.upload.values())
        result.upload, size = self.compression.transmit(result.upload, result.client_id, round)
        return size

    def send_uploads(self, round: int, results: Sequence[ClientResult]) -> int:
        return sum(self.send_upload(round, r) for r in results)

    def round_bytes(self, up: int, down: int) -> tuple[int, int]:
        """The round's bytes up and down: secure aggregation's protocol traffic in place of the
        plain uploads (when its round completed)."""
        last = self.secure.last if self.secure is not None else {}
        if "bytes_up" not in last:
            return up, down
        return last["bytes_up"], down + last["bytes_down"]

    # -- state and reports -------------------------------------------------------------------
    def _stateful(self) -> dict[str, Any]:
        named = {
            "privacy": self.privacy,
            "secure": self.secure,
            "robust": self.robust,
            "compression": self.compression,
        }
        return {k: m for k, m in named.items() if m is not None}

    def state_dict(self) -> dict[str, Any]:
        return {k: m.state_dict() for k, m in self._stateful().items()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, mechanism in self._stateful().items():
            if saved.get(key):
                mechanism.load_state_dict(saved[key])

    def summary(self) -> dict[str, Any]:
        """summary.json's sections: ``privacy``, ``secure_aggregation``, ``attack``,
        ``aggregator``."""
        out: dict[str, Any] = {}
        if self.privacy is not None:
            out["privacy"] = self.privacy.summary()
        if self.secure is not None:
            out["secure_aggregation"] = self.secure.summary()
        if self.config.attack.kind != "none":
            out["attack"] = {
                "kind": self.config.attack.kind,
                "fraction": self.config.attack.fraction,
                "malicious": self.malicious,
                **(self.poisoning.summary() if self.poisoning is not None else {}),
            }
        if self.robust is not None:
            out["aggregator"] = self.robust.summary()
        if self.compression is not None or self.download is not None:
            out["compression"] = {
                **(self.compression.summary() if self.compression is not None else {}),
                **(self.download.summary() if self.download is not None else {}),
            }
        return out

    # -- construction ----------------------------------------------------------------------
    def _privacy(self, buffers: list[str]) -> ClientLevelDP | SampleLevelDP | None:
        cfg = self.config
        kind = cfg.privacy.kind
        if kind == "none":
            return None
        if buffers:
            raise ConfigError(
                f"privacy.kind: {kind} cannot release the model's buffers ({', '.join(buffers)})"
                " without noise: use a model without normalization statistics"
            )
        train = cfg.train
        if kind == "sample_dp":
            population = {c: self.data.clients[c].num_train for c in self.train_ids}
            if ALGORITHMS.get(cfg.algorithm.name).pooled:  # one virtual client of all data
                population = {POOLED_CLIENT: sum(population.values())}
            most = {c: most_steps(train, c, n) * train.rounds for c, n in population.items()}
            return SampleLevelDP(cfg.privacy, population, train.batch_size, most)
        assert train.clients_per_round is not None  # checked when parsed
        return ClientLevelDP(
            cfg.privacy, cfg.seed, len(self.train_ids), train.clients_per_round, train.rounds
        )

    def _robust(
        self, module: torch.nn.Module, per_round: int
    ) -> RobustAggregation | FeatureAwareAggregation | None:
        cfg = self.config
        if cfg.aggregator.kind == "mean":
            return None
        if cfg.aggregator.kind == "feature_aware":  # masks: what each client observed
            key = first_layer_key(module, self.data.input_shape)
            return FeatureAwareAggregation(key, observed(self.data))
        return RobustAggregation(cfg.aggregator, cfg.seed, cfg.byzantine_f(per_round))

    def _secure(self, buffers: list[str]) -> SecureAggregation | None:
        cfg = self.config.secure_aggregation
        if cfg.kind == "none":
            return None
        if buffers:
            raise ConfigError(
                f"secure_aggregation.kind: {cfg.kind} sums one vector of parameters per client "
                f"and round; the model's buffers ({', '.join(buffers)}) would need a second sum:"
                " use a model without normalization statistics"
            )
        # a round holds at most every training client (Poisson sampling may exceed its mean)
        protocol = build_protocol(cfg, self.config.seed, max(2, len(self.train_ids)))
        return SecureAggregation(cfg, protocol)
