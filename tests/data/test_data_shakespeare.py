"""Shakespeare by role: parsing, min_chars, 80-character windows, chronological split."""

from __future__ import annotations

import pytest
import torch

from fedloom.data import load_dataset
from fedloom.data.shakespeare import (
    ALL_LETTERS,
    DEFAULT_MIN_CHARS,
    UNKNOWN_ID,
    encode,
    load_roles,
    split_roles,
    windows,
)
from fedloom.errors import ConfigError


@pytest.fixture(scope="module")
def roles(data_root) -> dict[str, str]:
    return load_roles(str(data_root))


def test_vocabulary() -> None:
    assert len(ALL_LETTERS) == 80 and len(set(ALL_LETTERS)) == 80
    ids = encode("Ab\n$é}")
    assert ids.dtype == torch.int64
    assert ids.tolist() == [
        ALL_LETTERS.index("A"),
        ALL_LETTERS.index("b"),
        0,
        UNKNOWN_ID,
        UNKNOWN_ID,
        79,
    ]


def test_split_roles_rules() -> None:
    text = "First Citizen:\nHello there.\nTwo lines.\n\nROMEO:\n\nJULIET:\nO Romeo!\n\nROMEO:\nYes."
    roles = split_roles(text)
    assert roles == {
        "First Citizen": "Hello there.\nTwo lines.",
        "ROMEO": "Yes.",
        "JULIET": "O Romeo!",
    }


def test_role_counts(roles) -> None:
    # 309 distinct heading names; 10 of them only ever have empty (interrupted) speeches.
    assert len(roles) == 309
    assert sum(bool(t) for t in roles.values()) == 299
    assert roles["GLOUCESTER"].startswith("Now is the winter of our discontent")


def test_natural_partition_by_role(data_root, cfg, roles) -> None:
    fd = load_dataset(cfg("shakespeare", root=str(data_root)), seed=0)
    assert fd.num_outputs == 80 and fd.input_shape == (80,) and fd.extras["vocab"] == ALL_LETTERS
    assert {"GLOUCESTER", "ROMEO", "JULIET", "DUKE VINCENTIO"} <= set(fd.client_names)
    expected = sum(len(t) >= DEFAULT_MIN_CHARS for t in roles.values())
    assert fd.num_clients == expected == 99
    assert fd.client_names[0] == "GLOUCESTER"  # the largest role comes first
    assert min(fd.extras["role_chars"]) >= DEFAULT_MIN_CHARS
    for name, c in zip(fd.client_names, fd.clients, strict=True):
        assert c.x_train.shape[1] == 80 and c.x_train.dtype == torch.int64
        ids = encode(roles[name])
        # train windows then test windows rebuild the role text: chronological, no overlap
        train_text = torch.cat([c.x_train[0], c.y_train])
        test_text = torch.cat([c.x_test[0], c.y_test])
        assert torch.equal(torch.cat([train_text, test_text]), ids)
        assert len(test_text) == round(0.2 * len(ids))


def test_windows_are_views_with_next_char(data_root, cfg) -> None:
    fd = load_dataset(cfg("shakespeare", root=str(data_root), num_clients=3), seed=0)
    assert fd.client_names == ["GLOUCESTER", "DUKE VINCENTIO", "KING RICHARD II"]
    c = fd.clients[0]
    assert torch.equal(c.x_train[1:, :-1], c.x_train[:-1, 1:])
    assert torch.equal(c.y_train[:-1], c.x_train[1:, -1])
    text = "".join(ALL_LETTERS[i] for i in c.x_train[0].tolist())
    assert text.startswith("Now is the winter")
    # a view over the 1-D text: storage is ~ the text, not n x 80 copies
    assert c.x_train.untyped_storage().nbytes() < 2 * 8 * (c.num_train + c.num_test + 160)


def test_windows_helper() -> None:
    ids = torch.arange(100)
    x, y = windows(ids)
    assert x.shape == (20, 80) and torch.equal(x[5], torch.arange(5, 85)) and int(y[5]) == 85
    x, y = windows(torch.arange(80))
    assert x.shape == (0, 80) and y.shape == (0,)


def test_min_chars_and_num_clients(data_root, cfg) -> None:
    fd = load_dataset(cfg("shakespeare", root=str(data_root), options={"min_chars": 20000}), seed=0)
    assert fd.num_clients == 10 and min(fd.extras["role_chars"]) >= 20000
    with pytest.raises(ConfigError, match=r"data\.num_clients: only 10 roles"):
        load_dataset(
            cfg("shakespeare", root=str(data_root), num_clients=11, options={"min_chars": 20000}),
            seed=0,
        )
    with pytest.raises(ConfigError, match=r"data\.shakespeare\.min_chars: must be >= 82"):
        load_dataset(cfg("shakespeare", root=str(data_root), options={"min_chars": 5}), seed=0)
