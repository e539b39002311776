"""Checkpoints without pickle (issue #13): safetensors + a checksummed JSON manifest, exact round
trips of every kind of value the engine stores, durable atomic writes, and a fall-back past a
damaged newest checkpoint."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fedloom
from fedloom.algorithms import ALGORITHMS
from fedloom.config import parse_config
from fedloom.data import load_dataset
from fedloom.engine.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    _manifest_sha256,
    encode,
    read_checkpoint,
    write_checkpoint,
)
from fedloom.engine.loop import Engine, horizontal_timing
from fedloom.engine.rundir import RunDir, config_sha256
from fedloom.engine.shell import RunShell
from fedloom.engine.state_store import ClientStateStore
from fedloom.errors import RunDirError
from fedloom.models import build_model


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Equal values of the same types, all the way down (NaN equals NaN; dtypes, shapes,
    requires_grad and int-vs-str dict keys all count)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=path)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_identical(a[key], b[key], f"{path}/{key!r}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Generator):
        assert torch.equal(a.get_state(), b.get_state()), path
    elif isinstance(a, float | np.floating) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def every_kind() -> dict[str, Any]:
    """One of every kind of value a checkpoint may hold."""
    shared = torch.arange(6.0)
    generator = torch.Generator().manual_seed(7)
    torch.rand(3, generator=generator)  # a state that is not the seed's
    return {
        "round": 12,
        "server": {
            "params": {"fc1.weight": torch.randn(3, 4), "fc1.bias": torch.zeros(3)},
            "buffers": {},  # empty dicts survive
            "opt": {"step": torch.tensor(3), "m": None},
        },
        "dtypes": {
            str(dtype): torch.ones(2, 3).to(dtype)
            for dtype in (
                torch.float16,
                torch.bfloat16,
                torch.float64,
                torch.int8,
                torch.int32,
                torch.int64,
                torch.uint8,
                torch.bool,
            )
        },
        "scalar": torch.tensor(2.5),
        "empty_tensor": torch.zeros(0, 3),
        "nan_tensor": torch.tensor([float("nan"), float("inf"), -1.0]),
        "non_contiguous": torch.arange(12.0).view(3, 4).t(),
        "views": [shared, shared[2:4]],  # two tensors sharing one storage
        "same_object": [shared, shared],
        "grad": torch.ones(2, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "numbers": [0, -(2**70), 1.0, 0.1, float("nan"), float("inf"), -float("inf"), True],
        "text": ["", "ümlaut", "$not_a_tag", "a/b~c"],
        "keys": {1: "int key", "1": "str key", (2, 3): "tuple key", None: 0, "$x": 1},
        "slash/key": {"a/b": torch.ones(1), "a~1b": torch.zeros(1)},
        "tuple": (1, (2.0, "x"), []),
        "set": {3, 1, 2},
        "frozenset": frozenset({"a"}),
        "bytes": b"\x00\xff",
        "numpy": {
            "array": np.arange(6, dtype=np.int16).reshape(2, 3),
            # converted values are temporaries while writing: none may take another's place
            "arrays": [np.full(3, i) for i in range(20)],
            "f64": np.float64(0.1),
            "i32": np.int32(-5),
            "bool": np.bool_(True),
            "nan": np.float32("nan"),
        },
        "generator": generator,
        "generators": [torch.Generator().manual_seed(i) for i in range(20)],
        "torch_meta": [torch.float32, torch.Size([2, 3]), torch.device("cpu")],
        "history": [{"round": 2, "train_loss": None, "client_accuracy": {0: 0.5, 1: 1.0}}],
    }


def test_every_kind_of_value_round_trips_exactly(tmp_path):
    payload = every_kind()
    path = write_checkpoint(tmp_path / "round_000012.json", payload)
    loaded = read_checkpoint(path)
    assert_identical(payload, loaded)
    assert loaded["same_object"][0] is loaded["same_object"][1]  # one tensor, stored once
    assert loaded["views"][1].untyped_storage().data_ptr() != 0
    gen = loaded["generator"]
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=payload["generator"]))
    tensors = load_file(tmp_path / "round_000012.safetensors")
    assert torch.equal(
        tensors["server/params/fc1.weight"], payload["server"]["params"]["fc1.weight"]
    )
    assert "slash~1key/a~1b" in tensors and "slash~1key/a~01b" in tensors
    manifest = json.loads((tmp_path / "round_000012.json").read_text())
    assert manifest["tree"]["server"]["buffers"] == {}
    assert manifest["tree"]["round"] == 12


def test_a_value_that_cannot_be_stored_names_its_path():
    with pytest.raises(TypeError, match=r"builtins.object at server/hook"):
        encode({"server": {"hook": object()}})
    with pytest.raises(TypeError, match="numpy object array at x"):
        encode({"x": np.array([object()])})


@pytest.mark.parametrize("storage", ["memory", "mmap"])
def test_client_state_store_round_trips(tmp_path, storage):
    store = ClientStateStore(5, storage, tmp_path / "a")
    store.set(1, {"params": {"w": torch.randn(2, 3)}, "c": {}, "n": torch.tensor(4)})
    store.set(3, {"params": {"w": torch.randn(2, 3)}, "c": {}, "n": torch.tensor(1)})
    store.set(4, None)
    path = write_checkpoint(tmp_path / "round_000001.json", {"clients": store.state_dict()})
    again = ClientStateStore(5, storage, tmp_path / "b")
    again.load_state_dict(read_checkpoint(path)["clients"])
    assert list(again) == list(store) == [1, 3, 4]
    assert again.get(4) is None
    for client in (1, 3):
        assert_identical(store.get(client), again.get(client))


class VerifyingRunDir(RunDir):
    """A run directory that reads every checkpoint back as soon as it is written and checks
    that it equals what the engine handed over."""

    saved = 0

    def save_checkpoint(self, round: int, payload: dict[str, Any], keep: int) -> Path:
        path = super().save_checkpoint(round, payload, keep)
        # the checkpoint also records the config it was written under (config drift, README)
        assert self.config is not None
        assert_identical({**payload, "config": self.config}, self.read_checkpoint(path))
        manifest = json.loads(path.read_text())
        assert manifest["config_sha256"] == config_sha256(self.config)
        self.saved += 1
        return path


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithms_checkpoint_round_trips(tmp_path, name):
    config = parse_config(
        {
            "data": {"name": "digits", "num_clients": 4},
            "model": {"name": "cnn_bn" if name == "fedbn" else "mlp"},
            "algorithm": {"name": name},
            "train": {"rounds": 2, "clients_per_round": 3, "local_steps": 2},
            "eval": {"every": 1},
            "checkpoint": {"every": 1, "keep": 1},
            "executor": {"kind": "sequential"},
        }
    )
    data = load_dataset(config.data, config.seed)
    module = build_model(config.model.name, data.input_shape, data.num_outputs)
    run_dir = VerifyingRunDir.create(tmp_path / "run")
    run_dir.write_config(config.to_yaml())
    engine = Engine(config, data, module)
    engine.run(RunShell(run_dir, config, horizontal_timing(config), engine.name))
    assert run_dir.saved == 2
    # a real checkpoint fits the run that wrote it (engine/checkpoint_fit.py: no false alarm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert run_dir.latest_checkpoint(engine.checkpoint_fit())["round"] == 2
    assert [p.name for p in sorted(run_dir.checkpoint_dir.iterdir())] == [
        "round_000002.json",
        "round_000002.safetensors",
    ]


# -- damage -------------------------------------------------------------------------------------
CONFIG = {
    "data": {"name": "digits", "num_clients": 4},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 4, "clients_per_round": 2, "local_steps": 2},
    "eval": {"every": 2},
    "checkpoint": {"every": 2, "keep": 2},
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    fedloom.run(CONFIG, out=out, progress=False)
    return out


def copy_run(source: Path, target: Path) -> RunDir:
    import shutil

    shutil.copytree(source, target)
    return RunDir.open_existing(target)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_tampered_tensor_byte_fails_the_checksum(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    tensors = run.checkpoint_dir / "round_000004.safetensors"
    flip_byte(tensors, tensors.stat().st_size - 3)  # inside the last tensor's data
    with pytest.raises(CheckpointError, match=r"round_000004\.safetensors.*SHA-256"):
        run.read_checkpoint(run.checkpoint_path(4))
    with pytest.warns(CheckpointWarning, match=r"round_000004\.safetensors"):
        assert run.latest_checkpoint()["round"] == 2


def test_a_tampered_manifest_fails_its_checksum(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    manifest = run.checkpoint_path(4)
    text = manifest.read_text()
    assert '"bytes_up": ' in text
    manifest.write_text(text.replace('"bytes_up": ', '"bytes_up": 1', 1))
    with pytest.raises(CheckpointError, match=r"round_000004\.json.*SHA-256 of the manifest"):
        run.read_checkpoint(manifest)


def test_a_truncated_newest_checkpoint_falls_back_to_the_older_one(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    tensors = run.checkpoint_dir / "round_000004.safetensors"
    with tensors.open("r+b") as f:
        f.truncate(tensors.stat().st_size // 2)
    with pytest.warns(CheckpointWarning, match=r"round_000004\.safetensors.*bytes"):
        saved = run.latest_checkpoint()
    assert saved["round"] == 2 and [r["round"] for r in saved["history"]] == [2]


def test_an_unfinished_write_is_skipped(finished_run, tmp_path):
    """A crash between the two renames leaves the tensors without their manifest."""
    run = copy_run(finished_run, tmp_path / "run")
    run.checkpoint_path(4).unlink()
    (run.checkpoint_dir / "round_000006.json.tmp").write_text("{")  # a torn temporary
    with pytest.warns(CheckpointWarning, match=r"round_000004\.json.*no manifest"):
        assert run.latest_checkpoint()["round"] == 2


def test_no_good_checkpoint_is_a_run_dir_error_naming_each(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    for r in (2, 4):
        run.checkpoint_path(r).write_text("not json")
    with pytest.warns(CheckpointWarning), pytest.raises(RunDirError) as err:
        run.latest_checkpoint()
    assert "round_000002.json" in str(err.value) and "round_000004.json" in str(err.value)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert RunDir(tmp_path / "empty").latest_checkpoint() is None


class Boom:
    """A pickle that runs code when unpickled: it creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def reseal(manifest_path: Path, tree: Any = None) -> None:
    """Make the manifest's checksums match its tensor file as it is now (and set its tree): a
    forger's checkpoint, which only the decoder stands between and the loaded state."""
    tensors = manifest_path.with_suffix(".safetensors")
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors"].update(
        sha256=hashlib.sha256(tensors.read_bytes()).hexdigest(), bytes=tensors.stat().st_size
    )
    if tree is not None:
        manifest["tree"] = tree
    manifest["sha256"] = _manifest_sha256(manifest)
    manifest_path.write_text(json.dumps(manifest))


