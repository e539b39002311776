"""Serving the dashboard with uvicorn, on a loopback address unless told otherwise."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from pathlib import Path

from fedloom.errors import FedloomInputError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IP addresses (127.0.0.0/8, ::1)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve to a public address


def check_host(host: str, allow_remote: bool = False) -> None:
    """Refuse a non-loopback ``host`` unless ``allow_remote``: the dashboard has no login,
    and every run directory it lists would be readable from the network."""
    if not is_loopback(host) and not allow_remote:
        raise FedloomInputError(
            f"refusing to serve the dashboard on '{host}', which is not a loopback address: "
            "anyone who can reach it could read your runs. Use 127.0.0.1 (the default), or "
            "pass --allow-remote if you really mean it"
        )


def check_port(host: str, port: int) -> None:
    """Raise a clear error if ``host:port`` cannot be bound (in use, or no such address)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as err:
            hint = "; choose another with --port" if err.errno in (98, 48, 10048) else ""
            raise FedloomInputError(
                f"cannot listen on {host}:{port}: {err.strerror or err}{hint}"
            ) from None


def serve(
    runs_dir: str | Path,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    allow_remote: bool = False,
    log_level: str = "warning",
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve the dashboard of ``runs_dir`` until interrupted; ``announce(url)`` is called once
    the checks passed, just before serving."""
    import uvicorn

    from fedloom.dashboard.app import LOOPBACK_HOSTS, create_app

    check_host(host, allow_remote)
    app = create_app(runs_dir, allowed_hosts=None if allow_remote else LOOPBACK_HOSTS)
    check_port(host, port)
    if announce is not None:
        bare = host.strip("[]")
        announce(f"http://{f'[{bare}]' if ':' in bare else bare}:{port}/")
    uvicorn.run(app, host=host.strip("[]"), port=port, log_level=log_level)
