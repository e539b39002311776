"""``fedloom dashboard RUNS_DIR``: a local web app listing runs, showing each run's report
panels live while it trains, and comparing runs (Starlette, served by uvicorn)."""

from fedloom.dashboard.app import create_app
from fedloom.dashboard.server import DEFAULT_HOST, DEFAULT_PORT, check_host, is_loopback, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "check_host", "create_app", "is_loopback", "serve"]
