"""Generated damage to a finished run directory (tests/rundir/test_damage_fuzz.py): wrong JSON
types at every key of its JSON files, truncated files, and checkpoint tensors of another shape
or dtype, or non-finite, with their checksums recomputed so that only a check of the tensors
themselves can tell (engine/checkpoint.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WRONG: list[Any] = [None, 5, -1, 2.5, True, "abc", [], {}, [1, "x"], {"a": 1}]
"""JSON values that are the wrong type (or value) for almost every key."""


@dataclass(frozen=True)
class Damage:
    """One damage: ``apply(run_dir)`` does it; ``name`` says what it did."""

    name: str
    apply: Callable[[Path], None]
    target: str = ""
    """The file (relative to the run directory) it damages."""
    tensor: str | None = None
    """The checkpoint tensor it changes (tensor damage only)."""


# -- JSON keys --------------------------------------------------------------------------------
def key_paths(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path of a JSON tree (dict keys and list indices), parents before children."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield (*prefix, key)
            yield from key_paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree[:2]):  # the first two items stand for the rest
            yield (*prefix, i)
            yield from key_paths(value, (*prefix, i))


def set_at(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def json_type_damages(
    run_dir: Path,
    rel: str,
    rehash: bool = False,
    keep: Callable[[tuple[Any, ...]], bool] = bool,
) -> list[Damage]:
    """A wrong value at each key of ``rel`` (a JSON file) whose path passes ``keep``, cycling
    through ``WRONG`` so that each key gets a few kinds; ``rehash``: recompute a checkpoint
    manifest's own SHA-256."""
    tree = json.loads((run_dir / rel).read_text())
    out = []
    for i, path in enumerate(key_paths(tree)):
        if not keep(path) or (rehash and path[0] == "sha256"):
            continue  # (the checksum itself: a wrong one is a checksum mismatch)
        for value in (WRONG[i % len(WRONG)], WRONG[(i + 3) % len(WRONG)]):
            out.append(
                Damage(
                    f"{rel}:{dotted(path)}={json.dumps(value)}",
                    _json_setter(rel, path, value, rehash),
                    rel,
                )
            )
    return out


def _json_setter(
    rel: str, path: tuple[Any, ...], value: Any, rehash: bool
) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        file = run_dir / rel
        tree = set_at(json.loads(file.read_text()), path, value)
        if rehash:
            tree["sha256"] = manifest_sha256(tree)
        file.write_text(json.dumps(tree))

    return apply


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """What engine/checkpoint.py records as a manifest's own checksum (written here again: a
    forger needs no fedloom)."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


# -- truncated files --------------------------------------------------------------------------
def truncation_damages(run_dir: Path, rels: list[str]) -> list[Damage]:
    """Each file cut to nothing and to half its bytes."""
    out = []
    for rel in rels:
        for share in (0.0, 0.5):
            out.append(Damage(f"{rel}:truncated to {share:.0%}", _truncator(rel, share), rel))
    return out


def _truncator(rel: str, share: float) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        file = run_dir / rel
        data = file.read_bytes()
        file.write_bytes(data[: int(len(data) * share)])

    return apply


# -- checkpoint tensors -----------------------------------------------------------------------
TensorChange = Callable[[torch.Tensor], torch.Tensor]


def _other_shape(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.cat([flat, flat[:1]]) if flat.numel() else torch.zeros(1, dtype=t.dtype)


def _nan(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[0] = float("nan")
    return out


def _inf(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[-1] = float("inf")
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32) if t.dtype != torch.int32 else t.to(torch.int64)


def _float64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.dtype != torch.float64 else t.to(torch.float32)


CHANGES: dict[str, TensorChange] = {
    "another shape": _other_shape,
    "one more dimension": lambda t: t.unsqueeze(0),
    "stored as int32": _int32,
    "stored as float64": _float64,
    "a NaN": _nan,
    "an inf": _inf,
}
FLOAT_ONLY = {"a NaN", "an inf"}


def tensor_damages(
    run_dir: Path, manifest_rel: str, forge: bool = False, only: Callable[[str], bool] = bool
) -> list[Damage]:
    """Each change of ``CHANGES`` to each tensor (whose key passes ``only``) of the checkpoint
    ``manifest_rel``, the tensor file's and the manifest's checksums recomputed; ``forge``:
    the manifest's record of each tensor's dtype and shape rewritten too, so that only what the
    run expects can tell."""
    manifest = run_dir / manifest_rel
    tensors = load_file(manifest.with_suffix(".safetensors"))
    out = []
    for key, value in sorted(tensors.items()):
        if not only(key):
            continue
        for what, change in CHANGES.items():
            if what in FLOAT_ONLY and not value.dtype.is_floating_point:
                continue
            out.append(
                Damage(
                    f"{manifest_rel}:{key}: {what}{' (record forged)' if forge else ''}",
                    _tensor_changer(manifest_rel, key, change, forge),
                    manifest_rel,
                    key,
                )
            )
    return out


def _tensor_changer(
    manifest_rel: str, key: str, change: TensorChange, forge: bool
) -> Callable[[Path], None]:
    def apply(run_dir: Path) -> None:
        manifest = run_dir / manifest_rel
        tensor_file = manifest.with_suffix(".safetensors")
        tensors = load_file(tensor_file)
        tensors[key] = change(tensors[key]).contiguous()
        save_file(tensors, tensor_file)
        rehash_tensor_file(manifest, tensors if forge else None)

    return apply


def rehash_tensor_file(manifest: Path, layout_of: dict[str, torch.Tensor] | None = None) -> None:
    """Record the tensor file's new SHA-256 and size in ``manifest``, and its own checksum;
    with ``layout_of``, also those tensors' dtypes and shapes as the manifest's record."""
    tree = json.loads(manifest.read_text())
    data = manifest.with_suffix(".safetensors").read_bytes()
    tree["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()
    tree["tensors"]["bytes"] = len(data)
    if layout_of is not None:
        tree["tensors"]["layout"] = {
            k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
            for k, v in layout_of.items()
        }
    tree["sha256"] = manifest_sha256(tree)
    manifest.write_text(json.dumps(tree))
