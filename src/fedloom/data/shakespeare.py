"""Tiny Shakespeare split by speaking role: next-character prediction on 80-character windows.

The LEAF Shakespeare task (Caldas et al., "LEAF", 2018; McMahan et al., FedAvg, 2017) on
Karpathy's char-rnn ``input.txt``. A speech starts with a line ``NAME:`` that follows a blank
line (or opens the file) and runs to the next blank line; a role's text is its speeches joined
by newlines. The file has no play boundaries, so generic roles ("First Citizen") merge across
plays. Headings with an empty speech (interruptions) contribute nothing: 7,222 headings,
309 names, 299 with text. (The data README's 7,108 / 302 came from a non-overlapping regex that
misses a heading right after an empty speech.)

Each role's text is split chronologically: the first (1 - test_fraction) for training, the
tail for testing, so windows never straddle the two. Windows are ``unfold`` views over one
int64 tensor per part: sample i is text[i:i+80] -> text[i+80].
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from fedloom.core.settings import FrozenModel
from fedloom.data.download import ensure_files
from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.natural import add_natural_dataset, first_users, from_users
from fedloom.data.spec import DataRequest
from fedloom.errors import ConfigError

#: LEAF's vocabulary (``ALL_LETTERS`` in its language-model utilities): 80 characters.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
#: Characters outside the vocabulary (in input.txt only '$') map to the space's id.
UNKNOWN_ID = ALL_LETTERS.index(" ")
SEQ_LEN = 80
DEFAULT_MIN_CHARS = 2000
FILE = "tinyshakespeare/input.txt"
_HEADING = re.compile(r"^[A-Za-z][^:]*:$")

assert len(ALL_LETTERS) == 80 and len(set(ALL_LETTERS)) == 80


class ShakespeareOptions(FrozenModel):
    """``data.shakespeare`` options: roles with fewer characters are dropped."""

    min_chars: int = Field(DEFAULT_MIN_CHARS, ge=SEQ_LEN + 2)


def split_roles(text: str) -> dict[str, str]:
    """``{role: its speeches joined by newlines}`` in order of first appearance."""
    speeches: dict[str, list[str]] = {}
    current: list[str] | None = None
    prev_blank = True
    for line in text.split("\n"):
        if not line.strip():
            current, prev_blank = None, True
            continue
        if prev_blank and _HEADING.match(line):
            current = []
            speeches.setdefault(line[:-1], []).append(current)  # type: ignore[arg-type]
        elif current is not None:
            current.append(line)
        prev_blank = False
    roles = {}
    for name, parts in speeches.items():
        lines = ["\n".join(p) for p in parts if p]  # type: ignore[arg-type]
        roles[name] = "\n".join(lines)
    return roles


def encode(text: str) -> torch.Tensor:
    """Character ids (int64) of ``text`` in ``ALL_LETTERS``; unknown characters -> UNKNOWN_ID."""
    table = np.full(256, UNKNOWN_ID, dtype=np.int64)
    table[[ord(ch) for ch in ALL_LETTERS]] = np.arange(len(ALL_LETTERS))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.where(codes < 256, table[np.minimum(codes, 255)], UNKNOWN_ID)
    return torch.from_numpy(ids)


def windows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x (n, 80) view, y (n,) view)`` with x[i] = ids[i:i+80], y[i] = ids[i+80]."""
    n = max(len(ids) - SEQ_LEN, 0)
    if n == 0:
        return ids.new_zeros((0, SEQ_LEN)), ids.new_zeros((0,))
    return ids[: n + SEQ_LEN - 1].unfold(0, SEQ_LEN, 1), ids[SEQ_LEN:]


@lru_cache(maxsize=2)
def load_roles(root: str, root_source: str = "") -> dict[str, str]:
    """Role texts of ``ROOT/tinyshakespeare/input.txt`` (downloaded if missing and allowed)."""
    (path,) = ensure_files(Path(root), [FILE], dataset="shakespeare", root_source=root_source)
    return split_roles(path.read_text(encoding="utf-8"))


def build(req: DataRequest) -> FederatedData:
    opt = req.options
    assert isinstance(opt, ShakespeareOptions)
    roles = load_roles(str(req.root), req.root_source)
    kept = sorted(
        ((len(t), name) for name, t in roles.items() if len(t) >= opt.min_chars),
        key=lambda item: (-item[0], item[1]),
    )
    available = (
        f"only {len(kept)} roles have >= {opt.min_chars} characters (data.shakespeare.min_chars)"
    )
    kept = first_users(kept, req.num_clients, available)
    users = {}
    for length, name in kept:
        ids = encode(roles[name])
        cut = length - round(req.test_fraction * length)
        if min(cut, length - cut) <= SEQ_LEN:
            raise ConfigError(
                f"data.shakespeare.min_chars: role {name!r} ({length} chars) leaves fewer than "
                f"{SEQ_LEN + 1} characters on one side of the test_fraction={req.test_fraction} "
                "split; raise min_chars"
            )
        x_train, y_train = windows(ids[:cut])
        x_test, y_test = windows(ids[cut:])
        users[name] = ClientData(x_train, y_train, x_test, y_test)
    return from_users(
        "shakespeare",
        users,
        input_shape=(SEQ_LEN,),
        num_classes=len(ALL_LETTERS),
        extras={
            "vocab": ALL_LETTERS,
            "unknown_id": UNKNOWN_ID,
            "seq_len": SEQ_LEN,
            "role_chars": [length for length, _ in kept],
        },
    )


add_natural_dataset("shakespeare", build, options=ShakespeareOptions)
