"""The Optuna study behind ``fedloom tune``: sampler, pruner, journal storage, resume.

- Sampler: multivariate TPE (Bergstra et al., NeurIPS 2011; Falkner et al., "BOHB", ICML 2018
  pair it with Hyperband). Its random state is re-derived for every trial from (seed, trial
  number) (:class:`TrialSeededTPE`), so a search stopped between two trials and resumed in a new
  process draws exactly what the uninterrupted search draws.
- Pruner: Hyperband (Li et al., JMLR 2018) or successive halving (Jamieson & Talwalkar, AISTATS
  2016) with the round as the resource (FedHPO-Bench, Wang et al. 2022: rounds are FL's natural
  fidelity), or none.
- Storage: an append-only journal file (no database server); the study name is fixed, because
  Hyperband assigns brackets by a hash of (study name, trial number) and a different name gives
  a different trial list (docs/tune.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from fedloom.core.rng import seed_for
from fedloom.errors import RunDirError

STUDY_NAME = "fedloom-tune"
JOURNAL_FILE = "journal.log"
REDUCTION_FACTOR = 3
PrunerKind = Literal["hyperband", "sha", "none"]
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class TrialSeededTPE(optuna.samplers.TPESampler):
    """Multivariate TPE whose random state is set from (seed, trial number) before each trial.

    Optuna's own TPE draws from one random state seeded once per process, so a resumed search
    would draw new values; here trial ``k``'s draws depend only on the seed, ``k`` and the
    finished trials before it, as in an uninterrupted search."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed, multivariate=True)
        self._base_seed = seed

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        state = seed_for(self._base_seed, "tune/sampler", trial.number) % 2**32
        self._rng.rng.seed(state)
        self._random_sampler._rng.rng.seed(state)
        super().before_trial(study, trial)


def make_pruner(
    kind: PrunerKind, min_resource: int, max_resource: int
) -> optuna.pruners.BasePruner:
    """Rounds are the resource: trials report at rounds ``min_resource``, ... ``max_resource``."""
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=min_resource,
            max_resource=max_resource,
            reduction_factor=REDUCTION_FACTOR,
        )
    if kind == "sha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=min_resource, reduction_factor=REDUCTION_FACTOR
        )
    return optuna.pruners.NopPruner()


def open_study(
    out: Path,
    definition: dict[str, Any],
    direction: Literal["minimize", "maximize"],
    pruner: optuna.pruners.BasePruner,
    seed: int,
) -> optuna.Study:
    """The study in ``out/journal.log``: created, or reopened to continue it.

    ``definition`` (base config, space, metric, pruner, seed) is stored with the study; a
    journal holding a different search is refused rather than mixed with this one. A trial left
    RUNNING by a killed process is marked FAIL and its values are queued again, so the search
    ends with every trial finished once."""
    storage = JournalStorage(JournalFileBackend(str(out / JOURNAL_FILE)))
    study = optuna.create_study(
        study_name=STUDY_NAME,
        storage=storage,
        sampler=TrialSeededTPE(seed),
        pruner=pruner,
        direction=direction,
        load_if_exists=True,
    )
    saved = study.user_attrs.get("definition")
    if saved is None:
        study.set_user_attr("definition", definition)
    elif _canonical(saved) != _canonical(definition):
        differing = sorted(
            k for k in set(saved) | set(definition) if saved.get(k) != definition.get(k)
        )
        raise RunDirError(
            f"{out} holds another search (it differs in {', '.join(differing)}); give a new "
            "--out, or the same config, space, metric, pruner and seed to continue it"
        )
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    return study


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=FINISHED)


def check_out_dir(out: Path) -> None:
    """``out`` must be new, empty, or a search directory (holding a journal) to continue."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / JOURNAL_FILE).is_file():
        raise RunDirError(
            f"--out {out} exists, is not empty and holds no {JOURNAL_FILE}: a search never "
            "writes into another directory; choose a new --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create --out {out}: {err.strerror}") from None
