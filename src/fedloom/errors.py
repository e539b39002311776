"""Errors that the command line turns into exit status 2 (bad input) with one clear message."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FedloomInputError(Exception):
    """Bad configuration or input data: reported without a traceback, exit status 2."""


class ConfigError(FedloomInputError):
    """A config key or value is wrong; the message names the key."""


class DataError(FedloomInputError):
    """A data file is missing, corrupt or cannot be fetched; the message names the file."""


class RunDirError(FedloomInputError):
    """The output or resume directory cannot be used."""


class RunDirLocked(RunDirError):
    """Another process is writing the run directory (it holds RUN/.lock); ``pid`` is its PID
    (None when unreadable)."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class RoundAborted(RuntimeError):
    """A round's server step cannot be taken (secure aggregation below its threshold, too few
    clients for a robust rule's precondition): the engine keeps the server's state for that
    round, logs why, and goes on."""


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The valid name closest to ``name`` (for 'did you mean' hints), or None."""
    matches = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_name_message(kind: str, name: str, choices: Iterable[str]) -> str:
    choices = sorted(choices)
    hint = closest(name, choices)
    did_you_mean = f" Did you mean '{hint}'?" if hint else ""
    return f"unknown {kind} '{name}'.{did_you_mean} Valid: {', '.join(choices)}."


SHOWN_CHARS = 80
"""The most characters of a value an error line echoes."""


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters, ending in '...' when cut: an error line names a
    100 KB value without echoing it whole."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
