"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021, "Personalized Federated Learning
with First Order Model Optimization", arXiv:2012.08565, Section 3, Eq. 3-6, Algorithm 1).

Each client i keeps its own model theta_i and a validation split D_i^val of its training data;
the server keeps every client's latest model theta_1..theta_m (algorithms/peers.py) and an
affinity matrix P (m x m, zero at the start). One round::

    server:   eps_t = max(0, eps - eps_decay t)
              for each client i: with probability eps_t, M other clients uniformly at random,
              else the M others of largest P_i,n (ties: lower id)          # server_message
    client i: L = L_i(theta_i) on D_i^val, and for each downloaded theta_n:
                  w_n = (L - L_i(theta_n)) / ||theta_n - theta_i||         # Eq. 3-4
              w~_n = max(0, w_n) / sum_n max(0, w_n)   (all 0 when none is positive)
              theta_i <- theta_i + sum_n w~_n (theta_n - theta_i)          # Eq. 5-6
              local SGD on the rest of its training data (the engine's number of steps,
              minibatches from the stream (seed, 'fedfomo/train', round, i))
              keep theta_i, upload theta_i and (n, w_n) for the downloaded n
    server:   theta_i <- upload;  P_i,n <- P_i,n + w_n                     # Algorithm 1

L_i is the mean loss in evaluation mode. P is updated with the raw first-order weights w_n,
negative ones included (as PFLlib does), so a peer that hurts
client i drops in its ranking. The validation split is ``val_fraction`` of the client's
training samples (at least one, at most all but one), drawn once from the stream (seed,
'fedfomo/val', client); the split does not change over rounds. The exploration draw of
client i at round t comes from (seed, 'fedfomo/explore', t, i). Defaults: M = 5 (the paper's),
val_fraction 0.2 (PFLlib's), eps = 0.3 decaying by 0.05 a round (this module's choice: the
paper's exploration schedule could not be checked against its text here; PFLlib has none).

Only parameters travel; buffers (BatchNorm statistics) stay with each client, and a peer's
model is evaluated with the client's own buffers. What travels: client i downloads M models
and their ids (``download_bytes``) and uploads one model and M weights. Deployment: theta_i. A
held-out new client starts from the mean of the clients' latest models.

The combination and the weights are computed in ``init`` (one client, in Python), the local
steps are SGD's (or AdamW's, ``train.optimizer``) on both backends (vmapped), so sequential and
vectorized executors agree. Sample-level DP is refused: the weights read the validation data
in the clear.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.peers import (
    flat_rows,
    model_table,
    row,
    rows,
    table_mean,
    training_clients,
    with_uploads,
)
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.core.rng import generator
from fedloom.solvers import Carry, ClientProgram, ClientRun
from fedloom.solvers.adamw import MOMENTS
from fedloom.solvers.local import batch_plan


class FedFomoConfig(AlgorithmConfig):
    M: int = Field(default=5, ge=1, description="peers' models downloaded a round (paper: 5)")
    val_fraction: float = Field(
        default=0.2, gt=0.0, lt=1.0, description="share of training data held out to weigh models"
    )
    eps: float = Field(
        default=0.3, ge=0.0, le=1.0, description="epsilon-greedy: chance of M random peers"
    )
    eps_decay: float = Field(default=0.05, ge=0.0, description="eps falls by this each round")


def split_indices(n: int, fraction: float, seed: int, client: int) -> tuple[torch.Tensor, ...]:
    """(train, validation) indices of a client's n training samples: a permutation from
    (seed, 'fedfomo/val', client), its first max(1, round(fraction n)) (at most n - 1) held out."""
    if n < 2:
        return torch.arange(n), torch.arange(0)
    held = min(max(1, round(fraction * n)), n - 1)
    perm = torch.randperm(n, generator=generator(seed, "fedfomo/val", client=client))
    return perm[held:], perm[:held]


def mean_loss(algorithm: Algorithm, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor):
    """L_i(theta): the mean loss on (x, y) in evaluation mode."""
    return algorithm.ctx.model.evaluate(params, buffers, x, y)[0] / max(1, int(x.shape[0]))


def first_order_weights(
    losses: torch.Tensor, own_loss: float, distances: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, w~): Eq. 3-4's w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i|| (0 for a
    peer equal to theta_i) and their clipped, normalised form (all 0 if none is positive)."""
    raw = torch.where(
        distances > 0, (own_loss - losses) / distances.clamp_min(1e-30), torch.zeros_like(losses)
    )
    clipped = raw.clamp_min(0.0)
    total = float(clipped.sum())
    return raw, clipped / total if total > 0 else clipped


def combine(own: Tree, peers: Tree, weights: torch.Tensor) -> Tree:
    """Eq. 5-6: theta_i + sum_n w~_n (theta_n - theta_i), key by key."""
    if not bool((weights > 0).any()):
        return own
    out = {}
    for k, v in own.items():
        w = weights.to(v.dtype).view(-1, *([1] * v.dim()))
        out[k] = v + (w * (peers[k] - v)).sum(dim=0)
    return out


class FedFomo(Algorithm):
    name = "fedfomo"
    summary = "FedFomo: each client combines M peers' models weighted by first-order gains"
    Config = FedFomoConfig
    capabilities = Capabilities(has_global_model=False)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.m = training_clients(ctx, self.name)
        self.peers_each = min(self.config.M, self.m - 1)
        self.wire = Wire(rows={"models": self.peers_each, "chosen": 1})  # M models, their ids

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {
            "params": params,  # the common initialization
            "buffers": buffers,
            "models": model_table(params, self.m),
            "affinity": torch.zeros(self.m, self.m, dtype=torch.float64),
        }

    def exploration(self, round: int) -> float:
        """eps_t = max(0, eps - eps_decay t)."""
        return max(0.0, self.config.eps - self.config.eps_decay * round)

    def choose(self, affinity: torch.Tensor, round: int) -> torch.Tensor:
        """The (m, M) ids each client downloads: epsilon-greedy over the affinity rows."""
        m, k, eps = self.m, self.peers_each, self.exploration(round)
        chosen = torch.zeros(m, k, dtype=torch.long)
        for i in range(m):
            others = torch.tensor([j for j in range(m) if j != i], dtype=torch.long)
            gen = generator(self.ctx.seed, "fedfomo/explore", round, i)
            if float(torch.rand((), generator=gen)) < eps:
                chosen[i] = others[torch.randperm(m - 1, generator=gen)[:k]]
            else:
                order = torch.argsort(-affinity[i, others], stable=True)
                chosen[i] = others[order[:k]]
        return chosen

    def server_message(self, server: State, round: int = 0) -> Message:
        return {
            "models": server["models"],
            "chosen": {"ids": self.choose(server["affinity"], round)},
        }

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        affinity = server["affinity"].clone()
        for r in results:
            sent = r.upload["affinity"]
            affinity[r.client_id, sent["ids"]] += sent["weights"].double()
        return {**server, "models": with_uploads(server["models"], results), "affinity": affinity}

    def summary_extras(self, server: State) -> dict[str, Any]:
        """summary.json extras: each client's peer of largest affinity."""
        affinity = server["affinity"].clone()
        affinity.fill_diagonal_(-torch.inf)
        return {"top_peer": affinity.argmax(dim=1).tolist() if self.m > 1 else []}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        """theta_i: its row of the table (the initialization until it uploads); a held-out
        new client: the mean of the table."""
        models = server["models"]
        params = row(models, client_id) if client_id < self.m else table_mean(models)
        return {"params": clone(params), "buffers": clone(server["buffers"])}

    def split(self, data: ClientData, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return split_indices(data.num_train, self.config.val_fraction, self.ctx.seed, client_id)

    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        """As many steps as the engine's plan, on the training part of the split."""
        train, _ = self.split(task.data, task.client_id)
        gen = generator(self.ctx.seed, "fedfomo/train", task.round, task.client_id)
        plan = batch_plan(train.numel(), self.ctx.batch_size, len(task.plan), gen)
        return [train[b] for b in plan]

    def weigh(
        self, own: tuple[Tree, Tree], peers: Tree, data: ClientData, client_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w, w~) of the downloaded ``peers`` (a table of M rows) on the validation split."""
        params, buffers = own
        _, val = self.split(data, client_id)
        count = next(iter(peers.values())).shape[0] if peers else 0
        if val.numel() == 0 or count == 0:
            zero = torch.zeros(count, dtype=torch.float64)
            return zero, zero
        x, y = data.x_train[val], data.y_train[val]
        own_loss = mean_loss(self, params, buffers, x, y)
        losses = torch.tensor(
            [mean_loss(self, row(peers, n), buffers, x, y) for n in range(count)],
            dtype=torch.float64,
        )
        flat_own = flat_rows({k: v.unsqueeze(0) for k, v in params.items()})
        distances = (flat_rows(peers) - flat_own).double().norm(dim=1)
        return first_order_weights(losses, own_loss, distances)

    def make_program(self) -> ClientProgram:
        return FedFomoProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state or self.init_client_state(server, task.client_id)
        return state["params"], state["buffers"]


class FedFomoProgram(SGDProgram):
    """The client side: the weights and the combined start in ``init`` (one client, in
    Python), SGD's step on the training split (both backends), the upload in ``finish``."""

    private_step = False  # the weights read the validation data in the clear

    def __init__(self, algorithm: FedFomo) -> None:
        super().__init__(algorithm)
        self.fomo = algorithm

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        own = (state["params"], state["buffers"])
        ids = message["chosen"]["ids"][task.client_id]
        peers = rows(message["models"], ids)
        raw, weights = self.fomo.weigh(own, peers, task.data, task.client_id)
        params = combine(state["params"], peers, weights)
        carry: Carry = {
            "params": params,
            "buffers": clone(state["buffers"]),
            "peers": ids.clone(),
            "weights": raw,
        }
        if self.optimizer is not None:  # train.optimizer: adamw
            carry[MOMENTS] = self.initial_moments(params, state)
        return carry

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        carry = run.carry
        params, buffers = carry["params"], carry["buffers"]
        upload: Message = {
            "params": params,
            "affinity": {"ids": carry["peers"], "weights": carry["weights"]},
        }
        new_state = {"params": params, "buffers": buffers}
        result = ClientResult(upload, task.data.num_train, run.metric(self.STEP), state=new_state)
        return self.keep_moments(result, state, carry.get(MOMENTS))
