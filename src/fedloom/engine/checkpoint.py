"""Checkpoint files that never unpickle (issue #13).

One checkpoint is a pair of files in ``checkpoints/``:

- ``round_NNNNNN.safetensors``: every tensor of the payload, under its flattened path in the
  tree (``server/params/fc1.weight``; a ``/`` or ``~`` inside one key is escaped as in JSON
  Pointer, RFC 6901: ``~1``, ``~0``). safetensors stores dtype and shape, nothing executable.
- ``round_NNNNNN.json``: the manifest: the payload's tree with every tensor replaced by a
  reference to its key, the SHA-256 and size of the tensor file and each tensor's dtype and
  shape (``tensors.layout``), and a SHA-256 of the manifest itself. Values JSON cannot hold
  exactly are tagged (``{"$tuple": [...]}``, see :func:`encode`), so ints stay ints, tuples
  stay tuples, int dict keys stay ints and NaN stays NaN.

Writing: each file goes to a temporary name, is flushed and ``os.fsync``-ed, then atomically
renamed with ``os.replace``; the tensor file first, the manifest (the commit point) last, then
the directory is fsync-ed. A power cut leaves either the previous checkpoint or the new one,
and a torn file is caught by its checksum when the checkpoint is read.

Reading trusts nothing (a run directory may come from anyone): the manifest is checked against
its typed model (core/run_files.py), every tensor against the dtype and shape the manifest
recorded, and then, by the reader's ``check``, against what the run expects
(engine/checkpoint_fit.py: the model's shapes and dtypes, no NaN or infinite weight). A
checkpoint failing any of these is damaged (``CheckpointError``): the run directory falls back
to the older one (engine/rundir.py, ``latest_checkpoint``); a tensor is never cast.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fedloom.core.run_files import CheckpointManifest, type_problem
from fedloom.errors import RunDirError

FORMAT = "fedloom-checkpoint"
VERSION = 1
TENSOR_SUFFIX = ".safetensors"
MANIFEST_SUFFIX = ".json"
_CHUNK = 1 << 20


class CheckpointError(RunDirError):
    """A checkpoint is damaged, incomplete or not a fedloom checkpoint; names the file."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older good one."""


class CheckpointMismatch(ValueError):
    """A checkpoint that is whole does not fit the run reading it (a ``Check``'s verdict: the
    message names the tensor or key, and what the run expects)."""


Check = Callable[[dict[str, Any], dict[str, torch.Tensor]], None]
"""What a reader expects of a checkpoint: called with the payload and its tensors by key;
raises ``CheckpointMismatch`` when they do not fit."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(tensor: torch.Tensor) -> str:
    """``float32 [10, 64]``: a tensor's dtype and shape, for messages."""
    return f"{dtype_name(tensor.dtype)} {list(tensor.shape)}"


# -- the tree <-> (JSON, tensors) ---------------------------------------------------------------
def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _is_plain_key(key: object) -> bool:
    return type(key) is str and not key.startswith("$")


