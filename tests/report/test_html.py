"""The offline HTML run report: content, self-containment, graceful degradation, errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fedloom.errors import RunDirError
from fedloom.report import format as fmt
from fedloom.report import write_report
from tests.report.fake_run import BYTES_PER_ROUND, CONFIG, MakeRun, make_rows, make_run_dir

PLOTLY_MARKER = "* plotly.js v"  # the licence header that opens the bundled library
FIGURE_IDS = (
    "fig-accuracy",
    "fig-loss",
    "fig-update_norms",
    "fig-cosine",
    "fig-clients",
    "fig-heterogeneity",
    "fig-client_heterogeneity",
    "fig-labels",
    "fig-communication",
    "fig-resources",
)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _figure_ids(html: str) -> list[str]:
    return re.findall(r'<div id="(fig-[a-z_]+)" class="plotly-graph-div"', html)


def _assert_offline(html: str) -> None:
    assert not re.search(r"<script[^>]*\ssrc\s*=", html, re.I), "external script"
    assert not re.search(r"<link[^>]*href\s*=\s*[\"']?(https?:)?//", html, re.I), "external css"
    assert not re.search(r"@import|url\(\s*[\"']?(https?:)?//", _css(html), re.I)


def _without_scripts(html: str) -> str:
    """The page minus its <script> contents (the plotly bundle contains every word)."""
    return re.sub(r"<script\b.*?</script>", "", html, flags=re.S)


def _css(html: str) -> str:
    return html[html.index("<style>") : html.index("</style>")]


# --- the full report --------------------------------------------------------


def test_writes_one_self_contained_html_page(run_dir: Path) -> None:
    path = write_report(run_dir)
    assert path == run_dir / "report.html"
    html = _read(path)
    assert html.startswith("<!DOCTYPE html>")
    for tag in ("<html", "</html>", "<head>", "<body>", "</body>"):
        assert html.count(tag) == 1, tag
    assert html.count(PLOTLY_MARKER) == 1  # the library once for the page, not per figure
    assert html.count("window.PlotlyConfig") == 1
    assert _figure_ids(html) == list(FIGURE_IDS)
    assert html.count("Plotly.newPlot(") == len(FIGURE_IDS)
    _assert_offline(html)
    assert not list(run_dir.glob(".report.html.*")), "temporary file left behind"


def test_header_names_the_run(run_dir: Path) -> None:
    html = _read(write_report(run_dir))
    page = _without_scripts(html)
    assert "<h1>fedavg on mnist</h1>" in page
    assert "<title>fedavg on mnist · fedloom report</title>" in page
    for chip in ("mlp", "sequential", "dirichlet (alpha=0.3)"):
        assert chip in page
    assert "complete" in page and "in progress" not in page


def test_headline_numbers_are_human_readable(run_dir: Path) -> None:
    html = _read(write_report(run_dir))
    page = _without_scripts(html)
    summary = json.loads(_read(run_dir / "summary.json"))
    final = summary["final"]
    assert f"{final['global']['accuracy'] * 100:.1f}%" in page
    pers = final["personalized"]
    assert f"{pers['accuracy_mean'] * 100:.1f}%" in page
    for key in ("p10", "p50", "p90", "min"):
        assert f"{pers['accuracy_' + key] * 100:.1f}%" in page, key
    total = BYTES_PER_ROUND * 50
    assert total == summary["communication"]["bytes_up"]
    assert f"{total / 1e6:.0f} MB" in page  # 356 MB, not 356224000
    assert str(total) not in page
    assert "1 min 02 s" in page  # 61.5 s wall time
    assert "1.2 s" in page  # seconds per round


def test_resolved_config_is_shown(run_dir: Path) -> None:
    html = _read(write_report(run_dir))
    block = html[html.index("Resolved configuration") :]
    assert "eval_every: 5" in block
    assert "kind: dirichlet" in block


def test_rewrites_an_existing_report(run_dir: Path) -> None:
    (run_dir / "report.html").write_text("stale", encoding="utf-8")
    html = _read(write_report(run_dir))
    assert html.startswith("<!DOCTYPE html>") and html.count(PLOTLY_MARKER) == 1


def test_text_from_run_files_is_escaped(make_run: MakeRun) -> None:
    config = {**CONFIG, "algorithm": {"name": "<script>alert(1)</script>"}}
    html = _read(write_report(make_run(config=config)))
    page = _without_scripts(html)
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt; on mnist" in page


# --- graceful degradation ---------------------------------------------------


def test_cold_start_panel_only_for_runs_with_new_clients(make_run: MakeRun) -> None:
    with_new = _read(write_report(make_run("new", new_clients=True)))
    assert 'id="cold_start"' in with_new and "adaptation steps" in with_new
    assert 'id="cold_start"' not in _read(write_report(make_run("plain")))


def test_no_global_model_and_regression(make_run: MakeRun) -> None:
    run_dir = make_run(
        global_model=False, regression=True, summary=False, label_histogram=False, monitor=False
    )
    html = _read(write_report(run_dir))
    page = _without_scripts(html)
    assert "No monitoring records in this run" in page  # an older run: notes, no errors
    assert "no global model" in page
    assert "Personalized loss" in page  # loss instead of an accuracy of null
    assert "No accuracy was reported" in page
    assert "Per-client accuracy is null" in page
    assert "No label histogram" in page
    assert _figure_ids(html) == ["fig-loss", "fig-communication"]
    assert html.count(PLOTLY_MARKER) == 1
    assert "in progress · at round 50 of 50" in page
    assert "estimated from wall time" in page


def test_no_global_model_keeps_personalized_accuracy(make_run: MakeRun) -> None:
    html = _read(write_report(make_run(global_model=False)))
    page = _without_scripts(html)
    assert "No global model in this run" in page
    assert _figure_ids(html) == list(FIGURE_IDS)
    assert '"name":"global"' not in html


def test_no_client_accuracy_and_no_label_histogram(make_run: MakeRun) -> None:
    html = _read(
        write_report(make_run(client_accuracy=False, label_histogram=False, monitor=False))
    )
    page = _without_scripts(html)
    assert "No per-client accuracy in metrics.jsonl." in page
    assert _figure_ids(html) == ["fig-accuracy", "fig-loss", "fig-communication"]


def test_single_evaluated_round(make_run: MakeRun) -> None:
    html = _read(write_report(make_run(n_rounds=1, summary=False)))
    page = _without_scripts(html)
    assert _figure_ids(html) == list(FIGURE_IDS)
    assert '"error_y"' in html  # the P10–P90 spread as a whisker: a band needs two rounds
    assert "at round 5 of 50" in page


def test_empty_metrics(make_run: MakeRun) -> None:
    html = _read(write_report(make_run(n_rounds=0, summary=False)))
    page = _without_scripts(html)
    assert "No evaluated rounds yet" in page
    assert "in progress" in page
    assert _figure_ids(html) == ["fig-labels"]  # the partition is known before round 1
    assert html.count(PLOTLY_MARKER) == 1


def test_empty_metrics_without_figures_needs_no_plotly(make_run: MakeRun) -> None:
    html = _read(write_report(make_run(n_rounds=0, summary=False, label_histogram=False)))
    page = _without_scripts(html)
    assert "No evaluated rounds yet" in page
    assert PLOTLY_MARKER not in html and _figure_ids(html) == []


def test_truncated_metrics_line_is_skipped(tmp_path: Path) -> None:
    rows = make_rows(3)
    run_dir = make_run_dir(tmp_path / "run", rows, summary=False)
    with (run_dir / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write('{"round": 20, "wall_sec')  # a writer caught mid-line
    html = _read(write_report(run_dir))
    page = _without_scripts(html)
    assert "skipped 1 unreadable line(s) (4)" in page
    assert "at round 15 of 50" in page


def test_corrupt_optional_files_are_noted(run_dir: Path) -> None:
    (run_dir / "summary.json").write_text("{not json", encoding="utf-8")
    (run_dir / "label_histogram.json").write_text('{"counts": 3}', encoding="utf-8")
    html = _read(write_report(run_dir))
    page = _without_scripts(html)
    assert "summary.json: unreadable" in page
    assert "heatmap omitted" in page
    assert "in progress" in page


# --- errors -----------------------------------------------------------------


def test_missing_run_dir_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(RunDirError, match="does not exist") as info:
        write_report(missing)
    assert str(missing) in str(info.value)


def test_run_dir_without_run_files_raises(tmp_path: Path) -> None:
    with pytest.raises(RunDirError) as info:
        write_report(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "config.yaml" in message and "metrics.jsonl" in message


def test_run_dir_without_metrics_raises(run_dir: Path) -> None:
    (run_dir / "metrics.jsonl").unlink()
    with pytest.raises(RunDirError, match=r"metrics\.jsonl"):
        write_report(run_dir)


def test_invalid_config_raises(run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text("- just\n- a list\n", encoding="utf-8")
    with pytest.raises(RunDirError, match=r"config\.yaml"):
        write_report(run_dir)


# --- formatting -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [(0, "0 B"), (999, "999 B"), (1536, "1.54 kB"), (356_220_000, "356 MB"), (None, "—")],
)
def test_human_bytes(value: float | None, text: str) -> None:
    assert fmt.human_bytes(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.42, "0.42 s"), (12.34, "12.3 s"), (245, "4 min 05 s"), (7380, "2 h 03 min")],
)
def test_duration(value: float, text: str) -> None:
    assert fmt.duration(value) == text


def test_percent_handles_null_and_nan() -> None:
    assert fmt.percent(0.8123) == "81.2%"
    assert fmt.percent(None) == fmt.percent(float("nan")) == fmt.percent(True) == "—"


# --- in a real browser ------------------------------------------------------

CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium")) if p and Path(p).exists()), None
)


@pytest.mark.parametrize("variant", ["full", "regression", "single"])
def test_renders_in_headless_chromium(make_run: MakeRun, variant: str) -> None:
    if CHROMIUM is None:  # CI installs Debian's chromium (.ci/run): there it must run
        if os.environ.get("CI"):
            pytest.fail("no /usr/bin/chromium: CI must run the browser checks")
        pytest.skip("needs /usr/bin/chromium")
    kwargs = {
        "full": {"new_clients": True},
        "regression": {"regression": True, "global_model": False, "summary": False},
        "single": {"n_rounds": 1, "summary": False},
    }[variant]
    html_path = write_report(make_run(variant, **kwargs))
    expected = _figure_ids(_read(html_path))
    assert expected
    proc = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # any network fetch would fail
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
            "--dump-dom",
            html_path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or "rror" in line], console
    dom = proc.stdout
    for i, fig_id in enumerate(expected):
        start = dom.index(f'id="{fig_id}"')
        end = dom.index(f'id="{expected[i + 1]}"') if i + 1 < len(expected) else len(dom)
        assert 'class="main-svg"' in dom[start:end], f"{fig_id} was not drawn"
