"""Smoke test of the personalized workloads of benchmarks/round_time.py (W1-/W3-<algorithm>)
and of their references in benchmarks/reference_pfl.py, on tiny clients."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
ALGORITHMS = ("ditto", "pfedme", "apfl", "perfedavg", "fedrep")


@pytest.fixture(scope="module")
def round_time() -> Any:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import round_time

        yield round_time
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.mark.heavy(budget=60)  # measured 24 s on a loaded 2-core machine
def test_every_pfl_workload_runs_one_round(round_time: Any) -> None:
    """Every PFL workload's reference, sequential, vectorized and auto contenders run one timed
    round on 3 clients x 20 samples (one thread count); the entry has the PFL targets and no
    evaluation."""
    tiny = [
        replace(wl, clients=3, samples=20, test_samples=5, repeats=1, warmup_clients=2)
        for wl in round_time.PFL_WORKLOADS.values()
    ]
    results = round_time.run(tiny, peak_size=128, thread_counts=(1,))
    assert set(results) == {f"{s}-{a}" for s in ("W1", "W3") for a in ALGORITHMS}
    for name, entry in results.items():
        for key in ("reference_s", "sequential_s", "vectorized_s", "best_s"):
            assert entry[key] > 0, (name, key)
        assert entry["algorithm"]["name"] == name.split("-")[1]
        assert set(entry["targets"]) == {"reference/auto", "sequential/auto"}
        wanted = 8.0 if name.startswith("W3") else 2.0
        assert entry["targets"]["reference/auto"]["target"] == wanted
        assert entry["targets"]["sequential/auto"]["target"] == 0.95
        assert entry["ratio_sequential_over_best"] == pytest.approx(
            entry["sequential_s"] / entry["best_s"]
        )
        assert "evaluation" not in entry
        assert entry["sequential_vs_vectorized_max_abs_diff"] < 1e-3
        rows = entry["sanity"]["after_round_1"]
        assert any(k.startswith("reference") for k in rows)
        assert any(k.startswith("auto") for k in rows)
        if name.startswith("W1"):
            # 20 samples < batch 32: one full-batch step, so every contender computes the same
            # update whatever its batch order
            assert entry["sanity"]["ok"], (name, entry["sanity"])
        if name.endswith("fedrep"):  # no global model: the body is compared, no probe loss
            assert entry["sanity"]["initial_loss"] is None
            assert "fc3" not in entry["sanity"]["compared"]
            assert all(row["loss"] is None for row in rows.values())
        else:
            assert entry["sanity"]["initial_loss"] > 0
    assert "hidden units" in results["W3-fedrep"]["note"]
    table = round_time.format_table(results)
    assert "W3-fedrep" in table and "sequential/auto" in table
    json.loads(json.dumps(results))


def fedloom_personal(name: str, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The personal parameters in fedloom's client state of ``name``."""
    if name in ("ditto", "apfl"):
        return state["personal"]["params"]
    return state["params"]  # pfedme: theta_k; fedrep: the head


def reference_personal(obj: Any) -> dict[str, torch.Tensor]:
    """The personal parameters the reference keeps: a module (ditto, pfedme, apfl) or a head's
    state dict (fedrep)."""
    return dict(obj.named_parameters()) if isinstance(obj, torch.nn.Module) else obj


@pytest.mark.parametrize("name", ALGORITHMS)
def test_reference_computes_fedloom_rounds_on_full_batches(round_time: Any, name: str) -> None:
    """With one minibatch holding a client's whole data the batch order cannot matter, so two
    rounds of the reference must give fedloom's server model and personal models (the second
    round reads the first round's personal objects: they must persist by client id)."""
    wl = replace(
        round_time.PFL_WORKLOADS[f"W1-{name}"],
        clients=3,
        samples=16,
        batch_size=16,
        epochs=2,
        hidden=8,
        test_samples=4,
    )
    data = round_time.make_data(wl)
    engine = round_time.EngineContender(data, "sequential", 1)
    reference = round_time.ReferenceContender(data, engine.initial_state(), 1)
    for _ in range(2):
        engine.round()
        reference.round()
    got, want = reference.global_state(), engine.global_state()
    assert set(got) == set(want)
    moved = max(float((want[k] - engine.initial_state()[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the rounds trained something
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4)
    if name == "perfedavg":  # keeps no client state
        return
    for client in range(wl.clients):
        ours = fedloom_personal(name, engine.st.clients.get(client))
        theirs = reference_personal(reference.pfl.personal[client])
        assert set(theirs) <= set(ours)
        for k, v in theirs.items():
            torch.testing.assert_close(v.detach(), ours[k], atol=2e-5, rtol=1e-4)


def test_workload_selection(round_time: Any) -> None:
    pick = round_time.select_workloads
    assert [w.name for w in pick("w3-pfl")] == [f"W3-{a}" for a in ALGORITHMS]
    assert len(pick("pfl")) == 10
    assert [w.name for w in pick("W1,w3-DITTO,W1")] == ["W1", "W3-ditto"]
    fedrep = round_time.PFL_WORKLOADS["W3-fedrep"]
    assert (fedrep.model, fedrep.hidden, fedrep.clients, fedrep.samples) == ("mlp", 16, 1000, 60)
    assert round_time.PFL_WORKLOADS["W3-ditto"].model == "logreg"
    with pytest.raises(ValueError, match=r"unknown workload 'W4'.*allowed: W1, W2, W3"):
        pick("W4")
