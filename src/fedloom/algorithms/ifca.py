"""IFCA, the iterative federated clustering algorithm (Ghosh, Chung, Yin, Ramchandran, NeurIPS
2020, "An Efficient Framework for Clustered Federated Learning", arXiv:2006.04088, Algorithm 1).

The server keeps k cluster models theta_1..theta_k. One round, line by line::

    server:   broadcast theta_1..theta_k to the round's clients M_t     # server_message
    client i: j_i = argmin_j F_i(theta_j), its mean loss on its training data
                                                    # the cluster identity estimate (init)
              model:    theta_i~ <- local SGD from theta_{j_i}         # option II, LocalUpdate
              gradient: g_i <- grad F_i(theta_{j_i}), full batch        # option I
              upload theta_i~ (or g_i) and j_i (the one-hot s_i, as an index)
    server:   model:    theta_j <- sum_{i: j_i = j} w_i theta_i~ / sum_{i: j_i = j} w_i
              gradient: theta_j <- theta_j - gamma sum_{i: j_i = j} w_i g_i / sum_{i in M_t} w_i
              (a cluster no client chose keeps its model)

w_i is 1 (``weighting: uniform``, the paper's and the authors' code's unweighted averages;
the gradient step's denominator is then |M_t|, the paper's m) or n_i (``samples``). gamma is
``train.lr``; the model variant's local SGD is the engine's (``train.local_steps`` or
``local_epochs``, ``batch_size``, ``lr``), the gradient variant takes one full-batch gradient
(as FedSGD, algorithms/fedsgd.py). With k = 1 and ``weighting: samples`` the model variant is
FedAvg and the gradient variant FedSGD.

Initialization: cluster 1 is the run's initial model, cluster j > 1 the model's initialization
from the stream (seed, 'ifca/init', j) (the paper: random initialization; it restarts several
times, which a user does with different seeds).

What travels: every sampled client downloads the k models (``download_bytes``: k models a
client), and uploads one model (or gradient) and its cluster index. The server keeps each
training client's latest identity estimate (-1: never sampled) with the k models; both are in
checkpoints, and summary.json's ``extras`` reports them (``cluster_identity``,
``cluster_sizes``).

Deployment: a client deploys the cluster model with the lowest mean loss on its own training
data under the current models (the same rule, never its test data); a held-out new client
(cold start) starts from the model its training data chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from scipy.optimize import linear_sum_assignment

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, SGDProgram
from fedloom.algorithms.weights import Weighting, aggregation_weight, weighting_field
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.core.rng import seed_for
from fedloom.solvers import Carry, ClientProgram, ClientRun


class IFCAConfig(AlgorithmConfig):
    k: int = Field(default=2, ge=1, description="number of cluster models")
    variant: Literal["model", "gradient"] = Field(
        default="model",
        description="model: local SGD, per-cluster model averaging (option II); gradient: one "
        "full-batch gradient, per-cluster gradient step (option I)",
    )
    weighting: Weighting = weighting_field("uniform", "client weight in a cluster's average")


def pick(stacked: Tree, cluster: int) -> Tree:
    """Cluster ``cluster``'s tree out of the (k, ...) stacked trees."""
    return {key: value[cluster] for key, value in stacked.items()}


def cluster_losses(
    model: FunctionalModel, clusters: Tree, buffers: Tree, data: ClientData, k: int
) -> list[float]:
    """F_i(theta_j) for j = 1..k: the mean loss of each cluster model on the client's training
    data (evaluation mode)."""
    n = max(data.num_train, 1)
    return [
        model.evaluate(pick(clusters, j), pick(buffers, j), data.x_train, data.y_train)[0] / n
        for j in range(k)
    ]


def best_cluster(
    model: FunctionalModel, clusters: Tree, buffers: Tree, data: ClientData, k: int
) -> int:
    """The cluster identity estimate argmin_j F_i(theta_j) (the first of equal losses)."""
    losses = cluster_losses(model, clusters, buffers, data, k)
    return min(range(k), key=losses.__getitem__)


