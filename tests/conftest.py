"""Shared fixtures: the real data root (FEDLOOM_DATA) and small helpers for running fedloom;
the split of the suite into cheap tests (the default run, CI) and heavy ones, with time budgets."""

from __future__ import annotations

# fedloom before torch: `import fedloom` sets OpenMP's passive wait policy, which OpenMP reads
# once, when torch loads it (README, "On a shared machine"). Imported after torch, the spinning
# default made 2-thread runs 4-5x slower beside a busy process (a 5-round MNIST test: 5 s -> 22 s).
import fedloom  # noqa: F401

# isort: split
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = os.environ.get("FEDLOOM_DATA")
    if not root:
        pytest.skip("FEDLOOM_DATA is not set (CI sets it to ../shared/data)")
    path = Path(root).resolve()
    assert path.is_dir(), f"FEDLOOM_DATA={root} does not exist"
    return path


TIMINGS = {"wall_seconds", "seconds"}
"""Metrics-row keys that hold measured times (they differ between identical runs)."""


def metrics_without_time(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in history]


# -- cheap and heavy tests -------------------------------------------------------------------
#
# `pytest` (and `bash scripts/test.sh`, what CI runs) runs the cheap tests only; tests marked
# `@pytest.mark.heavy(budget=SECONDS)` (long training on real data, spec-size acceptance runs,
# every algorithm on Ray, benchmark smoke runs) run with `--heavy` (only them) or `--all`. Every
# run says how many heavy tests it left out. Each test's call has a time budget: its heavy
# mark's, else DEFAULT_BUDGET_S; a test that passes over its budget fails, naming both times.

DEFAULT_BUDGET_S = 60.0
"""Budget of a test not marked heavy. The slowest cheap tests' calls take about 10 s on a quiet
2-core machine and up to 25 s beside 3-5 busy processes (pytest --durations): a cheap test over
this is no longer cheap, and is made cheaper or marked heavy, not left to grow the default run.
(Not lower: a budget a loaded machine can break would make the suite flaky.)"""

BUDGET_SCALE_ENV = "FEDLOOM_BUDGET_SCALE"
"""Multiplies every budget (default 1), for a machine known to be slower."""

HEAVY_RUN = "bash scripts/test.sh --heavy"

_SELECTION = pytest.StashKey[dict[str, tuple[int, float]]]()
_SCALE = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fedloom", "fedloom's cheap and heavy tests")
    group.addoption(
        "--heavy",
        action="store_true",
        help="run only the tests marked heavy (left out by default)",
    )
    group.addoption(
        "--all",
        action="store_true",
        dest="all_tests",
        help="run every test, the heavy ones included",
    )


def pytest_configure(config: pytest.Config) -> None:
    raw = os.environ.get(BUDGET_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_SCALE_ENV}={raw!r} is not a number") from None
    if not scale > 0:
        raise pytest.UsageError(f"{BUDGET_SCALE_ENV}={raw!r} must be positive")
    config.stash[_SCALE] = scale


def heavy_budget(item: pytest.Item) -> float | None:
    """The heavy mark's budget in seconds, None if the test is not heavy."""
    mark = item.get_closest_marker("heavy")
    if mark is None:
        return None
    budget = mark.kwargs.get("budget")
    if mark.args or set(mark.kwargs) != {"budget"} or not isinstance(budget, int | float):
        raise pytest.UsageError(
            f"{item.nodeid}: write the heavy mark as @pytest.mark.heavy(budget=SECONDS), got "
            f"args={mark.args} kwargs={mark.kwargs}"
        )
    if not budget > 0:
        raise pytest.UsageError(f"{item.nodeid}: heavy budget must be positive, got {budget}")
    return float(budget)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they do
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy, run_all = config.getoption("heavy"), config.getoption("all_tests")
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    counts = {"run": [0, 0.0], "not_run": [0, 0.0]}
    for item in items:
        budget = heavy_budget(item)
        selected = run_all or (budget is not None) == heavy
        (keep if selected else drop).append(item)
        if budget is not None:
            entry = counts["run" if selected else "not_run"]
            entry[0] += 1
            entry[1] += budget
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash[_SELECTION] = {k: (int(n), float(b)) for k, (n, b) in counts.items()}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    budget, scale = heavy_budget(item), item.config.stash[_SCALE]
    limit = (DEFAULT_BUDGET_S if budget is None else budget) * scale
    started = time.perf_counter()
    result = yield  # a failing test raises here and keeps its own failure
    took = time.perf_counter() - started
    if took > limit:
        scaled = f" x {BUDGET_SCALE_ENV}={scale:g}" if scale != 1 else ""
        if budget is None:
            pytest.fail(
                f"over budget: this cheap test took {took:.1f} s, over the {limit:g} s budget "
                f"of a test not marked heavy ({DEFAULT_BUDGET_S:g} s{scaled}). Make it cheaper, "
                f"or mark it @pytest.mark.heavy(budget=SECONDS) so that only `{HEAVY_RUN}` "
                "runs it.",
                pytrace=False,
            )
        pytest.fail(
            f"over budget: this heavy test took {took:.1f} s, over its {limit:g} s budget "
            f"(@pytest.mark.heavy(budget={budget:g}){scaled}). Make it cheaper, or raise the "
            "budget if the time it needs has grown for a reason.",
            pytrace=False,
        )
    return result


# Under pytest-xdist (scripts/test.sh runs `-n 2`) the workers collect and select, not the
# controller that prints the summary: each worker sends its selection back when it ends.
_WORKER_KEY = "fedloom_heavy_selection"


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)  # set on an xdist worker only
    if output is not None and _SELECTION in session.config.stash:
        output[_WORKER_KEY] = session.config.stash[_SELECTION]


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_testnodedown(node: Any, error: object) -> None:  # node: an xdist WorkerController
    selection = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if selection is not None:  # every worker collects the same tests: any one's count holds
        node.config.stash[_SELECTION] = {k: (int(n), float(b)) for k, (n, b) in selection.items()}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config):
    selection = config.stash.get(_SELECTION, None)
    if selection is None:  # collection did not finish
        return
    (n_run, b_run), (n_out, b_out) = selection["run"], selection["not_run"]

    def tests(n: int) -> str:
        return f"{n} heavy test{'' if n == 1 else 's'}"

    if n_out:
        terminalreporter.write_line(
            f"fedloom: {tests(n_out)} not run (budget {b_out:,.0f} s); run them with: "
            f"{HEAVY_RUN} (or --all for everything)"
        )
    if n_run:
        terminalreporter.write_line(f"fedloom: {tests(n_run)} selected (budget {b_run:,.0f} s)")
