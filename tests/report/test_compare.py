"""`fedloom compare`: the overlay page, its summary table, warnings and errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.errors import FedloomInputError, RunDirError
from fedloom.report import format as fmt
from fedloom.report.compare import (
    COMPARE_FILE,
    overlay_panels,
    round_seconds,
    run_labels,
    write_comparison,
)
from fedloom.report.rundir import load_run
from tests.report.fake_run import COLD_START, CONFIG, MakeRun

PLOTLY_MARKER = "* plotly.js v"
OVERLAYS = (
    "global_accuracy",
    "personalized_mean",
    "personalized_p10",
    "loss",
    "communication",
    "seconds",
)


def _ditto_config() -> dict[str, Any]:
    return {**CONFIG, "algorithm": {"name": "ditto", "lam": 0.1, "finetune_steps": 5}}


def _figures(html: str) -> dict[str, list[dict[str, Any]]]:
    """Each Plotly.newPlot call's div id and its list of traces."""
    decoder = json.JSONDecoder()
    out = {}
    for match in re.finditer(r'Plotly\.newPlot\(\s*"fig-([a-z_0-9]+)",\s*', html):
        traces, _ = decoder.raw_decode(html, match.end())
        out[match.group(1)] = traces
    return out


def _table(html: str) -> dict[str, dict[str, str]]:
    """The summary table as {run label: {column: cell text}}."""
    body = html[html.index("<tbody>") : html.index("</tbody>")]
    rows = {}
    for label, row in re.findall(r'<tr data-run(?:-hps)?="([^"]*)"[^>]*>(.*?)</tr>', body, re.S):
        cells = re.findall(r'data-col="([a-z_0-9]+)"[^>]*>(.*?)</td>', row, re.S)
        rows.setdefault(label, {}).update(
            {key: re.sub(r"<[^>]+>", " ", text).strip() for key, text in cells}
        )
    return rows


def _best(html: str, label: str) -> set[str]:
    row = re.search(rf'<tr data-run="{re.escape(label)}"[^>]*>(.*?)</tr>', html, re.S)
    assert row is not None
    return set(re.findall(r'class="num best" data-col="([a-z_0-9]+)"', row.group(1)))


@pytest.fixture
def two_runs(make_run: MakeRun) -> tuple[Path, Path]:
    fedavg = make_run("fedavg-run", n_rounds=10, new_clients=True)
    ditto = make_run("ditto-run", n_rounds=6, config=_ditto_config())
    return fedavg, ditto


