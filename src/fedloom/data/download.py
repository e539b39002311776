"""Find data files under the data root, verify their SHA-256, and download missing ones.

Every loader asks :func:`ensure_files` for the files it needs. Files with a known checksum
(``KNOWN_FILES``) are verified whether found locally or downloaded; downloads go to a temporary
file in the target folder and are renamed into place only after the hash matches. Set
``FEDLOOM_OFFLINE=1`` to forbid all network access.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedloom.errors import DataError

OFFLINE_ENV = "FEDLOOM_OFFLINE"
TIMEOUT_S = 60.0
_CHUNK = 1 << 20

_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_FASHION_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)


@dataclass(frozen=True)
class KnownFile:
    """A published data file: where to fetch it and its SHA-256."""

    sha256: str
    url: str


KNOWN_FILES: dict[str, KnownFile] = {
    "mnist/train-images-idx3-ubyte.gz": KnownFile(
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        _MNIST_URL + "train-images-idx3-ubyte.gz",
    ),
    "mnist/train-labels-idx1-ubyte.gz": KnownFile(
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        _MNIST_URL + "train-labels-idx1-ubyte.gz",
    ),
    "mnist/t10k-images-idx3-ubyte.gz": KnownFile(
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        _MNIST_URL + "t10k-images-idx3-ubyte.gz",
    ),
    "mnist/t10k-labels-idx1-ubyte.gz": KnownFile(
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        _MNIST_URL + "t10k-labels-idx1-ubyte.gz",
    ),
    "fashion-mnist/train-images-idx3-ubyte.gz": KnownFile(
        "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
        _FASHION_URL + "train-images-idx3-ubyte.gz",
    ),
    "fashion-mnist/train-labels-idx1-ubyte.gz": KnownFile(
        "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
        _FASHION_URL + "train-labels-idx1-ubyte.gz",
    ),
    "fashion-mnist/t10k-images-idx3-ubyte.gz": KnownFile(
        "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
        _FASHION_URL + "t10k-images-idx3-ubyte.gz",
    ),
    "fashion-mnist/t10k-labels-idx1-ubyte.gz": KnownFile(
        "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        _FASHION_URL + "t10k-labels-idx1-ubyte.gz",
    ),
    "tinyshakespeare/input.txt": KnownFile(
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", _SHAKESPEARE_URL
    ),
}

_LABELS = {"sha256": "SHA-256", "md5": "MD5"}


def _label(algorithm: str) -> str:
    return _LABELS.get(algorithm, algorithm)


# (resolved path, size, mtime_ns, algorithm) -> digest of files already hashed in this process.
_HASH_CACHE: dict[tuple[str, int, int, str], str] = {}


def offline() -> bool:
    """True when ``FEDLOOM_OFFLINE`` forbids downloads."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """The ``algorithm`` digest (hashlib's name: sha256, md5) of ``path``, cached by (path,
    size, mtime) so repeated loads hash once."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, algorithm)
    if key not in _HASH_CACHE:
        digest = hashlib.new(algorithm)
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        _HASH_CACHE[key] = digest.hexdigest()
    return _HASH_CACHE[key]


def sha256_of(path: Path) -> str:
    """SHA-256 of ``path`` (:func:`file_digest`)."""
    return file_digest(path)


def verify(path: Path, expected: str, algorithm: str = "sha256") -> None:
    """DataError (naming the file and both digests) unless ``path``'s ``algorithm`` digest is
    ``expected``."""
    actual = file_digest(path, algorithm)
    if actual != expected:
        raise DataError(
            f"checksum mismatch for {path}: expected {_label(algorithm)} {expected}, got {actual}. "
            "The file is corrupt or a different version; delete it to download it again."
        )


def download(url: str, target: Path, expected: str, algorithm: str = "sha256") -> None:
    """Fetch ``url`` to ``target`` atomically (temp file in the same folder, renamed once its
    ``algorithm`` digest is ``expected``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.new(algorithm)
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            while chunk := resp.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != expected:
            raise DataError(
                f"checksum mismatch for {url}: expected {_label(algorithm)} {expected}, "
                f"got {digest.hexdigest()}; not saved to {target}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_files(
    root: Path, relpaths: Sequence[str], *, dataset: str, root_source: str = "", how: str = ""
) -> list[Path]:
    """Paths of ``relpaths`` under ``root``, verified, downloading missing ones if allowed.

    Raises DataError listing every missing file, where it looked, and how to get them.
    """
    paths = [root / rel for rel in relpaths]
    missing = [rel for rel, p in zip(relpaths, paths, strict=True) if not p.is_file()]
    failures: list[str] = []
    if missing and not offline():
        for rel in list(missing):
            known = KNOWN_FILES.get(rel)
            if known is None:
                continue
            try:
                download(known.url, root / rel, known.sha256)
                missing.remove(rel)
            except DataError:
                raise
            except OSError as exc:  # URLError, HTTPError, timeouts, read-only folders
                failures.append(f"{known.url}: {exc}")
    if missing:
        raise DataError(_missing_message(root, missing, dataset, root_source, how, failures))
    for rel, p in zip(relpaths, paths, strict=True):
        if rel in KNOWN_FILES:
            verify(p, KNOWN_FILES[rel].sha256)
    return paths


def _missing_message(
    root: Path, missing: list[str], dataset: str, root_source: str, how: str, failures: list[str]
) -> str:
    where = f"data root {root}" + (f" (from {root_source})" if root_source else "")
    lines = [
        f"{dataset}: missing file(s) under {where}: " + ", ".join(str(root / m) for m in missing)
    ]
    if offline():
        lines.append(f"Downloading is disabled ({OFFLINE_ENV}=1).")
    elif failures:
        lines.append("Download failed: " + "; ".join(failures))
    urls = [KNOWN_FILES[m].url for m in missing if m in KNOWN_FILES]
    if urls:
        lines.append(
            "Get them from " + ", ".join(urls) + f" and put them under {root} with the same "
            f"relative paths (or unset {OFFLINE_ENV} and rerun to download them)."
        )
    if how:
        lines.append(how)
    lines.append("Choose another folder with data.root or the FEDLOOM_DATA environment variable.")
    return " ".join(lines)
