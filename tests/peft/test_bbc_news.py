"""The BBC News loader: sorted classes, duplicates dropped before any split, token ids."""

from __future__ import annotations

import hashlib

import torch

from fedloom.config import parse_config
from fedloom.data import load_dataset
from fedloom.data.bbc_news import read_articles
from tests.peft.helpers import tiny_config


def test_unique_articles_in_sorted_class_order():
    classes, labels, raw = read_articles()
    assert classes == sorted(classes) and len(classes) == 5
    assert len(raw) == 2127  # 2,225 files, 98 byte-identical duplicates (docs/peft.md)
    assert len({hashlib.sha256(r).hexdigest() for r in raw}) == len(raw)
    assert labels == sorted(labels, key=classes.index)


def test_clients_hold_token_ids_and_no_headline_is_on_both_sides():
    cfg = parse_config(tiny_config())
    data = load_dataset(cfg.data, cfg.seed)
    assert data.name == "bbc_news" and data.num_outputs == 5 and data.input_shape == (12,)
    train = torch.cat([c.x_train for c in data.clients])
    test = torch.cat([c.x_test for c in data.clients])
    assert train.dtype == torch.int64 and int(train.max()) < 30522
    assert (train[:, 0] == 101).all()  # [CLS] first, pad id 0 after [SEP]
    assert len(train) + len(test) == 2127
    counts = [torch.bincount(c.y_train, minlength=5) for c in data.clients]
    assert max(int((c > 0).sum()) for c in counts) <= 5
    assert min(float(c.max()) / float(c.sum()) for c in counts) > 0.3  # label skew
