"""The shadow-model attack (Shokri, Stronati, Song & Shmatikov, "Membership Inference Attacks
Against Machine Learning Models", S&P 2017, sections IV-B to IV-E).

k shadow models are trained like the target on disjoint slices of same-distribution data that
no client ever saw; each slice is half "in" (the shadow's training set) and half "out". The
shadows' outputs on their in and out samples, labelled member/non-member, train one attack
classifier per true class (section IV-E) whose input is the output vector sorted in decreasing
order (Salem et al., NDSS 2019; class-independent features, so a class with few samples still
has a model), as log probabilities. The attack classifier is the paper's small network (one
hidden layer of 64 units, scikit-learn's MLPClassifier); its member probability is the score
whose ROC curve is reported. Classes with too few shadow samples of either kind fall back to
one classifier over all classes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from fedloom.audit.membership import MembershipSet, Pool
from fedloom.audit.metrics import attack_summary
from fedloom.audit.outputs import Outputs, model_logits
from fedloom.audit.training import Model, train_sgd
from fedloom.core.functional import FunctionalModel
from fedloom.core.rng import generator, seed_for
from fedloom.errors import ConfigError

MIN_PER_CLASS = 10
"""Shadow samples of each kind (in, out) a class needs for a classifier of its own."""

Release = Callable[[Model, torch.Tensor], Outputs]
"""What the attacker gets from a model on queries x (the target's outputs, or a defence's)."""


@dataclass(frozen=True)
class ShadowSetup:
    """How the shadow models are trained: like the target (the paper's assumption that the
    attacker knows the training procedure), as far as one local training run can be."""

    num_shadows: int = 4
    size: int = 500
    """Training samples of each shadow model (as many again are its non-members)."""
    epochs: int = 20
    lr: float = 0.05
    batch_size: int | None = 32


def _classifier(seed: int, purpose: str, label: int) -> Pipeline:
    state = seed_for(seed, purpose, client=label) % 2**32
    net = MLPClassifier(hidden_layer_sizes=(64,), max_iter=300, random_state=state)
    return make_pipeline(StandardScaler(), net)


class AttackModel:
    """Per-class attack classifiers (with a class-agnostic fallback) over sorted outputs."""

    def __init__(self, features: np.ndarray, labels: np.ndarray, member: np.ndarray, seed: int):
        self.fallback = self._fit(_classifier(seed, "audit/shadow/attack", -1), features, member)
        self.per_class: dict[int, Pipeline] = {}
        for c in np.unique(labels).tolist():
            rows = labels == c
            if min(member[rows].sum(), (~member[rows]).sum()) >= MIN_PER_CLASS:
                clf = _classifier(seed, "audit/shadow/attack", c)
                self.per_class[c] = self._fit(clf, features[rows], member[rows])

    @staticmethod
    def _fit(clf: Pipeline, x: np.ndarray, member: np.ndarray) -> Pipeline:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            return clf.fit(x, member.astype(int))

    def score(self, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """P(member) for each row, by the classifier of its true class."""
        out = self.fallback.predict_proba(features)[:, 1]
        for c, clf in self.per_class.items():
            rows = labels == c
            if rows.any():
                out[rows] = clf.predict_proba(features[rows])[:, 1]
        return out


def clean_release(model: FunctionalModel) -> Release:
    """The model's logits, as deployed."""
    return lambda trained, x: Outputs(model_logits(model, trained[0], trained[1], x))


def train_attack_model(
    model: FunctionalModel,
    shadow: Pool,
    setup: ShadowSetup,
    seed: int,
    release: Release | None = None,
) -> tuple[AttackModel, dict[str, Any]]:
    """Train the k shadow models on disjoint in/out slices of ``shadow`` (streams
    (seed, 'audit/shadow/...', client=i)) and the attack classifiers on their outputs as
    ``release`` gives them (default: clean logits)."""
    release = release or clean_release(model)
    size = min(setup.size, len(shadow) // (2 * setup.num_shadows))
    if size < MIN_PER_CLASS:
        raise ConfigError(
            f"{len(shadow)} shadow samples are too few for {setup.num_shadows} shadow models "
            "(each needs in and out samples); lower the number of shadow models"
        )
    order = torch.randperm(len(shadow), generator=generator(seed, "audit/shadow/split"))
    feats, labels, member, accs = [], [], [], []
    for i in range(setup.num_shadows):
        part = order[2 * i * size : 2 * (i + 1) * size]
        inside, outside = shadow.take(part[:size]), shadow.take(part[size:])
        start = model.initial_state(seed_for(seed, "audit/shadow/init", client=i))
        trained = train_sgd(
            model,
            start,
            inside.x,
            inside.y,
            setup.epochs,
            setup.lr,
            setup.batch_size,
            generator(seed, "audit/shadow/batches", client=i),
        )
        for pool, is_member in ((inside, True), (outside, False)):
            out = release(trained, pool.x)
            feats.append(out.sorted_features())
            labels.append(pool.y.numpy())
            member.append(np.full(len(pool), is_member))
            if not is_member:
                accs.append(float((out.predictions() == pool.y).double().mean()))
    attack = AttackModel(
        np.concatenate(feats), np.concatenate(labels), np.concatenate(member), seed
    )
    info = {
        "num_shadows": setup.num_shadows,
        "shadow_size": size,
        "epochs": setup.epochs,
        "lr": setup.lr,
        "batch_size": setup.batch_size,
        "shadow_test_accuracy": float(np.mean(accs)),
        "per_class_classifiers": len(attack.per_class),
    }
    return attack, info


def shadow_attack(attack: AttackModel, outputs: Outputs, target: MembershipSet) -> dict[str, Any]:
    """The attack classifiers' member probabilities on ``target``, scored as an ROC curve."""
    scores = attack.score(outputs.sorted_features(), target.y.numpy())
    return attack_summary(scores, target.member.numpy())
