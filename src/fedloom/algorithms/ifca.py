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
from the stream (seed, 'ifca/init', j) (the paper: random initialization). A random
initialization can leave a cluster that no client ever picks while groups share another; two
remedies after the paper's Section 5 (off by default):

- ``restarts: R``: R independent initializations (run r > 0's cluster j from the stream
  (seed, 'ifca/init/r', j)) trained side by side for the first ``restart_rounds`` rounds
  (each client runs IFCA's round once per initialization, R times the work and the upload),
  then the server keeps the one of lowest loss: the mean over the last of those rounds'
  clients (weighted as the averages) of min_j F_i(theta_j), the losses the clients measured
  for their identity estimates at its start (after ``restart_rounds`` - 1 rounds of training);
- ``reseed_empty``: after each round, a cluster that no client's latest identity holds is
  re-seeded with the model the round's client of worst identity-estimate loss uploaded (a
  distinct client per empty cluster, worst first; that client's identity moves there), so
  the group that fits its clusters worst gets a model of its own.

With either, clients upload their identity-estimate loss with the index (8 bytes more).

What travels: every sampled client downloads the k models (``download_bytes``: k models a
client; R k in the restart rounds), and uploads one model (or gradient) and its cluster index
(R of each in the restart rounds). The server keeps each
training client's latest identity estimate (-1: never sampled) with the k models; both are in
checkpoints, and summary.json's ``extras`` reports them (``cluster_identity``,
``cluster_sizes``).

Deployment: a client deploys the cluster model with the lowest mean loss on its own training
data under the current models (the same rule, never its test data); a held-out new client
(cold start) starts from the model its training data chooses.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.clusters import (
    cluster_losses,
    identity_extras,
    num_clusters,
    pick,
    stack,
)
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.algorithms.weights import Weighting, aggregation_weight, weighting_field
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.core.rng import seed_for
from fedloom.errors import ConfigError
from fedloom.solvers import Batch, Carry, ClientProgram, ClientRun, Ops


class IFCAConfig(AlgorithmConfig):
    k: int = Field(default=2, ge=1, description="number of cluster models")
    variant: Literal["model", "gradient"] = Field(
        default="model",
        description="model: local SGD, per-cluster model averaging (option II); gradient: one "
        "full-batch gradient, per-cluster gradient step (option I)",
    )
    weighting: Weighting = weighting_field("uniform", "client weight in a cluster's average")
    restarts: int = Field(
        default=1,
        ge=1,
        description="random initializations trained side by side, the one of lowest loss kept",
    )
    restart_rounds: int = Field(
        default=3, ge=1, description="rounds the restarts train before the choice"
    )
    reseed_empty: bool = Field(
        default=False,
        description="re-seed a cluster no client holds with the worst-fitting client's model",
    )


def run_view(result: ClientResult, run: int) -> ClientResult:
    """Client ``result``'s upload for initialization ``run`` (0: the top level; run r > 0's
    trees travel as ``run<r>/<name>``)."""
    if run == 0:
        return result
    prefix = f"run{run}/"
    upload = {k.removeprefix(prefix): v for k, v in result.upload.items() if k.startswith(prefix)}
    return ClientResult(upload, result.weight, result.loss, client_id=result.client_id)


