"""``fedloom export RUN_DIR``: the run's deployable models as plain safetensors state dicts and
a small JSON card saying which file is which copy, the model to load them into, the input
shape, the classes and the measured metrics (docs/serving.md).

```
EXPORT/
  card.json
  global.safetensors            the server model after the last round
  ema.safetensors               the debiased EMA of the global model (serving.ema)
  best.safetensors              the global model of the best validation round (serving.keep_best)
  clients/client_K.safetensors  client K's deployed (personal) model after the last round
  clients_best/client_K.safetensors   client K's best deployed model on its validation set
```
Each file loads with ``safetensors.torch.load_file`` into ``fedloom.models.build_model(name,
input_shape, num_outputs).load_state_dict`` (:func:`load_exported` does both). Clients absent
from ``clients/`` deploy the global model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from fedloom.core.files import inside, one_line, read_json_object, read_yaml_mapping, strict_json
from fedloom.core.run_files import Card, ServingMeta, Summary, check_typed, read_typed
from fedloom.core.runpaths import under
from fedloom.engine.rundir import RunDir
from fedloom.engine.serving import FILES, META_FILE, SERVING_DIR
from fedloom.errors import RunDirError
from fedloom.models import build_model

CARD_FILE = "card.json"
EXPORT_DIR = "export"
Json = dict[str, Any]
WHAT = {
    "global": "the server's global model after the last round",
    "ema": "exponential moving average of the global model over rounds (debiased)",
    "best": "the global model of the round with the best validation metric",
    "clients": "each client's deployed (personal) model after the last round",
    "clients_best": "each client's deployed model of its best round on its own validation set",
}


META_KEYS = (
    "model",
    "files",
    "task",
    "input_shape",
    "num_outputs",
    "rounds",
    "clients",
    "personal",
)
"""What serving.json must hold (engine/serving.py writes it)."""


def _read_meta(path: Path) -> dict[str, Any]:
    meta = read_json_object(path)
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise RunDirError(f"{path}: missing {', '.join(missing)}; was it written by fedloom?")
    unknown = sorted(set(meta["files"]) - set(WHAT)) if isinstance(meta["files"], dict) else []
    if not isinstance(meta["files"], dict) or unknown:
        raise RunDirError(
            f"{path}: files names unknown copies {unknown or meta['files']!r}; "
            f"the copies are {', '.join(WHAT)}"
        )
    check_typed(meta, ServingMeta, path)
    return meta


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise RunDirError(f"cannot read {path}: {one_line(err)}") from None


def _save(tensors: dict[str, torch.Tensor], path: Path, copy: str, model: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path),
        metadata={"format": "pt", "copy": copy, "model": model},
    )


def _split_clients(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """``CLIENT/NAME`` keys (engine/serving.py) back into one state dict per client."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        cid, _, name = key.partition("/")
        if not (cid.isdigit() and name):
            raise RunDirError(f"a per-client copy holds tensor {key!r}, not CLIENT/NAME")
        out.setdefault(int(cid), {})[name] = value
    return out


def _export_target(run_dir: Path, out: str | Path | None) -> Path:
    """Where the export goes, after checking that ``run_dir`` holds no symbolic link
    (core/runpaths.py) and kept deployable models."""
    RunDir.open_existing(run_dir)
    if not under(run_dir, SERVING_DIR, META_FILE).is_file():
        raise RunDirError(
            f"{run_dir} has no {SERVING_DIR}/{META_FILE}: only runs with a serving section keep "
            "deployable models (serving: {keep_best: true, ema: 0.99}, docs/serving.md)"
        )
    target = Path(out) if out is not None else under(run_dir, EXPORT_DIR)
    if target.is_file():
        raise RunDirError(f"export directory {target} is a file; choose a new --out")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise RunDirError(f"export directory {target} exists and is not empty; choose a new --out")
    return target


@contextlib.contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A temporary folder beside ``target`` (in the same parent, so the last step is one
    rename) that becomes ``target`` when the block ends, or is removed if it fails: an export
    is whole or absent, never partial."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        )
        stage.chmod(0o755)  # mkdtemp's folder is the owner's only; an export is shared
    except OSError as err:
        raise RunDirError(f"cannot write export directory {target}: {err.strerror}") from None
    try:
        yield stage
        os.replace(stage, target)  # an empty target folder is replaced, a full one refused
    except OSError as err:
        shutil.rmtree(stage, ignore_errors=True)
        raise RunDirError(f"cannot write export directory {target}: {err.strerror}") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _export_copy(
    name: str, tensors: dict[str, torch.Tensor], target: Path, model: str
) -> dict[str, Any]:
    """Write one copy (one file, or one per client) and return its card entry."""
    entry: dict[str, Any] = {"what": WHAT[name]}
    if name in ("clients", "clients_best"):
        files = {}
        for cid, tree in sorted(_split_clients(tensors).items()):
            rel = f"{name}/client_{cid}.safetensors"
            _save(tree, target / rel, f"{name}/{cid}", model)
            files[str(cid)] = rel
        entry["files"] = files
    else:
        _save(tensors, target / FILES[name], name, model)
        entry["file"] = FILES[name]
    return entry


