"""``fedloom audit RUN_DIR``: membership inference (loss threshold, shadow models) on the global
model and each client's deployed model, or gradient inversion (DLG/iDLG and the analytic
first-layer recovery) against one client's minibatch gradient; optionally the defence
trade-off study. Results go into ``RUN_DIR/audit.json`` (one entry per attack, later audits
with another attack added beside earlier ones) and the page ``audit.html``."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedloom.audit.finished_run import FinishedRun, Model, load_finished_run
from fedloom.audit.membership import (
    MembershipSet,
    Pool,
    Reserve,
    allocate,
    make_reserve,
    matched_set,
)
from fedloom.audit.outputs import Outputs, model_logits
from fedloom.audit.study import StudySetup, defence_tradeoff
from fedloom.core.files import strict_json
from fedloom.core.rng import generator
from fedloom.core.runpaths import under, write_text_atomic
from fedloom.data import FederatedData
from fedloom.errors import ConfigError, unknown_name_message

ATTACKS = ("loss", "shadow", "dlg")
AUDIT_FILE = "audit.json"
PAGE_FILE = "audit.html"
MEAN_KEYS = ("auc", "tpr_at_1pct_fpr", "max_advantage")
DLG_DEFENCES = {"gaussian_noise": 0.1, "topk_prune": 0.9}
"""The gradient defences the DLG audit also tries (docs/audit.md): noise sigma, pruned share."""


def audit(
    run_dir: str | Path,
    attack: str = "loss",
    out: str | Path | None = None,
    *,
    data: FederatedData | None = None,
    model: nn.Module | None = None,
    holdout: tuple[torch.Tensor, torch.Tensor] | None = None,
    members: int = 500,
    num_shadows: int = 4,
    shadow_epochs: int | None = None,
    client: int | None = None,
    defences: bool = False,
    study: StudySetup | None = None,
) -> dict[str, Any]:
    """Audit a finished run; returns the whole audit.json.

    ``attack``: ``loss`` (Yeom et al. 2018), ``shadow`` (Shokri et al. 2017) or ``dlg``
    (DLG/iDLG against ``client``'s first minibatch of the last round at the final global
    model). ``out``: the page (default ``RUN_DIR/audit.html``). ``data``/``model``: those of a
    run on custom data or a custom model; ``holdout``: samples no client trained on (default:
    the dataset's official test split, else the clients' held-out splits). ``members``:
    members (and as many non-members) per target. ``defences``: also run the defence
    trade-off study (membership attacks: audit/study.py; dlg: gradient noise and pruning)."""
    if attack not in ATTACKS:
        raise ConfigError(unknown_name_message("--attack", attack, list(ATTACKS)))
    if members < 2:
        raise ConfigError(f"members: need at least 2 per target, got {members}")
    tick = time.perf_counter()
    run = load_finished_run(run_dir, data, model)
    seed = run.config.seed
    pool = Pool(*holdout) if holdout is not None else None
    doc = _existing(run.path)
    doc.update(_header(run))
    if attack == "dlg":
        result = inversion_audit(run, client, defended=defences)
    else:
        reserve = make_reserve(run.source_data, seed, pool, run.config.data.root)
        doc["reserve"] = {
            "source": reserve.source,
            "nonmembers": len(reserve.nonmembers),
            "shadow": len(reserve.shadow),
            "public": len(reserve.public),
        }
        result = membership_audit(run, attack, reserve, members, num_shadows, shadow_epochs)
        if defences:
            setup = study or _study_setup(run, members)
            clients = {k: run.data.clients[k] for k in run.train_ids}
            doc["defences"] = defence_tradeoff(
                run.model, run.global_model, clients, reserve, setup, seed
            )
    result["seconds"] = time.perf_counter() - tick
    doc.setdefault("attacks", {})[attack] = result
    write_text_atomic(under(run.path, AUDIT_FILE), strict_json(doc, indent=2))
    from fedloom.audit.page import write_page

    write_page(doc, Path(out) if out is not None else under(run.path, PAGE_FILE))
    return doc


# -- membership inference ---------------------------------------------------------------------
def target_sets(run: FinishedRun, reserve: Reserve, members: int) -> dict[str, MembershipSet]:
    """Balanced label-matched member/non-member sets: 'global' (members from every training
    client, in proportion to its size) and one per training client (its own members)."""
    seed, ids = run.config.seed, run.train_ids
    trains = {k: Pool(run.data.clients[k].x_train, run.data.clients[k].y_train) for k in ids}
    sets: dict[str, MembershipSet] = {}
    if run.global_model is not None:
        counts = allocate(members, [len(trains[k]) for k in ids])
        sources = [(k, trains[k], n) for k, n in zip(ids, counts, strict=True) if n]
        gen = generator(seed, "audit/members")
        sets["global"] = matched_set(sources, reserve.nonmembers, gen, reserve.transform)
    for k in ids:
        gen = generator(seed, "audit/members", client=k)
        sets[str(k)] = matched_set(
            [(k, trains[k], members)], reserve.nonmembers, gen, reserve.transform
        )
    return sets


def client_passes(run: FinishedRun) -> float:
    """How many passes over its data a typical client made during the run (local epochs or
    steps x rounds x the share of rounds it took part in): the shadow models' training length."""
    from fedloom.engine.workload import full_budget
    from fedloom.solvers.local import steps_per_epoch

    cfg = run.config
    n = int(statistics.median(run.data.clients[k].num_train for k in run.train_ids))
    steps = full_budget(cfg.train, cfg.seed, 1, run.train_ids[0], n)
    share = min(1.0, (cfg.train.clients_per_round or len(run.train_ids)) / len(run.train_ids))
    return cfg.train.rounds * share * steps / steps_per_epoch(n, cfg.train.batch_size)


