"""The virtual clock's pure parts (engine/clock.py): FedAsync's staleness functions in closed
form, the speed distributions, and the config's errors."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from fedloom.config import parse_config
from fedloom.engine.clock import Speeds, staleness_weight
from fedloom.errors import ConfigError
from fedloom.run_config.asynchrony import SpeedsConfig


@pytest.mark.parametrize("d", [0, 1, 2, 3, 7, 50])
def test_staleness_functions_match_fedasync_section_5_2(d):
    assert staleness_weight("constant", d, 0.5, 4) == 1.0
    assert staleness_weight("polynomial", d, 0.5, 4) == pytest.approx(1 / math.sqrt(d + 1))
    assert staleness_weight("polynomial", d, 2.0, 4) == pytest.approx((d + 1) ** -2.0)
    hinge = 1.0 if d <= 4 else 1.0 / (10 * (d - 4) + 1)
    assert staleness_weight("hinge", d, 10.0, 4) == pytest.approx(hinge)


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
def test_staleness_is_one_when_fresh_and_never_grows(kind):
    values = [staleness_weight(kind, d, 0.5, 2) for d in range(30)]
    assert values[0] == 1.0
    assert all(b <= a for a, b in itertools.pairwise(values))
    assert all(0 < v <= 1 for v in values)
    with pytest.raises(ValueError):
        staleness_weight(kind, -1, 0.5, 2)


def test_constant_speeds_take_one_unit_per_step():
    speeds = Speeds(SpeedsConfig(), seed=0, clients=list(range(5)))
    assert [speeds.duration(c, 3, 7) for c in range(5)] == [7.0] * 5


def test_stragglers_are_a_fixed_fraction_slowed_down():
    cfg = SpeedsConfig(kind="stragglers", fraction=0.5, slowdown=8.0)
    speeds = Speeds(cfg, seed=1, clients=list(range(20)))
    times = [speeds.step_time(c, 1) for c in range(20)]
    assert sorted(times) == [1.0] * 10 + [8.0] * 10
    assert times == [speeds.step_time(c, 99) for c in range(20)]  # a device stays slow
    other = Speeds(cfg, seed=2, clients=list(range(20)))
    assert other.stragglers != speeds.stragglers


def test_lognormal_medians_have_the_configured_spread_and_are_seeded():
    clients = list(range(3000))
    speeds = Speeds(SpeedsConfig(kind="lognormal", sigma=0.7), seed=0, clients=clients)
    logs = [math.log(speeds.median[c]) for c in clients]
    assert abs(statistics.fmean(logs)) < 0.05  # 4 standard errors of 0.7 / sqrt(3000)
    assert statistics.pstdev(logs) == pytest.approx(0.7, rel=0.05)
    again = Speeds(SpeedsConfig(kind="lognormal", sigma=0.7), seed=0, clients=clients[:10])
    assert [again.median[c] for c in range(10)] == [speeds.median[c] for c in range(10)]


def test_jitter_varies_per_job_around_the_client_median():
    cfg = SpeedsConfig(kind="per_client", values=[2.0, 5.0], jitter=0.3)
    speeds = Speeds(cfg, seed=0, clients=[0, 1])
    jobs = [speeds.step_time(0, key) for key in range(2000)]
    assert len(set(jobs)) == len(jobs)
    assert statistics.median(jobs) == pytest.approx(2.0, rel=0.05)
    assert speeds.step_time(1, 5) == speeds.step_time(1, 5)
    assert (
        Speeds(SpeedsConfig(kind="per_client", values=[2.0, 5.0]), 0, [0, 1]).step_time(1, 5) == 5.0
    )


def test_per_client_speeds_need_a_value_per_client():
    cfg = SpeedsConfig(kind="per_client", values=[1.0, 2.0])
    with pytest.raises(ConfigError, match="client 2"):
        Speeds(cfg, seed=0, clients=[0, 1, 2])


@pytest.mark.parametrize(
    ("asynchrony", "extra", "match"),
    [
        ({"kind": "fedasync"}, {"algorithm": {"name": "scaffold"}}, "Supported: .*fedavg"),
        ({"kind": "fedbuff"}, {"algorithm": {"name": "ditto"}}, "ditto"),
        ({"kind": "fedbuff"}, {"train": {"stragglers": 0.5}}, "train.stragglers: 0.5"),
        ({"kind": "fedbuff"}, {"aggregator": {"kind": "median"}}, "aggregator.kind: median"),
        ({"kind": "fedasync", "alpha": 1.5}, {}, "asynchrony.alpha"),
        ({"kind": "fedbuff", "buffer": 0}, {}, "asynchrony.buffer"),
        ({"speeds": {"kind": "per_client"}}, {}, "values"),
        ({"speeds": {"kind": "lognormal", "values": [1.0]}}, {}, "per_client"),
        ({"kind": "fedsync"}, {}, "asynchrony.kind"),
    ],
)
def test_config_errors_name_the_key(asynchrony, extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"asynchrony": asynchrony, **extra})
