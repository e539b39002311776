"""Headless-browser checks: Playwright driving Debian's chromium (no browser download).

(a) report.html of a real run, (b) the dashboard while a real experiment trains (the round
counter advances without a reload, every panel is drawn), (c) the comparison page, both the
offline file and the dashboard's view. Every page: no console errors, nothing requested from
outside, each Plotly figure drawn (an ``svg.main-svg`` inside it). Screenshots are saved under
$FEDLOOM_ARTIFACTS (default: tests-artifacts/ at the repository root). Without chromium or
playwright these tests skip locally and FAIL under CI (the ``CI`` variable set).
$FEDLOOM_CHROMIUM overrides the browser's path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import fedloom
from fedloom.dashboard import create_app
from fedloom.report.compare import write_comparison

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("FEDLOOM_CHROMIUM", "/usr/bin/chromium"))  # Debian's package
DATA = {"name": "digits", "num_clients": 8, "partition": {"kind": "dirichlet", "alpha": 0.5}}
REPORT_RUN = {
    "seed": 0,
    "data": DATA,
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 4, "local_steps": 5, "batch_size": 16},
    "eval": {"every": 1, "new_clients": 1},
    "checkpoint": {"every": None},
    "executor": {"kind": "sequential"},
}
# ~0.15 s a round on one core: the live run lasts about ten seconds
LIVE_RUN = {
    **REPORT_RUN,
    "algorithm": {"name": "ditto"},
    "train": {"rounds": 60, "local_steps": 15, "batch_size": 16},
}
FIGURE_IDS = re.compile(r'<div id="(fig-[a-z_0-9]+)" class="plotly-graph-div"')
TIMEOUT_MS = 60_000


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(
            f"{reason}: CI must run the browser tests (.ci/run installs Debian's chromium, "
            "scripts/setup.sh installs playwright with the test extra)",
            pytrace=False,
        )
    pytest.skip(reason)


@pytest.fixture(scope="module")
def artifacts() -> Path:
    path = Path(os.environ.get("FEDLOOM_ARTIFACTS") or ROOT / "tests-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    if not CHROMIUM.exists():
        _unavailable(f"Debian's chromium is not at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


class Watched:
    """A page that records console errors and blocks (and records) non-local requests."""

    def __init__(self, browser: Any) -> None:
        self.context = browser.new_context(viewport={"width": 1300, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.external: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda err: self.errors.append(f"pageerror: {err}"))
        self.context.route("**/*", self._route)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _route(self, route: Any) -> None:
        url = route.request.url
        if url.startswith(("file:", "data:", "blob:", "http://127.0.0.1:")):
            route.continue_()
        else:
            self.external.append(url)
            route.abort()

    def check_clean(self) -> None:
        assert self.errors == [], self.errors
        assert self.external == [], f"requests to outside: {self.external}"

    def assert_drawn(self, ids: list[str]) -> None:
        """Every figure div in ``ids`` holds a drawn Plotly SVG."""
        assert ids
        self.page.wait_for_function(
            "ids => ids.every(id => document.querySelector('#' + id + ' svg.main-svg'))",
            arg=ids,
            timeout=TIMEOUT_MS,
        )

    def screenshot(self, path: Path) -> None:
        self.page.wait_for_timeout(300)  # let Plotly finish its transitions
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser: Any) -> Iterator[Watched]:
    page = Watched(browser)
    yield page
    page.close()


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("browser") / "runs"


@pytest.fixture(scope="module")
def report_run(runs_dir: Path) -> Path:
    """A real 4-round FedAvg run on digits (with a held-out client: the cold-start panel)."""
    result = fedloom.run(REPORT_RUN, out=runs_dir / "fedavg-digits", progress=False, write=True)
    assert result.run_dir is not None
    return result.run_dir.path


@pytest.fixture(scope="module")
def live_run(runs_dir: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`fedloom run` of a 60-round Ditto experiment in a child process, writing into
    runs_dir/ditto-live while the tests watch it."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    config = runs_dir.parent / "live.yaml"
    config.write_text(yaml.safe_dump(LIVE_RUN), encoding="utf-8")
    out = runs_dir / "ditto-live"
    log = (runs_dir.parent / "live.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDLOOM_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedloom", "run", str(config), "--out", str(out)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def dashboard(runs_dir: Path) -> Iterator[str]:
    """The dashboard of runs_dir, served by uvicorn in a thread on a free loopback port."""
    import uvicorn

    runs_dir.mkdir(parents=True, exist_ok=True)
    config = uvicorn.Config(create_app(runs_dir), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the experiment exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def _counter(page: Any) -> int | None:
    text = page.locator("#round-counter").inner_text().strip()
    return int(text) if text.isdigit() else None


# --- (a) the report of a real run ---------------------------------------------


def test_report_of_a_real_run_renders(report_run: Path, watched: Watched, artifacts: Path) -> None:
    report = report_run / "report.html"
    assert report.is_file(), "the run did not write report.html"
    ids = FIGURE_IDS.findall(report.read_text(encoding="utf-8"))
    assert {"fig-accuracy", "fig-loss", "fig-communication", "fig-cold_start"} <= set(ids)
    watched.page.goto(report.as_uri())
    watched.assert_drawn(ids)
    sections = watched.page.locator("section.panel h2").count()
    assert sections >= len(ids)  # figures, plus panels that explain why they have none
    watched.check_clean()
    watched.screenshot(artifacts / "report.png")


# --- (b) the dashboard during a running experiment ----------------------------


def test_dashboard_follows_a_running_experiment(
    browser: Any,
    live_run: tuple[subprocess.Popen, Path],
    dashboard: str,
    watched: Watched,
    artifacts: Path,
) -> None:
    proc, out = live_run
    _wait_for(out / "config.yaml", proc)
    page = watched.page

    page.goto(dashboard + "/")
    row = page.locator('tr[data-run="ditto-live"]')
    row.wait_for(timeout=TIMEOUT_MS)
    assert row.locator('[data-col="status"]').inner_text().strip() == "running"
    watched.screenshot(artifacts / "dashboard-index.png")

    page.goto(f"{dashboard}/runs/ditto-live")
    page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads
    page.wait_for_function(
        "() => /^[0-9]+$/.test(document.getElementById('round-counter').textContent)",
        timeout=TIMEOUT_MS,
    )
    first = _counter(page)
    page.wait_for_function(
        "n => Number(document.getElementById('round-counter').textContent) > n",
        arg=first,
        timeout=TIMEOUT_MS,
    )
    second = _counter(page)
    assert first is not None and second is not None and second > first
    watched.screenshot(artifacts / "dashboard-run-live.png")

    assert proc.wait(timeout=300) == 0, (out.parent.parent / "live.log").read_text()
    page.wait_for_function(
        "() => document.getElementById('status').textContent === 'finished'",
        timeout=TIMEOUT_MS,
    )
    assert _counter(page) == LIVE_RUN["train"]["rounds"]
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded"
    with urllib.request.urlopen(f"{dashboard}/api/runs/ditto-live") as response:
        payload = json.load(response)
    ids = [f"fig-{p['key']}" for p in payload["panels"] if p["figure"] is not None]
    assert "fig-cold_start" in ids  # appears once the run has finished
    watched.assert_drawn(ids)
    assert page.locator("#figures section.panel").count() == len(payload["panels"])
    watched.check_clean()
    watched.screenshot(artifacts / "dashboard-run.png")


# --- (c) the comparison page --------------------------------------------------


def test_compare_page_renders(
    browser: Any,
    report_run: Path,
    live_run: tuple[subprocess.Popen, Path],
    dashboard: str,
    watched: Watched,
    artifacts: Path,
) -> None:
    proc, out = live_run
    assert proc.wait(timeout=300) == 0
    page_file = write_comparison([report_run, out], artifacts / "compare.html")
    ids = FIGURE_IDS.findall(page_file.read_text(encoding="utf-8"))
    assert "fig-cold_start" in ids and len(ids) == 7
    watched.page.goto(page_file.as_uri())
    watched.assert_drawn(ids)
    assert watched.page.locator("#data-mismatch").count() == 0  # same data for both runs
    watched.check_clean()
    watched.screenshot(artifacts / "compare.png")

    page = watched.page
    page.goto(dashboard + "/")
    for name in (report_run.name, out.name):
        page.locator(f'input[name="run"][value="{name}"]').check()
    with page.expect_navigation():
        page.locator("#compare-button").click()
    assert "/compare?" in page.url
    watched.assert_drawn(ids)
    assert page.locator('tr[data-run="ditto-live"]').count() == 1
    watched.check_clean()
    watched.screenshot(artifacts / "dashboard-compare.png")
