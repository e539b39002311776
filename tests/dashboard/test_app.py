"""The dashboard app through Starlette's TestClient: pages, JSON, errors, safety checks."""

from __future__ import annotations

import json
import re
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedloom.cli import app as cli_app
from fedloom.dashboard import check_host, create_app, is_loopback, serve
from fedloom.dashboard import server as dashboard_server
from fedloom.dashboard.runs import RunsFolder
from fedloom.errors import FedloomInputError, RunDirError
from fedloom.report import format as fmt
from fedloom.report.panels import build_panels
from fedloom.report.rundir import load_run
from tests.report.fake_run import make_rows

with warnings.catch_warnings():  # Starlette >= 1.x prefers httpx2; httpx works with every version
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

BASE = "http://127.0.0.1:8765"
PLOTLY_MARKER = "* plotly.js v"


@pytest.fixture
def client(runs_dir: Path) -> TestClient:
    return TestClient(create_app(runs_dir), base_url=BASE)


def _rows(html: str) -> dict[str, dict[str, str]]:
    rows = {}
    for name, row in re.findall(r'<tr data-run="([^"]*)">(.*?)</tr>', html, re.S):
        cells = re.findall(r'data-col="([a-z]+)"[^>]*>(.*?)</td>', row, re.S)
        rows[name] = {k: re.sub(r"<[^>]+>", "", v).strip() for k, v in cells}
    return rows


def _initial(html: str) -> dict[str, Any]:
    match = re.search(r'<script id="initial" type="application/json">(.*?)</script>', html, re.S)
    assert match is not None
    return json.loads(match.group(1))


