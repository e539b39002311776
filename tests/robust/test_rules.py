"""The robust rules against oracles: known vectors, planted honest clusters, preconditions,
norm bounds, and permutation invariance."""

from __future__ import annotations

import pytest
import torch

from fedloom.errors import ConfigError
from fedloom.robust import rules


def planted(n_honest: int, f: int, dim: int = 6, seed: int = 0) -> torch.Tensor:
    """n_honest rows near 1.0 and f rows far away (at 50)."""
    gen = torch.Generator().manual_seed(seed)
    honest = 1.0 + 0.01 * torch.randn(n_honest, dim, generator=gen, dtype=torch.float64)
    bad = 50.0 + torch.randn(f, dim, generator=gen, dtype=torch.float64)
    return torch.cat([honest, bad])


def test_median_and_trimmed_mean_of_known_vectors():
    x = torch.tensor([[1.0, 10.0], [2.0, -4.0], [3.0, 0.0], [100.0, 2.0]], dtype=torch.float64)
    assert rules.coordinate_median(x).tolist() == [2.5, 1.0]
    assert rules.coordinate_median(x[:3]).tolist() == [2.0, 0.0]
    assert rules.trimmed_mean(x, 0.25).tolist() == [2.5, 1.0]  # drops 1 at each end
    assert rules.trimmed_mean(x, 0.0).tolist() == x.mean(dim=0).tolist()
    with pytest.raises(ConfigError, match="trims all"):
        rules.trimmed_mean(x[:2], 0.5)


def test_krum_picks_a_member_of_the_honest_cluster():
    x = planted(8, 3)
    chosen = rules.multi_krum(x, f=3, m=1)
    assert any(torch.equal(chosen, row) for row in x[:8])
    assert torch.allclose(rules.multi_krum(x, f=3), x[:8].mean(dim=0), atol=0.02)  # m = n - f
    with pytest.raises(ConfigError, match=r"n > 2f \+ 2"):
        rules.krum_scores(x[:7], f=3)


def test_bulyan_stays_with_the_honest_cluster_and_needs_4f_plus_3():
    x = planted(12, 3)
    assert (rules.bulyan(x, f=3) - 1.0).abs().max() < 0.05
    with pytest.raises(ConfigError, match=r"n >= 4f \+ 3"):
        rules.bulyan(x[:14], f=3)


def test_clipping_bounds_every_norm_and_keeps_short_rows():
    x = planted(5, 2)
    clipped = rules.clip_rows(x, 2.0)
    assert (clipped.norm(dim=1) <= 2.0 + 1e-12).all()
    short = x[:1] / x[:1].norm() * 0.5
    assert torch.equal(rules.clip_rows(short, 2.0), short)
    assert rules.median_norm(x) == pytest.approx(float(x.norm(dim=1).median()), rel=1e-12)


@pytest.mark.parametrize(
    "rule",
    [
        rules.coordinate_median,
        lambda x: rules.trimmed_mean(x, 0.2),
        lambda x: rules.multi_krum(x, 2, m=1),
        lambda x: rules.multi_krum(x, 2),
        lambda x: rules.bulyan(x, 2),
    ],
)
def test_every_rule_is_permutation_invariant(rule):
    x = planted(9, 2, seed=3)
    x[3] = x[4]  # a tie in Krum's scores: broken by value, not by position
    reference = rule(x)
    for seed in range(5):
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(rule(x[order]), reference, atol=1e-12, rtol=0)
