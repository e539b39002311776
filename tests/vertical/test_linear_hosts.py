"""Vertical linear and logistic regression with a guest and K hosts (the three-party protocol
with a coordinator, Yang et al. 2019, Table 1, generalised): equal to centralised gradient
descent, encrypted equal to plaintext, and what each party sees (docs/vertical.md)."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.vertical import VerticalLinear, VerticalLogistic
from fedloom.vertical.he import MaskedValues, PaillierArray
from tests.vertical.conftest import KEY_BITS
from tests.vertical.test_linear import LAM, _centralised

HOST_COLUMNS = ((0, 3), (3, 7))
"""diabetes: host 1 = columns 0-2, host 2 = 3-6, the guest 7-9 with the target."""
ROWS = 150
"""The encrypted runs use diabetes' first 150 rows (time)."""


def _parts(x: np.ndarray) -> list[np.ndarray]:
    return [x[:, 7:], *(x[:, a:b] for a, b in HOST_COLUMNS)]


def _design(x: np.ndarray) -> np.ndarray:
    """The centralised design in the order (host 1, host 2, guest, intercept)."""
    return np.hstack([x[:, :3], x[:, 3:7], x[:, 7:], np.ones((len(x), 1))])


def _theta(model) -> np.ndarray:
    b, *hosts = model.parties_
    return np.concatenate([*(a.theta for a in hosts), b.theta])


@pytest.fixture(scope="module")
def linear_runs(diabetes_standardised):
    """Two full-batch iterations (the second one has non-zero scores, hence cross terms),
    plaintext and encrypted (1024 bits, messages kept)."""
    x, y = diabetes_standardised[0][:ROWS], diabetes_standardised[1][:ROWS]
    return {
        enc: VerticalLinear(0.1, LAM, 2, encrypt=enc, key_bits=KEY_BITS, keep_messages=enc).fit(
            _parts(x), y
        )
        for enc in (False, True)
    }


def test_two_hosts_equal_centralised(linear_runs, diabetes_standardised):
    """The plaintext protocol equals centralised GD on hstack(hosts, guest, 1) within 1e-12
    (Θ and the loss, whose cross-host terms come from the hosts); encrypted within 1e-6."""
    x, y = diabetes_standardised[0][:ROWS], diabetes_standardised[1][:ROWS]
    ref, losses = _centralised(_design(x), y, 0.1, 2, "linear")
    plain, enc = linear_runs[False], linear_runs[True]
    np.testing.assert_allclose(_theta(plain), ref[-1], atol=1e-12, rtol=0)
    np.testing.assert_allclose(plain.loss_history_, losses, atol=1e-12, rtol=0)
    np.testing.assert_allclose(_theta(enc), ref[-1], atol=1e-6, rtol=0)
    np.testing.assert_allclose(enc.loss_history_, losses, atol=1e-6, rtol=0)
    assert len(plain.coef_) == 3 and np.abs(ref[-1]).max() > 0.01
    scores = plain.decision_function(_parts(x))
    np.testing.assert_allclose(scores, _design(x) @ ref[-1], atol=1e-12, rtol=0)


def test_logistic_three_hosts_plain(breast_cancer_scaled):
    """Taylor logistic regression, guest + three hosts, 5 iterations: centralised GD."""
    x_tr, _, y_tr, _ = breast_cancer_scaled
    parts = [x_tr[:, 20:], x_tr[:, :5], x_tr[:, 5:12], x_tr[:, 12:20]]
    model = VerticalLogistic(lr=0.5, reg_lambda=LAM, iterations=5).fit(parts, y_tr)
    design = np.hstack([x_tr[:, :20], x_tr[:, 20:], np.ones((len(y_tr), 1))])
    ref, losses = _centralised(design, np.where(y_tr > 0, 1.0, -1.0), 0.5, 5, "taylor")
    np.testing.assert_allclose(_theta(model), ref[-1], atol=1e-12, rtol=0)
    np.testing.assert_allclose(model.loss_history_, losses, atol=1e-12, rtol=0)


def test_views_with_two_hosts(linear_runs):
    """Each host hears only from the guest and the coordinator, and receives ciphertexts
    under C's key ([[d]], the other hosts' summed scores), its own masked gradient (g + R,
    R ~ 2^940) and L; no host sends to another; the guest receives only ciphertexts, masked
    values and L; C receives only ciphertexts."""
    transcript = linear_runs[True].transcript_
    for host in ("host:1", "host:2"):
        received = transcript.select(receiver=host)
        assert {d.sender for d in received} == {"guest", "coordinator"}
        for d in received:
            for item in d.message.payload:
                assert isinstance(item, PaillierArray | MaskedValues | int | float), d.kind
                if isinstance(item, MaskedValues):
                    assert min(abs(int(v)) for v in item.values) > 2**900
        assert not transcript.select(
            sender=host, receiver="host:1" if host != "host:1" else "host:2"
        )
    assert {d.kind for d in transcript.select(receiver="host:2", sender="guest")} == {
        "residuals", "partial_scores"
    }  # fmt: skip
    assert not transcript.select(receiver="host:1", kind="partial_scores")  # nobody before it
    for d in transcript.select(receiver="guest"):
        for item in d.message.payload:
            assert isinstance(item, PaillierArray | MaskedValues | int | float), d.kind
    for d in transcript.select(receiver="coordinator"):
        assert all(isinstance(item, PaillierArray) for item in d.message.payload)


def test_two_party_protocol_takes_one_host(diabetes_standardised):
    x, y = diabetes_standardised
    with pytest.raises(ValueError, match="three_party"):
        VerticalLinear(protocol="two_party", encrypt=True, key_bits=KEY_BITS).fit(_parts(x), y)