def membership_audit(
    run: FinishedRun,
    attack: str,
    reserve: Reserve,
    members: int,
    num_shadows: int = 4,
    shadow_epochs: int | None = None,
) -> dict[str, Any]:
    """One attack on every target (the global model, each client's deployed model)."""
    from fedloom.audit.loss_attack import loss_attack

    sets = target_sets(run, reserve, members)
    result: dict[str, Any] = {"attack": attack, "members_per_target": members}
    score = None
    if attack == "shadow":
        from fedloom.audit.shadow import ShadowSetup, shadow_attack, train_attack_model

        cfg = run.config
        sizes = [run.data.clients[k].num_train for k in run.train_ids]
        epochs = shadow_epochs or max(1, min(100, round(client_passes(run))))
        setup = ShadowSetup(
            num_shadows, int(statistics.median(sizes)), epochs, cfg.train.lr, cfg.train.batch_size
        )
        attack_model, info = train_attack_model(run.model, reserve.shadow, setup, cfg.seed)
        result["shadow"] = info

        def score(outputs: Outputs, target: MembershipSet) -> dict[str, Any]:
            return shadow_attack(attack_model, outputs, target)
    else:
        score = loss_attack
    models: dict[str, Model] = {str(k): m for k, m in run.deployed.items()}
    if run.global_model is not None:
        models = {"global": run.global_model, **models}
    scored = {
        name: score(Outputs(model_logits(run.model, *models[name], target.x)), target)
        for name, target in sets.items()
    }
    result["global"] = scored.pop("global", None)
    result["clients"] = scored
    result["client_mean"] = {
        key: statistics.fmean(r[key] for r in scored.values()) for key in MEAN_KEYS
    }
    return result


def _study_setup(run: FinishedRun, members: int) -> StudySetup:
    """The study's personal training in the run's step size and batch size, with Ditto's lambda
    where the run is Ditto."""
    cfg = run.config
    mu = float(getattr(cfg.algorithm, "mu", StudySetup.mu))
    return StudySetup(mu=mu, lr=cfg.train.lr, batch_size=cfg.train.batch_size, members=members)


