"""Secure vertical linear and logistic regression (Yang et al. 2019; Hardy et al. 2017): the
protocols against centralised gradient descent, the Taylor closed form, torch.autograd, and the
transcripts (who sees what)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from sklearn.linear_model import LogisticRegression

from fedloom.vertical import VerticalLinear, VerticalLogistic
from fedloom.vertical.he import MaskedValues, PaillierArray, PaillierBackend
from fedloom.vertical.messages import Channel
from tests.vertical.conftest import KEY_BITS

LAM = 0.01


def _fit(cls, parts, y, iterations, **kw):
    """Fit, recording (θ_host, θ_guest incl. intercept) after every iteration."""
    thetas = []

    def record(t, m):
        b, a = m.parties_
        thetas.append(np.concatenate([a.theta, b.theta]))

    model = cls(kw.pop("lr"), LAM, iterations, **kw).fit(parts, y, callback=record)
    return model, np.array(thetas)


def _centralised(design, y, lr, iterations, loss):
    """Gradient descent on hstack(X_A, X_B, 1): θ after each step and the loss before it."""
    n = len(y)
    theta, thetas, losses = np.zeros(design.shape[1]), [], []
    for _ in range(iterations):
        z = design @ theta
        if loss == "linear":
            d, value = z - y, np.mean(0.5 * (z - y) ** 2)
        else:
            d, value = 0.25 * z - 0.5 * y, np.mean(np.log(2) - 0.5 * y * z + 0.125 * z**2)
        losses.append(value + 0.5 * LAM * theta @ theta)
        theta = theta - lr * (design.T @ d / n + LAM * theta)
        thetas.append(theta)
    return np.array(thetas), np.array(losses)


# -- test 1 -------------------------------------------------------------------------------
def test_vlinr_secure_equals_plain(diabetes_standardised):
    """diabetes, A = cols 0-4, B = cols 5-9 + y, λ = 0.01, η = 0.1, 5 full-batch iterations,
    1024-bit keys: Θ after each iteration and the losses equal centralised GD within 1e-6."""
    x, y = diabetes_standardised
    parts = [x[:, 5:], x[:, :5]]
    model, thetas = _fit(VerticalLinear, parts, y, 5, lr=0.1, encrypt=True, key_bits=KEY_BITS)
    ref, losses = _centralised(np.hstack([x[:, :5], x[:, 5:], np.ones((len(y), 1))]), y, 0.1, 5,
                               "linear")  # fmt: skip
    np.testing.assert_allclose(thetas, ref, atol=1e-6, rtol=0)
    np.testing.assert_allclose(model.loss_history_, losses, atol=1e-6, rtol=0)
    assert np.abs(thetas[-1]).max() > 0.01  # it moved


# -- test 2 -------------------------------------------------------------------------------
def test_vlr_taylor_closed_form(breast_cancer_scaled):
    """20,000 plaintext-path iterations reach the Taylor loss's minimiser
    (¼XᵀX/n + λI) w = ½Xᵀy/n within 1e-9, and 163/171 test accuracy."""
    x_tr, x_te, y_tr, y_te = breast_cancer_scaled
    model = VerticalLogistic(lr=0.5, reg_lambda=LAM, iterations=20000).fit(
        [x_tr[:, 15:], x_tr[:, :15]], y_tr
    )
    design = np.hstack([x_tr[:, :15], x_tr[:, 15:], np.ones((len(y_tr), 1))])
    ys, n = np.where(y_tr > 0, 1.0, -1.0), len(y_tr)
    w = np.linalg.solve(0.25 * design.T @ design / n + LAM * np.eye(design.shape[1]),
                        0.5 * design.T @ ys / n)  # fmt: skip
    b, a = model.parties_
    np.testing.assert_allclose(np.concatenate([a.theta, b.theta]), w, atol=1e-9, rtol=0)
    accuracy = np.mean(model.predict([x_te[:, 15:], x_te[:, :15]]) == y_te)
    assert accuracy == pytest.approx(163 / 171)
    sk = LogisticRegression(C=1 / (LAM * n), max_iter=5000).fit(x_tr, y_tr)
    assert accuracy >= 0.94 and sk.score(x_te, y_te) >= 0.94


# -- tests 3-5: one encrypted fit per protocol, shared ------------------------------------
@pytest.fixture(scope="module")
def logistic_runs(breast_cancer_scaled):
    """3 iterations of each protocol, encrypted (messages kept) and plaintext."""
    x_tr, _, y_tr, _ = breast_cancer_scaled
    parts = [x_tr[:, 15:], x_tr[:, :15]]
    out = {}
    for protocol in ("three_party", "two_party"):
        for encrypt in (True, False):
            out[protocol, encrypt] = _fit(
                VerticalLogistic, parts, y_tr, 3, lr=0.5, protocol=protocol, encrypt=encrypt,
                key_bits=KEY_BITS, keep_messages=encrypt,
            )  # fmt: skip
    return out


@pytest.mark.parametrize("protocol", ["three_party", "two_party"])
def test_vlr_secure_logistic_equals_plain(logistic_runs, breast_cancer_scaled, protocol):
    (enc, enc_thetas), (plain, plain_thetas) = (
        logistic_runs[protocol, True],
        logistic_runs[protocol, False],
    )
    np.testing.assert_allclose(enc_thetas, plain_thetas, atol=1e-6, rtol=0)
    np.testing.assert_allclose(enc.loss_history_, plain.loss_history_, atol=1e-6, rtol=0)
    x_tr, _, y_tr, _ = breast_cancer_scaled
    design = np.hstack([x_tr[:, :15], x_tr[:, 15:], np.ones((len(y_tr), 1))])
    ref, losses = _centralised(design, np.where(y_tr > 0, 1.0, -1.0), 0.5, 3, "taylor")
    np.testing.assert_allclose(plain_thetas, ref, atol=1e-12, rtol=0)
    np.testing.assert_allclose(plain.loss_history_, losses, atol=1e-12, rtol=0)


def test_vlr_views(logistic_runs):
    """C receives only ciphertexts and learns only L and g + R; the host never receives labels
    or residuals in the clear; the guest never receives the host's features or scores."""
    model, _ = logistic_runs["three_party", True]
    transcript = model.transcript_
    to_c = transcript.select(receiver="coordinator")
    assert to_c and all(
        all(isinstance(item, PaillierArray) for item in d.message.payload) for d in to_c
    )
    from_c = transcript.select(sender="coordinator")
    kinds = {d.kind for d in from_c}
    assert kinds == {"public_key", "masked_gradient_plain", "loss_value"}
    for d in transcript.select(receiver="host:1"):
        for item in d.message.payload:  # ciphertexts, masked ints, the public key, L
            assert isinstance(item, PaillierArray | MaskedValues | int | float), d.kind
            if isinstance(item, MaskedValues):  # g + R with R ~ 2^940: no trace of g
                assert min(abs(int(v)) for v in item.values) > 2**900
    for d in transcript.select(receiver="guest"):
        for item in d.message.payload:
            assert isinstance(item, PaillierArray | MaskedValues | int | float), d.kind
    # the 2-party protocol: each party receives ciphertexts under the other's key only
    two, _ = logistic_runs["two_party", True]
    for d in two.transcript_.select(stage="residuals") + two.transcript_.select(stage="scores"):
        (enc, *_) = d.message.payload
        assert isinstance(enc, PaillierArray)