def _serving_facts(summary: Json, meta: Json) -> Json:
    """What the run recorded about its served copies (summary.json, else serving.json)."""
    return summary.get("serving") or meta.get("serving") or {}


def _card(run_dir: Path, meta: Json, summary: Json, config: Json, copies: Json) -> Json:
    """card.json: the model to build, its input and classes, where it came from, the copies."""
    routing = dict(_serving_facts(summary, meta).get("routing") or {})
    routing.pop("clients", None)
    return {
        "format": "fedloom-export",
        "version": 1,
        "model": {"name": meta["model"], "config": config.get("model")},
        "task": meta["task"],
        "input_shape": meta["input_shape"],
        "num_outputs": meta["num_outputs"],
        "classes": list(range(meta["num_outputs"])) if meta["task"] == "classification" else None,
        "dataset": summary.get("dataset") or (config.get("data") or {}).get("name"),
        "algorithm": summary.get("algorithm") or (config.get("algorithm") or {}).get("name"),
        "rounds": meta["rounds"],
        "seed": config.get("seed"),
        "source": str(run_dir.resolve()),
        "copies": copies,
        "clients_on_global": sorted(set(meta["clients"]) - set(meta["personal"])),
        **({"routing": routing} if routing else {}),
        "load": (
            "fedloom.serving.load_exported(DIR, COPY[, client=K]); or "
            "fedloom.models.build_model(model.name, input_shape, num_outputs)"
            ".load_state_dict(safetensors.torch.load_file(FILE))"
        ),
    }


def export_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``out`` (default ``RUN_DIR/export``) from ``RUN_DIR/serving``; returns the card."""
    run_dir = Path(run_dir)
    source = under(run_dir, SERVING_DIR)
    target = _export_target(run_dir, out)
    meta = _read_meta(under(source, META_FILE))
    summary_path = under(run_dir, "summary.json")
    summary = read_typed(summary_path, Summary) if summary_path.is_file() else {}
    config = read_yaml_mapping(under(run_dir, "config.yaml"))
    serving = _serving_facts(summary, meta)
    final = summary.get("final") or {}
    # every copy is read before any is written: a damaged one leaves no partial export. The
    # file names serving.json gives are read inside RUN/serving only; what is written is
    # named here (FILES, clients/...), never after them
    loaded = {
        name: _load(inside(source, filename, f"{META_FILE} files.{name}"))
        for name, filename in meta["files"].items()
    }
    copies: dict[str, Any] = {}
    with _staged(target) as stage:
        for name, tensors in loaded.items():
            entry = _export_copy(name, tensors, stage, meta["model"])
            entry.update(_metrics(name, final, serving))
            copies[name] = entry
        card = _card(run_dir, meta, summary, config, copies)
        (stage / CARD_FILE).write_text(strict_json(card, indent=2))
    return target / CARD_FILE


def _metrics(name: str, final: dict[str, Any], serving: dict[str, Any]) -> dict[str, Any]:
    """What the run measured for one copy (test metrics; for best, its validation value)."""
    if name == "global":
        return {"test": final.get("global")}
    if name == "clients":
        return {"test": final.get("personalized"), "per_client": final.get("client_accuracy")}
    if name == "ema":
        ema = serving.get("ema") or {}
        return {"decay": ema.get("decay"), "steps": ema.get("steps"), "test": ema.get("test")}
    if name == "best":
        best = serving.get("best") or {}
        return {
            "round": best.get("round"),
            "validation": {serving.get("metric", "validation"): best.get("validation")},
            "test": best.get("test"),
        }
    kept = serving.get("clients_best") or {}
    return {"rounds": kept.get("rounds"), "test": kept.get("test")}


def load_exported(folder: str | Path, copy: str = "global", client: int | None = None) -> nn.Module:
    """The exported ``copy`` (global | ema | best | clients | clients_best) as a torch module
    in evaluation mode; ``client`` picks a client's file of the per-client copies."""
    folder = Path(folder)
    card = read_typed(folder / CARD_FILE, Card)
    if copy not in card.get("copies", {}):
        raise RunDirError(f"{folder} has no '{copy}' copy; it has {', '.join(card['copies'])}")
    entry = card["copies"][copy]
    if "files" in entry:
        if client is None or str(client) not in entry["files"]:
            raise RunDirError(
                f"'{copy}' is per client: pass client= one of {', '.join(entry['files'])}"
            )
        path = inside(folder, entry["files"][str(client)], f"{CARD_FILE} {copy}")
    else:
        path = inside(folder, entry["file"], f"{CARD_FILE} {copy}")
    section = card["model"].get("config") or {}
    options = {k: v for k, v in section.items() if k not in ("name", "freeze")}  # resnet18's norm
    module = build_model(
        card["model"]["name"], tuple(card["input_shape"]), card["num_outputs"], options
    )
    try:
        module.load_state_dict(_load(path))
    except RuntimeError as err:  # another shape than card.json's model has
        raise RunDirError(
            f"{path} does not fit the model {CARD_FILE} describes ({one_line(err)[:300]})"
        ) from None
    return module.eval()


__all__ = ["CARD_FILE", "FILES", "export_run", "load_exported"]