class _Encoder:
    """Walks a payload, collecting its tensors under unique flattened keys."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, str] = {}  # the same tensor object twice: one entry, one object
        self._storages: set[tuple[str, int]] = set()
        self._alive: list[torch.Tensor] = []  # so no id() or storage address is reused meanwhile

    def tensor(self, value: torch.Tensor, path: tuple[str, ...]) -> str:
        if id(value) in self._by_id:
            return self._by_id[id(value)]
        key = "/".join(_escape(p) for p in path) or "."
        unique, n = key, 1
        while unique in self.tensors:  # e.g. the str key "1" beside the int key 1
            unique, n = f"{key}#{n}", n + 1
        data = value.detach().cpu()
        storage = (str(data.device), data.untyped_storage().data_ptr())
        if storage[1] and storage in self._storages:  # a view of a stored tensor: own copy
            data = data.clone()
        self._storages.add((str(data.device), data.untyped_storage().data_ptr()))
        self.tensors[unique] = data.contiguous()
        self._by_id[id(value)] = unique
        self._alive.append(value)
        return unique

    def encode(self, value: Any, path: tuple[str, ...]) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        method = _ENCODE_BY_TYPE.get(kind)
        if method is not None:
            return method(self, value, path)
        if isinstance(value, np.generic) and not value.dtype.hasobject:
            return {"$npscalar": value.dtype.str, "value": self.encode(value.item(), path)}
        raise TypeError(
            f"checkpoint: cannot store a {kind.__module__}.{kind.__qualname__} at "
            f"{'/'.join(path) or '(root)'}; state must be tensors, numpy arrays, numbers, "
            "strings, None, bools and lists/tuples/sets/dicts of them"
        )

    def items(self, values: Any, path: tuple[str, ...]) -> list[Any]:
        """The members of a list or tuple, each under its index."""
        return [self.encode(v, (*path, str(i))) for i, v in enumerate(values)]

    def mapping(self, value: dict[Any, Any], path: tuple[str, ...]) -> Any:
        """A plain JSON object when every key is a str not starting with ``$``, else pairs."""
        if all(_is_plain_key(k) for k in value):
            return {k: self.encode(v, (*path, k)) for k, v in value.items()}
        return {
            "$dict": [
                [self.encode(k, (*path, "$key")), self.encode(v, (*path, str(k)))]
                for k, v in value.items()
            ]
        }

    def collection(self, value: set[Any] | frozenset[Any], path: tuple[str, ...]) -> Any:
        tag = "$set" if type(value) is set else "$frozenset"
        return {tag: [self.encode(v, (*path, "$item")) for v in value]}

    def tensor_ref(self, value: torch.Tensor, path: tuple[str, ...]) -> dict[str, Any]:
        """A reference to the stored tensor, with what the tensor file does not keep."""
        ref: dict[str, Any] = {"$tensor": self.tensor(value, path)}
        if type(value) is torch.nn.Parameter:
            ref["parameter"] = True
        if value.requires_grad:
            ref["requires_grad"] = True
        if value.device.type != "cpu":
            ref["device"] = str(value.device)
        return ref

    def ndarray(self, value: np.ndarray, path: tuple[str, ...]) -> dict[str, Any]:
        if value.dtype.hasobject:
            raise TypeError(f"checkpoint: numpy object array at {'/'.join(path)}")
        return {"$ndarray": self.tensor(torch.from_numpy(np.ascontiguousarray(value)), path)}

    def generator(self, value: torch.Generator, path: tuple[str, ...]) -> dict[str, Any]:
        return {"$generator": self.tensor(value.get_state(), path), "device": str(value.device)}


_Encode = Callable[[_Encoder, Any, tuple[str, ...]], Any]

# how each type (matched exactly, not by subclass) is written; see :func:`decode` for the reverse
_ENCODE_BY_TYPE: dict[type, _Encode] = {
    float: lambda _, v, __: v if math.isfinite(v) else {"$float": repr(v)},
    list: _Encoder.items,
    tuple: lambda enc, v, path: {"$tuple": enc.items(v, path)},
    dict: _Encoder.mapping,
    set: _Encoder.collection,
    frozenset: _Encoder.collection,
    torch.Tensor: _Encoder.tensor_ref,
    torch.nn.Parameter: _Encoder.tensor_ref,
    np.ndarray: _Encoder.ndarray,
    torch.Generator: _Encoder.generator,
    torch.dtype: lambda _, v, __: {"$dtype": dtype_name(v)},
    torch.Size: lambda _, v, __: {"$size": list(v)},
    torch.device: lambda _, v, __: {"$device": str(v)},
    bytes: lambda _, v, __: {"$bytes": base64.b64encode(v).decode("ascii")},
}


def encode(payload: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able tree, tensors by key): ``decode`` of the two gives ``payload`` back exactly
    (types, dtypes, int dict keys, NaN, the identity of a tensor object used twice)."""
    encoder = _Encoder()
    return encoder.encode(payload, ()), encoder.tensors


def _restore_device(tensor: torch.Tensor, device: str | None) -> torch.Tensor:
    if device is None:
        return tensor
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        return tensor  # written on a GPU machine, read on a CPU-only one
    return tensor.to(target)