def test_vlr_masks_zero_hook_and_uniformity(breast_cancer_scaled):
    """With R fixed to 0 (debug hook) C's decryption equals g; with real R the top 8 bits of
    2,000 masked values are uniform (chi-square, p > 1e-3, seeded)."""
    x_tr, _, y_tr, _ = breast_cancer_scaled
    parts = [x_tr[:, 15:], x_tr[:, :15]]
    model = VerticalLogistic(
        lr=0.5, reg_lambda=LAM, iterations=1, encrypt=True, key_bits=KEY_BITS,
        keep_messages=True, zero_masks=True,
    ).fit(parts, y_tr)  # fmt: skip
    guest, host = model.parties_
    for party in (guest, host):
        sent = model.transcript_.select(sender=party.name, kind="masked_gradient")[0]
        back = model.transcript_.select(receiver=party.name, kind="masked_gradient_plain")[0]
        scale = sent.message.payload[0].scale
        seen = np.array([int(v) / 2**scale for v in back.message.payload[0].values])
        # C decrypts Σ_i d_i x_i = s·g; θ was 0, so g has no λθ
        np.testing.assert_allclose(seen / len(y_tr), party.last_gradient, atol=1e-9)
    # real masks on the true gradient integers (the protocol adds them as fresh encryptions)
    backend = PaillierBackend(
        Channel(), public_key=model.protocol_.c.key.public_key, mask_random=random.Random(7)
    )
    g = [round(v * 2**96) for v in host.last_gradient]
    masked = [g[i % len(g)] + r for i, r in enumerate(backend.draw_masks(2000))]
    top = [min(v >> (backend.mask_bits - 8), 255) for v in masked]
    counts = np.bincount(top, minlength=256)
    assert chisquare(counts).pvalue > 1e-3
    assert backend.max_hidden_bits + 80 == backend.mask_bits


def test_vlr_gradient_formula(logistic_runs, breast_cancer_scaled):
    """The protocol's last gradient (at θ after two steps) equals torch.autograd of the stated
    Taylor loss: plaintext path within 1e-12, encrypted within 1e-10 (float64)."""
    x_tr, _, y_tr, _ = breast_cancer_scaled
    design = torch.tensor(np.hstack([x_tr[:, :15], x_tr[:, 15:], np.ones((len(y_tr), 1))]))
    ys = torch.tensor(np.where(y_tr > 0, 1.0, -1.0))
    for encrypt, tol in ((False, 1e-12), (True, 1e-10)):
        model, thetas = logistic_runs["three_party", encrypt]
        theta = torch.tensor(thetas[-2], requires_grad=True)
        z = design @ theta
        loss = torch.mean(np.log(2.0) - 0.5 * ys * z + 0.125 * z**2) + 0.5 * LAM * theta @ theta
        (grad,) = torch.autograd.grad(loss, theta)
        guest, host = model.last_gradients_
        np.testing.assert_allclose(np.concatenate([host, guest]), grad.numpy(), atol=tol, rtol=0)


def test_vlinr_minibatches_equal_centralised(diabetes_standardised):
    """Mini-batches of agreed ids (the guest's seeded epoch permutation, ids sent to the host):
    the plaintext protocol equals centralised mini-batch GD on the same rows."""
    x, y = diabetes_standardised
    model, thetas = _fit(VerticalLinear, [x[:, 5:], x[:, :5]], y, 6, lr=0.1, batch_size=100)
    design = np.hstack([x[:, :5], x[:, 5:], np.ones((len(y), 1))])
    theta = np.zeros(design.shape[1])
    batches = [msg.message for msg in model.transcript_.select(kind="batch_ids")]
    assert batches == [None] * 6  # ids are recorded (bytes), not kept without keep_messages
    for t in range(6):
        rows = model._batch(t, len(y), 100)
        d = design[rows] @ theta - y[rows]
        theta = theta - 0.1 * (design[rows].T @ d / len(rows) + LAM * theta)
        np.testing.assert_allclose(thetas[t], theta, atol=1e-12, rtol=0)
    assert len({tuple(model._batch(t, len(y), 100)) for t in range(4)}) == 4
