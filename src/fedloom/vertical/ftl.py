"""The federated transfer learning estimator (Liu et al., arXiv:1812.03337;
docs/vertical.md): full-batch gradient descent on the Taylor objective of
``ftl_model``, run by the AHE protocol (``ftl_he``; ``encrypt=False``: the same protocol in the
clear) or by the secret-sharing protocol (``ftl_ss``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from fedloom.core.rng import generator
from fedloom.vertical.ftl_he import AHEProtocol, SourceParty, TargetParty
from fedloom.vertical.ftl_model import Alignment, FTLParams, phi_source, represent
from fedloom.vertical.he import new_key
from fedloom.vertical.linear_model import iterate
from fedloom.vertical.messages import Channel

SOURCE, TARGET = "source", "target"


class LeakyModeWarning(UserWarning):
    """The representation-level FTL mode was switched on (it leaks labels)."""


class FederatedTransfer:
    """FTL between a labelled source A and an unlabelled target B with partly shared ids.

    ``fit(x_a, y_a, x_b, overlap=(ids_a, ids_b), labelled=...)``: ``overlap`` pairs A's and B's
    rows of the same entities, ``labelled`` picks the overlap pairs whose label enters L_1
    (D_c; default all). ``predict(x_b)`` labels target rows by sign(Φ^A·u^B) (±1).
    ``protocol``: ``ahe`` (Paillier, two key pairs, ``encrypt=True``; in the clear otherwise) or
    ``secret_sharing`` (additive shares in Z_2^64 with Beaver triples)."""

    def __init__(
        self,
        hidden: int = 8,
        gamma: float = 1.0,
        reg_lambda: float = 1e-3,
        lr: float = 0.5,
        iterations: int = 500,
        *,
        protocol: Literal["ahe", "secret_sharing"] = "ahe",
        encrypt: bool = False,
        key_bits: int = 2048,
        frac_bits: int = 32,
        ss_frac_bits: int = 20,
        leaky_fast: bool = False,
        init_scale: float = 0.1,
        seed: int = 0,
        keep_messages: bool = False,
    ) -> None:
        if protocol not in ("ahe", "secret_sharing"):
            raise ValueError(f"protocol must be 'ahe' or 'secret_sharing', got {protocol!r}")
        if leaky_fast and protocol != "ahe":
            raise ValueError("leaky_fast applies to the AHE protocol only")
        if leaky_fast:
            warnings.warn(
                "FTL leaky_fast=True decrypts representation-level gradients: the target learns "
                "label information (−½y_i + ¼φ_i) and the source learns u^B on the overlap",
                LeakyModeWarning,
                stacklevel=2,
            )
        self.hidden, self.lr, self.iterations = hidden, lr, iterations
        self.params = FTLParams(gamma, reg_lambda)
        self.protocol, self.encrypt, self.key_bits = protocol, encrypt, key_bits
        self.frac_bits, self.ss_frac_bits, self.leaky_fast = frac_bits, ss_frac_bits, leaky_fast
        self.init_scale, self.seed, self.keep_messages = init_scale, seed, keep_messages
        self.loss_history_: list[float] = []

    def _init(self, rows: int, party: int) -> np.ndarray:
        """W ~ N(0, init_scale²) from the run's stream for this party."""
        gen = generator(self.seed, "ftl_init", client=party)
        w = torch.randn(rows, self.hidden, generator=gen, dtype=torch.float64) * self.init_scale
        return w.numpy()

    def fit(
        self,
        x_a: np.ndarray,
        y_a: np.ndarray,
        x_b: np.ndarray,
        overlap: tuple[np.ndarray, np.ndarray],
        labelled: np.ndarray | None = None,
        *,
        init: tuple[np.ndarray, np.ndarray] | None = None,
        callback: Callable[[int, Any], None] | None = None,
        resume: dict[str, Any] | None = None,
    ) -> FederatedTransfer:
        """Train on both parties' rows; ``resume``: a :meth:`state_dict` to continue from (the
        same data and settings)."""
        x_a, x_b = np.asarray(x_a, np.float64), np.asarray(x_b, np.float64)
        y = np.asarray(y_a, dtype=np.float64)
        if not np.all(np.isin(y, (-1.0, 0.0, 1.0))):
            raise ValueError("FTL needs binary source labels (0/1 or -1/+1)")
        y = np.where(y > 0, 1.0, -1.0)
        ids_a, ids_b = (np.asarray(v, dtype=np.int64) for v in overlap)
        if len(ids_a) != len(ids_b) or not len(ids_a):
            raise ValueError("overlap must pair as many A rows as B rows (at least one)")
        chosen = np.arange(len(ids_a)) if labelled is None else np.asarray(labelled)
        if chosen.dtype == bool:
            chosen = np.flatnonzero(chosen)
        align = Alignment(ids_a, ids_b, chosen.astype(np.int64))
        w_a, w_b = (
            init if init is not None else (self._init(x_a.shape[1], 0), self._init(x_b.shape[1], 1))
        )
        self.channel_ = channel = Channel(keep_messages=self.keep_messages)
        if self.protocol == "secret_sharing":
            from fedloom.vertical.ftl_ss import SSProtocol

            self.protocol_: Any = SSProtocol(
                channel,
                x_a,
                y,
                x_b,
                np.array(w_a),
                np.array(w_b),
                align,
                self.params,
                self.lr,
                frac_bits=self.ss_frac_bits,
                seed=self.seed,
            )
        else:
            key_a = new_key(
                channel, encrypt=self.encrypt, key_bits=self.key_bits, frac_bits=self.frac_bits
            )
            key_b = new_key(
                channel, encrypt=self.encrypt, key_bits=self.key_bits, frac_bits=self.frac_bits
            )
            a = SourceParty(
                SOURCE, channel, x_a, w_a, key_a, self.lr, y=y, align=align, params=self.params
            )
            b = TargetParty(
                TARGET, channel, x_b, w_b, key_b, self.lr, align=align, params=self.params
            )
            self.protocol_ = AHEProtocol(a, b, leaky_fast=self.leaky_fast)
        self.loss_history_ = []
        if resume is not None:
            self._load_state_dict(resume)
        iterate(self, channel, lambda t: self.protocol_.iteration(), callback)
        return self

    def state_dict(self) -> dict[str, Any]:
        """The state after the iterations done so far (docs/vertical.md, Checkpoints and
        resume): both parties' weights and last gradients, the loss history, the channel's
        records and, for secret sharing, the dealer's random stream. Keys are never saved: a
        resumed Paillier run generates fresh ones."""
        protocol = self.protocol_
        shares = getattr(protocol, "ss", None)  # the secret-sharing engine
        return {
            "loss_history": list(self.loss_history_),
            "w": [protocol.a.w.copy(), protocol.b.w.copy()],
            "last_gradient": [protocol.a.last_gradient, protocol.b.last_gradient],
            "channel": self.channel_.state_dict(),
            "dealer": shares.dealer.rng.bit_generator.state if shares is not None else None,
        }

    def _load_state_dict(self, saved: dict[str, Any]) -> None:
        protocol = self.protocol_
        self.loss_history_ = [float(x) for x in saved["loss_history"]]
        for party, w, grad in zip(
            (protocol.a, protocol.b), saved["w"], saved["last_gradient"], strict=True
        ):
            party.w = np.array(w)
            party.last_gradient = None if grad is None else np.array(grad)
        self.channel_.load_state_dict(saved["channel"])
        if saved.get("dealer") is not None:
            protocol.ss.dealer.rng.bit_generator.state = saved["dealer"]

    @property
    def weights_(self) -> tuple[np.ndarray, np.ndarray]:
        """(W_A, W_B)."""
        return self.protocol_.a.w.copy(), self.protocol_.b.w.copy()

    @property
    def transcript_(self):
        return self.channel_.transcript

    def decision_function(self, x_b: np.ndarray) -> np.ndarray:
        """φ = Φ^A·u^B of target rows, computed across the parties."""
        return np.asarray(self.protocol_.predict(np.asarray(x_b, np.float64)))

    def predict(self, x_b: np.ndarray) -> np.ndarray:
        return np.where(self.decision_function(x_b) > 0, 1, -1)

    def predict_proba(self, x_b: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.decision_function(x_b)))

    def plain_scores(self, x_b: np.ndarray) -> np.ndarray:
        """φ computed in one place from both weights (tests and benchmarks only)."""
        a = self.protocol_.a
        w_a, w_b = self.weights_
        return represent(np.asarray(x_b, np.float64), w_b) @ phi_source(represent(a.x, w_a), a.y)