class IFCA(Algorithm):
    name = "ifca"
    summary = "IFCA: k cluster models, each client trains the one of lowest loss (Ghosh et al.)"
    Config = IFCAConfig
    has_global_model = False

    def _choose(self, clusters: Tree, buffers: Tree, data: ClientData) -> int:
        return best_cluster(self.ctx.model, clusters, buffers, data, self.config.k)

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        models = [(params, buffers)] + [
            self.ctx.model.initial_state(seed_for(self.ctx.seed, "ifca/init", client=j))
            for j in range(1, self.config.k)
        ]
        return {
            "clusters": {key: torch.stack([p[key] for p, _ in models]) for key in params},
            "buffers": {key: torch.stack([b[key] for _, b in models]) for key in buffers},
            "identity": torch.full((self.ctx.num_clients,), -1, dtype=torch.long),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"clusters": server["clusters"], "cluster_buffers": server["buffers"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        clusters = {key: value.clone() for key, value in server["clusters"].items()}
        buffers = {key: value.clone() for key, value in server["buffers"].items()}
        identity = server["identity"].clone()
        chosen = [int(r.upload["cluster"]["index"]) for r in results]
        total = sum(r.weight for r in results)
        for j in sorted(set(chosen)):
            members = [r for r, c in zip(results, chosen, strict=True) if c == j]
            weights = [r.weight for r in members]
            if self.config.variant == "model":
                new = self.ctx.aggregate([r.upload["params"] for r in members], weights)
            else:  # theta_j - gamma sum_{S_j} w_i g_i / sum_{M_t} w_i
                grad = self.ctx.aggregate([r.upload["grad"] for r in members], weights)
                share = self.ctx.lr * sum(weights) / total
                new = {key: clusters[key][j] - share * g for key, g in grad.items()}
            for key, value in new.items():
                clusters[key][j] = value
            if buffers:
                mean = self.ctx.aggregate([r.upload["buffers"] for r in members], weights)
                for key, value in mean.items():
                    buffers[key][j] = value
        for r, c in zip(results, chosen, strict=True):
            identity[r.client_id] = c
        return {"clusters": clusters, "buffers": buffers, "identity": identity}

    def summary_extras(self, server: State) -> dict[str, Any]:
        """summary.json extras: each client's latest cluster identity (-1: never sampled)
        and how many clients hold each."""
        identity = server["identity"].tolist()
        return {
            "cluster_identity": identity,
            "cluster_sizes": [identity.count(j) for j in range(self.config.k)],
        }

    # -- client ---------------------------------------------------------------------------
    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        if self.config.variant == "gradient":  # one full-batch gradient
            return [torch.arange(task.data.num_train)]
        return task.plan

    def make_program(self) -> ClientProgram:
        return IFCAProgram(self)

    def client_delta(self, message: Message, result: ClientResult) -> Tree | None:
        if "params" not in result.upload:
            return super().client_delta(message, result)
        start = pick(message["clusters"], int(result.upload["cluster"]["index"]))
        return {key: p - start[key] for key, p in result.upload["params"].items()}

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        j = self._choose(server["clusters"], server["buffers"], task.data)
        return pick(server["clusters"], j), pick(server["buffers"], j)

    def new_client_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        return self.deployed_model(server, None, task)


class IFCAProgram(SGDProgram):
    """The client side: the identity estimate and its cluster's model in ``init`` (one client,
    in Python), SGD's step (both backends), the upload with the identity in ``finish``."""

    private_step = False  # the identity estimate reads the training data in the clear

    def __init__(self, algorithm: IFCA) -> None:
        super().__init__(algorithm)
        self.ifca = algorithm

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        clusters, buffers = message["clusters"], message["cluster_buffers"]
        j = self.ifca._choose(clusters, buffers, task.data)
        return {
            "params": pick(clusters, j),
            "buffers": clone(pick(buffers, j)),
            "cluster": torch.tensor(j, dtype=torch.long),
        }

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        carry = run.carry
        j = int(carry["cluster"])
        upload: Message = {"buffers": carry["buffers"], "cluster": {"index": carry["cluster"]}}
        if self.ifca.config.variant == "model":
            upload["params"] = carry["params"]
        else:  # the step's gradient, read off the one full-batch step (as FedSGD)
            start, lr = pick(message["clusters"], j), self.step_size(task)
            upload["grad"] = {key: (start[key] - p) / lr for key, p in carry["params"].items()}
        weight = aggregation_weight(self.ifca.config.weighting, task.data.num_train)
        return ClientResult(upload, weight, run.metric(self.STEP))


def cluster_agreement(found: Sequence[int], planted: Sequence[int]) -> float:
    """The fraction of clients whose found cluster matches its planted group under the best
    one-to-one relabelling of the clusters (clients with found identity -1 count as wrong)."""
    labels_f, labels_p = sorted(set(found) - {-1}), sorted(set(planted))
    counts = torch.zeros(len(labels_f), len(labels_p))
    for f, p in zip(found, planted, strict=True):
        if f != -1:
            counts[labels_f.index(f), labels_p.index(p)] += 1
    rows, cols = linear_sum_assignment(counts.numpy(), maximize=True)
    return float(counts[rows, cols].sum()) / max(len(found), 1)