# -- gradient inversion -----------------------------------------------------------------------
def inversion_audit(run: FinishedRun, client: int | None, defended: bool) -> dict[str, Any]:
    """DLG and iDLG against ``client``'s gradient of its first training sample of its first
    minibatch of the last round (batch 1, the attacks' setting), at the final global model
    (its deployed model for algorithms without one); the analytic recovery when the model's
    first layer is fully connected with a bias; with ``defended``, DLG against the gradient
    under Gaussian noise and top-k pruning too."""
    from fedloom.audit.images import png_data_uri
    from fedloom.audit.inversion import (
        analytic_recovery,
        batch_gradient,
        first_linear_layer,
        gradient_inversion,
        gradient_noise,
        idlg_label,
        last_layer_keys,
        topk_prune,
    )

    k = run.train_ids[0] if client is None else client
    if k not in run.train_ids:
        raise ConfigError(
            f"--client: {k} is not a training client of the run (0..{max(run.train_ids)})"
        )
    seed, data, fm = run.config.seed, run.data.clients[k], run.model
    at, where = (run.global_model, "global") if run.global_model else (run.deployed[k], "deployed")
    plan = run.engine.algorithm.ctx.make_plan(data, 1, "batches", run.round, k)
    idx = plan[0][:1]
    x, y = data.x_train[idx], data.y_train[idx]
    lo, hi = float(x.min()), float(x.max())
    data_range = 1.0 if lo >= 0 and hi <= 1 else hi - lo
    grads = batch_gradient(fm, at[0], at[1], x, y)
    weight, bias = last_layer_keys(fm, run.data.num_outputs)
    label = idlg_label(grads, weight, bias)
    observed = {"none": grads}
    if defended:
        gen = generator(seed, "audit/dlg/noise", client=k)
        observed["gaussian_noise"] = gradient_noise(grads, DLG_DEFENCES["gaussian_noise"], gen)
        observed["topk_prune"] = topk_prune(grads, DLG_DEFENCES["topk_prune"])
    result: dict[str, Any] = {
        "attack": "dlg",
        "client": k,
        "model": where,
        "round": run.round,
        "sample": int(idx[0]),
        "true_label": int(y[0]),
        "idlg_label": label,
        "original": png_data_uri(x[0], data_range) if _showable(x[0]) else None,
        "reconstructions": [],
    }
    for defence, obs in observed.items():
        for method, labels in (("iDLG", torch.tensor([label])), ("DLG", None)):
            if defence != "none" and method == "DLG":
                continue
            inv = gradient_inversion(
                fm, at[0], at[1], obs, tuple(x.shape), run.data.num_outputs,
                generator(seed, f"audit/dlg/{method}", client=k), labels=labels,
            )  # fmt: skip
            result["reconstructions"].append(
                {
                    "method": method,
                    "defence": defence,
                    "setting": DLG_DEFENCES.get(defence),
                    "psnr": inv.psnr(x, data_range),
                    "label": int(inv.label[0]),
                    "matching_loss": inv.matching_loss,
                    "seconds": inv.seconds,
                    "image": png_data_uri(inv.x[0], data_range) if _showable(x[0]) else None,
                }
            )
    layer = first_linear_layer(fm)
    if layer is not None:
        for defence, obs in observed.items():
            x_hat = analytic_recovery(obs, *layer).view_as(x[0]).to(x.dtype)
            result["reconstructions"].append(
                {
                    "method": "analytic",
                    "defence": defence,
                    "setting": DLG_DEFENCES.get(defence),
                    "psnr": float(_psnr(x[0], x_hat, data_range)),
                    "label": None,
                    "image": png_data_uri(x_hat.clamp(lo, hi), data_range)
                    if _showable(x[0])
                    else None,
                }
            )
    return result


def _psnr(x: torch.Tensor, x_hat: torch.Tensor, data_range: float) -> float:
    from fedloom.audit.metrics import psnr

    return psnr(x, x_hat, data_range)


def _showable(x: torch.Tensor) -> bool:
    if x.ndim == 3:
        return x.shape[0] in (1, 3)
    return x.ndim == 1 and math.isqrt(x.numel()) ** 2 == x.numel()


# -- the file ---------------------------------------------------------------------------------
def _header(run: FinishedRun) -> dict[str, Any]:
    cfg = run.config
    return {
        "run": {
            "path": str(run.path.resolve()),
            "algorithm": cfg.algorithm.name,
            "dataset": run.data.name,
            "model": cfg.model.name,
            "seed": cfg.seed,
            "round": run.round,
            "rounds": cfg.train.rounds,
            "clients": run.data.num_clients,
            "global_accuracy": (run.evaluation.get("global") or {}).get("accuracy"),
            "personalized_accuracy": (run.evaluation.get("personalized") or {}).get(
                "accuracy_mean"
            ),
        }
    }


def _existing(path: Path) -> dict[str, Any]:
    """The run's audit.json so far (another attack's results are kept), or a fresh one."""
    file = under(path, AUDIT_FILE)
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


__all__ = ["ATTACKS", "AUDIT_FILE", "PAGE_FILE", "StudySetup", "audit"]