def test_a_malicious_pickle_is_never_executed(finished_run, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    # an old-style pickle checkpoint only: refused, not loaded
    legacy = RunDir.create(tmp_path / "legacy")
    (legacy.checkpoint_dir / "round_000009.pt").write_bytes(pickle.dumps({"x": Boom(marker)}))
    with pytest.raises(RunDirError, match=r"round_000009\.pt.*arbitrary code"):
        legacy.latest_checkpoint()
    # a pickle posing as the tensor file, with a manifest whose checksums match it
    run = copy_run(finished_run, tmp_path / "run")
    torch.save({"server": Boom(marker)}, run.checkpoint_dir / "round_000004.safetensors")
    reseal(run.checkpoint_path(4))

    # and no pickle path at all: loading never reaches an unpickler
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError, match=r"round_000004\.safetensors.*not a safetensors"):
        run.read_checkpoint(run.checkpoint_path(4))
    with pytest.warns(CheckpointWarning):
        assert run.latest_checkpoint()["round"] == 2
    assert not marker.exists()


@pytest.mark.parametrize(
    "tree",
    [
        {"server": {"$tensor": "no/such/key"}},
        {"g": {"$generator": "w", "device": "no-such-device"}},
        {"x": {"$npscalar": "O", "value": 1}},
        {"x": {"$dtype": "nn"}},
        {"x": {"$tuple": [], "$set": []}},
        {"x": {"$eval": "__import__('os')"}},
        {"x": {"$dict": [[1]]}},
        [1, 2],
    ],
)
def test_a_forged_tree_is_a_checkpoint_error(tmp_path, tree):
    path = write_checkpoint(tmp_path / "round_000001.json", {"w": torch.ones(2)})
    reseal(path, tree)
    with pytest.raises(CheckpointError, match=r"round_000001\.json"):
        read_checkpoint(path)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names fds via /proc (Linux)")
