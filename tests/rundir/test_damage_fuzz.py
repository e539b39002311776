"""A run directory is a trust boundary: generated damage to a finished run (wrong JSON types
at every key of serving.json, card.json, summary.json and the checkpoint manifests, truncated
files, checkpoint tensors of another shape or dtype or non-finite with valid checksums) makes
``fedloom run --resume``, ``export``, ``report``, ``compare``, ``summary`` and ``audit`` exit
0 or 2 with one error line, never 1 and never a traceback; a damaged newest checkpoint is
skipped, with a warning naming the file and the tensor, for the older one.

The cheap tests take a deterministic share of the cases; the heavy ones take all of them."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import fedloom
from fedloom.engine.checkpoint import read_checkpoint
from fedloom.errors import FedloomInputError
from fedloom.serving import export_run, load_exported
from tests.cli.invoke import Outcome
from tests.cli.invoke import fedloom as fedloom_cli
from tests.rundir.damage import (
    Damage,
    json_type_damages,
    tensor_damages,
    truncation_damages,
)

ROUNDS = 3
NEWEST = f"checkpoints/round_{ROUNDS:06d}.json"
OLDER = f"round_{ROUNDS - 1:06d}"
CASE_SECONDS = 20
"""The most one command may take on a damaged run (the undamaged ones take under a second)."""

CONFIG = {
    "seed": 0,
    "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "logreg"},
    "algorithm": {"name": "ditto", "mu": 0.1},
    "train": {"rounds": ROUNDS, "local_steps": 2, "lr": 0.1, "batch_size": 16},
    "eval": {"every": 1, "validation_fraction": 0.2},
    "checkpoint": {"every": 1, "keep": ROUNDS},
    "monitor": {"enabled": False},
    "executor": {"kind": "sequential"},
    "serving": {"keep_best": True, "ema": 0.8},
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, data_root) -> Path:
    """A finished run (3 rounds, a checkpoint each) with an export beside it (EXPORT/card.json)."""
    base = tmp_path_factory.mktemp("damage")
    fedloom.run(CONFIG, out=base / "run", progress=False)
    export_run(base / "run", base / "export")
    return base


Command = Callable[[Path, Path], list[str]]
"""(damaged run, scratch folder) -> the command line."""


def RESUME(run: Path, tmp: Path) -> list[str]:
    return ["run", "--resume", str(run)]


def EXPORT(run: Path, tmp: Path) -> list[str]:
    return ["export", str(run), "--out", str(tmp / "exported")]


def REPORT(run: Path, tmp: Path) -> list[str]:
    return ["report", str(run)]


def SUMMARY(run: Path, tmp: Path) -> list[str]:
    return ["summary", str(run)]


def AUDIT(run: Path, tmp: Path) -> list[str]:
    return ["audit", str(run), "--members", "20", "--out", str(tmp / "a.html")]


def compare_with(pristine: Path) -> Command:
    return lambda run, tmp: ["compare", str(run), str(pristine / "run"), "--out", str(tmp / "c")]


class Tally:
    """The outcomes of the cases: exit codes counted, the wrong ones kept to report."""

    def __init__(self) -> None:
        self.codes: Counter[int] = Counter()
        self.wrong: list[str] = []

    def add(self, case: str, outcome: Outcome, seconds: float) -> None:
        self.codes[outcome.code] += 1
        if outcome.code == 0:
            ok = "Traceback" not in outcome.stderr
        else:
            ok = outcome.is_clear_input_error()
        if not ok or seconds > CASE_SECONDS:
            self.wrong.append(f"{case}: exit {outcome.code} in {seconds:.1f} s: {outcome.stderr}")

    def expect(self, case: str, ok: bool, why: str) -> None:
        if not ok:
            self.wrong.append(f"{case}: {why}")

    def check(self) -> None:
        print(f"exit codes {dict(sorted(self.codes.items()))}, {len(self.wrong)} wrong")
        assert not self.wrong, (
            f"{len(self.wrong)} wrong of {sum(self.codes.values())} "
            f"(exit codes {dict(self.codes)}):\n" + "\n".join(w[:600] for w in self.wrong[:12])
        )


def run_cases(
    pristine: Path,
    tmp_path: Path,
    damages: Sequence[Damage],
    commands: Sequence[Command],
    after: Callable[[Damage, Path, Outcome, Tally], None] | None = None,
) -> Tally:
    """Each damage on a fresh copy of the run, then each command on it."""
    tally = Tally()
    for n, damage in enumerate(damages):
        for m, command in enumerate(commands):
            case = tmp_path / f"case{n}_{m}"
            run = case / "run"
            shutil.copytree(pristine / "run", run, ignore=shutil.ignore_patterns(".lock"))
            damage.apply(run)
            args = command(run, case)
            start = time.perf_counter()
            outcome = fedloom_cli(args, seconds=CASE_SECONDS * 3)
            tally.add(f"{damage.name} | fedloom {args[0]}", outcome, time.perf_counter() - start)
            if after is not None:
                after(damage, run, outcome, tally)
            shutil.rmtree(case, ignore_errors=True)
    return tally


def share(cases: list[Damage], every: int) -> list[Damage]:
    """Every ``every``-th case (the cheap tests' deterministic share)."""
    return cases[::every]


# -- JSON files -------------------------------------------------------------------------------
def _serving(pristine: Path) -> list[Damage]:
    return json_type_damages(pristine / "run", "serving/serving.json")


def _summary(pristine: Path) -> list[Damage]:
    return json_type_damages(pristine / "run", "summary.json")


def _manifest(pristine: Path, every_key: bool = True) -> list[Damage]:
    """Wrong types in the newest manifest, with and without its checksum recomputed; without
    ``every_key``, only in its envelope and the top two levels of its tree outside the history
    and the config (tree.config: a change is config drift, compared with config.yaml)."""

    def keep(path: tuple) -> bool:
        return every_key or (
            len(path) <= 3 and path[:2] not in (("tree", "history"), ("tree", "config"))
        )

    run = pristine / "run"
    return json_type_damages(run, NEWEST, keep=keep) + json_type_damages(
        run, NEWEST, rehash=True, keep=keep
    )


def test_wrong_types_in_serving_json_export_exits_2_and_leaves_no_export(pristine, tmp_path):
    def no_partial_export(damage: Damage, run: Path, outcome: Outcome, tally: Tally) -> None:
        exported = run.parent / "exported"
        partial = outcome.code != 0 and exported.exists() and any(exported.iterdir())
        tally.expect(damage.name, not partial, f"a partial export left behind in {exported}")

    run_cases(pristine, tmp_path, share(_serving(pristine), 2), [EXPORT], no_partial_export).check()


def test_wrong_types_in_summary_json(pristine, tmp_path):
    damages = share(_summary(pristine), 10)
    run_cases(pristine, tmp_path, damages, [EXPORT, SUMMARY]).check()
    run_cases(pristine, tmp_path, share(damages, 4), [REPORT, compare_with(pristine)]).check()


@pytest.mark.heavy(budget=600)
def test_wrong_types_in_summary_json_every_key(pristine, tmp_path):
    commands = [EXPORT, SUMMARY, REPORT, compare_with(pristine)]
    run_cases(pristine, tmp_path, _summary(pristine), commands).check()


def test_wrong_types_in_card_json_are_run_dir_errors(pristine, tmp_path):
    wrong = Counter()
    failures = []
    for damage in json_type_damages(pristine / "export", "card.json"):
        folder = tmp_path / "export"
        shutil.copytree(pristine / "export", folder)
        damage.apply(folder)
        for copy in ("global", "clients"):
            try:
                load_exported(folder, copy, client=0 if copy == "clients" else None)
                wrong[0] += 1
            except FedloomInputError:
                wrong[2] += 1
            except Exception as err:
                wrong[1] += 1
                failures.append(f"{damage.name} ({copy}): {type(err).__name__}: {err}")
        shutil.rmtree(folder)
    assert not failures, f"{len(failures)} of {sum(wrong.values())}:\n" + "\n".join(failures[:12])


# -- checkpoints ------------------------------------------------------------------------------
def falls_back(damage: Damage, run: Path, outcome: Outcome, tally: Tally) -> None:
    """A damaged newest checkpoint: resumed from the older one, with a warning naming the
    file (and the tensor), and the newest checkpoint written again, whole."""
    warned = [line for line in outcome.stderr.splitlines() if line.startswith("warning:")]
    named = [w for w in warned if f"round_{ROUNDS:06d}" in w and (damage.tensor or "") in w]
    tally.expect(damage.name, outcome.code == 0, "resume did not succeed")
    tally.expect(damage.name, bool(named), f"no warning naming the file and tensor: {warned}")
    if outcome.code == 0:
        saved = read_checkpoint(run / NEWEST)
        tally.expect(damage.name, saved["round"] == ROUNDS, "the newest checkpoint not rewritten")


def test_tensor_damage_with_valid_checksums_falls_back_to_the_older_checkpoint(pristine, tmp_path):
    damages = share(tensor_damages(pristine / "run", NEWEST), 15)
    run_cases(pristine, tmp_path, damages, [RESUME], falls_back).check()


def _weight(key: str) -> bool:
    """The model's weights in the checkpoint: the server's, the clients' personal models',
    the served copies' (the digits logreg's linear.weight and linear.bias)."""
    return key.endswith(("linear.weight", "linear.bias"))


def test_forged_weights_that_do_not_fit_the_model_fall_back(pristine, tmp_path):
    """The manifest's record rewritten too: only the run's own model can tell (int32 weights
    were cast silently before, another shape was a RuntimeError and exit 1, NaN weights
    blamed on the learning rate)."""
    damages = share(tensor_damages(pristine / "run", NEWEST, forge=True, only=_weight), 13)
    run_cases(pristine, tmp_path, damages, [RESUME], falls_back).check()


@pytest.mark.heavy(budget=600)
def test_every_forged_weight_falls_back(pristine, tmp_path):
    damages = tensor_damages(pristine / "run", NEWEST, forge=True, only=_weight)
    run_cases(pristine, tmp_path, damages, [RESUME], falls_back).check()


@pytest.mark.heavy(budget=600)
def test_every_tensor_damage_falls_back_and_audit_exits_0_or_2(pristine, tmp_path):
    damages = tensor_damages(pristine / "run", NEWEST)
    run_cases(pristine, tmp_path, damages, [RESUME], falls_back).check()
    run_cases(pristine, tmp_path, damages, [AUDIT]).check()


def test_wrong_types_in_the_newest_manifest(pristine, tmp_path):
    damages = share(_manifest(pristine, every_key=False), 24)
    run_cases(pristine, tmp_path, damages, [RESUME]).check()


@pytest.mark.heavy(budget=1200)
def test_wrong_types_at_every_key_of_the_newest_manifest(pristine, tmp_path):
    damages = share(_manifest(pristine), 2)  # of 1,738 cases, each key once
    run_cases(pristine, tmp_path, damages, [RESUME]).check()
    run_cases(pristine, tmp_path, share(damages, 8), [AUDIT]).check()


def test_no_usable_checkpoint_is_exit_2_saying_what_to_do(pristine, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(pristine / "run", run, ignore=shutil.ignore_patterns(".lock"))
    for manifest in sorted((run / "checkpoints").glob("round_*.json")):
        manifest.write_text(manifest.read_text()[:-10])
    outcome = fedloom_cli(RESUME(run, tmp_path))
    assert outcome.is_clear_input_error(), outcome.stderr
    for word in ("no good checkpoint", "round_000001", "--out"):
        assert word in outcome.stderr


# -- truncated files --------------------------------------------------------------------------
FILES = [
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "label_histogram.json",
    "partition.json",
    "serving/serving.json",
    "serving/global.safetensors",
    "serving/clients.safetensors",
    NEWEST,
    NEWEST.replace(".json", ".safetensors"),
]


def test_truncated_files(pristine, tmp_path):
    damages = share(truncation_damages(pristine / "run", FILES), 2)
    run_cases(pristine, tmp_path, damages, [RESUME, EXPORT]).check()


@pytest.mark.heavy(budget=600)
def test_truncated_files_every_command(pristine, tmp_path):
    damages = truncation_damages(pristine / "run", FILES)
    commands = [RESUME, EXPORT, REPORT, SUMMARY, AUDIT, compare_with(pristine)]
    run_cases(pristine, tmp_path, damages, commands).check()


@pytest.mark.heavy(budget=300)
def test_wrong_types_in_serving_json_every_key(pristine, tmp_path):
    run_cases(pristine, tmp_path, _serving(pristine), [EXPORT]).check()
