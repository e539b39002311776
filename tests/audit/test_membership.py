"""Members and non-members: balanced, label-matched, disjoint, from the right places."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedloom.audit.membership import (
    Pool,
    allocate,
    make_reserve,
    matched_set,
    partition_transform,
)
from fedloom.config import parse_config
from fedloom.data import from_arrays, load_dataset


def _rows(x: torch.Tensor) -> set[bytes]:
    return {r.numpy().tobytes() for r in x}


def test_matched_set_is_balanced_label_matched_and_disjoint() -> None:
    gen = torch.Generator().manual_seed(0)
    train = Pool(torch.randn(60, 3), torch.tensor([0] * 40 + [1] * 20))
    pool = Pool(torch.randn(50, 3) + 100, torch.tensor([0] * 15 + [1] * 35))
    s = matched_set([(0, train, 50)], pool, gen)
    members, nonmembers = s.member.sum().item(), (~s.member).sum().item()
    assert members == nonmembers
    assert sorted(s.y[s.member].tolist()) == sorted(s.y[~s.member].tolist())
    assert (s.y[~s.member] == 0).sum() <= 15  # class 0 limited by the pool: members dropped
    assert _rows(s.x[s.member]) <= _rows(train.x)
    assert _rows(s.x[~s.member]) <= _rows(pool.x)
    assert len(_rows(s.x[~s.member])) == nonmembers  # no non-member twice


def test_matched_set_applies_the_client_transform() -> None:
    train = Pool(torch.zeros(10, 2), torch.zeros(10, dtype=torch.long))
    pool = Pool(torch.ones(10, 2), torch.zeros(10, dtype=torch.long))
    s = matched_set([(3, train, 5)], pool, torch.Generator(), lambda x, k: x * k)
    assert torch.equal(s.x[~s.member], torch.full((5, 2), 3.0))


def test_allocate() -> None:
    assert allocate(10, [30, 10]) == [8, 2]
    assert sum(allocate(7, [1, 1, 1, 100])) == 7
    assert allocate(100, [3, 4]) == [3, 4]


def test_reserve_of_fashion_mnist_is_the_official_test_split(data_root: Path) -> None:
    cfg = parse_config(
        {"data": {"name": "fashion_mnist", "num_clients": 3, "root": str(data_root)}}
    )
    data = load_dataset(cfg.data, 0)
    reserve = make_reserve(data, 0, root=str(data_root))
    assert "official test split" in reserve.source
    sizes = len(reserve.nonmembers), len(reserve.shadow), len(reserve.public)
    assert sizes == (4000, 4000, 2000)
    parts = [_rows(p.x) for p in (reserve.nonmembers, reserve.shadow, reserve.public)]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    train = _rows(torch.cat([c.x_train for c in data.clients[:1]]))
    assert not (train & parts[0])  # no training image among the non-members
    again = make_reserve(data, 0, root=str(data_root))
    assert torch.equal(again.nonmembers.y, reserve.nonmembers.y)  # seeded


def test_reserve_falls_back_to_held_out_splits_and_needs_classification() -> None:
    data = from_arrays([(torch.randn(50, 2), torch.randint(0, 2, (50,)))] * 2)
    reserve = make_reserve(data, 0)
    assert "held-out" in reserve.source
    assert len(reserve.nonmembers) + len(reserve.shadow) + len(reserve.public) == 20
    regression = from_arrays([(torch.randn(50, 2), torch.randn(50))])
    with pytest.raises(Exception, match="classification"):
        make_reserve(regression, 0)


def test_rotation_partition_transform_is_recovered(data_root: Path) -> None:
    raw = {
        "data": {
            "name": "mnist",
            "num_clients": 2,
            "root": str(data_root),
            "partition": {"kind": "rotation", "angles": [0, 90]},
        }
    }
    data = load_dataset(parse_config(raw).data, 0)
    transform = partition_transform(data)
    x = torch.arange(16.0).view(1, 1, 4, 4)
    assert torch.equal(transform(x, 0), x)
    rotated = transform(x, 1)
    assert rotated.shape == x.shape and not torch.equal(rotated, x)
