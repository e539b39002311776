"""The SPEC: strict parsing, the grid's cells, validation of every cell before anything runs,
and a changed SPEC refused against an existing sweep directory."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.errors import ConfigError
from fedloom.sweep import load_spec, parse_spec
from fedloom.sweep.run import open_out
from fedloom.sweep.spec import NAME_LIMIT, first_difference
from tests.sweep.specs import BASE, write_spec


def invoke(spec, out):
    return CliRunner().invoke(app, ["sweep", str(spec), "--out", str(out), "--no-progress"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"gird": {"train.lr": [0.1]}}, "gird: unknown key"),
        ({"grid": {"train.lr": []}}, "grid.train.lr: List should have at least 1 item"),
        ({"grid": {"train..lr": [0.1]}}, "is not a dotted config key"),
        ({"grid": {"seed": [1, 2]}}, "'seed' is set by seeds:"),
        ({"grid": {"train.lr": [0.1, 0.1]}}, "repeat one"),
        ({"seeds": []}, "seeds: List should have at least 1 item"),
        ({"seeds": [0, 0]}, "repeat one"),
        ({"seeds": [-1]}, "seeds.0: Input should be greater than or equal to 0"),
        ({"seeds": ["1"]}, "seeds.0: Input should be a valid integer"),
        ({"seeds": [True]}, "seeds.0: Input should be a valid integer"),
    ],
)
def test_a_malformed_spec_is_exit_2_naming_the_key(tmp_path, spec, message):
    done = invoke(write_spec(tmp_path, **spec), tmp_path / "out")
    assert done.exit_code == 2, done.output
    assert message in done.output.replace("\n", " ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"train.lrr": [0.1]}, "cell train.lrr=0.1 (seed 0): train.lrr: unknown key"),
        ({"train.lr": [0.1, -1]}, "cell train.lr=-1 (seed 0): train.lr"),
        ({"model.name": ["logreg", "nosuch"]}, "cell model.name=nosuch (seed 0): model.name"),
    ],
)
def test_every_cell_is_validated_before_anything_runs(tmp_path, grid, message):
    """The bad cell is the second one: the first must not have run either."""
    done = invoke(write_spec(tmp_path, grid=grid), tmp_path / "out")
    assert done.exit_code == 2, done.output
    assert message in done.output.replace("\n", " ")
    assert not (tmp_path / "out").exists()


def test_a_base_key_the_cells_algorithm_lacks_is_exit_2_before_anything_runs(tmp_path):
    base = {**BASE, "algorithm": {"name": "fedprox", "mu": 0.5}}
    spec = write_spec(tmp_path, base=base, grid={"algorithm.name": ["fedprox", "fedavg"]})
    done = invoke(spec, tmp_path / "out")
    assert done.exit_code == 2, done.output
    message = (
        "cell algorithm.name=fedavg (seed 0): algorithm.mu: not a key of algorithm 'fedavg' "
        "(written in the sweep's base)"
    )
    assert message in done.output.replace("\n", " ")
    assert not (tmp_path / "out").exists()


def test_cells_are_the_grid_product_in_spec_order(tmp_path):
    base = {**BASE, "algorithm": {"name": "fedprox", "mu": 0.5}}
    grid = {"algorithm.name": ["fedprox", "ditto"], "train.lr": [0.1, 0.01, 1]}
    sweep = parse_spec({"base": base, "grid": grid, "seeds": [3, 1]}, "spec", tmp_path)
    cells = sweep.cells()
    assert [c.name for c in cells] == [
        "algorithm.name=fedprox,train.lr=0.1",
        "algorithm.name=fedprox,train.lr=0.01",
        "algorithm.name=fedprox,train.lr=1",
        "algorithm.name=ditto,train.lr=0.1",
        "algorithm.name=ditto,train.lr=0.01",
        "algorithm.name=ditto,train.lr=1",
    ]
    prox, ditto = sweep.config(cells[1], 3), sweep.config(cells[5], 1)
    assert prox["algorithm"] == {"name": "fedprox", "mu": 0.5} and prox["seed"] == 3
    assert prox["train"]["lr"] == 0.01
    # another algorithm keeps what base wrote, as --set algorithm.name=ditto does (Ditto's mu)
    assert ditto["algorithm"] == {"name": "ditto", "mu": 0.5} and ditto["train"]["lr"] == 1
    assert ditto["seed"] == 1 and base["algorithm"] == {"name": "fedprox", "mu": 0.5}
    sweep.validate()
    one = parse_spec({"base": BASE, "seeds": [0]}, "spec", tmp_path).cells()
    assert [(c.name, c.values) for c in one] == [("base", {})]


def test_cell_names_are_file_names_and_distinct(tmp_path):
    grid = {
        "data.partition": [{"kind": "dirichlet", "alpha": 0.1}, {"kind": "iid"}],
        "train.lr": [0.1 + i / 1000 for i in range(3)],
        "algorithm.name": ["fedavg_ft_with_a_long_name" * 3],
    }
    cells = parse_spec({"base": BASE, "grid": grid, "seeds": [0]}, "spec", tmp_path).cells()
    names = [c.name for c in cells]
    assert len(set(names)) == len(names) == 6
    assert all(len(n) <= NAME_LIMIT and "/" not in n and " " not in n for n in names)
    assert names[0].startswith("data.partition=_alpha_0.1,kind_dirichlet_,train.lr=0.1,")


def test_base_path_is_relative_to_the_spec(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text(yaml.safe_dump(BASE))
    spec = tmp_path / "sweeps" / "s.yaml"
    spec.write_text(yaml.safe_dump({"base": "../configs/tiny.yaml", "seeds": [0]}))
    assert load_spec(spec).base == BASE
    spec.write_text(yaml.safe_dump({"base": "missing.yaml", "seeds": [0]}))
    with pytest.raises(ConfigError, match="config file not found"):
        load_spec(spec)


def test_first_difference_names_key_old_and_new():
    old = {"base": {"train": {"lr": 0.1, "rounds": 2}}, "grid": {"a.b": [1]}, "seeds": [0]}
    assert first_difference(old, old) is None
    new = {**old, "base": {"train": {"lr": 0.1, "rounds": 3}}, "seeds": [0, 1]}
    assert first_difference(old, new) == ("base.train.rounds", 2, 3)
    assert first_difference(old, {**old, "grid": {"a.b": [1, 2]}}) == ("grid['a.b']", [1], [1, 2])
    assert first_difference(old, {**old, "grid": {}}) == ("grid['a.b']", [1], None)


def test_a_changed_spec_against_an_existing_dir_is_exit_2(tmp_path):
    out = tmp_path / "out"
    first = write_spec(tmp_path, grid={"train.lr": [0.1]})
    open_out(out, load_spec(first))  # as a sweep of it leaves the directory
    stored = (out / "sweep.yaml").read_text()
    changed = write_spec(tmp_path, grid={"train.lr": [0.1, 0.2]})
    done = invoke(changed, out)
    assert done.exit_code == 2, done.output
    text = done.output.replace("\n", " ")
    assert "grid['train.lr'] was [0.1] there, is [0.1, 0.2] now" in text
    write_spec(tmp_path, grid={"train.lr": [0.1]}, seeds=[0, 1])
    done = invoke(changed, out)
    assert done.exit_code == 2 and "seeds was [0] there, is [0, 1] now" in done.output
    assert (out / "sweep.yaml").read_text() == stored and not (out / "runs").exists()


def test_a_dir_holding_something_else_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = invoke(write_spec(tmp_path), out)
    assert done.exit_code == 2 and "holds no sweep.yaml" in done.output


def test_a_second_sweep_in_a_running_ones_dir_is_refused(tmp_path):
    import fcntl

    out, spec = tmp_path / "out", write_spec(tmp_path)
    open_out(out, load_spec(spec))
    with (out / ".lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running sweep holds it
        done = invoke(spec, out)
    assert done.exit_code == 2 and "another fedloom sweep is running there" in done.output
    assert not (out / "runs").exists()