def test_each_file_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run = RunDir.create(tmp_path / "run")
    run.save_checkpoint(3, {"w": torch.ones(3), "round": 3}, keep=2)
    ckpt = str(run.checkpoint_dir.resolve())
    tensors_tmp = f"{ckpt}/round_000003.safetensors.tmp"
    manifest_tmp = f"{ckpt}/round_000003.json.tmp"
    assert events == [
        ("fsync", tensors_tmp),
        ("replace", tensors_tmp),
        ("fsync", manifest_tmp),
        ("replace", manifest_tmp),
        ("fsync", ckpt),  # the renames themselves are made durable
    ]


def test_keep_prunes_old_checkpoints_and_a_resave_drops_stale_later_ones(tmp_path):
    run = RunDir.create(tmp_path / "run")
    for r in (2, 4, 6, 8):
        run.save_checkpoint(r, {"round": r}, keep=3)
    names = sorted(p.name for p in run.checkpoint_dir.iterdir())
    assert names == [f"round_{r:06d}.{ext}" for r in (4, 6, 8) for ext in ("json", "safetensors")]
    # resumed from round 4 (say 6 and 8 were damaged): saving 6 supersedes both
    run.save_checkpoint(6, {"round": 6}, keep=3)
    assert [p.name for p in run.checkpoints()] == ["round_000004.json", "round_000006.json"]
    assert run.latest_checkpoint() == {"round": 6}


