"""Every config section of every run family derives from the one strict base
(core/settings.py's ``StrictModel``), and each family's rules between sections are rows of the
one ``Rule`` type (run_config/rules.py), checked by ``check_rules`` (docs/architecture.md,
"Config")."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from fedloom.config import RULES, RunConfig
from fedloom.core.settings import StrictModel
from fedloom.rl.config import RL_ALGORITHM_CONFIGS, RL_RULES, RLRunConfig
from fedloom.run_config.rules import Rule
from fedloom.vertical.config import ALGORITHM_CONFIGS, VERTICAL_RULES, VerticalRunConfig


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (through unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in models_in(arg)]


def sections(top: type[BaseModel]) -> set[type[BaseModel]]:
    """``top`` and every model nested in its fields."""
    seen: set[type[BaseModel]] = set()
    todo = [top]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            todo.extend(models_in(field.annotation))
    return seen


@pytest.mark.parametrize(
    "models",
    [
        sections(RunConfig),
        sections(RLRunConfig) | set(RL_ALGORITHM_CONFIGS.values()),
        sections(VerticalRunConfig) | set(ALGORITHM_CONFIGS.values()),
    ],
    ids=["horizontal", "rl", "vertical"],
)
def test_every_section_derives_from_strict_model(models):
    loose = sorted(m.__name__ for m in models if not issubclass(m, StrictModel))
    assert not loose


@pytest.mark.parametrize("table", [RULES, RL_RULES, VERTICAL_RULES], ids=["h", "rl", "vertical"])
def test_every_family_declares_its_rules_as_rows_of_one_type(table):
    assert table and all(isinstance(rule, Rule) for rule in table)