def _decode_tensor(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    value = _restore_device(tensors[tree["$tensor"]], tree.get("device"))
    if tree.get("parameter"):
        return torch.nn.Parameter(value, requires_grad=bool(tree.get("requires_grad")))
    return value.requires_grad_() if tree.get("requires_grad") else value


def _decode_npscalar(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> np.generic:
    dtype = np.dtype(tree["$npscalar"])
    if dtype.hasobject:
        raise ValueError(f"numpy scalar of object dtype {tree['$npscalar']!r}")
    return dtype.type(decode(tree["value"], tensors))


def _decode_generator(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Generator:
    generator = torch.Generator(tree["device"])
    generator.set_state(tensors[tree["$generator"]])
    return generator


def _decode_dtype(body: str) -> torch.dtype:
    dtype = getattr(torch, body)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {body!r}")
    return dtype


_Decode = Callable[[Any, dict[str, torch.Tensor]], Any]

# tags whose value needs the rest of the tagged object (its flags) get the whole object
_DECODE_TAGGED: dict[str, Callable[[dict[str, Any], dict[str, torch.Tensor]], Any]] = {
    "$tensor": _decode_tensor,
    "$npscalar": _decode_npscalar,
    "$generator": _decode_generator,
}
# the others get only the tag's value
_DECODE_BODY: dict[str, _Decode] = {
    "$float": lambda body, _: float(body),
    "$dict": lambda body, t: {decode(k, t): decode(v, t) for k, v in body},
    "$tuple": lambda body, t: tuple(decode(v, t) for v in body),
    "$ndarray": lambda body, t: t[body].numpy(),
    "$dtype": lambda body, _: _decode_dtype(body),
    "$size": lambda body, _: torch.Size(body),
    "$device": lambda body, _: torch.device(body),
    "$set": lambda body, t: {decode(v, t) for v in body},
    "$frozenset": lambda body, t: frozenset(decode(v, t) for v in body),
    "$bytes": lambda body, _: base64.b64decode(body, validate=True),
}


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`; raises ``KeyError``/``ValueError`` on a malformed tree."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    tags = [k for k in tree if k.startswith("$")]
    if not tags:
        return {k: decode(v, tensors) for k, v in tree.items()}
    if len(tags) != 1:
        raise ValueError(f"ambiguous tags {tags}")
    tag = tags[0]
    if tag in _DECODE_TAGGED:
        return _DECODE_TAGGED[tag](tree, tensors)
    if tag in _DECODE_BODY:
        return _DECODE_BODY[tag](tree[tag], tensors)
    raise ValueError(f"unknown tag {tag!r}")


# -- files ------------------------------------------------------------------------------------
def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (POSIX; Windows cannot open a directory)."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_sha256(path: Path, sync: bool = False) -> tuple[str, int]:
    """(hex SHA-256, size) of ``path``; with ``sync``, also fsync it to disk."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def _manifest_sha256(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without its own ``sha256`` entry."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def write_checkpoint(
    manifest_path: Path, payload: dict[str, Any], facts: dict[str, Any] | None = None
) -> Path:
    """Write ``payload`` as ``manifest_path`` (``.json``) and its ``.safetensors`` beside it,
    each fsync-ed under a temporary name and then atomically renamed (see the module doc).
    ``facts`` go into the manifest itself, readable without the tensors (the hash of the
    config the checkpoint was written under: ``config_sha256``)."""
    tree, tensors = encode(payload)
    tensor_path = manifest_path.with_suffix(TENSOR_SUFFIX)
    save_file(tensors, _tmp(tensor_path))
    sha, size = _file_sha256(_tmp(tensor_path), sync=True)
    os.replace(_tmp(tensor_path), tensor_path)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "tensors": {
            "file": tensor_path.name,
            "sha256": sha,
            "bytes": size,
            "layout": {
                k: {"dtype": dtype_name(v.dtype), "shape": list(v.shape)}
                for k, v in tensors.items()
            },
        },
        "tree": tree,
        **(facts or {}),
    }
    manifest["sha256"] = _manifest_sha256(manifest)
    with _tmp(manifest_path).open("w") as f:
        json.dump(manifest, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(_tmp(manifest_path), manifest_path)
    _fsync_dir(manifest_path.parent)
    return manifest_path


def read_checkpoint(manifest_path: Path, check: Check | None = None) -> dict[str, Any]:
    """The payload of a checkpoint, after verifying both checksums, the manifest's types, each
    tensor's dtype and shape against the manifest, and ``check`` (what the reader expects);
    never unpickles.

    Raises :class:`CheckpointError` naming the file (and the tensor or key) when anything is
    missing, damaged or does not fit."""
    tensor_path = manifest_path.with_suffix(TENSOR_SUFFIX)

    def bad(path: Path, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} is damaged or incomplete: {why}")

    if not manifest_path.is_file():
        raise bad(manifest_path, "no manifest (the write did not finish)")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise bad(manifest_path, f"not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad(manifest_path, f"not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise bad(manifest_path, f"version {manifest.get('version')!r}, expected {VERSION}")
    try:
        own = _manifest_sha256(manifest)
    except ValueError as err:  # NaN in the JSON text: never written by write_checkpoint
        raise bad(manifest_path, f"not strict JSON ({err})") from None
    if manifest.get("sha256") != own:
        raise bad(manifest_path, "SHA-256 of the manifest does not match")
    problem = type_problem(manifest, CheckpointManifest)
    if problem is not None:
        raise bad(manifest_path, problem)
    expected = manifest["tensors"]
    if expected["file"] != tensor_path.name:
        raise bad(manifest_path, f"names tensor file {expected['file']!r}")
    if not tensor_path.is_file():
        raise bad(tensor_path, "missing")
    sha, size = _file_sha256(tensor_path)
    if size != expected["bytes"]:
        raise bad(tensor_path, f"{size} bytes, the manifest recorded {expected['bytes']}")
    if sha != expected["sha256"]:
        raise bad(tensor_path, "SHA-256 does not match the manifest's")
    try:
        # each tensor in memory of its own (aligned as torch aligns fresh tensors): the loaded
        # ones share one buffer at byte offsets, and kernels that see other alignments may sum
        # in another order (1-ulp differences from the run that wrote them)
        tensors = {k: v.clone() for k, v in load_file(tensor_path).items()}
    except SafetensorError as err:
        raise bad(tensor_path, f"not a safetensors file ({err})") from None
    why = _layout_problem(tensors, expected.get("layout"))
    if why is not None:
        raise bad(tensor_path, why)
    try:
        payload = decode(manifest["tree"], tensors)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as err:
        raise bad(
            manifest_path, f"its tree does not decode ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(payload, dict):
        raise bad(manifest_path, "the payload is not a dict")
    if check is not None:
        try:
            check(payload, tensors)
        except CheckpointMismatch as err:
            raise bad(manifest_path, str(err)) from None
    return payload


def _layout_problem(
    tensors: dict[str, torch.Tensor], layout: dict[str, dict[str, Any]] | None
) -> str | None:
    """How the tensor file differs from the manifest's record of it (None: it does not)."""
    if layout is None:
        return None
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    if missing or extra:
        which = f"no tensor {missing[0]}" if missing else f"a tensor {extra[0]} not recorded"
        return f"{which} in the manifest's record of the tensor file"
    for key, tensor in tensors.items():
        record = layout[key]
        if record["dtype"] != dtype_name(tensor.dtype) or record["shape"] != list(tensor.shape):
            return (
                f"tensor {key} is {describe(tensor)}, the manifest recorded "
                f"{record['dtype']} {record['shape']}"
            )
    return None


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """``CheckpointMismatch`` naming the first floating-point tensor holding NaN or infinity
    (a run's readers: no state a run checkpoints is non-finite, since a diverged client is
    refused or dropped before it reaches the server, train.nonfinite; the file format itself
    keeps NaN)."""
    for key, tensor in tensors.items():
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(
            torch.isfinite(tensor).all()
        ):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointMismatch(
                f"tensor {key} holds {bad} NaN or infinite value(s) of {tensor.numel()} "
                "(weights a finite run cannot have)"
            )
