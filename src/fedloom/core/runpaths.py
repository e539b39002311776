"""Paths under a run directory, opened inside it. A run directory someone sent you is a trust
boundary (README.md, "Run directory"; docs/architecture.md, "A run directory is a trust
boundary"): it may hold symbolic links to anywhere on this disk, and a command that followed
one would read, overwrite or delete files outside the run.

So every file fedloom reads or writes under a run directory is named through :func:`under`,
which refuses a path with any component below the run directory that is a symbolic link, or
that leaves it (``..``, an absolute name); and each command that opens a run directory (resume,
export, report, compare, audit, summary, the dashboard's listing) first looks through the
whole tree for a link (:func:`refuse_links`). The run directory itself may be a link (the
user named it); nothing below it may. A refusal is a ``RunDirError`` (exit status 2) naming
the link and where it points."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fedloom.errors import RunDirError

LINK_HINT = (
    "fedloom follows no symbolic link inside a run directory (it could point anywhere on this "
    "disk): replace the link by the file or folder itself"
)


def link_error(path: Path) -> RunDirError:
    """The refusal of the symbolic link ``path``, saying where it points."""
    try:
        where = f" (to {os.readlink(path)})"
    except OSError:
        where = ""
    return RunDirError(f"{path} is a symbolic link{where}; {LINK_HINT}")


def under(root: str | Path, *parts: str | Path, what: str = "run directory file") -> Path:
    """``root / parts`` after checking each component below ``root``: none may be a symbolic
    link (an absent one is fine: a file about to be written), and the name may not leave
    ``root`` (``..`` or an absolute path; ``what`` names where the name came from)."""
    root = Path(root)
    if not all(isinstance(p, str | Path) for p in parts):
        raise RunDirError(f"{what}: {parts!r} is not a file name")
    rel = Path(*parts) if parts else Path()
    if rel.is_absolute() or ".." in rel.parts:
        raise RunDirError(f"{what}: {str(rel)!r} points outside {root}; refused")
    path = root
    for part in rel.parts:
        path = path / part
        if path.is_symlink():
            raise link_error(path)
    return path


def find_link(root: str | Path) -> Path | None:
    """The first symbolic link anywhere below ``root`` (a folder's own entries, sorted, before
    its subfolders'), or None. Links to folders are found, not entered."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            if path.is_symlink():
                return path
    return None


def refuse_links(root: str | Path) -> None:
    """``RunDirError`` naming the first symbolic link below the run directory ``root``."""
    link = find_link(root)
    if link is not None:
        raise link_error(link)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` (already checked with :func:`under`) under a temporary name beside it,
    then rename it into place: a reader never sees half a file. The temporary name is created
    afresh (``O_EXCL``, ``O_NOFOLLOW``), so a link planted there is never written through, and
    the rename replaces a link at ``path`` itself rather than its target."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a stale one (a crash), or a planted link: removed, not followed
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as err:
        raise RunDirError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
