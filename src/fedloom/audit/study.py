"""The defence trade-off study (the report's table): membership-inference AUC
against accuracy for personal models without a defence and under each of the three defences
(audit/defences.py; docs/audit.md, "The three defences and their honesty labels").

Every client k gets a personal model phi_k = argmin f_k(phi) + mu/2 ||phi - w||^2 from the
global model w (Ditto's objective (9), solved from w by SGD: :func:`personalize`); that is the
*undefended* row. Each defence then changes one thing: the noisy proximal term in that same
training, the released model (distilled through public data), or the released answers (output
noise). Each row: the loss-threshold attack's AUC, TPR at 1% FPR and label-only advantage on
phi_k's balanced member/non-member set, and the accuracy of what the client deploys on its own
held-out data, averaged over clients, with the change from the undefended row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from fedloom.audit.defences import OutputNoise, distill, personalize
from fedloom.audit.loss_attack import loss_attack
from fedloom.audit.membership import MembershipSet, Pool, Reserve, matched_set
from fedloom.audit.outputs import Outputs, model_logits
from fedloom.audit.training import Model
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.rng import generator


@dataclass(frozen=True)
class StudySetup:
    """The personal training and each defence's settings."""

    mu: float = 0.1
    """Ditto's lambda toward w (0 for a run without a global model)."""
    epochs: int = 50
    lr: float = 0.05
    batch_size: int | None = 32
    prox_sigmas: tuple[float, ...] = (0.3, 1.0)
    """sigma of the noisy proximal term's xi."""
    prox_draws: tuple[str, ...] = ("step",)
    """'step': xi drawn afresh each step (the default); 'once': one draw for the whole
    training (the objective-perturbation form, still heuristic for a neural network)."""
    distill_epochs: int = 10
    public_size: int = 1000
    epsilons: tuple[float, ...] = (1.0, 8.0)
    """Calibrated output noise: epsilon per query (at ``delta``)."""
    delta: float = 1e-5
    logit_sigmas: tuple[float, ...] = (2.0, 5.0)
    """Uncalibrated Gaussian noise on the logits."""
    members: int = 500
    clients: int = 10
    """At most this many training clients (the first ones) are studied."""
    train_samples: int = 1000
    """A client with more training samples trains its study models on this many of them
    (seeded); its members are drawn from those."""


Released = Callable[[torch.Tensor], Outputs]


@dataclass
class _Row:
    defence: str
    setting: str
    guarantee: str
    per_client: list[dict[str, float]]


def _measure(release: Released, target: MembershipSet, test: Pool) -> dict[str, float]:
    outputs, answers = release(target.x), release(test.x)
    if not torch.isfinite(outputs.values).all():  # the training diverged
        nan = float("nan")
        keys = ("auc", "tpr_at_1pct_fpr", "label_only_advantage", "accuracy")
        return dict.fromkeys(keys, nan)
    attack = loss_attack(outputs, target)
    return {
        "auc": attack["auc"],
        "tpr_at_1pct_fpr": attack["tpr_at_1pct_fpr"],
        "label_only_advantage": attack["label_only"]["advantage"],
        "accuracy": float((answers.predictions() == test.y).double().mean()),
    }


def defence_tradeoff(
    model: FunctionalModel,
    global_model: Model | None,
    clients: dict[int, ClientData],
    reserve: Reserve,
    setup: StudySetup,
    seed: int,
) -> dict[str, Any]:
    """The trade-off table for ``clients`` (their training and held-out data) around the
    global model ``global_model`` (None: from the initial model with mu 0, and no noisy
    proximal rows). Streams: (seed, 'audit/study/...', client=k)."""
    mu = setup.mu if global_model is not None else 0.0
    w = global_model if global_model is not None else model.initial_state(seed)
    public = reserve.public.x[: setup.public_size]
    rows: dict[str, _Row] = {}

    def row(defence: str, setting: str, guarantee: str) -> _Row:
        return rows.setdefault(f"{defence}/{setting}", _Row(defence, setting, guarantee, []))

    def outputs_of(trained: Model) -> Released:
        return lambda x: Outputs(model_logits(model, trained[0], trained[1], x))

    for k, data in list(clients.items())[: setup.clients]:
        if data.num_train > setup.train_samples:
            keep = torch.randperm(
                data.num_train, generator=generator(seed, "audit/study/subset", client=k)
            )
            keep = keep[: setup.train_samples]
            data = ClientData(data.x_train[keep], data.y_train[keep], data.x_test, data.y_test)
        target = matched_set(
            [(k, Pool(data.x_train, data.y_train), setup.members)],
            reserve.nonmembers,
            generator(seed, "audit/study/members", client=k),
            reserve.transform,
        )
        test = Pool(data.x_test, data.y_test)

        def train(sigma: float, draw: str = "step", k: int = k, data: ClientData = data) -> Model:
            gen = generator(seed, f"audit/study/personal/{draw}/{sigma:g}", client=k)
            return personalize(
                model, w, data.x_train, data.y_train, setup.epochs, setup.lr,
                setup.batch_size, mu, sigma, gen, fresh=draw == "step",
            )  # fmt: skip

        personal = train(0.0)
        base = row("none", f"mu={mu:g}", "undefended")
        base.per_client.append(_measure(outputs_of(personal), target, test))
        for draw in setup.prox_draws if mu else ():
            for sigma in setup.prox_sigmas:
                when = "fresh each step" if draw == "step" else "drawn once"
                setting = f"mu={mu:g}, sigma={sigma:g}, xi {when}"
                noisy = row("noisy_prox", setting, "heuristic (no epsilon)")
                noisy.per_client.append(_measure(outputs_of(train(sigma, draw)), target, test))
        student = distill(
            model, personal, w, public, setup.distill_epochs, setup.lr, setup.batch_size,
            generator(seed, "audit/study/distill", client=k),
        )  # fmt: skip
        setting = f"{len(public)} public samples, {setup.distill_epochs} epochs"
        row("distillation", setting, "empirical (no formal guarantee)").per_client.append(
            _measure(outputs_of(student), target, test)
        )
        mechanisms = [OutputNoise.calibrated(e, setup.delta, seed) for e in setup.epsilons]
        mechanisms += [OutputNoise(s, "logits", seed=seed) for s in setup.logit_sigmas]
        for mech in mechanisms:
            setting = f"sigma={mech.sigma:.3g} on {mech.on}"
            row("output_noise", setting, mech.label).per_client.append(
                _measure(lambda x, m=mech, p=personal: m.release(model, p, x), target, test)
            )
    return {"setup": {**asdict(setup), "mu": mu}, "rows": _table(list(rows.values()))}


def _table(rows: list[_Row]) -> list[dict[str, Any]]:
    """Means over clients, and each row's change from the undefended one."""
    out = []
    for r in rows:
        ok = [c for c in r.per_client if np.isfinite(c["auc"])]  # diverged models left out
        mean = {
            k: float(np.mean([c[k] for c in ok])) if ok else float("nan") for k in r.per_client[0]
        }
        diverged = len(r.per_client) - len(ok)
        out.append(
            {"defence": r.defence, "setting": r.setting, "guarantee": r.guarantee, **mean,
             "diverged": diverged}
        )  # fmt: skip
    base = out[0]
    for r in out:
        r["auc_change"] = r["auc"] - base["auc"]
        r["accuracy_cost"] = base["accuracy"] - r["accuracy"]
    return out
