"""The README's quick start, read as a new user runs it top to bottom: every command parses,
every file it names exists, and every run directory a command reads was made by a line above
it (the export line once named a run no line created)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from typer.main import get_command

from fedloom.cli import app

ROOT = Path(__file__).resolve().parents[2]
READS_RUN = {"report", "export", "audit", "summary"}


def quick_start() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_every_quick_start_line_names_what_exists_or_was_made_above():
    commands = get_command(app).commands  # type: ignore[attr-defined]
    made: set[str] = set()
    for words in quick_start():
        assert words[0] == "fedloom" and words[1] in commands, words
        args = words[2:]
        for word in args:
            if word.startswith(("examples/", "docs/")):
                assert (ROOT / word).exists(), word
        if "--out" in args:
            made.add(args[args.index("--out") + 1])
        for flag in ("--resume",):
            if flag in args:
                assert args[args.index(flag) + 1] in made, words
        if words[1] in READS_RUN:
            assert args[0] in made, f"{' '.join(words)}: no line above makes {args[0]}"
