"""The ``model`` section's options: flat keys, checked against the model, recorded resolved."""

from __future__ import annotations

import pytest

from fedloom.config import apply_overrides, parse_config
from fedloom.errors import ConfigError


def test_options_are_resolved_into_the_recorded_config():
    cfg = parse_config({"model": {"name": "resnet18", "norm": "group"}})
    recorded = cfg.to_dict()["model"]
    assert recorded == {
        "name": "resnet18",
        "freeze": True,
        "norm": "group",
        "width": 64,
        "groups": 2,
    }
    assert parse_config({"model": recorded}).to_dict()["model"] == recorded  # config.yaml again
    batch = parse_config({"model": {"name": "resnet18"}}).to_dict()["model"]
    assert batch == {"name": "resnet18", "freeze": True, "norm": "batch", "width": 64}
    assert parse_config({"model": {"name": "cnn4"}}).to_dict()["model"] == {
        "name": "cnn4",
        "freeze": True,
    }


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"name": "mlp", "norm": "group"},
            r"model\.norm: unknown key for model mlp\. It is an option of resnet18",
        ),
        ({"name": "resnet18", "nrom": "group"}, r"model\.nrom: .*Did you mean 'model\.norm'"),
        (
            {"name": "resnet18", "norm": "layer"},
            r"model\.norm: input should be 'batch', 'group' or 'none'",
        ),
        ({"name": "resnet18", "width": 0}, r"model\.width: must be >= 1"),
        ({"name": "resnet18", "groups": 2}, r"model\.groups: applies only with norm: group"),
    ],
)
def test_wrong_options_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": section})


def test_set_of_another_model_keeps_what_the_file_wrote():
    """Switching the model keeps the written options: one the new model does not take is an
    error naming it (nothing the user wrote is dropped), one it takes carries over."""
    raw = {"model": {"name": "resnet18", "norm": "group"}}
    with pytest.raises(ConfigError, match=r"model\.norm: not a key of model 'cnn4'"):
        apply_overrides(raw, ["model.name=cnn4"])
    assert apply_overrides({"model": {"name": "resnet18", "width": 32}}, ["model.name=resnet18"])[
        "model"
    ] == {"name": "resnet18", "width": 32}
    assert apply_overrides(raw, ["model.norm=none"])["model"] == {
        "name": "resnet18",
        "norm": "none",
    }
