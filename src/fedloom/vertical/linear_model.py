"""Secure vertical linear and logistic regression (docs/vertical.md): the
three-party protocol with a coordinator (Yang et al. 2019, Table 1), the two-party protocol
without one (in the spirit of Yang S. et al. 2019, arXiv:1911.09824), and the estimators
:class:`VerticalLinear` and :class:`VerticalLogistic` (Hardy et al. 2017's Taylor loss).

One iteration (mini-batch S of agreed ids, s = |S|), three-party (C holds the only key):
  1. A → B: [[u^A]], [[s·L_A]]                  2. B → A: [[d]];  B → C: [[s·L]]
  3. A → C: [[s·g_A + R_A]];  B → C: [[s·g_B + R_B]]   (s·g = Σ_i d_i x_i, without λΘ)
  4. C → A: s·g_A + R_A;  C → B: s·g_B + R_B;  C → A, B: L
  5. A, B unmask, divide by s, add λΘ, step.
The public factor 1/s is applied after decryption rather than encoded into every term, which
keeps the fixed-point rounding of 1/s out of the sums.
K hosts A_1 .. A_K (three-party only, as FATE's multi-host hetero-LR with an arbiter): u^A =
Σ_k u^{A_k}, B sums the hosts' ciphertexts; each host gets [[d]] and is paid its own gradient;
the loss's cross-host terms come from one extra exchange per host (:class:`ThreePartyProtocol`).
Two-party (each holds a key pair): A → B: [[u^A]]_A, [[L_A]]_A; B → A: [[2a u^B + b]]_B;
A → B: [[g_A + R_A]]_B, B decrypts, B → A; B → A: [[g_B + R_B]]_A, A decrypts, A → B;
B → A: [[L + r]]_A, A decrypts, A → B; B removes r and publishes L.
The plaintext path (``encrypt=False``) runs exactly these steps with the plaintext backend.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from fedloom.core.rng import numpy_rng
from fedloom.vertical.data import check_parts
from fedloom.vertical.he import HEBackend, new_key, public_key_payload, public_view
from fedloom.vertical.linear_roles import (
    LINEAR,
    TAYLOR_LOGISTIC,
    FeatureParty,
    KeyHolder,
    LabelParty,
    QuadraticLoss,
)
from fedloom.vertical.messages import PREDICT, Channel, host_name

Protocol = Literal["three_party", "two_party"]
GUEST, COORDINATOR = "guest", "coordinator"


class ThreePartyProtocol:
    """Yang et al.'s sequence with coordinator C (module docstring), for one or more hosts
    A_1 .. A_K: B sums their [[u^{A_k}]] into [[u^A]]; each A_k receives [[d]] and sends its
    own masked gradient to C. The loss needs the cross terms 2a Σ_i u_i^{A_k} U_i^{<k} of
    a(Σ_k u^{A_k})²: B sends each A_k (k >= 2) [[U^{<k}]] = Σ_{j<k} [[u^{A_j}]], A_k returns
    [[2a Σ_i u_i^{A_k} U_i^{<k}]] re-randomised (it sees only ciphertexts under C's key)."""

    def __init__(
        self, hosts: Sequence[FeatureParty], b: LabelParty, c: KeyHolder, loss: QuadraticLoss
    ):
        self.hosts, self.b, self.c, self.loss = list(hosts), b, c, loss
        self.pub = public_view(c.key)  # what the hosts and B hold of C's key
        n = public_key_payload(c.key)
        if n:
            for party in (*self.hosts, b):
                c.send(party, "public_key", n, stage="setup")

    def iteration(self, rows: np.ndarray) -> float:
        b, c, pub, loss = self.b, self.c, self.pub, self.loss
        scores = []
        for a in self.hosts:
            enc_u, enc_la, _ = a.score_ciphertexts(pub, loss, rows)
            scores.append(a.send(b, "scores", enc_u, enc_la, stage="scores"))
        enc_ua = pub.add_many(*(m[0] for m in scores))
        enc_las = [m[1] for m in scores]
        prefix = scores[0][0]
        for a, m in zip(self.hosts[1:], scores[1:], strict=True):
            sent = b.send(a, "partial_scores", prefix, stage="loss")
            cross = a.cross_loss(pub, loss, sent[0], rows)
            enc_las.append(a.send(b, "cross_loss", cross, stage="loss")[0])
            prefix = pub.add(prefix, m[0])
        enc_d = b.residuals(pub, loss, enc_ua, rows)
        enc_loss = b.loss_ciphertext(pub, loss, enc_ua, pub.add_many(*enc_las), rows)
        residuals = [b.send(a, "residuals", enc_d, stage="residuals") for a in self.hosts]
        m3 = b.send(c, "loss", enc_loss, stage="loss")
        masked = [
            a.masked_gradient(pub, m[0], rows) for a, m in zip(self.hosts, residuals, strict=True)
        ]
        gb, mask_b = b.masked_gradient(pub, enc_d, rows)
        to_c = [
            a.send(c, "masked_gradient", g, stage="gradient")
            for a, (g, _) in zip(self.hosts, masked, strict=True)
        ]
        m4b = b.send(c, "masked_gradient", gb, stage="gradient")
        for a, m, (_, mask) in zip(self.hosts, to_c, masked, strict=True):
            back = c.send(a, "masked_gradient_plain", c.decrypt_masked(m[0]), stage="decrypt")
            a.step(pub, back[0], mask, len(rows))
        back_b = c.send(b, "masked_gradient_plain", c.decrypt_masked(m4b[0]), stage="decrypt")
        b.step(pub, back_b[0], mask_b, len(rows))
        value = c.decrypt_loss(m3[0], len(rows))
        for party in (*self.hosts, b):
            c.send(party, "loss_value", value, stage="loss")
        return value

    def predict(self, x_b: np.ndarray, x_hosts: Sequence[np.ndarray]) -> np.ndarray:
        """Yang et al. Table 2: C asks every party for its scores and outputs the sum."""
        total = self.b.send(self.c, "scores_plain", self.b.scores(x_b), stage=PREDICT)[0]
        for a, x in zip(self.hosts, x_hosts, strict=True):
            total = total + a.send(self.c, "scores_plain", a.scores(x), stage=PREDICT)[0]
        return total


class TwoPartyProtocol:
    """No coordinator: each party decrypts, under its own key, the other's masked values."""

    def __init__(self, a: FeatureParty, b: LabelParty, loss: QuadraticLoss):
        if a.key is None or b.key is None:
            raise ValueError("the two-party protocol needs a key pair per party")
        self.a, self.b, self.loss = a, b, loss
        self.a_key, self.b_key = a.key, b.key
        self.a_pub, self.b_pub = public_view(a.key), public_view(b.key)
        for owner, key in ((a, a.key), (b, b.key)):
            n = public_key_payload(key)
            if n:
                owner.send(b if owner is a else a, "public_key", n, stage="setup")

    def iteration(self, rows: np.ndarray) -> float:
        a, b, loss = self.a, self.b, self.loss
        # (1) A -> B under A's key
        enc_u, enc_la, u_a = a.score_ciphertexts(self.a_pub, loss, rows)
        m1 = a.send(b, "scores", enc_u, enc_la, stage="scores")
        # (2) B -> A under B's key
        enc_db = self.b_key.encrypt(b.residual_part(loss, rows))
        m2 = b.send(a, "residual_part", enc_db, stage="residuals")
        # (3) A: [[d]]_B = [[2a u^B + b]]_B ⊕ 2a u^A; B decrypts g_A + R_A
        enc_d_b = self.b_pub.add_plain(m2[0], 2 * loss.a * u_a)
        ga, mask_a = a.masked_gradient(self.b_pub, enc_d_b, rows)
        m3 = a.send(b, "masked_gradient", ga, stage="gradient")
        back_a = b.send(a, "masked_gradient_plain", b.decrypt_masked(m3[0]), stage="decrypt")
        a.step(self.b_pub, back_a[0], mask_a, len(rows))
        # (4) B: [[d]]_A = 2a ⊗ [[u^A]]_A ⊕ (2a u^B + b); A decrypts g_B + R_B
        enc_d_a = b.residuals(self.a_pub, loss, m1[0], rows)
        gb, mask_b = b.masked_gradient(self.a_pub, enc_d_a, rows)
        m4 = b.send(a, "masked_gradient", gb, stage="gradient")
        back_b = a.send(b, "masked_gradient_plain", a.decrypt_masked(m4[0]), stage="decrypt")
        # (5) loss: B forms [[L + r]]_A with the step-1 ciphertexts (before its own step)
        enc_loss = b.loss_ciphertext(self.a_pub, loss, m1[0], m1[1], rows)
        b.step(self.a_pub, back_b[0], mask_b, len(rows))
        masked_loss, mask_l = self.a_pub.mask(enc_loss)
        m5 = b.send(a, "masked_loss", masked_loss, stage="loss")
        back_l = a.send(b, "masked_loss_plain", a.decrypt_masked(m5[0]), stage="loss")
        value = float(self.a_pub.unmask(back_l[0], mask_l)[0]) / len(rows)
        b.send(a, "loss_value", value, stage="loss")
        return value

    def predict(self, x_b: np.ndarray, x_hosts: Sequence[np.ndarray]) -> np.ndarray:
        """A sends its scores to B, which outputs the sum."""
        (x_a,) = x_hosts
        ua = self.a.send(self.b, "scores_plain", self.a.scores(x_a), stage=PREDICT)
        return ua[0] + self.b.scores(x_b)


IterationCallback = Callable[[int, Any], None]


class DivergedError(FloatingPointError):
    """Gradient descent diverged (the loss is no longer finite)."""


def check_finite(loss: float, iteration: int, hint: str) -> None:
    if not np.isfinite(loss):
        raise DivergedError(f"the loss is {loss} at iteration {iteration}: {hint}")


def iterate(
    model: Any,
    channel: Channel,
    iteration: Callable[[int], float],
    callback: IterationCallback | None,
) -> None:
    """The iterations of a gradient-descent protocol from where ``model.loss_history_`` left
    off (a resumed fit continues) up to ``model.iterations``: each under its round on the
    channel, its loss checked finite and recorded, then ``callback(t, model)``."""
    for t in range(len(model.loss_history_), model.iterations):
        channel.round = t
        with np.errstate(over="ignore", invalid="ignore"):
            loss = iteration(t)
        check_finite(loss, t, "standardise the features or lower lr")
        model.loss_history_.append(loss)
        if callback is not None:
            callback(t, model)


class _VerticalGLM:
    """Shared estimator: parties' blocks guest first (``[X_B, X_A]``: B holds the labels and
    the intercept), ``fit`` returns self. ``encrypt=False`` runs the plaintext path."""

    loss: QuadraticLoss

    def __init__(
        self,
        lr: float = 0.1,
        reg_lambda: float = 0.01,
        iterations: int = 100,
        *,
        batch_size: int | None = None,
        protocol: Protocol = "three_party",
        encrypt: bool = False,
        key_bits: int = 2048,
        frac_bits: int = 32,
        fit_intercept: bool = True,
        seed: int = 0,
        keep_messages: bool = False,
        mask_random: random.Random | None = None,
        zero_masks: bool = False,
    ) -> None:
        if protocol not in ("three_party", "two_party"):
            raise ValueError(f"protocol must be 'three_party' or 'two_party', got {protocol!r}")
        self.lr, self.reg_lambda, self.iterations = lr, reg_lambda, iterations
        self.batch_size, self.protocol, self.encrypt = batch_size, protocol, encrypt
        self.key_bits, self.frac_bits, self.fit_intercept = key_bits, frac_bits, fit_intercept
        self.seed, self.keep_messages = seed, keep_messages
        self.mask_random, self.zero_masks = mask_random, zero_masks
        self.loss_history_: list[float] = []

    def _labels(self, y: np.ndarray) -> np.ndarray:
        return np.asarray(y, dtype=np.float64)

    def _key(self, channel: Channel) -> HEBackend:
        return new_key(
            channel,
            encrypt=self.encrypt,
            key_bits=self.key_bits,
            frac_bits=self.frac_bits,
            mask_random=self.mask_random,
            zero_masks=self.zero_masks,
        )

    def fit(
        self,
        parts: Sequence[np.ndarray],
        y: np.ndarray,
        callback: IterationCallback | None = None,
        resume: dict[str, Any] | None = None,
    ) -> _VerticalGLM:
        """Train on the parties' blocks (guest first) and the guest's labels; ``resume``: a
        :meth:`state_dict` to continue from (the same data and settings)."""
        blocks = check_parts(parts, len(y))
        if self.protocol == "two_party" and len(blocks) != 2:
            raise ValueError(
                f"the two-party protocol takes exactly two parties (guest, host), got "
                f"{len(blocks)}: more hosts need protocol='three_party' (a coordinator)"
            )
        n = len(y)
        s = n if self.batch_size is None else min(self.batch_size, n)
        widest = max(block.shape[1] for block in blocks[1:])
        if s <= 2 * widest:
            warnings.warn(
                f"batch size {s} is not much larger than a host's {widest} features: the host "
                "could solve Σ d_i x_i for the residuals (label leakage)",
                stacklevel=2,
            )
        self.channel_ = channel = Channel(keep_messages=self.keep_messages)
        b = LabelParty(
            GUEST,
            channel,
            blocks[0],
            self._labels(y),
            self.lr,
            self.reg_lambda,
            self.fit_intercept,
        )
        hosts = [
            FeatureParty(host_name(k), channel, block, self.lr, self.reg_lambda)
            for k, block in enumerate(blocks[1:], start=1)
        ]
        self.parties_ = (b, *hosts)
        if self.protocol == "three_party":
            c = KeyHolder(COORDINATOR, channel, self._key(channel))
            self.protocol_: ThreePartyProtocol | TwoPartyProtocol = ThreePartyProtocol(
                hosts, b, c, self.loss
            )
        else:
            (a,) = hosts
            a.key, b.key = self._key(channel), self._key(channel)
            self.protocol_ = TwoPartyProtocol(a, b, self.loss)
        self.loss_history_ = []
        if resume is not None:
            self._load_state_dict(resume)

        def iteration(t: int) -> float:
            rows = self._batch(t, n, s)
            if s < n:
                for a in hosts:
                    b.send(a, "batch_ids", rows, stage="batch")
            return self.protocol_.iteration(rows)

        iterate(self, channel, iteration, callback)
        return self

    def state_dict(self) -> dict[str, Any]:
        """The state after the iterations done so far (docs/vertical.md, Checkpoints and
        resume): the parties' coefficients and last gradients, the loss history and the
        channel's records. Keys are never saved: a resumed Paillier run generates fresh ones,
        and its new public-key messages are counted."""
        return {
            "loss_history": list(self.loss_history_),
            "theta": [p.theta.copy() for p in self.parties_],
            "last_gradient": [p.last_gradient for p in self.parties_],
            "channel": self.channel_.state_dict(),
        }

    def _load_state_dict(self, saved: dict[str, Any]) -> None:
        self.loss_history_ = [float(x) for x in saved["loss_history"]]
        for party, theta, grad in zip(
            self.parties_, saved["theta"], saved["last_gradient"], strict=True
        ):
            party.theta, party.last_gradient = np.array(theta), grad
        self.channel_.load_state_dict(saved["channel"])

    def _batch(self, t: int, n: int, s: int) -> np.ndarray:
        """Mini-batch t: the guest's epoch-wise permutation (seeded stream), or all rows."""
        if s >= n:
            return np.arange(n)
        per_epoch = n // s
        epoch, k = divmod(t, per_epoch)
        order = numpy_rng(self.seed, "vertical_batches", round=epoch).permutation(n)
        return np.sort(order[k * s : (k + 1) * s])

    # -- results ----------------------------------------------------------------------------
    @property
    def transcript_(self):
        return self.channel_.transcript

    @property
    def coef_(self) -> list[np.ndarray]:
        """Coefficients per party, guest first (the guest's without its intercept)."""
        b, *hosts = self.parties_
        guest = b.theta[:-1] if self.fit_intercept else b.theta.copy()
        return [guest, *(a.theta.copy() for a in hosts)]

    @property
    def intercept_(self) -> float:
        b = self.parties_[0]
        return float(b.theta[-1]) if self.fit_intercept else 0.0

    @property
    def last_gradients_(self) -> list[np.ndarray]:
        """The gradients the parties unmasked in the last iteration, guest first (the guest's
        with its intercept entry last)."""
        return [p.last_gradient for p in self.parties_]  # type: ignore[misc]

    def decision_function(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """Joint scores u^B + u^A of new rows, computed across the parties."""
        blocks = check_parts(parts)
        if len(blocks) != len(self.parties_):
            raise ValueError(f"expected {len(self.parties_)} parties' blocks, got {len(blocks)}")
        return np.asarray(self.protocol_.predict(blocks[0], blocks[1:]))


class VerticalLinear(_VerticalGLM):
    """Vertical linear regression: L = (1/2s) Σ (u^A + u^B − y)² + (λ/2)‖Θ‖²."""

    loss = LINEAR

    def predict(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return self.decision_function(parts)


class VerticalLogistic(_VerticalGLM):
    """Vertical logistic regression with Hardy et al.'s Taylor loss log 2 − ½yz + ⅛z²
    (labels 0/1 or ±1)."""

    loss = TAYLOR_LOGISTIC

    def __init__(self, lr: float = 0.5, reg_lambda: float = 0.01, iterations: int = 200, **kw: Any):
        super().__init__(lr, reg_lambda, iterations, **kw)

    def _labels(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.float64)
        if not np.all(np.isin(y, (0.0, 1.0, -1.0))):
            raise ValueError("VerticalLogistic needs binary labels (0/1 or -1/+1)")
        return np.where(y > 0, 1.0, -1.0)

    def predict_proba(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """σ(z) of the joint score."""
        return 1.0 / (1.0 + np.exp(-self.decision_function(parts)))

    def predict(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return (self.decision_function(parts) > 0).astype(np.int64)
