"""Contribution evaluation and payments in the engine (engine/contribution.py): from YAML
beside several algorithms, summary and metrics contents, resume with the queues intact, and
the config errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import fedloom
from fedloom.config import parse_config
from fedloom.errors import ConfigError
from tests.resume import killed_and_resumed

CONFIG = {
    "seed": 3,
    "data": {"name": "digits", "num_clients": 6, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 4, "clients_per_round": 4, "local_steps": 4, "batch_size": 16, "lr": 0.1},
    "eval": {"every": 2},
    "monitor": {"enabled": False},
    "executor": {"kind": "sequential"},
    "checkpoint": {"every": 1},
    "contribution": {"kind": "gtg", "validation_fraction": 0.15},
    "incentive": {"kind": "fli", "budget": 10.0, "sub_rounds": 4},
}


def with_(**sections) -> dict:
    config = copy.deepcopy(CONFIG)
    for key, value in sections.items():
        config[key] = value if not isinstance(value, dict) else {**config.get(key, {}), **value}
    return config


def test_resume_keeps_queues_and_values(tmp_path: Path):
    """Killed in round 4 and resumed from the round-3 checkpoint, which holds round 3's
    values and payments not yet in a metrics row (rows at rounds 2 and 4): every row, the
    payments, queues and contributions equal the uninterrupted run."""
    full, resumed, saved = killed_and_resumed(CONFIG, tmp_path, crash_round=4)
    assert saved["round"] == 3
    assert list(saved["mechanisms"]["incentives"]["pending"]["contribution"]) == ["3"]
    assert saved["mechanisms"]["incentives"]["book"]["ledgers"]["fli"]["regret"]
    assert resumed.summary["incentive"] == full.summary["incentive"]
    for key in ("per_client", "per_client_raw", "evaluations", "rounds_valued"):
        assert resumed.summary["contribution"][key] == full.summary["contribution"][key]


def test_summary_and_rows(tmp_path: Path):
    result = fedloom.run(CONFIG, out=tmp_path / "run", progress=False)
    incentive, contribution = result.summary["incentive"], result.summary["contribution"]
    budget, rounds = CONFIG["incentive"]["budget"], CONFIG["train"]["rounds"]
    assert set(incentive["schemes"]) == {"fli", "equal", "samples", "shapley", "cost"}
    for scheme in incentive["schemes"].values():  # every scheme paid B(t) each round
        assert scheme["total_payoff"] == pytest.approx(budget * rounds)
        assert sum(scheme["payoff"].values()) == pytest.approx(budget * rounds)
    payoff = {c: v["payoff"] for c, v in incentive["per_client"].items()}
    assert payoff == pytest.approx(incentive["schemes"]["fli"]["payoff"])
    assert set(contribution["per_client"]) == set(incentive["per_client"])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valued = [r for row in rows for r in row["contribution"]["rounds"]]
    paid = [r for row in rows for r in row["incentive"]["rounds"]]
    assert valued == paid == ["1", "2", "3", "4"]  # every round's values reach a row
    for row in rows:
        for entry in row["incentive"]["rounds"].values():
            assert set(entry["pay"]) == set(incentive["schemes"])
            for pay in entry["pay"].values():
                assert set(pay) == set(entry["cost"])
                assert sum(pay.values()) == pytest.approx(budget)
    assert rows[-1]["contribution"]["cumulative"] == contribution["per_client"]
    assert rows[-1]["seconds"]["contribution"] > 0
    assert "validation" in rows[-1]  # the split the game is measured on
    for entry in rows[0]["contribution"]["rounds"].values():
        if not entry.get("truncated"):  # GTG's rescaled values sum to the round's gain
            values = entry["values"].values()
            if all(v >= 0 for v in values):
                assert sum(values) == pytest.approx(entry["gain"])
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Cumulative payoff vs contribution" in report


@pytest.mark.parametrize(
    "algorithm", [{"name": "scaffold"}, {"name": "fedadam"}, {"name": "ditto", "lam": 0.1}]
)
def test_beside_other_algorithms(algorithm):
    config = with_(
        algorithm=algorithm,
        train={"rounds": 1},
        contribution={"kind": "exact"},
        incentive={"kind": "shapley"},
    )
    config["algorithm"] = algorithm
    result = fedloom.run(config, write=False, progress=False)
    contribution = result.summary["contribution"]
    assert contribution["evaluations"] == 2**4
    gain = result.history[-1]["contribution"]["rounds"]["1"]["gain"]
    assert sum(contribution["per_client"].values()) == pytest.approx(gain, abs=1e-9)


def test_incentives_without_contribution(tmp_path: Path):
    config = with_(
        train={"rounds": 2}, incentive={"kind": "cost", "cost": {"per_client": [1, 2, 3, 4, 5, 6]}}
    )
    del config["contribution"]
    result = fedloom.run(config, out=tmp_path / "run", progress=False)
    incentive = result.summary["incentive"]
    assert "contribution" not in result.summary
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Regret and waiting queues per client" in report
    assert "Cumulative contribution per client" not in report
    assert list(incentive["schemes"]) == ["cost", "equal", "samples"]
    for client, entry in incentive["per_client"].items():
        rounds = sum(
            client in r["cost"]
            for row in result.history
            for r in row["incentive"]["rounds"].values()
        )
        assert entry["cost"] == pytest.approx((int(client) + 1) * rounds)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"contribution": {"kind": "none"}}, "incentive.kind: fli pays by contribution"),
        ({"algorithm": {"name": "fedper"}}, "fedper has no global model"),
        ({"secure_aggregation": {"kind": "secagg"}}, "needs them in the clear"),
        (
            {
                "train": {"clients_per_round": None},
                "data": {"num_clients": 14},
                "contribution": {"kind": "exact"},
            },
            "more than 12: use gtg",
        ),
        ({"incentive": {"kind": "tips"}}, "incentive.kind"),
        ({"asynchrony": {"kind": "fedbuff"}}, "set asynchrony.kind: none"),
        ({"algorithm": {"name": "centralized"}}, "one pooled virtual client"),
    ],
)
def test_config_errors(sections, message):
    config = with_(**sections)
    if "algorithm" in sections:
        config["algorithm"] = sections["algorithm"]
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_per_client_costs_must_cover_every_client():
    config = with_(incentive={"kind": "cost", "cost": {"per_client": [1.0, 2.0]}})
    with pytest.raises(ConfigError, match="2 costs for 6 training clients"):
        fedloom.run(config, write=False, progress=False)


def test_robust_rule_sees_coalitions_without_counting_them():
    """Krum (f = 1) needs 5 uploads: every coalition of 4 keeps the model (v = v(empty)),
    so leave-one-out gives each client v(N) - v(empty); the rule's skipped rounds stay 0."""
    config = with_(
        train={"rounds": 1, "clients_per_round": 5},
        aggregator={"kind": "krum", "f": 1},
        contribution={"kind": "loo"},
        incentive={"kind": "equal"},
    )
    result = fedloom.run(config, write=False, progress=False)
    assert result.summary["aggregator"]["rounds_skipped"] == 0
    entry = result.history[-1]["contribution"]["rounds"]["1"]
    assert entry["values"] == {c: pytest.approx(entry["gain"]) for c in entry["values"]}


def test_valued_every_other_round_pays_by_latest_values():
    config = with_(contribution={"kind": "loo", "every": 2}, eval={"every": 4})
    result = fedloom.run(config, write=False, progress=False)
    (row,) = result.history
    assert list(row["contribution"]["rounds"]) == ["2", "4"]
    assert list(row["incentive"]["rounds"]) == ["1", "2", "3", "4"]
    assert result.summary["contribution"]["rounds_valued"] == 2
    first = row["incentive"]["rounds"]["1"]["pay"]["shapley"]
    assert set(first.values()) == {0.0}  # nobody valued yet: Shapley-proportional pays nothing
    assert sum(row["incentive"]["rounds"]["3"]["pay"]["shapley"].values()) > 0
