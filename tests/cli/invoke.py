"""The ``fedloom`` command in-process (Click's runner), as a user sees it: exit status, stdout,
stderr with fedloom's warnings as ``warning:`` lines, and a time limit that turns a hang into a
failure (SIGALRM; the tests run in pytest's main thread)."""

from __future__ import annotations

import signal
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from typer.testing import CliRunner

from fedloom import cli


class Hang(Exception):
    """A command ran past its time limit."""


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def _raise(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        """stderr's non-empty lines other than warnings."""
        return [
            line
            for line in self.stderr.splitlines()
            if line.strip() and not line.startswith("warning:")
        ]

    def is_clear_input_error(self) -> bool:
        """Exit 2 with one line saying what is wrong (Click's usage errors: its 'Error:' line
        after the usage reminder) and no traceback."""
        if self.code != 2 or "Traceback" in self.stderr:
            return False
        errors = [line for line in self.lines if line.lower().startswith("error:")]
        usage = [line for line in self.lines if line.startswith(("Usage:", "Try "))]
        return len(errors) == 1 and len(self.lines) == 1 + len(usage)


def fedloom(args: Sequence[str], seconds: int = 120) -> Outcome:
    """Run ``fedloom ARGS`` in this process."""
    runner = CliRunner()
    with warnings.catch_warnings(), time_limit(seconds):
        warnings.simplefilter("default")
        warnings.showwarning = cli._show_warning
        result = runner.invoke(cli.app, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        if isinstance(result.exception, Hang):
            raise result.exception
        # an exception Click did not turn into an exit status: what a user would see as exit 1
        # with a traceback
        return Outcome(1, result.stdout, result.stderr + f"\nTraceback: {result.exception!r}")
    return Outcome(result.exit_code, result.stdout, result.stderr)


QUADRATIC = {
    "seed": 0,
    "data": {
        "name": "quadratic",
        "num_clients": 6,
        "quadratic": {"dim": 3, "samples": 20, "heterogeneity": 1.0, "noise": 0.1},
    },
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {
        "rounds": 2,
        "local_steps": 2,
        "batch_size": None,
        "lr": 0.05,
        "clients_per_round": 5,
    },
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
}
"""A valid config whose run takes well under a second (no data files)."""


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path
