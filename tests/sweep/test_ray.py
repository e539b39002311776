"""``fedloom sweep --ray``: one Ray task per run on a real local Ray cluster (two nodes of one
CPU, tests/engine/ray_cluster.py), each run's numbers those of the same run in this process."""

from __future__ import annotations

import csv

import pytest

import fedloom
from fedloom.errors import ConfigError
from fedloom.sweep import load_spec, sweep
from tests.engine.ray_cluster import free_port, ray_cluster
from tests.sweep.specs import write_spec

pytestmark = pytest.mark.ray  # run apart from the parallel tests (scripts/test.sh)

pytest.importorskip("ray")


@pytest.mark.heavy(budget=240)
def test_one_ray_task_per_run(tmp_path):
    spec = write_spec(tmp_path, grid={"algorithm.name": ["fedavg", "ditto"]})
    out = tmp_path / "out"
    with ray_cluster(nodes=2, cpus_per_node=1) as address:
        result = sweep(spec, out, ray=address, progress=False, compare=False)
    assert result.ran == 2 and not result.failed
    with (out / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    parsed = load_spec(spec)
    for row, cell in zip(rows, parsed.cells(), strict=True):
        alone = fedloom.run(parsed.config(cell, 0), write=False, progress=False).summary
        pers = alone["final"]["personalized"]
        assert float(row["final_personalized_mean_fraction"]) == pers["accuracy_mean"]
        assert float(row["final_global_accuracy_fraction"]) == alone["final"]["global"]["accuracy"]


def test_an_unreachable_cluster_is_exit_2_naming_the_option(tmp_path):
    spec = write_spec(tmp_path)
    with pytest.raises(ConfigError, match="--ray: cannot connect to the Ray cluster"):
        sweep(spec, tmp_path / "out", ray=f"127.0.0.1:{free_port()}", progress=False)
