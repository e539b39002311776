"""The dashboard's Starlette application (``create_app``): routes and responses.

Routes: ``/`` the run list, ``/runs/{name}`` a run's live page, ``/runs/{name}/report`` its
report.html built now, ``/compare?run=A&run=B`` the comparison page, ``/api/runs`` and
``/api/runs/{name}[?since=VERSION]`` the JSON the pages poll, ``/static/plotly.min.js`` the
Plotly library of the installed ``plotly`` package (nothing is loaded from the internet).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from fedloom.dashboard.pages import (
    PLOTLY_URL,
    index_page,
    message_page,
    run_page,
    run_payload,
    runs_json,
)
from fedloom.dashboard.runs import Entry, RunsFolder
from fedloom.report.compare import render_comparison
from fedloom.report.html import render_report
from fedloom.report.rundir import RunData

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
"""Host headers accepted by default: a page on another site cannot read the dashboard
through DNS rebinding."""
NO_STORE = {"Cache-Control": "no-store"}


@functools.cache
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def create_app(
    runs_dir: str | Path, *, allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS
) -> Starlette:
    """The dashboard of the run directories under ``runs_dir``. ``allowed_hosts``: the Host
    header values served (None: any, for ``--allow-remote``)."""
    folder = RunsFolder(runs_dir)

    def _missing(name: str) -> HTMLResponse:
        return HTMLResponse(
            message_page("No such run", f"There is no run called '{name}' in {folder.root}."),
            status_code=404,
        )

    def _unreadable(entry: Entry) -> HTMLResponse:
        return HTMLResponse(
            message_page("Run cannot be read", entry.error or "unreadable"), status_code=422
        )

    def _readable(name: str) -> tuple[Entry, RunData] | HTMLResponse:
        """The run called ``name`` with its data, or the page saying why it cannot be shown."""
        entry = folder.entry(name)
        if entry is None:
            return _missing(name)
        if entry.run is None:
            return _unreadable(entry)
        return entry, entry.run

    def _run_html(render: Callable[[Entry, RunData], str]) -> Callable[[Request], Response]:
        """A route answering ``render(entry, run)`` for the run named in the path."""

        def route(request: Request) -> Response:
            found = _readable(request.path_params["name"])
            if isinstance(found, Response):
                return found
            return HTMLResponse(render(*found), headers=NO_STORE)

        return route

    def _payload(entry: Entry) -> dict:
        return folder.cached(entry, "payload", run_payload)

    def index(request: Request) -> Response:
        return HTMLResponse(index_page(folder), headers=NO_STORE)

    def api_runs(request: Request) -> Response:
        return JSONResponse(runs_json(folder), headers=NO_STORE)

    run = _run_html(lambda entry, _run: run_page(entry, _payload(entry)))
    report = _run_html(lambda _entry, run: render_report(run))

    def api_run(request: Request) -> Response:
        entry = folder.entry(request.path_params["name"])
        if entry is None:
            name = request.path_params["name"]
            return JSONResponse({"error": f"no run called '{name}'"}, status_code=404)
        if entry.run is None:
            return JSONResponse({"error": entry.error}, status_code=422)
        if request.query_params.get("since") == entry.version:
            status = entry.facts.status if entry.facts else None
            body = {"unchanged": True, "version": entry.version, "status": status}
            return JSONResponse(body, headers=NO_STORE)
        return JSONResponse(_payload(entry), headers=NO_STORE)

    def compare(request: Request) -> Response:
        names = request.query_params.getlist("run")
        if not names:
            return HTMLResponse(
                message_page("Nothing to compare", "Tick one or more runs in the list first."),
                status_code=400,
            )
        entries = []
        for name in dict.fromkeys(names):  # each run once, in the order given
            found = _readable(name)
            if isinstance(found, Response):
                return found
            entries.append(found)
        html = render_comparison(
            [run for _, run in entries],
            [entry.name for entry, _ in entries],
            plotlyjs=PLOTLY_URL,
            back_href="/",
        )
        return HTMLResponse(html, headers=NO_STORE)

    def static_plotly(request: Request) -> Response:
        return Response(
            plotly_js(),
            media_type="application/javascript",
            headers={"Cache-Control": "max-age=86400"},
        )

    routes = [
        Route("/", index),
        Route("/runs/{name}", run),
        Route("/runs/{name}/report", report),
        Route("/compare", compare),
        Route("/api/runs", api_runs),
        Route("/api/runs/{name}", api_run),
        Route(PLOTLY_URL, static_plotly),
    ]
    middleware = []
    if allowed_hosts is not None:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)))
    app = Starlette(routes=routes, middleware=middleware)
    app.state.folder = folder
    return app
