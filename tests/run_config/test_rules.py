"""The cross-section rules of a run config (fedloom/config.py, ``RULES``; run_config/rules.py):
declared once, checked in one place, once per parse, each naming what clashes; a section's
own keys are checked by the section."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedloom import config as config_module
from fedloom.config import RULES, RunConfig, parse_config
from fedloom.errors import ConfigError
from fedloom.run_config.rules import Rule, check_rules, equals, used

BASE = {
    "data": {"name": "digits", "num_clients": 10},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 2, "clients_per_round": 5},
}


def parsed(**sections: dict) -> RunConfig:
    return parse_config({**BASE, **sections})


def test_a_rule_requires_and_excludes_and_names_the_clash():
    rule = Rule(
        when=used("asynchrony.kind"),
        excludes=(used("privacy.kind"), used("train.dropout", 0.0)),
        message="asynchrony.kind: {asynchrony.kind} does not combine with {clash}",
    )
    ok = parsed()
    assert rule.violation(ok) is None
    bad = RunConfig.model_construct(
        **{
            **dict(ok),
            "asynchrony": ok.asynchrony.model_copy(update={"kind": "fedbuff"}),
            "train": ok.train.model_copy(update={"dropout": 0.2}),
        }
    )
    assert (
        rule.violation(bad) == "asynchrony.kind: fedbuff does not combine with train.dropout: 0.2"
    )
    needs = Rule(
        when=equals("algorithm.name", "fedavg"), requires=used("privacy.kind"), message="m"
    )
    with pytest.raises(ConfigError, match=r"^m$"):
        check_rules(ok, [needs])


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        (
            {"asynchrony": {"kind": "fedbuff"}, "aggregator": {"kind": "median"}},
            "aggregator.kind: median",
        ),
        (
            {"compression": {"kind": "topk"}, "secure_aggregation": {"kind": "secagg"}},
            "secure_aggregation.kind: secagg",
        ),
        (
            {
                "aggregator": {"kind": "median"},
                "privacy": {"kind": "client_dp", "noise_multiplier": 1.0, "sampling": "fixed"},
            },
            "client_dp",
        ),
        (
            {"contribution": {"kind": "exact"}, "secure_aggregation": {"kind": "secagg"}},
            "secure_aggregation",
        ),
        ({"algorithm": {"name": "local"}, "contribution": {"kind": "loo"}}, "global model"),
    ],
)
def test_clashes_across_sections_are_refused_naming_both(sections, words):
    with pytest.raises(ConfigError, match=words):
        parsed(**sections)


def test_rules_are_checked_by_one_validator_of_run_config():
    """RunConfig has one model validator and it hands the table to check_rules; no other
    validator of the top module reads two sections."""
    tree = ast.parse(Path(config_module.__file__).read_text())
    run_config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    validators = [
        f
        for f in run_config.body
        if isinstance(f, ast.FunctionDef)
        and any("model_validator" in ast.unparse(d) for d in f.decorator_list)
    ]
    assert len(validators) == 1
    assert "check_rules" in ast.unparse(validators[0])
    assert len(RULES) >= 15
    assert all(isinstance(rule, Rule) for rule in RULES)
