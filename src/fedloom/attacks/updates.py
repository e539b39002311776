"""Model poisoning: what a malicious client uploads instead of its honest update Delta (its
uploaded model minus the broadcast one; an uploaded ``delta`` or ``grad`` tree as it is).

- ``gaussian`` (Ditto's A2): N(0, sigma^2 I) with sigma the standard deviation of Delta's entries;
- ``scale`` (model replacement, Ditto's A3 "boosting"): K Delta, K = ``scale`` (default: the
  clients per round);
- ``sign_flip``: -s Delta, s = ``scale`` (default 1).

An upload transform of the engine (``(upload, client, round) -> upload``), applied before any
privacy clipping: the server sees the poisoned upload. Noise from the stream (seed, round,
client, 'attack/gaussian').
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fedloom.core.protocol import Message
from fedloom.core.rng import generator

if TYPE_CHECKING:
    from fedloom.attacks.config import AttackConfig

MODEL_ATTACKS = ("gaussian", "scale", "sign_flip")

Tree = dict[str, torch.Tensor]


class ModelPoisoning:
    """The malicious clients' upload transform of one run."""

    def __init__(
        self, config: AttackConfig, malicious: Sequence[int], seed: int, per_round: int
    ) -> None:
        self.config = config
        self.malicious = set(malicious)
        self.seed = seed
        default = float(per_round) if config.kind == "scale" else 1.0
        self.factor = config.scale if config.scale is not None else default
        self.anchor: Mapping[str, torch.Tensor] = {}

    def start_round(self, round: int, message: Message) -> None:
        self.anchor = message.get("params", {})

    def __call__(self, upload: Message, client_id: int, round: int) -> Message:
        if client_id not in self.malicious:
            return upload
        out = dict(upload)
        for key in ("params", "delta", "grad"):
            tree = upload.get(key)
            if not isinstance(tree, Mapping) or not tree:
                continue
            anchor = self.anchor if key == "params" and set(tree) == set(self.anchor) else None
            honest = {k: v - anchor[k] for k, v in tree.items()} if anchor else dict(tree)
            bad = self.poisoned(honest, round, client_id)
            out[key] = {k: anchor[k] + v for k, v in bad.items()} if anchor else bad
        return out

    def poisoned(self, honest: Tree, round: int, client_id: int) -> Tree:
        kind = self.config.kind
        if kind == "scale":
            return {k: v * self.factor for k, v in honest.items()}
        if kind == "sign_flip":
            return {k: v * -self.factor for k, v in honest.items()}
        flat = torch.cat([v.detach().double().reshape(-1) for v in honest.values()])
        sigma = float(flat.std()) if flat.numel() > 1 else 0.0
        gen = generator(self.seed, "attack/gaussian", round, client_id)
        return {
            k: (sigma * torch.randn(v.shape, generator=gen, dtype=torch.float64)).to(v.dtype)
            for k, v in honest.items()
        }

    def summary(self) -> dict[str, Any]:
        return {"factor": self.factor} if self.config.kind != "gaussian" else {}
