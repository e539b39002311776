"""The run directory (README.md, "Run directory"): config.yaml, metrics.jsonl, summary.json,
report.html, label_histogram.json and checkpoints/. A run never writes into another run's
directory, and one process at a time writes a run directory: the writer holds an exclusive
lock on RUN/.lock (:class:`RunLock`) from creating the directory, or opening it to resume,
until the run ends (docs/architecture.md, "Run directory lock")."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import time
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml

from fedloom.core.files import strict_json
from fedloom.core.runpaths import link_error, refuse_links, under, write_text_atomic
from fedloom.engine.checkpoint import (
    MANIFEST_SUFFIX,
    TENSOR_SUFFIX,
    Check,
    CheckpointError,
    CheckpointWarning,
    read_checkpoint,
    write_checkpoint,
)
from fedloom.errors import RunDirError, RunDirLocked

LOCK_FILE = ".lock"
"""RUN/.lock: the file the writing process holds its flock on (its PID inside, for messages)."""
LOCK_TRIES = 5
"""Non-blocking attempts, 20 ms apart, before a lock counts as held: a reader's probe
(``lock_holder``) holds it for microseconds."""


class RunLock:
    """An exclusive ``flock(2)`` on RUN/.lock, held by the one process that writes the run
    directory. The kernel drops a process's flock when it dies, so a run killed outright
    (``kill -9``, out of memory) leaves nothing stale: no PID file is checked.

    The descriptor is not inherited: it is closed on exec (``os.open``'s O_CLOEXEC, so Ray's
    processes and other spawned programs never get it), and in a child forked without exec
    (the processes executor's workers) it is closed right after the fork (``_close_in_child``):
    a flock belongs to the open file, which a forked child would share, keeping the lock
    after the parent died. The child only closes its copy (an unlock there would release the
    parent's)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, run_path: Path) -> RunLock:
        """The lock of the run directory ``run_path`` (which exists), or ``RunDirLocked``
        naming the process that holds it."""
        path = under(run_path, LOCK_FILE)
        try:  # O_NOFOLLOW: a link planted as .lock is refused, never truncated through
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if path.is_symlink():
                raise link_error(path) from None
            raise RunDirError(f"cannot write to run directory {run_path}: {err.strerror}") from None
        for attempt in range(LOCK_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == LOCK_TRIES - 1:
                    pid = _read_pid(path)
                    os.close(fd)
                    raise _locked(run_path, pid) from None
                time.sleep(0.02)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        lock = cls(fd, path)
        _HELD[fd] = lock
        scope = _SCOPE.get()
        if scope is not None:
            scope.append(lock)
        return lock

    def release(self) -> None:
        """Unlock and close (idempotent). The file stays: removing it would let a process that
        opened it before the removal lock a file no one else can see."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        _HELD.pop(fd, None)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


_HELD: dict[int, RunLock] = {}
"""The locks this process holds, by descriptor (closed in forked children)."""
_SCOPE: ContextVar[list[RunLock] | None] = ContextVar("fedloom_run_locks", default=None)


def _close_in_child() -> None:
    for fd, lock in list(_HELD.items()):
        lock.fd = None  # the child's object must not unlock the parent's lock later
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


@contextlib.contextmanager
def releasing_locks() -> Iterator[None]:
    """Release, at the end, every run-directory lock taken inside (``fedloom.run``: a run that
    fails frees its directory at once, for a resume in the same process)."""
    taken: list[RunLock] = []
    token = _SCOPE.set(taken)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        for lock in taken:
            lock.release()


def _read_pid(path: Path) -> int | None:
    """The PID written in a lock file (None if unreadable: a writer between lock and write)."""
    for _ in range(LOCK_TRIES):
        try:
            text = path.read_text().strip()
        except OSError:
            return None
        if text.isdigit():
            return int(text)
        time.sleep(0.02)
    return None


def _locked(run_path: Path, pid: int | None) -> RunDirLocked:
    who = "this process" if pid == os.getpid() else f"process {pid}" if pid else "a process"
    return RunDirLocked(
        f"run directory {run_path} is being written by {who} (it holds {run_path / LOCK_FILE}); "
        "two runs in one directory would corrupt it: wait for that run to end, or stop it "
        "and resume with --resume",
        pid,
    )


def lock_holder(run_path: str | Path) -> int | None:
    """The PID of the process writing ``run_path`` (0 when its PID is unreadable), or None
    when no process holds its lock. Only reads: no lock file is created."""
    path = Path(run_path) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(path) or 0
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def refuse_if_written(run_path: str | Path, what: str) -> None:
    """``RunDirLocked`` when a process is writing ``run_path``: ``what`` (a reader that needs a
    finished run, e.g. the audit, whose checkpoints the writer may prune under it) waits for
    the run's end."""
    holder = lock_holder(run_path)
    if holder is not None:
        who = f"process {holder}" if holder else "a process"
        raise RunDirLocked(
            f"run directory {run_path} is being written by {who}: {what} it when that run has "
            "ended",
            holder or None,
        )


def default_run_dir(algorithm: str, dataset: str, base: str | Path = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / f"{algorithm}-{dataset}-{stamp}"
    suffix = 2
    while path.exists():
        path = Path(base) / f"{algorithm}-{dataset}-{stamp}-{suffix}"
        suffix += 1
    return path


def config_sha256(config: dict[str, Any]) -> str:
    """SHA-256 of a resolved config's canonical JSON (recorded in each checkpoint manifest)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys at which two configs (nested mappings) differ, sorted."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            out += differing_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _at(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


class ConfigDriftWarning(UserWarning):
    """A run resumed under a config other than its checkpoint's (accepted explicitly)."""


class RunDir:
    def __init__(self, path: str | Path, lock: RunLock | None = None) -> None:
        self.path = Path(path)
        self.lock = lock
        """The writer's lock (``create``, ``open_for_writing``); None for a reader."""
        self.config: dict[str, Any] | None = None
        """The resolved config the run is under (set when config.yaml is written, or by the
        resume that read it): each checkpoint records it and its hash."""
        self.accept_config_change = False
        """Resume even if config.yaml changed since the checkpoint (``check_drift``)."""

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """A new, empty run directory, locked for this process; refuses an existing non-empty
        one (``RunDirLocked`` when another process is writing it)."""
        path = Path(path)
        cls.check_new(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot write to output directory {path}: {err.strerror}") from None
        lock = RunLock.acquire(path)
        if _has_files(path):  # another run started here since the check, and has ended
            lock.release()
            raise _not_empty(path)
        try:
            under(path, "checkpoints").mkdir(exist_ok=True)
            probe = under(path, ".write-test")
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            lock.release()
            raise RunDirError(f"cannot write to output directory {path}: {err.strerror}") from None
        return cls(path, lock)

    @staticmethod
    def check_new(path: str | Path) -> None:
        """Refuse ``path`` as a new run's directory unless it is absent or empty (cheap: the
        Python API checks before it loads data; ``create`` again under the lock)."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or _has_files(path)):
            holder = lock_holder(path) if path.is_dir() else None
            if holder is not None:
                raise _locked(path, holder)
            raise _not_empty(path)

    @classmethod
    def open_existing(cls, path: str | Path, accept_config_change: bool = False) -> RunDir:
        """An existing run directory, to read (no lock: ``open_for_writing`` to write); one
        holding a symbolic link anywhere is refused (core/runpaths.py)."""
        path = Path(path)
        if path.is_dir():
            refuse_links(path)
        if not (path / "config.yaml").is_file():
            raise RunDirError(f"{path} is not a fedloom run directory (no config.yaml)")
        run_dir = cls(path)
        run_dir.accept_config_change = accept_config_change
        return run_dir

    @classmethod
    def open_for_writing(cls, path: str | Path, accept_config_change: bool = False) -> RunDir:
        """An existing run directory to resume, locked for this process (``RunDirLocked``
        naming the process that is writing it)."""
        run_dir = cls.open_existing(path, accept_config_change)
        run_dir.lock = RunLock.acquire(run_dir.path)
        return run_dir

    def release(self) -> None:
        """Give up the writer's lock (the run has ended)."""
        if self.lock is not None:
            self.lock.release()

    # -- files: each named through core/runpaths.py's ``under`` (no link, never outside) ------
    def file(self, *parts: str) -> Path:
        """``RUN/parts``, refused when a component is a symbolic link."""
        return under(self.path, *parts)

    @property
    def config_path(self) -> Path:
        return self.file("config.yaml")

    @property
    def metrics_path(self) -> Path:
        return self.file("metrics.jsonl")

    @property
    def checkpoint_dir(self) -> Path:
        return self.file("checkpoints")

    def write_config(self, yaml_text: str) -> None:
        write_text_atomic(self.config_path, yaml_text)
        self.config = yaml.safe_load(yaml_text)

    def write_json(self, name: str, obj: Any) -> None:
        write_text_atomic(self.file(name), strict_json(obj, indent=2))

    def append_metrics(self, row: dict[str, Any]) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        fd = os.open(self.metrics_path, flags, 0o644)  # a log, not a program
        with os.fdopen(fd, "a") as f:
            f.write(strict_json(row) + "\n")

    def rewrite_metrics(self, rows: list[dict[str, Any]]) -> None:
        write_text_atomic(self.metrics_path, "".join(strict_json(r) + "\n" for r in rows))

    # -- checkpoints (engine/checkpoint.py: safetensors + a checksummed JSON manifest) ---------
    def checkpoint_path(self, round: int) -> Path:
        """The manifest of round ``round``'s checkpoint (its tensors sit beside it)."""
        return under(self.checkpoint_dir, _checkpoint_names(round)[0])

    def save_checkpoint(self, round: int, payload: dict[str, Any], keep: int) -> Path:
        """Write round ``round``'s checkpoint durably, then keep only the newest ``keep``.

        Checkpoints of later rounds are removed: they belong to a run that was resumed from an
        earlier checkpoint (their own was damaged) and are superseded by this one."""
        facts = None
        if self.config is not None:
            payload = {**payload, "config": self.config}
            facts = {"config_sha256": config_sha256(self.config)}
        for name in _checkpoint_names(round)[2:]:  # temporary names: a stale one, or a link
            self.file("checkpoints").joinpath(name).unlink(missing_ok=True)
        path = write_checkpoint(self.checkpoint_path(round), payload, facts)
        self.prune_checkpoints(keep, newest=round)
        return path

    def _checkpoint_rounds(self) -> dict[int, list[Path]]:
        """Every checkpoint file (finished, partial or temporary) by its round: only the names
        fedloom writes (``_checkpoint_names``, and older fedloom's pickles), nothing else of
        a file called round_*; a symbolic link among them is refused."""
        rounds: dict[int, list[Path]] = {}
        folder = self.checkpoint_dir
        for path in folder.glob("round_*"):
            match = _CHECKPOINT_NAME.fullmatch(path.name)
            if match and path.name in (*_checkpoint_names(int(match[1])), _legacy(match[1])):
                under(folder, path.name)
                rounds.setdefault(int(match[1]), []).append(path)
        return rounds

    def prune_checkpoints(self, keep: int, newest: int | None = None) -> None:
        """Delete all but the newest ``keep`` checkpoints (all files of a round go together);
        with ``newest``, first those of rounds after it."""
        rounds = self._checkpoint_rounds()
        if newest is not None:
            stale = [r for r in rounds if r > newest]
            for r in stale:
                for path in rounds.pop(r):
                    if path.suffix != ".pt":  # a pickle of older fedloom's: not ours to delete
                        path.unlink(missing_ok=True)
        for r in sorted(rounds)[:-keep]:
            for path in rounds[r]:
                if path.suffix != ".pt":
                    path.unlink(missing_ok=True)

    def checkpoints(self) -> list[Path]:
        """The finished checkpoints' manifests, oldest first (not yet verified)."""
        folder = self.checkpoint_dir
        return sorted(under(folder, p.name) for p in folder.glob(f"round_*{MANIFEST_SUFFIX}"))

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        """One checkpoint's payload, verified (raises ``CheckpointError`` naming the file)."""
        path = under(path.parent, path.name)
        under(path.parent, path.with_suffix(TENSOR_SUFFIX).name)
        return read_checkpoint(path)

    def latest_checkpoint(self, check: Check | None = None) -> dict[str, Any] | None:
        """The newest good checkpoint's payload, or None if there is none at all.

        A damaged or incomplete newer one (torn by a crash, a tampered byte, a tensor of
        another shape or dtype than the manifest's or ``check``'s, NaN weights) is skipped with
        a ``CheckpointWarning`` naming it; if every checkpoint is bad, ``RunDirError`` names
        them and says what to do.
        """
        rounds = self._checkpoint_rounds()
        legacy = sorted(p for files in rounds.values() for p in files if p.suffix == ".pt")
        candidates = sorted(
            (r for r, files in rounds.items() if any(_is_checkpoint_file(p) for p in files)),
            reverse=True,
        )
        if not candidates and legacy:
            raise RunDirError(
                f"{self.checkpoint_dir} holds only pickle checkpoints from an older fedloom "
                f"({', '.join(p.name for p in legacy)}); they are not loaded, because unpickling "
                "can run arbitrary code. Start the run again, or resume it with the fedloom "
                "version that wrote it."
            )
        failures: list[str] = []
        for r in candidates:
            try:
                manifest = self.checkpoint_path(r)
                under(manifest.parent, manifest.with_suffix(TENSOR_SUFFIX).name)
                return read_checkpoint(manifest, check)
            except CheckpointError as err:
                failures.append(str(err))
                warnings.warn(f"{err}; trying an older checkpoint", CheckpointWarning, stacklevel=2)
        if failures:
            raise RunDirError(
                f"no good checkpoint to resume {self.path} from: "
                + "; ".join(failures)
                + ". Restore its checkpoints/ from a copy, or start the run again in a new "
                "directory (fedloom run CONFIG --out NEW_DIR, with its config.yaml as CONFIG)"
            )
        return None

    def check_drift(self, saved: dict[str, Any]) -> None:
        """Resume ``saved`` (a checkpoint payload) under ``self.config`` (config.yaml as read
        now): refused with a RunDirError naming the first differing key when the checkpoint
        was written under another config (config.yaml edited since), unless
        ``accept_config_change`` (then a ``ConfigDriftWarning``)."""
        before, config = saved.get("config"), self.config
        if config is None:
            return
        changed = differing_keys(before, config) if isinstance(before, dict) else []
        if changed:
            key = changed[0]
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            what = (
                f"{key} was {_at(before, key)!r} when round {saved.get('round')}'s checkpoint "
                f"was written, and is {_at(config, key)!r} now{more}"
            )
            if not self.accept_config_change:
                raise RunDirError(
                    f"cannot resume {self.path}: its config changed since the checkpoint: "
                    f"{what}. Restore config.yaml, or resume with --accept-config-change "
                    "(accept_config_change=True) to continue under the new one"
                )
            warnings.warn(f"resuming under a changed config: {what}", ConfigDriftWarning, 2)


def _has_files(path: Path) -> bool:
    """Whether the directory holds anything but a lock file."""
    return any(p.name != LOCK_FILE for p in path.iterdir())


def _not_empty(path: Path) -> RunDirError:
    if not path.is_dir():
        return RunDirError(
            f"output directory {path} is a file; a run writes a folder: choose a new --out"
        )
    return RunDirError(
        f"output directory {path} already exists and is not empty; a run never "
        "overwrites another run: choose a new --out, or resume it with --resume"
    )


_CHECKPOINT_NAME = re.compile(r"round_(\d+)\..*")


def _checkpoint_names(round: int) -> tuple[str, ...]:
    """The files fedloom writes for round ``round``'s checkpoint: the manifest, the tensors,
    and their temporary names (engine/checkpoint.py); pruning deletes only these."""
    stem = f"round_{round:06d}"
    names = (f"{stem}{MANIFEST_SUFFIX}", f"{stem}{TENSOR_SUFFIX}")
    return (*names, *(f"{n}.tmp" for n in names))


def _legacy(digits: str) -> str:
    """An older fedloom's pickle checkpoint of that round (reported, never loaded)."""
    return f"round_{digits}.pt"


def _is_checkpoint_file(path: Path) -> bool:
    return path.suffix in (MANIFEST_SUFFIX, TENSOR_SUFFIX)
