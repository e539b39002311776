"""FedLC (Zhang et al., ICML 2022, arXiv:2209.00189: label distribution shift): the calibrated
loss against a hand computation, tau = 0 is FedAvg bit for bit, the calibration favours rare
classes, configuration errors, and learning against FedAvg on Fashion-MNIST Dirichlet label
skew (tests/algorithms/pfl_setup.py)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms.fedlc import calibrated_loss, calibration_shift
from fedloom.errors import ConfigError
from tests.algorithms.digits_setup import assert_same_global
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import pfl_config


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedlc", "tau": -1.0}, "algorithm.tau"),
        ({"name": "fedlc", "min_count": 0.0}, "algorithm.min_count"),
        ({"name": "fedlc", "prior_weight": -0.1}, "algorithm.prior_weight"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


# -- FedLC ----------------------------------------------------------------------------------
def test_fedlc_loss_equals_a_hand_computation():
    logits = torch.tensor([[1.0, -0.5, 0.3], [0.2, 0.4, -1.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    counts = torch.tensor([16, 1, 0])  # class 2 absent: count clamped at min_count 1e-8
    tau = 1.5
    shift = [tau * 16**-0.25, tau * 1.0, tau * (1e-8) ** -0.25]  # 0.75, 1.5, 150
    assert calibration_shift(counts, tau, 1e-8).tolist() == pytest.approx(shift, rel=1e-12)
    expected = 0.0
    for row, label in zip(logits.tolist(), y.tolist(), strict=True):
        cal = [z - s for z, s in zip(row, shift, strict=True)]
        expected += -math.log(math.exp(cal[label]) / sum(math.exp(c) for c in cal))
    expected /= 2
    loss = calibrated_loss(logits, y, counts, tau, min_count=1e-8)
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    # the optional prior term: -sum_c pi_c log(p_c / pi_c), p = mean softmax over the batch
    pi = [16 / 17, 1 / 17, 0.0]
    probs = [[math.exp(z) / sum(math.exp(v) for v in row) for z in row] for row in logits.tolist()]
    p = [(probs[0][c] + probs[1][c]) / 2 for c in range(3)]
    prior = -sum(pi[c] * math.log(p[c] / pi[c]) for c in range(2))  # 0 log 0 = 0 for class 2
    with_prior = calibrated_loss(logits, y, counts, tau, prior_weight=0.7, min_count=1e-8)
    assert float(with_prior) == pytest.approx(expected + 0.7 * prior, rel=1e-12)
    assert prior > 0  # a KL divergence
    # min_count = 1 (the default): an absent class counts as one sample
    one = calibrated_loss(logits, y, counts, tau)
    cal = logits - torch.tensor([0.75, 1.5, 1.5], dtype=torch.float64)
    assert float(one) == pytest.approx(float(F.cross_entropy(cal, y)), rel=1e-12)


def test_fedlc_calibration_favours_rare_classes():
    counts = torch.tensor([1000, 10, 1])  # frequent, rare, rarer
    shift = calibration_shift(counts, 1.0)
    assert shift[0] < shift[1] < shift[2]

    def grad(label: int, tau: float) -> torch.Tensor:
        z = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
        calibrated_loss(z, torch.tensor([label]), counts, tau).backward()
        assert z.grad is not None
        return z.grad[0]

    plain, cal = grad(2, 0.0), grad(2, 1.0)
    # a sample of the rarest class: its logit is pushed up harder than by plain CE ...
    assert cal[2] < plain[2] < 0
    # ... and the frequent class's logit pushed down harder
    assert cal[0] > plain[0] > 0
    plain, cal = grad(0, 0.0), grad(0, 1.0)
    # a sample of the frequent class pushes the rare classes' logits down less than plain CE
    assert 0 < cal[2] < cal[1] < plain[2] == pytest.approx(plain[1])
    # at equal logits the rare class's sample carries the larger loss (the larger margin)
    zero = torch.zeros(1, 3)
    losses = [float(calibrated_loss(zero, torch.tensor([c]), counts, 1.0)) for c in range(3)]
    assert losses[0] < losses[1] < losses[2]


def test_fedlc_with_tau_zero_is_fedavg():
    # stragglers (a shorter plan) and partial participation: the global model bit for bit
    fedavg = run({"name": "fedavg"}, stragglers=0.4)
    fedlc = run({"name": "fedlc", "tau": 0.0}, stragglers=0.4)
    assert_same_global(fedavg, fedlc)
    assert fedavg.summary["communication"] == fedlc.summary["communication"]
    # and tau > 0 does change it
    calibrated = run({"name": "fedlc"}, stragglers=0.4)
    assert not torch.equal(calibrated.global_params["fc3.bias"], fedavg.global_params["fc3.bias"])


@pytest.mark.slow
def test_fedlc_is_not_worse_than_fedavg_on_dirichlet_label_skew(data_root):
    # FedLC does not beat FedAvg measurably on any setup we could afford. Global accuracy,
    # seed 0, 20 rounds:
    #   Dirichlet(0.1), 20 local steps: FedAvg 0.6790; FedLC min_count 1: tau 0.5 0.6810,
    #     tau 1 0.6846, tau 2 0.6873; min_count 1e-8 (absent classes leave the
    #     softmax, as in the public code): 0.6382; tau 1 + prior_weight 1: 0.6766
    #   Dirichlet(0.1), 50 local steps: FedAvg 0.7286, FedLC min_count 1 0.7364, 1e-8 0.7092
    #   2-label shards: FedAvg 0.6215, FedLC min_count 1 0.6052, 1e-8 0.1734 (each client's
    #     softmax is its 2 classes: nothing ranks classes of different clients)
    #   seed 1, min_count 1: Dirichlet(0.1) 0.5863 against FedAvg 0.5690; shards 0.5871 / 0.5912
    def dirichlet(algorithm: dict) -> float:
        config = pfl_config(algorithm)
        config["data"]["partition"] = {"kind": "dirichlet", "alpha": 0.1}
        result = fedloom.run(config, write=False, progress=False)
        return float(result.summary["final"]["global"]["accuracy"])

    fedavg = dirichlet({"name": "fedavg"})
    fedlc = dirichlet({"name": "fedlc"})  # min_count 1, the default
    assert fedlc >= fedavg - 0.02, (fedlc, fedavg)
