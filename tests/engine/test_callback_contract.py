"""The callback contract (engine/context.py): callbacks read a frozen RunContext and return
what they add to the round's row and to summary.json; nothing in the engine below the loop
imports it (issue #27)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

import fedloom
from fedloom.engine.context import Callback, RunContext, merge

ENGINE = Path(fedloom.__file__).parent / "engine"

CONFIG = {
    "seed": 0,
    "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "iid"}},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 3, "local_steps": 2, "batch_size": 16, "lr": 0.1},
    "eval": {"every": 2},
    "monitor": {"enabled": True, "gradient_dissimilarity": False},
    "executor": {"kind": "sequential"},
}


def engine_imports() -> dict[str, set[str]]:
    """Each engine module's imports of other engine modules, wherever they stand in the file
    (``if TYPE_CHECKING:`` blocks and function bodies included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ENGINE.glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found |= {n.split(".")[2] for n in names if n.startswith("fedloom.engine.")}
        graph[path.stem] = found & {p.stem for p in ENGINE.glob("*.py")}
    return graph


def test_no_engine_module_imports_the_loop():
    graph = engine_imports()
    assert graph["build"] and graph["callbacks"]  # the parser sees imports at all
    assert sorted(m for m, deps in graph.items() if "loop" in deps) == []


def test_engine_modules_have_no_import_circle():
    graph = engine_imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join([*path, module])
        if module not in done:
            for dep in sorted(graph[module] - {module}):
                visit(dep, (*path, module))
            done.add(module)

    for module in sorted(graph):
        visit(module, ())


class Probe(Callback):
    """Returns metrics and a summary part; records what it was given."""

    def __init__(self) -> None:
        self.contexts: list[Any] = []
        self.seen: list[set[str]] = []
        self.summary: dict[str, Any] = {}

    def on_round_end(self, ctx, state, report) -> dict[str, Any]:
        self.contexts.append(ctx)
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.algorithm = None
        self.seen.append(set(report.metrics))
        return {"probe": {"round": report.round, "clients": len(ctx.train_ids)}}

    def on_run_end(self, ctx, state) -> dict[str, Any]:
        return {"probe": state.round, "final": {"probe": "last"}}

    def on_summary(self, ctx, summary) -> None:
        self.summary = dict(summary)


def test_a_callback_reads_a_frozen_context_and_its_metrics_land_in_the_row():
    probe = Probe()
    result = fedloom.run(CONFIG, write=False, progress=False, callbacks=[probe])
    assert all(isinstance(c, RunContext) for c in probe.contexts)
    assert len(probe.contexts) == 3 and len({id(c) for c in probe.contexts}) == 1
    # the metrics of the callbacks before it (evaluation, monitoring) on evaluated rounds
    assert {"global", "personalized", "monitor"} <= probe.seen[1] and not probe.seen[0]
    rows = result.history
    assert [r["round"] for r in rows] == [2, 3]
    assert [r["probe"] for r in rows] == [{"round": r, "clients": 4} for r in (2, 3)]
    assert set(rows[0]["seconds"]) == {"round", "monitor"} and rows[0]["seconds"]["monitor"] > 0
    assert result.summary["probe"] == 3
    assert result.summary["final"]["probe"] == "last"
    assert result.summary["final"]["global"] == rows[-1]["global"]  # merged, not replaced
    assert probe.summary == result.summary


def test_merge_unites_dicts_and_replaces_the_rest():
    row: dict[str, Any] = {"seconds": {"monitor": 1.0}, "global": 1}
    merge(row, {"seconds": {"contribution": 2.0}, "global": 2, "new": [1]})
    merge(row, None)
    assert row == {"seconds": {"monitor": 1.0, "contribution": 2.0}, "global": 2, "new": [1]}