def _append_round(run_dir: Path, n_rounds: int) -> None:
    row = make_rows(n_rounds)[-1]
    with (run_dir / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


# --- the run list -----------------------------------------------------------


def test_index_lists_runs_with_status(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    rows = _rows(response.text)
    assert set(rows) == {"alpha", "beta", "gamma"}  # not 'notes', 'README.txt', '../secret'
    assert rows["alpha"]["status"] == "finished"
    assert rows["beta"]["status"] == "running"
    assert rows["gamma"]["status"] == "running"
    assert rows["alpha"]["round"] == "50 / 50" and rows["beta"]["round"] == "15 / 50"
    assert rows["gamma"]["round"] == "— / 50"
    best = max(r["personalized"]["accuracy_mean"] for r in make_rows(10))
    assert rows["alpha"]["best"] == fmt.percent(best)
    assert 'href="/runs/alpha"' in response.text
    assert '<form action="/compare" method="get">' in response.text


def test_api_runs(client: TestClient) -> None:
    data = client.get("/api/runs").json()
    runs = {r["name"]: r for r in data["runs"]}
    assert runs["alpha"]["status"] == "finished" and runs["alpha"]["last_round"] == 50
    assert runs["beta"]["algorithm"] == "ditto" and runs["beta"]["status"] == "running"
    assert runs["gamma"]["last_round"] is None
    assert 'data-run="beta"' in data["rows_html"]


def test_empty_folder_says_how_to_start(tmp_path: Path) -> None:
    client = TestClient(create_app(tmp_path), base_url=BASE)
    assert "No runs here yet" in client.get("/").text


# --- one run ----------------------------------------------------------------


def test_run_page_has_the_reports_panels_and_a_round_counter(
    client: TestClient, runs_dir: Path
) -> None:
    response = client.get("/runs/alpha")
    assert response.status_code == 200
    html = response.text
    assert '<span id="round-counter">50</span>' in html
    assert '<script src="/static/plotly.min.js"></script>' in html
    assert not re.search(r"<script[^>]*\ssrc\s*=\s*[\"']?(https?:)?//", html)  # no CDN
    assert PLOTLY_MARKER not in html  # the library is served once, not inlined
    payload = _initial(html)
    panels = build_panels(load_run(runs_dir / "alpha"))
    assert [p["key"] for p in payload["panels"]] == [p.key for p in panels]
    for sent, panel in zip(payload["panels"], panels, strict=True):
        if panel.figure is None:
            assert sent["figure"] is None and sent["note"] == panel.note
        else:
            assert sent["figure"] == json.loads(panel.figure.to_json()), panel.key
    assert payload["round"] == 50 and payload["status"] == "finished"
    assert 'id="alerts"' in payload["alerts_html"]


def test_run_json_changes_when_the_run_writes_a_round(client: TestClient, runs_dir: Path) -> None:
    first = client.get("/api/runs/beta").json()
    assert first["round"] == 15 and first["status"] == "running" and first["panels"]
    same = client.get("/api/runs/beta", params={"since": first["version"]}).json()
    assert same == {"unchanged": True, "version": first["version"], "status": "running"}
    _append_round(runs_dir / "beta", 4)
    later = client.get("/api/runs/beta", params={"since": first["version"]}).json()
    assert later["version"] != first["version"] and later["round"] == 20
    accuracy = next(p for p in later["panels"] if p["key"] == "accuracy")
    assert len(accuracy["figure"]["data"][0]["x"]) == 4
    page = client.get("/runs/beta").text
    assert '<span id="round-counter">20</span>' in page


def test_run_without_metrics_yet(client: TestClient) -> None:
    html = client.get("/runs/gamma").text
    assert '<span id="round-counter">—</span>' in html
    payload = _initial(html)
    assert payload["round"] is None and payload["status"] == "running"
    assert "No evaluated round yet" in payload["notes_html"]


def test_static_report_of_a_run(client: TestClient) -> None:
    response = client.get("/runs/alpha/report")
    assert response.status_code == 200 and "fedloom report" in response.text


def test_plotly_is_served_from_the_installed_package(client: TestClient) -> None:
    response = client.get("/static/plotly.min.js")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/javascript")
    assert PLOTLY_MARKER in response.text[:2000] and len(response.text) > 1_000_000


# --- compare ----------------------------------------------------------------


def test_compare_view(client: TestClient) -> None:
    response = client.get("/compare", params=[("run", "alpha"), ("run", "beta")])
    assert response.status_code == 200
    html = response.text
    assert 'data-run="alpha"' in html and 'data-run="beta"' in html
    assert 'src="/static/plotly.min.js"></script>' in html
    assert not re.search(r"<script[^>]*\ssrc\s*=\s*[\"']?(https?:)?//", html)  # no CDN
    assert PLOTLY_MARKER not in html
    assert 'href="/"' in html
    assert client.get("/compare").status_code == 400
    assert client.get("/compare", params={"run": "nope"}).status_code == 404


# --- errors and safety ------------------------------------------------------


@pytest.mark.parametrize("path", ["/runs/nope", "/runs/nope/report", "/api/runs/nope"])
def test_unknown_run_is_404(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "nope" in response.text


@pytest.mark.parametrize(
    "path",
    [
        "/runs/..%2Fsecret",
        "/runs/%2E%2E",
        "/api/runs/..%2Fsecret",
        "/runs/%2Ftmp",
        "/compare?run=../secret",
        "/compare?run=..",
        "/runs/notes",
    ],
)
def test_path_traversal_is_refused(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert 'id="round-counter"' not in response.text and 'id="initial"' not in response.text


def test_names_outside_the_folder_are_never_resolved(runs_dir: Path) -> None:
    folder = RunsFolder(runs_dir)
    for name in ("..", ".", "", "../secret", "/etc", str(runs_dir / "alpha"), "a\0b", "notes"):
        assert folder.path_of(name) is None, name
    assert folder.path_of("alpha") == runs_dir.resolve() / "alpha"


def test_foreign_host_header_is_refused(client: TestClient) -> None:
    """A page on another site reaching 127.0.0.1 through DNS rebinding gets nothing."""
    assert client.get("/", headers={"Host": "evil.example"}).status_code == 400
    assert client.get("/api/runs", headers={"Host": "localhost:8765"}).status_code == 200


def test_missing_runs_dir(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="does not exist"):
        create_app(tmp_path / "nope")


# --- binding ----------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_are_allowed(host: str) -> None:
    assert is_loopback(host)
    check_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.com"])
def test_other_hosts_need_allow_remote(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(FedloomInputError, match="--allow-remote"):
        check_host(host)
    check_host(host, allow_remote=True)


def test_serve_refuses_before_binding(runs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(dashboard_server, "check_port", lambda *a: calls.append(("port", a)))
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: calls.append(("run", k)))
    with pytest.raises(FedloomInputError, match="not a loopback address"):
        serve(runs_dir, "0.0.0.0", 8765)
    assert calls == []
    serve(runs_dir, "0.0.0.0", 8765, allow_remote=True)
    assert calls[-1] == ("run", {"host": "0.0.0.0", "port": 8765, "log_level": "warning"})


def test_cli_refuses_remote_host(runs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(dashboard_server, "check_port", lambda *a: None)
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: ran.append(k))
    runner = CliRunner()
    result = runner.invoke(cli_app, ["dashboard", str(runs_dir), "--host", "0.0.0.0"])
    assert result.exit_code == 2 and ran == []
    assert "--allow-remote" in result.output and "Traceback" not in result.output
    result = runner.invoke(
        cli_app, ["dashboard", str(runs_dir), "--host", "0.0.0.0", "--allow-remote"]
    )
    assert result.exit_code == 0, result.output
    assert ran == [{"host": "0.0.0.0", "port": 8765, "log_level": "warning"}]
    result = runner.invoke(cli_app, ["dashboard", str(runs_dir), "--port", "9001"])
    assert result.exit_code == 0 and ran[-1]["host"] == "127.0.0.1" and ran[-1]["port"] == 9001
    assert "http://127.0.0.1:9001/" in result.output


def test_cli_errors(runs_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli_app, ["dashboard", str(runs_dir / "missing")])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = runner.invoke(cli_app, ["dashboard", str(runs_dir / "alpha")])
    assert result.exit_code == 2 and "is a run directory" in result.output


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FedloomInputError, match=f"127.0.0.1:{port}.*--port"):
            dashboard_server.check_port("127.0.0.1", port)
