"""Missing-feature-aware aggregation (docs/missing_features.md): clients lacking input features
(``data.missing``) and the server's per-column mean over the clients that observed each feature
(``aggregator.kind: feature_aware``).

The closed form: linear regression whose input columns are zero-mean and mutually orthogonal
on every client, with noiseless targets y = X w* + b*. A client that lacks feature j gets no
gradient for w_j and, trained to convergence by full-batch gradient descent, returns w*
everywhere else and the w_j it was sent. After one round the plain mean is therefore biased,
w_j = (sum_{k observed j} n_k w*_j + sum_{k not} n_k w_j^0) / sum_k n_k, and the feature-aware
mean is w* exactly."""

from __future__ import annotations

import math

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.data import from_arrays
from fedloom.data.missing import MissingFeatures, feature_masks, observed
from fedloom.errors import ConfigError
from fedloom.robust.feature_aware import FeatureAwareAggregation

D, SIZES = 8, (40, 24, 32, 56)
W_STAR = torch.tensor([[1.5, -2.0, 0.5, 3.0, -1.0, 2.5, -0.5, 1.0]])
B_STAR = 0.7


def orthogonal_inputs(n: int, seed: int) -> torch.Tensor:
    """n samples of D zero-mean, mutually orthogonal columns with X^T X = n I."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.cat([torch.ones(n, 1), torch.randn(n, D, generator=g)], 1))
    return q[:, 1:] * math.sqrt(n)


def regression_data():
    train = []
    for k, n in enumerate(SIZES):
        x = orthogonal_inputs(n, k)
        train.append((x, x @ W_STAR.T + B_STAR))
    return from_arrays(train=train, test=train)


def run(aggregator: str, rounds: int = 1) -> fedloom.RunResult:
    config = {
        "seed": 0,
        "data": {
            "name": "synthetic",
            "missing": {"kind": "columns", "fraction": 0.25, "clients": 0.5},
        },
        "algorithm": {"name": "fedavg"},
        "aggregator": {"kind": aggregator},
        # full-batch GD, Hessian 2I: lr 0.25 halves the error each step, 60 steps converge
        "train": {"rounds": rounds, "local_steps": 60, "batch_size": None, "lr": 0.25},
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
    }
    return fedloom.run(config, data=regression_data(), model=linear(), write=False, progress=False)


def test_plain_mean_is_biased_and_feature_aware_is_not():
    masks = feature_masks(MissingFeatures(kind="columns", fraction=0.25, clients=0.5), 0, 4, (D,))
    assert int((~masks).sum()) == 2 * 2 and bool(masks.any(0).all())  # 2 clients lack 2 each
    plain, aware = run("mean"), run("feature_aware")
    n = torch.tensor(SIZES, dtype=torch.float64)
    m = masks.to(torch.float64)
    assert torch.allclose(aware.global_params["0.weight"], W_STAR, atol=1e-5)
    assert aware.global_params["0.bias"].item() == pytest.approx(B_STAR, abs=1e-5)
    # plain: a lacking client returns the initial w_j; derive w_j^0 from the observed share
    share = (n[:, None] * m).sum(0) / n.sum()  # per column: weight of the observing clients
    got = plain.global_params["0.weight"][0].double()
    hidden = share < 1
    assert bool(hidden.any())
    assert torch.allclose(got[~hidden], W_STAR[0, ~hidden].double(), atol=1e-5)
    # w_j = share_j w*_j + (1 - share_j) w_j^0, so w_j^0 = (w_j - share_j w*_j) / (1 - share_j):
    # the same initial weights the feature-aware run started from
    init_w = (got[hidden] - share[hidden] * W_STAR[0, hidden].double()) / (1 - share[hidden])
    assert not torch.allclose(got[hidden], W_STAR[0, hidden].double(), atol=0.05)
    first = initial_weight()
    assert torch.allclose(init_w, first[0, hidden].double(), atol=1e-5)


def linear() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(D, 1))  # initialized from the run's seed


def initial_weight() -> torch.Tensor:
    """The server's initial first-layer weight in the runs above (seed 0)."""
    params, _ = FunctionalModel(linear(), "regression").initial_state(0)
    return params["0.weight"]


def test_feature_aware_rule_on_known_trees():
    """Column j: sum_k w_k M_kj W_k[:, j] / sum_k w_k M_kj; a column nobody observed and
    every other parameter: the plain weighted mean."""
    masks = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    rule = FeatureAwareAggregation("w", masks)
    trees = [
        {"w": torch.tensor([[1.0, 10.0, 100.0]]), "b": torch.tensor([1.0])},
        {"w": torch.tensor([[3.0, 20.0, 200.0]]), "b": torch.tensor([2.0])},
        {"w": torch.tensor([[5.0, 40.0, 400.0]]), "b": torch.tensor([4.0])},
    ]
    rule.begin([0, 1, 2])
    out = rule.aggregate(trees, [1.0, 1.0, 2.0])
    assert torch.allclose(out["w"], torch.tensor([[2.0, 100 / 3, 275.0]]))
    assert torch.allclose(out["b"], torch.tensor([2.75]))
    rule.begin([2, 1])  # the round's clients, in the order of their results
    out = rule.aggregate(trees[:2], [1.0, 3.0])
    assert torch.allclose(out["w"], torch.tensor([[3.0, 17.5, 175.0]]))
    with pytest.raises(ValueError, match="2 clients"):
        rule.aggregate(trees, [1.0, 1.0, 1.0])


