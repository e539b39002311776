"""A symbolic link planted anywhere in a run directory someone sent you (tests/rundir/
symlinks.py): every command that opens the run (resume, export, report, compare, audit,
summary, the dashboard's listing) refuses it with exit status 2 naming the link, and nothing
outside the run is read through it, written or deleted (README.md, "Run directory").

Before the run directory was a trust boundary, the full product (336 cases) ended 281 times
with exit 0 (the dashboard listed 20 of its 48 runs holding a link), 6 times with exit 1, and
changed the sentinel tree in 8 cases: a resume read and wrote checkpoints in a linked
checkpoints/ and pruned the user's files there, wrote serving copies through a linked
serving/ or serving.json, wrote through a planted temporary name, truncated a file linked as
.lock; an export wrote into a linked export/; an audit wrote audit.json through a link."""

from __future__ import annotations

import pytest

from tests.rundir.symlinks import COMMANDS, Case, all_cases, finished_run, locations, run_case

LIMIT_S = 30.0
"""A case's time limit: a refused case takes milliseconds, a whole resume or audit of the
small run about 2 s."""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return finished_run(tmp_path_factory.mktemp("symlinks"))


def check(base, tmp_path, case: Case) -> None:
    outcome, unchanged, _ = run_case(base, tmp_path / "case", case, LIMIT_S)
    assert unchanged, f"{case.id}: the sentinel tree outside the run changed"
    assert outcome.code == 2, (case.id, outcome.code, outcome.stderr)
    if case.command != "dashboard":
        assert outcome.is_clear_input_error(), (case.id, outcome.stderr)
        assert "symbolic link" in outcome.stderr, (case.id, outcome.stderr)
        # the link is named (rich may wrap the line: compare without whitespace)
        assert case.location.split("/")[0] in "".join(outcome.stderr.split()), outcome.stderr


CHEAP = [
    ("checkpoints", "copy", "resume"),
    ("checkpoints/round_000002.safetensors", "copy", "resume"),
    ("config.yaml", "copy", "resume"),
    ("serving", "copy", "resume"),
    (".lock", "copy", "resume"),
    ("summary.json.tmp", "absent", "resume"),
    ("export", "absent", "export"),
    ("serving/global.safetensors", "copy", "export"),
    ("summary.json", "copy", "report"),
    ("metrics.jsonl", "copy", "compare"),
    ("audit.json", "copy", "audit"),
    ("checkpoints/round_000002.json", "copy", "audit"),
    ("summary.json", "copy", "summary"),
    ("checkpoints/round_000002.json", "copy", "dashboard"),
    ("serving/serving.json", "copy", "dashboard"),
]
"""The measured escapes and one case of each command: the cheap run's subset."""


@pytest.mark.parametrize(("location", "target", "command"), CHEAP)
def test_a_planted_link_is_refused(base, tmp_path, location, target, command):
    assert location in locations(base) and command in COMMANDS
    check(base, tmp_path, Case(location, target, command))


@pytest.mark.heavy(budget=240)
def test_every_link_under_every_command(base, tmp_path):
    """Every entry of the run (each level) and each planted name, linked to a copy outside
    and to a name not there yet, under every command."""
    cases = all_cases(base)
    assert len(cases) > 300
    for i, case in enumerate(cases):
        check(base, tmp_path / str(i), case)