class IFCA(Algorithm):
    name = "ifca"
    summary = "IFCA: k cluster models, each client trains the one of lowest loss (Ghosh et al.)"
    Config = IFCAConfig
    capabilities = Capabilities(has_global_model=False)
    wire = Wire(delta_from="clusters")

    def _choose(self, clusters: Tree, buffers: Tree, data: Any, run: int = 0) -> tuple[int, float]:
        """The identity estimate argmin_j F_i(theta_j) among initialization ``run``'s k models
        (the first of equal losses), and its loss."""
        k = self.config.k
        losses = cluster_losses(
            self.ctx.model,
            {key: v[run * k : (run + 1) * k] for key, v in clusters.items()},
            {key: v[run * k : (run + 1) * k] for key, v in buffers.items()},
            data,
            k,
        )
        j = min(range(k), key=losses.__getitem__)
        return j, losses[j]

    def sends_loss(self) -> bool:
        """Whether clients upload their identity-estimate loss (the remedies read it)."""
        return self.config.restarts > 1 or self.config.reseed_empty

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        cfg = self.config
        models = [(params, buffers)] + [
            self.ctx.model.initial_state(seed_for(self.ctx.seed, init_purpose(r), client=j))
            for r in range(cfg.restarts)
            for j in range(cfg.k)
            if (r, j) != (0, 0)
        ]
        return {
            "clusters": stack([p for p, _ in models], list(params)),
            "buffers": stack([b for _, b in models], list(buffers)),
            "identity": torch.full((cfg.restarts, self.ctx.num_clients), -1, dtype=torch.long),
            "rounds": torch.tensor(0, dtype=torch.long),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"clusters": server["clusters"], "cluster_buffers": server["buffers"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        k = self.config.k
        clusters = {key: value.clone() for key, value in server["clusters"].items()}
        buffers = {key: value.clone() for key, value in server["buffers"].items()}
        identity = server["identity"].clone()
        runs, rounds = identity.shape[0], int(server["rounds"]) + 1
        for run in range(runs):
            views = [run_view(r, run) for r in results]
            self._aggregate_run(server, clusters, buffers, identity[run], run * k, views)
        if runs > 1 and rounds >= self.config.restart_rounds:  # keep the best initialization
            best = min(range(runs), key=lambda run: (self._score(results, run), run))
            rows = slice(best * k, (best + 1) * k)
            clusters = {key: value[rows].clone() for key, value in clusters.items()}
            buffers = {key: value[rows].clone() for key, value in buffers.items()}
            identity = identity[best : best + 1].clone()
        return {
            "clusters": clusters,
            "buffers": buffers,
            "identity": identity,
            "rounds": torch.tensor(rounds, dtype=torch.long),
        }

    def _score(self, results: list[ClientResult], run: int) -> float:
        """Initialization ``run``'s loss: the weighted mean of the round's identity-estimate
        losses min_j F_i(theta_j)."""
        views = [run_view(r, run) for r in results]
        total = sum(v.weight for v in views)
        return sum(v.weight * float(v.upload["cluster"]["loss"]) for v in views) / total

    def _aggregate_run(
        self,
        server: State,
        clusters: Tree,
        buffers: Tree,
        identity: torch.Tensor,
        offset: int,
        results: list[ClientResult],
    ) -> None:
        """IFCA's server step for one initialization, on rows offset..offset + k - 1 of the
        stacked models (in place), its identities ``identity`` (in place)."""
        chosen = [int(r.upload["cluster"]["index"]) for r in results]
        total = sum(r.weight for r in results)
        for j in sorted(set(chosen)):
            members = [r for r, c in zip(results, chosen, strict=True) if c == j]
            weights = [r.weight for r in members]
            row = offset + j
            if self.config.variant == "model":
                new = self.ctx.aggregate([r.upload["params"] for r in members], weights)
            else:  # theta_j - gamma sum_{S_j} w_i g_i / sum_{M_t} w_i
                grad = self.ctx.aggregate([r.upload["grad"] for r in members], weights)
                share = self.ctx.lr * sum(weights) / total
                new = {key: clusters[key][row] - share * g for key, g in grad.items()}
            for key, value in new.items():
                clusters[key][row] = value
            if buffers:
                mean = self.ctx.aggregate([r.upload["buffers"] for r in members], weights)
                for key, value in mean.items():
                    buffers[key][row] = value
        for r, c in zip(results, chosen, strict=True):
            identity[r.client_id] = c
        if self.config.reseed_empty:
            self._reseed(server, clusters, buffers, identity, offset, results)

    def _reseed(
        self,
        server: State,
        clusters: Tree,
        buffers: Tree,
        identity: torch.Tensor,
        offset: int,
        results: list[ClientResult],
    ) -> None:
        """Each cluster no client's latest identity holds gets the uploaded model of the
        round's client of worst identity-estimate loss (distinct clients, worst first)."""
        held = set(identity.tolist())
        empty = [j for j in range(self.config.k) if j not in held]
        worst = sorted(results, key=lambda r: (-float(r.upload["cluster"]["loss"]), r.client_id))
        for j, r in zip(empty, worst[: len(empty)], strict=False):
            own = int(r.upload["cluster"]["index"])
            if self.config.variant == "model":
                model = r.upload["params"]
            else:  # the client's one full-batch step from its cluster's model
                start = pick(server["clusters"], offset + own)
                model = {key: start[key] - self.ctx.lr * g for key, g in r.upload["grad"].items()}
            for key, value in model.items():
                clusters[key][offset + j] = value
            for key, value in r.upload["buffers"].items():
                buffers[key][offset + j] = value
            identity[r.client_id] = j

    def summary_extras(self, server: State) -> dict[str, Any]:
        """summary.json extras: each client's latest cluster identity (-1: never sampled)
        and how many clients hold each (of the first initialization during the restarts)."""
        return identity_extras(server["identity"][0], self.config.k)

    # -- client ---------------------------------------------------------------------------
    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        if self.config.variant == "gradient":  # one full-batch gradient
            return [torch.arange(task.data.num_train)]
        return task.plan

    def make_program(self) -> ClientProgram:
        return IFCAProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        j, _ = self._choose(server["clusters"], server["buffers"], task.data)
        return pick(server["clusters"], j), pick(server["buffers"], j)


def init_purpose(run: int) -> str:
    """The stream of initialization ``run``'s cluster models ('ifca/init', then
    'ifca/init/r')."""
    return "ifca/init" if run == 0 else f"ifca/init/{run}"


class IFCAProgram(SGDProgram):
    """The client side: the identity estimate and its cluster's model in ``init`` (one client,
    in Python), SGD's step (both backends), the upload with the identity in ``finish``. In the
    restart rounds the carry holds one such model per further initialization under ``runs``,
    each stepped by plain SGD on the same minibatch."""

    private_step = False  # the identity estimate reads the training data in the clear

    def __init__(self, algorithm: IFCA) -> None:
        super().__init__(algorithm)
        self.ifca = algorithm
        if algorithm.config.restarts > 1 and self.optimizer is not None:
            raise ConfigError(
                "train.optimizer: adamw: IFCA's restarts step their models by plain SGD; use "
                "train.optimizer: sgd or algorithm.restarts: 1 (docs/optimizers.md)"
            )

    def _start(self, message: Message, task: ClientTask, run: int) -> Carry:
        clusters, buffers = message["clusters"], message["cluster_buffers"]
        j, loss = self.ifca._choose(clusters, buffers, task.data, run)
        row = run * self.ifca.config.k + j
        carry: Carry = {
            "params": pick(clusters, row),
            "buffers": clone(pick(buffers, row)),
            "cluster": torch.tensor(j, dtype=torch.long),
        }
        if self.ifca.sends_loss():
            carry["loss"] = torch.tensor(loss, dtype=torch.float64)
        return carry

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        runs = num_clusters(message["clusters"]) // self.ifca.config.k
        carry = self._start(message, task, 0)
        if runs > 1:
            carry["runs"] = {str(r): self._start(message, task, r) for r in range(1, runs)}
        return carry

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        carry, metrics = super().step(ops, carry, batches, shared)
        if "runs" in carry:
            (batch,) = batches
            runs = {}
            for r, run in carry["runs"].items():
                grads, _ = self.data_grad(ops, run, batch)
                runs[r] = {**run, "params": ops.descend(run["params"], grads, shared["lr"])}
            carry = {**carry, "runs": runs}
        return carry, metrics

    def _upload(self, message: Message, task: ClientTask, carry: Carry, run: int) -> Message:
        j = int(carry["cluster"])
        index = {"index": carry["cluster"]}
        if "loss" in carry:
            index["loss"] = carry["loss"]
        upload: Message = {"buffers": carry["buffers"], "cluster": index}
        if self.ifca.config.variant == "model":
            upload["params"] = carry["params"]
        else:  # the step's gradient, read off the one full-batch step (as FedSGD)
            start = pick(message["clusters"], run * self.ifca.config.k + j)
            lr = self.step_size(task)
            upload["grad"] = {key: (start[key] - p) / lr for key, p in carry["params"].items()}
        return upload

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        carry = run.carry
        upload = self._upload(message, task, carry, 0)
        for r, sub in carry.get("runs", {}).items():
            for name, tree in self._upload(message, task, sub, int(r)).items():
                upload[f"run{r}/{name}"] = tree
        weight = aggregation_weight(self.ifca.config.weighting, task.data.num_train)
        return ClientResult(upload, weight, run.metric(self.STEP))
