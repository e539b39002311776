"""Config errors name the key and the closest valid name."""

from __future__ import annotations

import pytest

from fedloom.data import load_dataset
from fedloom.errors import ConfigError


def _raises(cfg_obj, pattern: str) -> str:
    with pytest.raises(ConfigError, match=pattern) as info:
        load_dataset(cfg_obj, seed=0)
    return str(info.value)


def test_unknown_dataset_suggests_closest(cfg) -> None:
    msg = _raises(cfg("mnsit"), r"^data\.name: unknown dataset 'mnsit'")
    assert "Did you mean 'mnist'?" in msg


def test_unknown_partition_suggests_closest(cfg) -> None:
    msg = _raises(cfg("digits", partition={"kind": "dirichlett"}), r"^data\.partition\.kind")
    assert "'dirichlet'" in msg


@pytest.mark.parametrize("alpha", [-1, 0])
def test_bad_alpha(cfg, alpha) -> None:
    msg = _raises(cfg("digits", partition={"kind": "dirichlet", "alpha": alpha}), "alpha")
    assert msg == f"data.partition.alpha: must be > 0, got {alpha}"


def test_unknown_keys(cfg) -> None:
    msg = _raises(cfg("synthetic", options={"alhpa": 1.0}), r"^data\.synthetic\.alhpa")
    assert msg.startswith("data.synthetic.alhpa: unknown key, did you mean 'alpha'?")
    _raises(cfg("digits", partition={"kind": "dirichlet", "alpah": 1}), r"data\.partition\.alpah")
    _raises(cfg("mnist", options={"x": 1}), r"data\.mnist\.x: unknown key")
    _raises(cfg("synthetic", options={"iid": "maybe"}), r"data\.synthetic\.iid: ")


@pytest.mark.parametrize(
    ("name", "kind", "allowed"),
    [("digits", "natural", "iid, dirichlet"), ("synthetic", "dirichlet", "allowed: natural")],
)
def test_unsupported_partition(cfg, name, kind, allowed) -> None:
    msg = _raises(cfg(name, partition={"kind": kind}), r"^data\.partition\.kind: dataset")
    assert allowed in msg


@pytest.mark.parametrize(
    ("num_clients", "spc", "why"),
    [
        (4, 11, "must be <= the number of classes"),
        (2, 2, "cannot deal 2 clients x 2 = 4 shards over 10 classes"),
        (1000, 2, "2000 shards, more than the 1797 samples"),
    ],
)
def test_impossible_shards(cfg, num_clients, spc, why) -> None:
    part = {"kind": "shards", "shards_per_client": spc}
    msg = _raises(
        cfg("digits", num_clients=num_clients, partition=part),
        r"^data\.partition\.shards_per_client: ",
    )
    assert why in msg


def test_too_many_clients(cfg) -> None:
    _raises(cfg("digits", num_clients=5000), r"^data\.num_clients: 5000 clients")
    _raises(cfg("digits", num_clients=0), r"^data\.num_clients: must be an integer >= 1")
    _raises(
        cfg("digits", num_clients=200, partition={"kind": "dirichlet", "alpha": 1}),
        r"^data\.partition\.min_size: 200 clients x min_size 10 exceeds",
    )


@pytest.mark.parametrize("f", [0.0, 1.0, -0.1])
def test_bad_test_fraction(cfg, f) -> None:
    _raises(cfg("digits", test_fraction=f), r"^data\.test_fraction: must be > 0 and < 1")


def test_rotation_needs_images(cfg) -> None:
    # synthetic only allows natural, so rotation is refused before any data is made
    _raises(cfg("synthetic", partition={"kind": "rotation"}), r"allowed: natural")