@pytest.mark.parametrize("kind", ["columns", "regions"])
def test_hidden_features_are_deterministic_and_zero_in_train_and_test(kind):
    cfg = {
        "name": "digits",
        "num_clients": 6,
        "missing": {"kind": kind, "fraction": 0.3, "clients": 0.5},
    }
    parsed = parse_config({"data": cfg})
    shape = (1, 8, 8)
    masks = feature_masks(parsed.data.missing, 1, 6, shape)
    assert torch.equal(masks, feature_masks(parsed.data.missing, 1, 6, shape))
    assert not torch.equal(masks, feature_masks(parsed.data.missing, 2, 6, shape))
    lacking = [k for k in range(6) if not bool(masks[k].all())]
    assert len(lacking) == 3
    for k in lacking:
        hidden = int((~masks[k]).sum())
        if kind == "columns":
            assert hidden == round(0.3 * 64)
        else:  # a rectangle of sqrt(0.3) x sqrt(0.3) of the 8 x 8 image: 4 x 4
            rows = (~masks[k]).reshape(8, 8).any(1).nonzero().flatten()
            assert hidden == 16 and int(rows[-1] - rows[0]) == 3
    result = fedloom.run(
        {
            "seed": 1,
            "data": cfg,
            "train": {"rounds": 1, "local_steps": 2},
            "monitor": {"enabled": False},
            "executor": {"kind": "sequential"},
        },
        write=False,
        progress=False,
    )
    assert math.isfinite(result.summary["final"]["global"]["loss"])


def test_observed_reads_the_masks_back_from_the_data():
    from fedloom.data.missing import hide_features

    data = regression_data()
    cfg = MissingFeatures(kind="columns", fraction=0.25, clients=0.5)
    hidden = hide_features(data, cfg, seed=0)
    assert torch.equal(observed(hidden), feature_masks(cfg, 0, 4, (D,)))
    for before, after, m in zip(data.clients, hidden.clients, observed(hidden), strict=True):
        assert torch.equal(after.x_train[:, m], before.x_train[:, m])
        assert torch.equal(after.x_test[:, ~m], torch.zeros_like(after.x_test[:, ~m]))
    assert hide_features(data, None, 0) is data


def digits_config(aggregator: str, executor: str) -> dict:
    return {
        "seed": 2,
        "data": {
            "name": "digits",
            "num_clients": 6,
            "missing": {"kind": "regions", "fraction": 0.4, "clients": 0.5},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedprox", "mu": 0.01},
        "aggregator": {"kind": aggregator},
        "train": {
            "rounds": 3,
            "clients_per_round": 4,
            "local_steps": 4,
            "batch_size": 16,
            "lr": 0.1,
        },
        "eval": {"every": 3},
        "monitor": {"enabled": False},
        "executor": {"kind": executor},
    }


def test_feature_aware_on_images_runs_on_both_executors():
    seq = fedloom.run(digits_config("feature_aware", "sequential"), write=False, progress=False)
    vec = fedloom.run(digits_config("feature_aware", "vectorized"), write=False, progress=False)
    plain = fedloom.run(digits_config("mean", "sequential"), write=False, progress=False)
    for key, value in seq.global_params.items():
        assert torch.allclose(value, vec.global_params[key], atol=1e-4, rtol=0), key
    first = next(iter(seq.global_params))
    assert not torch.allclose(seq.global_params[first], plain.global_params[first], atol=1e-4)
    report = seq.summary["aggregator"]
    assert report["kind"] == "feature_aware" and report["features"] == 64
    assert 0 < report["observed_share_mean"] < 1


@pytest.mark.parametrize(
    ("data", "extra", "message"),
    [
        (
            {"name": "digits"},
            {"model": {"name": "cnn"}, "aggregator": {"kind": "feature_aware"}},
            "first layer is linear",
        ),
        ({"name": "synthetic", "missing": {"kind": "regions"}}, {}, "regions needs images"),
        ({"name": "digits", "missing": {"kind": "rows"}}, {}, "data.missing.kind"),
        ({"name": "digits", "missing": {"fraction": 1.0}}, {}, "data.missing.fraction"),
    ],
)
def test_bad_missing_feature_configs_are_config_errors(data, extra, message):
    with pytest.raises(ConfigError, match=message):
        fedloom.run({"data": data, "train": {"rounds": 1}, **extra}, write=False, progress=False)