# -- what the run expects (engine/checkpoint_fit.py) ---------------------------------------------
def _fit_payload(weight: torch.Tensor, table: torch.Tensor | None = None) -> dict[str, Any]:
    """A RunState checkpoint with the server weight ``weight`` and, when given, a client table
    of personal weights ``table``."""
    from fedloom.engine.state import RunState

    store = ClientStateStore(3)
    if table is not None:
        store.tables["personal/params/fc.weight"] = table
    return RunState(server={"params": {"fc.weight": weight}, "step": 0}, clients=store).checkpoint()


def _fit_check(payload: dict[str, Any]) -> None:
    from fedloom.engine.checkpoint_fit import run_fit

    weight = torch.zeros(2, 3)
    check = run_fit({"fc.weight": weight}, _fit_payload(weight), slots=3)
    check(payload, encode(payload)[1])


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (
            _fit_payload(torch.zeros(2, 3, dtype=torch.int32)),
            ["server/params/fc.weight is int32 [2, 3]", "expects float32 [2, 3]"],
        ),
        (
            _fit_payload(torch.zeros(3, 2)),
            ["server/params/fc.weight is float32 [3, 2]", "expects float32 [2, 3]"],
        ),
        (
            _fit_payload(torch.zeros(2, 3), torch.zeros(3, 2, 4)),
            [
                "clients/tables/personal~1params~1fc.weight is float32 [3, 2, 4]",
                "expects float32 [3, 2, 3]",
            ],
        ),
        (
            _fit_payload(torch.zeros(2, 3), torch.zeros(2, 2, 3)),
            ["tables/personal~1params~1fc.weight", "3 rows"],
        ),
        (
            _fit_payload(torch.tensor([[0.0, float("nan"), 1], [0, 0, float("inf")]])),
            ["server/params/fc.weight holds 2 NaN or infinite"],
        ),
        (
            {**_fit_payload(torch.zeros(2, 3)), "round": "3"},
            ["round: Input should be a valid integer"],
        ),
        (
            {
                **_fit_payload(torch.zeros(2, 3)),
                "server": {"params": {"fc.weight": torch.zeros(2, 3)}, "step": "0"},
            },
            ["server/step is a string, the run expects a number"],
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_run_names_the_tensor(payload, words):
    from fedloom.engine.checkpoint import CheckpointMismatch

    with pytest.raises(CheckpointMismatch) as err:
        _fit_check(payload)
    for word in words:
        assert word in str(err.value)


def test_a_fitting_checkpoint_passes_the_run_check():
    _fit_check(_fit_payload(torch.ones(2, 3), torch.ones(3, 2, 3)))
    _fit_check(_fit_payload(torch.ones(2, 3), torch.ones(3, 5, 2, 3)))  # a stack per client


def test_a_tensor_unlike_the_manifests_record_is_damage_with_valid_checksums(tmp_path):
    from tests.rundir.damage import rehash_tensor_file

    path = write_checkpoint(tmp_path / "round_000001.json", {"w": torch.ones(3)})
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3, dtype=torch.int32)}, path.with_suffix(".safetensors"))
    rehash_tensor_file(path)
    with pytest.raises(
        CheckpointError, match=r"tensor w is int32 \[3\], the manifest recorded float32 \[3\]"
    ):
        read_checkpoint(path)


def test_a_manifest_without_a_record_of_its_tensors_still_reads(tmp_path):
    """Manifests written before ``tensors.layout`` was recorded."""
    path = write_checkpoint(tmp_path / "round_000001.json", {"w": torch.arange(3.0)})
    manifest = json.loads(path.read_text())
    del manifest["tensors"]["layout"]
    manifest["sha256"] = _manifest_sha256(manifest)
    path.write_text(json.dumps(manifest))
    assert torch.equal(read_checkpoint(path)["w"], torch.arange(3.0))


def test_a_flat_copy_keyed_by_a_weight_name_outside_the_weights_places_is_not_checked():
    """A compressor's residual (mechanisms/compression/...) is keyed by weight name but flat."""
    payload = _fit_payload(torch.zeros(2, 3))
    payload["mechanisms"] = {"compression": {"residual": {0: {"fc.weight": torch.zeros(6)}}}}
    _fit_check(payload)