def test_writes_one_offline_page_with_one_trace_per_run(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    out = write_comparison(two_runs, tmp_path / "cmp.html")
    assert out == tmp_path / "cmp.html"
    html = out.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and html.count("</html>") == 1
    assert html.count(PLOTLY_MARKER) == 1  # inlined once: works offline
    assert not re.search(r"<script[^>]*\ssrc\s*=", html, re.I)
    figures = _figures(html)
    assert list(figures) == [*OVERLAYS, "cold_start"]
    for key in OVERLAYS:
        assert [t["name"] for t in figures[key]] == ["fedavg-run", "ditto-run"], key
    assert [t["name"] for t in figures["cold_start"]] == ["fedavg-run"]  # ditto has no curve
    assert "Not reported by: ditto-run." in html
    assert not list(tmp_path.glob(".cmp.html.*")), "temporary file left behind"


def test_overlay_values_are_the_runs_series(two_runs: tuple[Path, Path]) -> None:
    runs = [load_run(p) for p in two_runs]
    panels = {p.key: p for p in overlay_panels(runs, ["a", "b"])}
    for trace, run in zip(panels["personalized_p10"].figure.data, runs, strict=True):
        assert list(trace.x) == run.round_numbers
        assert list(trace.y) == run.series("personalized", "accuracy_p10")
    comm = panels["communication"].figure.data[0]
    rows = runs[0].rounds
    expected = [r["communication"]["bytes_up"] + r["communication"]["bytes_down"] for r in rows]
    assert list(comm.y) == expected
    cold = panels["cold_start"].figure.data[0]
    assert list(cold.x) == COLD_START["steps"] and list(cold.y) == COLD_START["accuracy_mean"]


def test_summary_table_matches_summary_json(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    html = write_comparison(two_runs, tmp_path / "cmp.html").read_text(encoding="utf-8")
    table = _table(html)
    assert list(table) == ["fedavg-run", "ditto-run"]
    for run_dir in two_runs:
        summary = json.loads((run_dir / "summary.json").read_text())
        row = table[run_dir.name]
        assert row["algorithm"] == summary["algorithm"]
        assert row["global"] == fmt.percent(summary["final"]["global"]["accuracy"])
        pers = summary["final"]["personalized"]
        for q in ("mean", "p10", "p50", "p90", "min"):
            assert row[f"p_{q}"] == fmt.percent(pers[f"accuracy_{q}"]), q
        comm = summary["communication"]
        assert row["mb"] == f"{(comm['bytes_up'] + comm['bytes_down']) / 1e6:,.2f}"
        assert row["spr"] == f"{summary['seconds_per_round']:,.2f}"
        assert "finished" in row["rounds"]
    fedavg, ditto = table["fedavg-run"], table["ditto-run"]
    for step, acc in zip(COLD_START["steps"], COLD_START["accuracy_mean"], strict=True):
        assert fedavg[f"cold_{step}"] == fmt.percent(acc)
        assert ditto[f"cold_{step}"] == fmt.MISSING
    assert "lam=0.1" in ditto["hyperparameters"] and "lr=0.05" in ditto["hyperparameters"]
    assert "finetune_steps=5" in fedavg["hyperparameters"]
    # fedavg ran 10 evaluations, ditto 6: fedavg's accuracies are higher, and bold
    assert {"global", "p_mean", "p_p10"} <= _best(html, "fedavg-run")
    assert {"mb", "spr"} <= _best(html, "ditto-run")  # fewer rounds: fewer bytes


def test_run_in_progress_uses_its_latest_round(make_run: MakeRun, tmp_path: Path) -> None:
    done = make_run("done", n_rounds=10)
    running = make_run("running", n_rounds=3, summary=False)
    html = write_comparison([done, running], tmp_path / "c.html").read_text(encoding="utf-8")
    row = _table(html)["running"]
    last = load_run(running).rounds[-1]
    assert row["p_mean"] == fmt.percent(last["personalized"]["accuracy_mean"])
    assert "running" in row["rounds"] and "15 / 50" in row["rounds"]
    assert "running is still in progress (round 15 of 50)." in html
    assert 'id="data-mismatch"' not in html  # same data


def test_warns_when_runs_use_different_data(make_run: MakeRun, tmp_path: Path) -> None:
    other = {**CONFIG, "data": {**CONFIG["data"], "name": "fashion_mnist"}}
    other["data"]["partition"] = {"kind": "shards", "shards_per_client": 2}
    a, b = make_run("a"), make_run("b", config=other)
    html = write_comparison([a, b], tmp_path / "c.html").read_text(encoding="utf-8")
    warning = html[html.index('id="data-mismatch"') : html.index("</div>", html.index("data-mis"))]
    assert "not directly comparable" in warning
    assert "data.name differs (a: mnist; b: fashion_mnist)" in warning
    assert "data.partition differs (a: dirichlet (alpha=0.3); b: shards (shards_per_client=2))" in (
        warning
    )
    assert "num_clients" not in warning


def test_text_from_run_files_is_escaped(make_run: MakeRun, tmp_path: Path) -> None:
    evil = {**CONFIG, "algorithm": {"name": "<script>alert(1)</script>"}}
    html = write_comparison([make_run("x", config=evil)], tmp_path / "c.html").read_text()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_labels_are_unique() -> None:
    paths = [Path("a/run"), Path("b/run"), Path("c/other")]
    assert run_labels(paths) == ["a/run", "b/run", "other"]
    assert run_labels([Path("x/run"), Path("x/run")]) == ["x/run", "x/run #2"]


def test_round_seconds_prefers_the_engines_timing(make_run: MakeRun) -> None:
    # wall_seconds 6.15, 12.3, 18.45 at rounds 5, 10, 15 and no per-round timing
    run = load_run(make_run(n_rounds=3, monitor=False))
    assert round_seconds(run)[0] is None  # the first includes start-up: left out
    assert round_seconds(run)[1:] == pytest.approx([1.23, 1.23])
    run.rounds[1]["seconds"] = {"round": 0.5}
    assert round_seconds(run)[1] == 0.5
    timed = load_run(make_run("timed", n_rounds=3))
    assert round_seconds(timed) == [row["seconds"]["round"] for row in timed.rounds]


# --- errors -----------------------------------------------------------------


def test_missing_run_dir_is_a_clear_error(make_run: MakeRun, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(RunDirError, match="does not exist") as info:
        write_comparison([make_run("a"), missing], tmp_path / "c.html")
    assert str(missing) in str(info.value)
    assert not (tmp_path / "c.html").exists()


def test_not_a_run_and_repeats_and_nothing(make_run: MakeRun, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"config\.yaml"):
        write_comparison([tmp_path / "empty"], tmp_path / "c.html")
    a = make_run("a")
    with pytest.raises(FedloomInputError, match="given twice"):
        write_comparison([a, tmp_path / "." / "a"], tmp_path / "c.html")
    with pytest.raises(FedloomInputError, match="at least one"):
        write_comparison([], tmp_path / "c.html")


def test_cli_writes_compare_html_in_the_working_directory(
    two_runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = CliRunner().invoke(app, ["compare", *map(str, two_runs)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == COMPARE_FILE
    assert (work / COMPARE_FILE).read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    result = CliRunner().invoke(app, ["compare", *map(str, two_runs), "--out", "sub/x.html"])
    assert result.exit_code == 0 and (work / "sub" / "x.html").is_file()


def test_cli_errors_are_one_line(make_run: MakeRun, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["compare", str(make_run("a")), str(tmp_path / "nope"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "does not exist" in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / COMPARE_FILE).exists()
