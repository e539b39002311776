"""Exactness of the LoRA aggregations (docs/peft.md, "Strategies and their exactness"), HetLoRA."""

from __future__ import annotations

import torch

from fedloom.peft import strategies as S


def _factors(k: int, r: int = 4, d_in: int = 12, d_out: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(r, d_in, generator=g) for _ in range(k)]
    b = [torch.randn(d_out, r, generator=g) for _ in range(k)]
    return a, b


P = [0.5, 0.3, 0.2]


def test_fedit_is_inexact_ffa_flora_fedex_are_exact():
    a, b = _factors(3)
    exact = S.exact_product(a, b, P)
    a_bar, b_bar = S.fedit(a, b, P)
    assert (b_bar @ a_bar - exact).norm() > 1e-3 * exact.norm()
    # FFA: one A for all
    same = [a[0]] * 3
    a_bar, b_bar = S.fedit(same, b, P)
    assert (b_bar @ a_bar - S.exact_product(same, b, P)).norm() < 1e-6 * exact.norm() + 1e-6
    a_stack, b_stack = S.flora_stack(a, b, P)
    assert (b_stack @ a_stack - exact).abs().max() < 1e-5
    a_bar, b_bar = S.fedit(a, b, P)
    assert (b_bar @ a_bar + S.fedex_residual(a, b, P) - exact).abs().max() < 1e-5


def test_flora_stacks_heterogeneous_ranks():
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(r, 6, generator=g) for r in (1, 3, 5)]
    b = [torch.randn(7, r, generator=g) for r in (1, 3, 5)]
    a_stack, b_stack = S.flora_stack(a, b, P)
    assert a_stack.shape == (9, 6) and b_stack.shape == (7, 9)
    assert (b_stack @ a_stack - S.exact_product(a, b, P)).abs().max() < 1e-5


def test_hetlora_one_full_rank_client_and_padding_round_trip():
    a, b = _factors(3, r=8)
    zero_a = [a[0], torch.zeros_like(a[1]), torch.zeros_like(a[2])]
    zero_b = [b[0], torch.zeros_like(b[1]), torch.zeros_like(b[2])]
    ups = [{"m.lora_A": x, "m.lora_B": y} for x, y in zip(zero_a, zero_b, strict=True)]
    w = S.hetlora_weights(ups, ["m"], P)
    assert w == [1.0, 0.0, 0.0]
    agg_a, agg_b = S.fedit(zero_a, zero_b, w)
    assert torch.equal(agg_b @ agg_a, b[0] @ a[0])
    small_a, small_b = S.truncate(a[1], b[1], 3)
    big_a, big_b = S.pad(small_a, small_b, 8)
    assert big_a.shape == a[1].shape and big_b.shape == b[1].shape
    back_a, back_b = S.truncate(big_a, big_b, 3)
    assert torch.equal(back_a, small_a) and torch.equal(back_b, small_b)
    assert torch.equal(big_b @ big_a, small_b @ small_a)
    assert torch.equal(S.rank_mask(a[1], 3, 0), big_a.new_zeros(()) + pad(a[1][:3], 8))


def pad(rows: torch.Tensor, r_max: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(r_max - rows.shape[0], rows.shape[1])])


def test_rank_by_size_rule():
    assert S.rank_by_size(1000, 1000, 8) == 8
    assert S.rank_by_size(31, 1000, 8) == 4  # floor(8 * log 32 / log 1001) = floor(4.01)
    assert S.rank_by_size(0, 1000, 8) == 1
    ranks = [S.rank_by_size(n, 500, 16) for n in (10, 50, 100, 500)]
    assert ranks == sorted(ranks) and ranks[-1] == 16


def test_spherical_mean_keeps_norm_and_matches_slerp_midpoint():
    g = torch.Generator().manual_seed(2)
    p0, p1 = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    p1 = p1 / p1.norm(dim=-1, keepdim=True) * p0.norm(dim=-1, keepdim=True)  # equal norms
    mean = S.spherical_mean([p0, p1], [0.5, 0.5])
    assert torch.allclose(mean.norm(dim=-1), p0.norm(dim=-1), atol=1e-5)
    assert torch.allclose(mean, S.slerp(p0, p1, 0.5), atol=1e-5)
    plain = S.weighted_sum([p0, p1], [0.5, 0.5])
    assert (plain.norm(dim=-1) < p0.norm(dim=-1) - 1e-3).all()  # the average shrinks


def test_personal_keys_per_strategy():
    keys = ["lora.0.query.lora_A", "lora.0.query.lora_B", "classifier.weight"]
    assert S.personal_keys(keys, "a", "lora", "shared") == {"lora.0.query.lora_B"}
    assert S.personal_keys(keys, "b", "lora", "shared") == {"lora.0.query.lora_A"}
    assert S.personal_keys(keys, "both", "lora", "personal") == {"classifier.weight"}
    assert S.personal_keys(["prompts.shared", "prompts.personal"], "a", "prompt", "shared") == {
        "prompts.personal"
    }
