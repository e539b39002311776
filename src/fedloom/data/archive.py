"""Datasets published as one archive (CIFAR-10, CIFAR-100, Tiny-ImageNet): find the unpacked
folder under the data root, or verify the archive against its published MD5, downloading it if
allowed, and unpack it safely.

Safe means: every member is a plain file or folder whose path stays inside the target (no
absolute path, no ``..``, no symbolic or hard link, no device), checked before anything is
written; the archive is unpacked into a temporary folder beside the target and renamed into
place, so an interrupted unpack leaves no half folder behind. ``FEDLOOM_OFFLINE=1`` (or no
network) is a DataError naming the files expected and the archive's address.
"""

from __future__ import annotations

import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from fedloom.data.download import OFFLINE_ENV, download, offline, verify
from fedloom.errors import DataError


@dataclass(frozen=True)
class Archive:
    """A published archive: where it is fetched from, its published MD5, where it is kept under
    the data root (``file``) and the folder it unpacks to (``folder``, whose last part is the
    archive's top-level folder)."""

    url: str
    md5: str
    file: str
    folder: str


def ensure_unpacked(
    root: Path, archive: Archive, needed: Sequence[str], *, dataset: str, root_source: str = ""
) -> Path:
    """The unpacked folder of ``archive`` under ``root`` holding every file of ``needed``
    (paths inside the folder): unpacked from the archive file, verified first, and downloaded
    first where it is missing and downloads are allowed."""
    folder = root / archive.folder
    if all((folder / name).is_file() for name in needed):
        return folder
    if folder.exists():
        missing = [name for name in needed if not (folder / name).is_file()]
        raise DataError(
            f"{dataset}: {folder} lacks {', '.join(missing)}. Remove the folder to unpack "
            f"{root / archive.file} again (downloaded from {archive.url} if missing)."
        )
    path = root / archive.file
    if not path.is_file():
        _fetch(root, archive, dataset, root_source)
    verify(path, archive.md5, "md5")
    unpack(path, folder)
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{dataset}: {path} did not hold {', '.join(missing)}")
    return folder


def _fetch(root: Path, archive: Archive, dataset: str, root_source: str) -> None:
    where = f"data root {root}" + (f" (from {root_source})" if root_source else "")
    expected = f"{dataset}: missing {root / archive.folder} (or the archive {root / archive.file})"
    fix = (
        f"Get {archive.url} (MD5 {archive.md5}) and put it at {root / archive.file}, or unpack "
        f"it there; choose another folder with data.root or FEDLOOM_DATA."
    )
    if offline():
        raise DataError(
            f"{expected} under {where}. Downloading is disabled ({OFFLINE_ENV}=1). {fix}"
        )
    try:
        download(archive.url, root / archive.file, archive.md5, "md5")
    except OSError as exc:  # URLError, HTTPError, timeouts, read-only folders
        raise DataError(f"{expected} under {where}. Download failed: {exc}. {fix}") from None


def unpack(path: Path, folder: Path) -> None:
    """Unpack the archive ``path`` (.tar.gz or .zip) whose one top-level folder is
    ``folder.name`` into ``folder``, refusing any unsafe member before writing anything."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".unpack", dir=folder.parent))
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    _check_member(path, info.filename, _zip_kind(info))
                zf.extractall(tmp)
        else:
            try:
                with tarfile.open(path) as tar:
                    members = tar.getmembers()
                    for member in members:
                        _check_member(path, member.name, _tar_kind(member))
                    tar.extractall(tmp, members=members, filter="data")
            except tarfile.TarError as exc:
                raise DataError(f"{path}: not a readable tar or zip archive ({exc})") from None
        top = tmp / folder.name
        if not top.is_dir():
            raise DataError(f"{path}: expected its files in a folder {folder.name}/")
        top.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.issym() or member.islnk():
        return "link"
    return "file" if member.isfile() else "folder" if member.isdir() else "special file"


def _zip_kind(info: zipfile.ZipInfo) -> str:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return "link"
    return "folder" if info.is_dir() else "file"


def _check_member(path: Path, name: str, kind: str) -> None:
    """DataError naming the member unless it is a plain file or folder inside the target."""
    parts = PurePosixPath(name.replace("\\", "/"))
    if kind not in ("file", "folder"):
        raise DataError(f"{path}: refused: member {name!r} is a {kind}")
    if parts.is_absolute() or ".." in parts.parts or (parts.parts and ":" in parts.parts[0]):
        raise DataError(f"{path}: refused: member {name!r} would be written outside the folder")
