"""The runs folder the dashboard shows: listing, safe name lookup, cached loading.

A run is a direct subdirectory with a ``config.yaml``. Names from URLs are only ever looked
up among the listed subdirectories, so no URL reaches a path outside the folder; a
subdirectory that is a symlink to somewhere outside it, or a run holding a symlink at any
level (a file, checkpoints/, serving/), is not listed. Each run is
reloaded only when one of its files changed (size or modification time): the ``version``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedloom.core.files import read_yaml_mapping
from fedloom.core.runpaths import find_link, under
from fedloom.errors import RunDirError
from fedloom.report.compare import RunFacts, run_facts
from fedloom.report.rundir import CONFIG_FILE, METRICS_FILE, RunData, load_run

WATCHED_SUFFIXES = (".json", ".jsonl", ".yaml")


@dataclass
class Entry:
    """One listed run: its facts, or the reason it cannot be read."""

    name: str
    path: Path
    version: str
    updated: float  # seconds since the epoch of the newest watched file
    run: RunData | None
    facts: RunFacts | None
    error: str | None = None


def run_version(path: Path) -> tuple[str, float]:
    """A short hash of the names, sizes and times of the run's top-level data files, and the
    newest modification time."""
    parts: list[str] = []
    newest = 0.0
    try:
        with os.scandir(path) as it:
            files = sorted(
                (e for e in it if e.name.endswith(WATCHED_SUFFIXES) and e.is_file()),
                key=lambda e: e.name,
            )
            for e in files:
                st = e.stat()
                parts.append(f"{e.name}:{st.st_size}:{st.st_mtime_ns}")
                newest = max(newest, st.st_mtime)
    except OSError:
        pass
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16], newest


def load_live_run(path: Path) -> RunData:
    """``load_run``, except that a run which has not written metrics.jsonl yet (it has not
    finished its first evaluated round) loads as a run with no rounds."""
    if under(path, METRICS_FILE).is_file():
        return load_run(path)
    return RunData(path, read_yaml_mapping(under(path, CONFIG_FILE)), [], None, None, [])


class RunsFolder:
    """The folder of run directories, with a cache of loaded runs keyed by version."""

    def __init__(self, root: str | Path) -> None:
        root = Path(root)
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise RunDirError(f"runs directory '{root}' {what}")
        self.root = root.resolve()
        self._cache: dict[str, Entry] = {}
        self._extras: dict[tuple[str, str, str], Any] = {}
        self._lock = threading.Lock()

    def contained(self, path: Path) -> bool:
        """True when the run directory ``path`` resolves inside the folder and holds no
        symbolic link at any level (core/runpaths.py): a run linked from elsewhere, or one
        whose config.yaml, checkpoints/ or serving/ files are links, is neither listed nor
        served."""
        try:
            return path.resolve().is_relative_to(self.root) and find_link(path) is None
        except OSError:
            return False

    def names(self) -> list[str]:
        """Subdirectories holding a config.yaml, newest first (then by name); only those
        inside the folder (``contained``)."""
        found: list[tuple[float, str]] = []
        try:
            with os.scandir(self.root) as it:
                for e in it:
                    path = Path(e.path)
                    if e.is_dir() and (path / CONFIG_FILE).is_file() and self.contained(path):
                        found.append((Path(e.path, CONFIG_FILE).stat().st_mtime, e.name))
        except OSError:
            return []
        return [name for _, name in sorted(found, key=lambda p: (-p[0], p[1]))]

    def path_of(self, name: str) -> Path | None:
        """The run directory called ``name``, or None when no listed run has that name (so
        '..', 'a/b', absolute paths and anything else outside the folder are refused)."""
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            return None
        path = self.root / name
        if not path.is_dir() or not (path / CONFIG_FILE).is_file() or not self.contained(path):
            return None
        return path

    def entry(self, name: str) -> Entry | None:
        """The run ``name``, reloaded when its files changed; None if there is no such run."""
        path = self.path_of(name)
        if path is None:
            return None
        version, updated = run_version(path)
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None and cached.version == version:
            return cached
        try:
            run = load_live_run(path)
            entry = Entry(name, path, version, updated, run, run_facts(run, name))
        except RunDirError as exc:
            entry = Entry(name, path, version, updated, None, None, str(exc))
        with self._lock:
            self._cache[name] = entry
        return entry

    def entries(self) -> list[Entry]:
        out = []
        for name in self.names():
            entry = self.entry(name)
            if entry is not None:
                out.append(entry)
        return out

    def cached(self, entry: Entry, kind: str, build: Any) -> Any:
        """``build(entry)`` computed once per run version (e.g. the run page's JSON)."""
        key = (entry.name, kind, entry.version)
        with self._lock:
            if key in self._extras:
                return self._extras[key]
        value = build(entry)
        with self._lock:
            stale = [k for k in self._extras if k[0] == entry.name and k[1] == kind]
            for k in stale:
                del self._extras[k]
            self._extras[key] = value
        return value


def age(updated: float, now: float | None = None) -> str:
    """'12 s ago', '4 min ago', '3 h ago', '2 days ago'."""
    if not updated:
        return "—"
    seconds = max(0.0, (time.time() if now is None else now) - updated)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def script_json(obj: Any) -> str:
    """JSON that is safe inside a <script> element (no '<', '>' or '&' characters)."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
