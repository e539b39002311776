"""Serving (docs/serving.md): the EMA and best copies against their definitions, resume,
export round-trip, and the confidence router."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import fedloom
from fedloom.core.functional import FunctionalModel
from fedloom.engine.callbacks import Callback
from fedloom.engine.serving import SERVING_DIR, ema_debiased, ema_update
from fedloom.errors import ConfigError, RunDirError
from fedloom.models import build_model
from fedloom.serving import export_run, load_exported, route
from tests.resume import killed_and_resumed


def config(**serving: Any) -> dict[str, Any]:
    """Ditto (personal models and a global one) on digits, Dirichlet(0.1), 5 clients."""
    return {
        "seed": 0,
        "data": {
            "name": "digits",
            "num_clients": 5,
            "partition": {"kind": "dirichlet", "alpha": 0.1},
        },
        "model": {"name": "logreg"},
        "algorithm": {"name": "ditto", "mu": 0.1},
        "train": {"rounds": 6, "local_steps": 5, "lr": 0.1, "batch_size": 16},
        "eval": {"every": 2, "validation_fraction": 0.2},
        "checkpoint": {"every": 2},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
        "serving": {"keep_best": True, "ema": 0.8, "route": "confidence", **serving},
    }


class GlobalEachRound(Callback):
    """The global model after every round."""

    def __init__(self) -> None:
        self.models: dict[int, dict[str, torch.Tensor]] = {}

    def on_round_end(self, engine, state, report) -> None:
        params, buffers = engine.algorithm.global_model(state.server)
        self.models[report.round] = {k: v.clone() for k, v in {**params, **buffers}.items()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[fedloom.RunResult, GlobalEachRound, Path]:
    out = tmp_path_factory.mktemp("serving") / "run"
    spy = GlobalEachRound()
    result = fedloom.run(config(), out=out, progress=False, callbacks=[spy])
    return result, spy, out


def test_ema_is_the_debiased_weighted_mean_of_the_rounds():
    decay, models = 0.7, [{"w": torch.randn(3), "n": torch.tensor(i)} for i in range(1, 6)]
    ema = None
    for m in models:
        ema = ema_update(ema, m, decay)
    served = ema_debiased(ema, decay, len(models))
    weights = [decay ** (len(models) - s) for s in range(1, len(models) + 1)]
    expected = sum(w * m["w"] for w, m in zip(weights, models, strict=True)) / sum(weights)
    torch.testing.assert_close(served["w"], expected, rtol=1e-6, atol=1e-6)
    assert served["n"].item() == 5  # integer buffers: the latest value


def test_run_keeps_ema_and_the_best_validation_round(finished):
    result, spy, out = finished
    serving = result.summary["serving"]
    kept = {k: v for k, v in load_file(str(out / SERVING_DIR / "ema.safetensors")).items()}
    ema = None
    for r in sorted(spy.models):
        ema = ema_update(ema, spy.models[r], 0.8)
    expected = ema_debiased(ema, 0.8, len(spy.models))
    for key, value in expected.items():
        torch.testing.assert_close(kept[key], value, rtol=1e-6, atol=1e-6)
    # best: the evaluated round with the highest validation accuracy (first on ties)
    rows = {row["round"]: row["validation"]["global"]["accuracy"] for row in result.history}
    best_round = max(rows, key=lambda r: (rows[r], -r))
    assert serving["best"]["round"] == best_round
    assert serving["best"]["validation"] == rows[best_round]
    best = load_file(str(out / SERVING_DIR / "best.safetensors"))
    for key, value in spy.models[best_round].items():
        assert torch.equal(best[key], value), key
    assert set(serving["clients_best"]["rounds"]) == {str(c) for c in range(5)}


def test_export_round_trip_gives_the_same_predictions(finished, tmp_path):
    result, spy, out = finished
    card_path = export_run(out, tmp_path / "export")
    card = json.loads(card_path.read_text())
    assert set(card["copies"]) == {"global", "ema", "best", "clients", "clients_best"}
    assert card["input_shape"] == [1, 8, 8] and card["classes"] == list(range(10))
    assert card["copies"]["global"]["test"] == result.summary["final"]["global"]
    x = torch.cat([c.x_test for c in fedloom.data.load_dataset(
        fedloom.config.parse_config(config()).data, 0).clients])  # fmt: skip
    functional = FunctionalModel(build_model("logreg", (1, 8, 8), 10), "classification")

    def predictions(tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional.forward(tree, {}, x)

    with torch.no_grad():
        loaded = load_exported(tmp_path / "export", "global")
        assert torch.equal(loaded(x), predictions(result.global_params))
        for cid, params in result.client_params.items():
            personal = load_exported(tmp_path / "export", "clients", client=cid)
            assert torch.equal(personal(x), predictions(params)), cid
        best = load_exported(tmp_path / "export", "best")
        assert torch.equal(
            best(x).argmax(-1),
            predictions(spy.models[result.summary["serving"]["best"]["round"]]).argmax(-1),
        )
    with pytest.raises(RunDirError, match="per client"):
        load_exported(tmp_path / "export", "clients")
    with pytest.raises(RunDirError, match="not empty"):
        export_run(out, tmp_path / "export")


def test_router_rule():
    personal = torch.log(torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.6, 0.4], [0.5, 0.5]]))
    global_ = torch.log(torch.tensor([[0.1, 0.9], [0.1, 0.9], [0.55, 0.45], [0.5, 0.5]]))
    routed = route(personal, global_, 0.8)
    # confident personal; unsure personal, surer global; unsure but surer than global; tie
    assert routed.personal.tolist() == [True, False, True, True]
    assert routed.prediction.tolist() == [0, 1, 0, 0]
    assert route(personal, global_, 0.0).personal.all()
    more_confident = route(personal, global_, 1.0)
    assert more_confident.personal.tolist() == [True, False, True, True]


def test_router_is_never_worse_than_the_worse_model(finished):
    routing = finished[0].summary["serving"]["routing"]
    for cid, row in routing["clients"].items():
        assert row["routed"] >= min(row["personal"], row["global"]), cid
    for key in ("accuracy_mean", "accuracy_pooled"):
        worse = min(routing["personal"][key], routing["global"][key])
        assert routing["routed"][key] >= worse
    assert 0.0 <= routing["personal_share"] <= 1.0
    report = (finished[2] / "report.html").read_text()
    assert "Routed accuracy" in report and "Best global" in report


def test_ema_and_best_survive_resume(tmp_path):
    cfg = config(route="none")
    full, resumed, _ = killed_and_resumed(cfg, tmp_path, crash_round=5)
    assert resumed.summary["serving"] == full.summary["serving"]
    for name in ("ema", "best", "clients_best"):
        a = load_file(str(tmp_path / "full" / SERVING_DIR / f"{name}.safetensors"))
        b = load_file(str(tmp_path / "killed" / SERVING_DIR / f"{name}.safetensors"))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def test_serving_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="validation_fraction"):
        fedloom.run({**config(), "eval": {"every": 2}}, write=False)
    quadratic = {
        "data": {"name": "quadratic", "num_clients": 3},
        "model": {"name": "logreg"},
        "train": {"rounds": 1, "local_steps": 1},
        "serving": {"route": "confidence"},
    }
    with pytest.raises(ConfigError, match="classification only"):
        fedloom.run(quadratic, write=False, progress=False)
    plain = fedloom.run({**quadratic, "serving": {}}, out=tmp_path / "plain", progress=False)
    assert "serving" not in plain.summary
    with pytest.raises(RunDirError, match="serving section"):
        export_run(tmp_path / "plain")


def test_cli_export_and_its_exit_status(finished, tmp_path):
    from typer.testing import CliRunner

    from fedloom.cli import app

    runner = CliRunner()
    done = runner.invoke(app, ["export", str(finished[2]), "--out", str(tmp_path / "e")])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "e" / "card.json").is_file() and "card.json" in done.stdout
    bad = runner.invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "f")])
    assert bad.exit_code == 2 and "not a fedloom run directory" in bad.output
