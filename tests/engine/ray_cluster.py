"""A real multi-process Ray cluster on 127.0.0.1 for tests: one head and extra worker nodes,
each a ``ray start --block`` process group of its own, in a private temp dir, with private
ports and a private auth token, torn down by process id (never ``ray stop``, which would also
stop other people's Ray processes on the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"
STORE_BYTES = 100 * 1024**2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_ports() -> list[str]:
    """Ports every node on one host needs to differ in (their defaults are fixed numbers)."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}",
    ]


def _ours(temp_dir: str) -> list[int]:
    """Ids of the processes whose command line names ``temp_dir`` (only this cluster's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if temp_dir.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _stop(procs: list[subprocess.Popen[bytes]], temp_dir: str) -> None:
    """Terminate each node's process group, then any leftover process of this cluster."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for proc in reversed(procs):  # worker nodes before the head
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    for pid in _ours(temp_dir):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _wait_for_nodes(address: str, nodes: int, procs: list[subprocess.Popen[bytes]]) -> None:
    import ray

    deadline = time.monotonic() + 90
    ray.init(address=address, logging_level="WARNING")
    try:
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= nodes:
                return
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"Ray test cluster at {address}: {len(alive)} of {nodes} nodes up"
                    + (f", `ray start` exited with {dead[0].returncode}" if dead else "")
                )
            time.sleep(0.2)
    finally:
        ray.shutdown()


@contextmanager
def ray_cluster(nodes: int = 2, cpus_per_node: int = 1) -> Iterator[str]:
    """Start a ``nodes``-node Ray cluster on 127.0.0.1; yield its address 'HOST:PORT'.

    Token authentication is off (RAY_AUTH_MODE=disabled in the nodes' environment): the
    cluster listens on the loopback interface only, and a driver, whatever token it has from
    ``~/.ray``, can connect.
    """
    temp_dir = tempfile.mkdtemp(prefix="rt_", dir="/tmp")  # short: socket paths are limited
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_AUTH_TOKEN", None)
    common = [
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={cpus_per_node}",
        f"--object-store-memory={STORE_BYTES}",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    head = [
        "--head",
        f"--port={port}",
        "--include-dashboard=false",
        f"--dashboard-port={free_port()}",  # a minimal dashboard head runs even so
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(nodes):
            role = head if i == 0 else [f"--address={address}"]
            with open(Path(temp_dir) / f"node{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [str(RAY), "start", *role, *common, *_node_ports()],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        env=env,
                    )
                )
            if i == 0:
                _wait_for_port(port, procs[0], Path(temp_dir) / "node0.log")
        _wait_for_nodes(address, nodes, procs)
        yield address
    finally:
        try:
            import ray

            ray.shutdown()
        finally:
            _stop(procs, temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode}:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"Ray head did not open port {port} within 60 s")
