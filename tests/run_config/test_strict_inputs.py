"""Strict config values (docs/inputs.md, "Strict values"): a bool is not a number, a number or
a string is not a bool, a quoted string is not a number; a key written twice, an empty file and
a huge value are exit 2 with one short line naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fedloom.config import EMPTY_CONFIG, apply_overrides, load_yaml, parse_config
from fedloom.core.yaml_text import DuplicateKeyError, dump_yaml_text, load_yaml_text
from fedloom.data.config import validate
from fedloom.data.partition import PARTITIONS
from fedloom.errors import SHOWN_CHARS, ConfigError, clipped
from fedloom.sweep.spec import load_spec
from fedloom.tune.space import load_space, override_items
from tests.cli.invoke import QUADRATIC, fedloom, write_yaml


def with_(section: str, key: str, value: object) -> dict:
    raw = copy.deepcopy(QUADRATIC)
    raw.setdefault(section, {})[key] = value
    return raw


@pytest.mark.parametrize(
    ("section", "key", "value", "words"),
    [
        ("train", "rounds", True, "valid integer"),
        ("train", "rounds", "3", "valid integer"),
        ("train", "rounds", 2.0, "valid integer"),
        ("train", "lr", "0.05", "valid number"),
        ("train", "lr", True, "valid number"),
        ("data", "num_clients", True, "valid integer"),
        ("serving", "keep_best", 1, "valid boolean"),
        ("serving", "keep_best", "yes", "valid boolean"),
        ("eval", "every", "1", "valid integer"),
    ],
)
def test_a_value_of_another_type_is_refused_naming_the_key(section, key, value, words):
    with pytest.raises(ConfigError) as err:
        parse_config(with_(section, key, value))
    message = str(err.value)
    assert message.startswith(f"{section}.{key}")
    assert words in message


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (("algorithm",), {"name": "fedprox", "mu": True}, "algorithm.mu"),
        (("train", "optimizer"), {"kind": "adamw", "betas": [True, 0.9]}, "betas"),
    ],
)
def test_nested_sections_and_algorithm_configs_are_strict_too(path, value, words):
    raw = copy.deepcopy(QUADRATIC)
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=words):
        parse_config(raw)


@pytest.mark.parametrize(
    ("kind", "value", "words"),
    [
        ("dirichlet", {"alpha": "0.3"}, "data.partition.alpha: input should be a valid number"),
        ("dirichlet", {"alpha": True}, "data.partition.alpha: input should be a valid number"),
        ("shards", {"shards_per_client": 2.0}, "data.partition.shards_per_client"),
    ],
)
def test_partitions_are_strict(kind, value, words):
    with pytest.raises(ConfigError, match=words):
        validate(PARTITIONS.get(kind), {"kind": kind, **value}, "data.partition")
    assert validate(PARTITIONS.get("dirichlet"), {"alpha": 1}, "data.partition").alpha == 1.0


def test_ints_for_floats_and_lists_for_tuples_still_load():
    raw = with_("train", "lr", 1)
    raw["algorithm"] = {"name": "fedprox", "mu": 1}
    raw["train"]["optimizer"] = {"kind": "adamw", "betas": [0, 0.5], "eps": 1}
    config = parse_config(raw)
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.algorithm.mu == 1.0 and isinstance(config.algorithm.mu, float)
    assert config.train.optimizer.betas == (0.0, 0.5)
    assert isinstance(config.train.optimizer.eps, float)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-3", 0.001), ("2E5", 200000.0), ("1.5e+2", 150.0), ("1.0e-8", 1e-8), ("10", 10)],
)
def test_exponent_notation_is_a_float_and_a_quoted_one_a_string(text, value):
    parsed = load_yaml_text(text)
    assert parsed == value and type(parsed) is type(value)
    assert load_yaml_text(f'"{text}"') == text
    config = parse_config(apply_overrides(QUADRATIC, [f"train.lr={text}"]))
    assert config.train.lr == value


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("train.rounds=true", "train.rounds", "valid integer (got True)"),
        ('train.lr="0.05"', "train.lr", "valid number (got '0.05')"),
        ("data.num_clients=true", "data.num_clients", "valid integer (got True)"),
        ("eval.every=yes", "eval.every", "valid integer (got True)"),
        ("data.quadratic.dim=true", "data.quadratic.dim", "valid integer, got True"),
        ("data.quadratic.noise='0.1'", "data.quadratic.noise", "valid number, got '0.1'"),
    ],
)
def test_cli_set_of_the_wrong_type_is_exit_2_naming_the_key(tmp_path, override, key, words):
    config = write_yaml(tmp_path / "q.yaml", QUADRATIC)
    out = fedloom(["run", str(config), "--set", override, "--out", str(tmp_path / "run")])
    assert out.is_clear_input_error(), out.stderr
    assert key in out.stderr and words in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


DUPLICATES = [
    ("seed: 0\ntrain:\n  rounds: 2\n  lr: 0.1\n  rounds: 3\n", "train.rounds", 3, 5),
    ("seed: 0\nseed: 1\n", "seed", 1, 2),
    ("data:\n  partition: {kind: dirichlet, kind: iid}\n", "data.partition.kind", 2, 2),
    ("grid:\n  - {a: 1}\n  - a: 1\n    b: 2\n    a: 3\n", "grid.a", 3, 5),
    ("1: x\n1.0: y\n", "1.0", 1, 2),
]


@pytest.mark.parametrize(("text", "key", "first", "second"), DUPLICATES)
def test_a_duplicate_key_names_its_path_and_both_lines(text, key, first, second):
    with pytest.raises(DuplicateKeyError) as err:
        load_yaml_text(text)
    assert f"duplicate key '{key}' (lines {first} and {second})" in str(err.value)


def test_keys_merged_from_an_anchor_may_be_overridden():
    text = "base: &b {lr: 0.1, rounds: 2}\ntrain:\n  <<: *b\n  lr: 0.2\n"
    assert load_yaml_text(text)["train"] == {"lr": 0.2, "rounds": 2}
    assert load_yaml_text("a: &x [1, *x]\n") is not None  # a cycle is left to check_plain_tree


@pytest.mark.parametrize(
    ("name", "load"),
    [("config.yaml", load_yaml), ("spec.yaml", load_spec), ("space.yaml", load_space)],
)
def test_duplicates_in_configs_sweeps_and_spaces_are_config_errors(tmp_path, name, load):
    path = tmp_path / name
    path.write_text("base: {}\ngrid:\n  train.lr: [0.1]\n  train.lr: [0.2]\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'grid\.train\.lr' \(lines 3 and 4\)"):
        load(path)


def test_cli_duplicate_key_is_exit_2(tmp_path):
    text = yaml.safe_dump(QUADRATIC, sort_keys=False).replace("seed: 0\n", "seed: 0\nseed: 1\n")
    config = tmp_path / "dup.yaml"
    config.write_text(text)
    out = fedloom(["run", str(config), "--out", str(tmp_path / "run")])
    assert out.is_clear_input_error(), out.stderr
    assert "duplicate key 'seed' (lines 1 and 2)" in out.stderr


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "null\n", "---\n", "~\n"])
def test_an_empty_config_file_is_exit_2(tmp_path, text):
    config = tmp_path / "empty.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=f"^{config}: {EMPTY_CONFIG}$"):
        load_yaml(config)
    out = fedloom(["run", str(config), "--out", str(tmp_path / "run")])
    assert out.is_clear_input_error(), out.stderr
    assert "empty config: give a file with keys, or no file for the default experiment" in (
        out.stderr
    )


@pytest.mark.parametrize(
    ("name", "load", "words"),
    [("spec.yaml", load_spec, "empty sweep spec"), ("space.yaml", load_space, "empty search")],
)
def test_empty_sweep_specs_and_spaces_say_what_they_need(tmp_path, name, load, words):
    path = tmp_path / name
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=words):
        load(path)


def test_clipped_cuts_to_the_limit_with_dots():
    assert clipped("x" * 10) == "x" * 10
    assert clipped("x" * SHOWN_CHARS) == "x" * SHOWN_CHARS
    cut = clipped("x" * (SHOWN_CHARS + 1))
    assert len(cut) == SHOWN_CHARS and cut.endswith("...")


HUGE = 100_000


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("train.lr=" + "x" * HUGE, "train.lr: Input should be a valid number (got 'xxx"),
        ("train.rounds=" + "9" * HUGE, "an integer of 100000 digits is too large"),
        ("seed=" + "9" * 4000, "seed: 999"),
        ("train.lr=[" + "1, " * 10_000 + "1]", "train.lr"),
        ("train.rounds={a: " + "y" * HUGE + ", a: 1}", "duplicate key 'a'"),
        ("no_equals_" + "z" * HUGE, "expected key.path=value"),
    ],
)
def test_error_lines_cut_long_values(tmp_path, override, words):
    config = write_yaml(tmp_path / "q.yaml", QUADRATIC)
    out = fedloom(["run", str(config), "--set", override, "--out", str(tmp_path / "run")])
    assert out.is_clear_input_error(), out.stderr[:500]
    assert words in out.stderr
    assert len(out.stderr) < 700, out.stderr[:700]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (with_("train", "rounds", 10**5000), "train.rounds: 16,610 bits is too large"),
        (with_("train", "rounds", 10**100), "train.rounds: 1000000000"),
        (with_("train", "k" * HUGE, 1), "train.kkkk"),
        (with_("eval", "adaptation_steps", [True] * 20_000), "eval.adaptation_steps.4: Input"),
        (with_("eval", "adaptation_steps", [True] * 20_000), "; and 19,995 more"),
    ],
)
def test_python_api_errors_cut_long_values_and_keys(raw, words):
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert words in str(err.value)
    assert len(str(err.value)) < 2000


def test_a_long_value_in_a_file_is_cut(tmp_path):
    config = write_yaml(tmp_path / "q.yaml", with_("train", "lr", "x" * HUGE))
    with pytest.raises(ConfigError) as err:
        parse_config(load_yaml(Path(config)))
    assert len(str(err.value)) < 200 and "..." in str(err.value)


@pytest.mark.parametrize("value", ["1e5", "2E-3", {"name": "1.5e+2", "lr": 1e-5}, ["1e1", 1e300]])
def test_what_fedloom_writes_reads_back_as_it_was(value):
    text = dump_yaml_text(value)
    assert load_yaml_text(text) == value
    assert override_items({"tracking.name": "1e5"}) == ["tracking.name='1e5'"]
    raw = apply_overrides(QUADRATIC, override_items({"train.lr": 2e-3}))
    assert raw["train"]["lr"] == 0.002
