"""fedloom's messages and states as Flower records, and back.

A fedloom message is a dict of named trees (``params``, ``buffers``, SCAFFOLD's ``control``
...), each a nested dict of tensors. Each tree travels as one Flower ``ArrayRecord`` under a
namespaced key of the ``RecordDict`` (``message.params``, ``upload.delta``, ``state.control``),
its tensors keyed by their path in the tree (``layer/weight``); what an ``ArrayRecord`` cannot
hold (python scalars, ``None``, empty sub-dicts such as the ``buffers`` of a model without
BatchNorm) goes into a ``ConfigRecord`` beside it (``<key>.layout``). Tensors round-trip
bit-exactly (NumPy's ``.npy`` serialization, dtype and shape kept).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

SEP = "/"
"""Joins the keys of a path in a tree (parameter names use ``.``, never ``/``)."""

LAYOUT = ".layout"
"""Suffix of the ConfigRecord that holds a tree's non-tensor leaves and empty sub-dicts."""

_ORDER, _EMPTY, _NONE, _SCALARS = "order", "empty", "none", "scalar:"


def encode_tree(tree: dict[str, Any]) -> tuple[ArrayRecord, ConfigRecord]:
    """A nested dict of tensors (and python scalars) as an ArrayRecord and its layout."""
    arrays, layout = ArrayRecord(), ConfigRecord()
    order: list[str] = []
    empty: list[str] = []
    none: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        if not node and prefix:
            empty.append(prefix)
        for key, value in node.items():
            if SEP in key:
                raise ValueError(f"tree key {key!r} contains {SEP!r}: it cannot travel to Flower")
            path = f"{prefix}{SEP}{key}" if prefix else key
            order.append(path)
            if isinstance(value, dict):
                walk(value, path)
            elif isinstance(value, torch.Tensor):
                arrays[path] = Array.from_numpy_ndarray(value.detach().cpu().numpy())
            elif value is None:
                none.append(path)
            elif isinstance(value, bool | int | float | str):
                layout[_SCALARS + path] = value
            else:
                raise TypeError(
                    f"tree leaf {path!r} is a {type(value).__name__}: only tensors, dicts and "
                    "python scalars travel to Flower"
                )

    walk(tree, "")
    layout[_ORDER], layout[_EMPTY], layout[_NONE] = order, empty, none
    return arrays, layout


def decode_tree(arrays: ArrayRecord, layout: ConfigRecord) -> dict[str, Any]:
    """The tree :func:`encode_tree` encoded, its keys in their order (tensors own their
    memory)."""
    leaves: dict[str, Any] = {str(path): {} for path in layout.get(_EMPTY, [])}
    leaves |= {str(path): None for path in layout.get(_NONE, [])}
    leaves |= {k[len(_SCALARS) :]: v for k, v in layout.items() if k.startswith(_SCALARS)}
    for path, array in arrays.items():
        leaves[path] = torch.from_numpy(np.array(array.numpy(), copy=True))
    tree: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        *parents, last = path.split(SEP)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    for path in layout.get(_ORDER, []):
        path = str(path)
        if path in leaves:  # an inner dict's path is in the order, not among the leaves
            put(path, leaves[path])
    return tree


def put_trees(content: RecordDict, namespace: str, trees: dict[str, dict[str, Any]]) -> None:
    """Each named tree of ``trees`` into ``content`` as ``<namespace>.<name>`` (+ layout)."""
    names = ConfigRecord({"names": list(trees)})
    content[f"{namespace}{LAYOUT}"] = names
    for name, tree in trees.items():
        arrays, layout = encode_tree(tree)
        content[f"{namespace}.{name}"] = arrays
        content[f"{namespace}.{name}{LAYOUT}"] = layout


def get_trees(content: RecordDict, namespace: str) -> dict[str, dict[str, Any]] | None:
    """The named trees :func:`put_trees` stored under ``namespace`` (None: none stored)."""
    names = content.get(f"{namespace}{LAYOUT}")
    if names is None:
        return None
    out = {}
    for name in names["names"]:
        arrays = content.array_records[f"{namespace}.{name}"]
        layout = content.config_records[f"{namespace}.{name}{LAYOUT}"]
        out[str(name)] = decode_tree(arrays, layout)
    return out


def drop_trees(content: RecordDict, namespace: str) -> None:
    """Remove what :func:`put_trees` stored under ``namespace`` (no-op if nothing)."""
    for key in [k for k in content if k == f"{namespace}{LAYOUT}" or k.startswith(namespace + ".")]:
        del content[key]
