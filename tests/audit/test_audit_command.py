"""``fedloom audit RUN_DIR`` end to end on a run directory of a registered dataset (rebuilt from
config.yaml and the seed), and the Python API ``fedloom.audit``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fedloom
from fedloom.cli import app
from fedloom.errors import ConfigError, RunDirError

TINY = {
    "seed": 0,
    "data": {"name": "fashion_mnist", "num_clients": 4, "partition": {"kind": "iid"}},
    "model": {"name": "mlp"},
    "algorithm": {"name": "ditto", "mu": 0.1},
    "train": {"rounds": 2, "local_steps": 5, "batch_size": 32, "lr": 0.05},
    "eval": {"every": 2},
    "checkpoint": {"every": 2},
    "monitor": {"enabled": False},
    "executor": {"kind": "sequential"},
}


@pytest.fixture(scope="module")
def run_dir(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit-cli") / "run"
    fedloom.run(TINY, out=out, progress=False)
    return out


def test_audit_command_writes_json_and_page(run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["audit", str(run_dir), "--members", "100"])
    assert result.exit_code == 0, result.output
    assert "global model AUC" in result.output and "deployed models AUC mean" in result.output
    doc = json.loads((run_dir / "audit.json").read_text())
    loss = doc["attacks"]["loss"]
    assert doc["run"]["algorithm"] == "ditto" and doc["run"]["round"] == 2
    assert "official test split" in doc["reserve"]["source"]
    assert set(loss["clients"]) == {"0", "1", "2", "3"}
    for target in [loss["global"], *loss["clients"].values()]:
        assert 0.0 <= target["auc"] <= 1.0 and target["members"] == target["nonmembers"] == 100
        assert target["roc"]["fpr"][0] == 0.0 and target["roc"]["tpr"][-1] == 1.0
    assert loss["client_mean"]["auc"] == pytest.approx(
        sum(r["auc"] for r in loss["clients"].values()) / 4
    )
    page = (run_dir / "audit.html").read_text()
    assert "ROC curves" in page and "AUC per client" in page and "Plotly" in page
    assert '<script src="http' not in page  # offline: plotly inlined

    # a second attack is added beside the first; the page goes where --out says
    other = tmp_path / "pages" / "dlg.html"
    result = runner.invoke(
        app, ["audit", str(run_dir), "--attack", "dlg", "--client", "1", "--out", str(other)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((run_dir / "audit.json").read_text())
    assert set(doc["attacks"]) == {"loss", "dlg"}
    dlg = doc["attacks"]["dlg"]
    assert dlg["client"] == 1 and dlg["idlg_label"] == dlg["true_label"]
    analytic = next(r for r in dlg["reconstructions"] if r["method"] == "analytic")
    assert analytic["psnr"] is None or analytic["psnr"] >= 100.0  # the 2NN's first layer
    page = other.read_text()
    assert "Gradient inversion" in page and "data:image/png;base64," in page
    assert "ROC curves" in page  # the earlier loss attack is on the page too


def test_audit_command_errors(run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["audit", str(run_dir), "--attack", "shadwo"])
    assert result.exit_code == 2 and "Did you mean 'shadow'" in result.output
    result = runner.invoke(app, ["audit", str(tmp_path)])
    assert result.exit_code == 2 and "not a fedloom run directory" in result.output
    result = runner.invoke(app, ["audit", str(run_dir), "--attack", "dlg", "--client", "9"])
    assert result.exit_code == 2 and "not a training client" in result.output


def test_audit_api_shadow_attack_and_guards(run_dir: Path, tmp_path: Path) -> None:
    import fedloom.audit.inversion as inversion  # the package and the function share a name

    assert callable(fedloom.audit) and callable(inversion.gradient_inversion)
    doc = fedloom.audit(run_dir, attack="shadow", members=100, num_shadows=2, shadow_epochs=2)
    shadow = doc["attacks"]["shadow"]
    assert shadow["shadow"]["num_shadows"] == 2 and shadow["shadow"]["epochs"] == 2
    assert 0.0 <= shadow["global"]["auc"] <= 1.0
    assert "shadow" in doc["attacks"]

    no_checkpoint = tmp_path / "no-ckpt"
    fedloom.run({**TINY, "checkpoint": {"every": None}}, out=no_checkpoint, progress=False)
    with pytest.raises(RunDirError, match="no checkpoint"):
        fedloom.audit(no_checkpoint)

    other = {**TINY, "data": {**TINY["data"], "num_clients": 5}}
    wrong = tmp_path / "wrong-data"
    fedloom.run(other, out=wrong, progress=False)
    data = fedloom.data.load_dataset(
        fedloom.RunConfig.model_validate({"data": TINY["data"]}).data, 0
    )
    with pytest.raises(ConfigError, match="does not match the run"):
        fedloom.audit(wrong, data=data)
