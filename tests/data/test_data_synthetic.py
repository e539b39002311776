"""Synthetic(alpha, beta) follows FedProx's construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedloom.data import load_dataset


def _all_x(c) -> torch.Tensor:
    return torch.cat([c.x_train, c.x_test]).double()


def test_shapes_and_sizes(cfg) -> None:
    fd = load_dataset(cfg("synthetic", test_fraction=0.1), seed=0)
    assert fd.num_clients == 30 and fd.input_shape == (60,) and fd.num_outputs == 10
    sizes = fd.extras["sizes"]
    assert min(sizes) >= 50
    for c, n in zip(fd.clients, sizes, strict=True):
        assert c.num_train + c.num_test == n and c.num_test == round(0.1 * n)
        assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.int64


def test_sizes_are_lognormal_4_2(cfg) -> None:
    fd = load_dataset(cfg("synthetic", num_clients=400), seed=1)
    logs = np.log(np.array(fd.extras["sizes"]) - 50 + 0.5)
    assert abs(np.median(logs) - 4.0) < 0.4
    q75, q25 = np.percentile(logs, [75, 25])
    assert abs((q75 - q25) / 1.349 - 2.0) < 0.4


def test_features_and_labels_follow_the_model(cfg) -> None:
    fd = load_dataset(cfg("synthetic", options={"alpha": 1.0, "beta": 1.0}), seed=2)
    ex = fd.extras
    resid = torch.cat([_all_x(c) - ex["v"][k] for k, c in enumerate(fd.clients)])
    var = resid.var(dim=0)
    expected = torch.arange(1, 61, dtype=torch.float64) ** -1.2
    assert torch.allclose(ex["feature_variances"], expected)
    assert ((var - expected).abs() / expected).max() < 0.15
    assert resid.mean(dim=0).abs().max() < 0.1
    agree = []
    for k, c in enumerate(fd.clients):
        logits = _all_x(c) @ ex["W"][k] + ex["b"][k]
        agree.append((logits.argmax(1) == torch.cat([c.y_train, c.y_test])).double().mean())
    assert min(agree) > 0.99
    # v_k ~ N(B_k, 1) per feature; W_k, b_k ~ N(u_k, 1)
    assert (ex["v"].mean(dim=1) - ex["B"]).abs().max() < 4 / 60**0.5
    assert (ex["W"].mean(dim=(1, 2)) - ex["u"]).abs().max() < 4 / 600**0.5


@pytest.mark.parametrize(("ab", "lo", "hi"), [(0.0, 0.0, 0.0), (10.0, 5.0, 16.0)])
def test_alpha_beta_spread(cfg, ab, lo, hi) -> None:
    fd = load_dataset(cfg("synthetic", options={"alpha": ab, "beta": ab}), seed=3)
    for key in ("u", "B"):
        std = float(fd.extras[key].std())
        assert lo <= std <= hi


def test_iid_variant_shares_one_model(cfg) -> None:
    fd = load_dataset(cfg("synthetic", options={"iid": True}), seed=4)
    ex = fd.extras
    assert torch.equal(ex["W"], ex["W"][:1].expand_as(ex["W"]))
    assert torch.equal(ex["b"], ex["b"][:1].expand_as(ex["b"]))
    assert not ex["v"].any()
    non_iid = load_dataset(cfg("synthetic"), seed=4)
    assert not torch.equal(non_iid.extras["W"][0], non_iid.extras["W"][1])
