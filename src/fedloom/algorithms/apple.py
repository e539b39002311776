"""APPLE (Luo and Wu, IJCAI 2022, "Adapt to Adaptation: Learning Personalization for
Cross-Silo Federated Learning", arXiv:2110.08394, Section 3, Eq. 2-6, Algorithm 1).

Every client j trains a *core model* theta_j that it shares; client i also learns a directed
relationship (DR) vector p_i over all m clients, and its personalized model is::

    theta^_i = sum_j p_ij theta_j                                                (Eq. 2)

Client i keeps a copy of every core model (the ones not downloaded this round stay as last
downloaded) and minimizes, on minibatches B of its data::

    L_i(theta^_i; B) + lambda(r) mu ||p_i - p_i^0||^2                            (Eq. 3-4)

over its own core theta_i and p_i (the other cores are fixed on client i). One local step, both
from the same gradient g = grad_{theta^} L_i(theta^_i; B)::

    theta_i <- theta_i - lr p_ii g                                            (Eq. 5)
    p_ij    <- p_ij - dr_learning_rate (<g, theta_j> + 2 lambda(r) mu (p_ij - p_ij^0))  (Eq. 6)

The loss scheduler lambda(r) moves the focus from the global objective (p_i near p_i^0, the
FedAvg weights) to personalization: for the first L T rounds (T = train.rounds, ``L`` a
fraction), ``cosine`` (1 + cos(pi r / (L T))) / 2 or ``exponential`` 0.001^(r / (L T)), and 0
after. p_i^0, where p_i starts and what the proximal term pulls it toward, is the FedAvg
weights n_j / n (``p_init: samples``, the authors' code) or the one-hot e_i (``own``).

Downloads (the paper's limited bandwidth): each round client i downloads ``M`` other clients'
latest cores (None: all m - 1), first those it never downloaded (in a random order), then
others drawn without replacement with probability proportional to base^|p_ij|, base =
max(thresh, lamb r M / m): the authors' rule, with their ``thresh`` 1.5 and ``lamb`` 1. The
draws come from the stream (seed, 'apple/download', round, i); every copy starts at the common
initialization, as the authors' first round, which downloads all. The client uploads its core
(and the ids it downloaded, which the server ignores). ``download_bytes`` counts M cores a
client.

Defaults are the authors' code's: dr_learning_rate 0.001, mu 0.1, L 0.1, exponential. The
core models take plain SGD steps at ``train.lr`` (the authors' SGD has momentum 0.9; use
``train.lr`` accordingly). With ``p_init: own`` and ``dr_learning_rate: 0`` p_i stays e_i and
APPLE is local training exactly. Deployment: theta^_i from the client's copies. A held-out new
client deploys sum_j n_j / n theta_j of the server's latest cores.

Cost: every client keeps m core copies (m^2 models over the federation) and each local step
reads all m (the mixture and <g, theta_j>). p_i's curvature scales with ||theta_j||^2, so a
large ``dr_learning_rate`` makes its steps amplify rounding: on batch-10 Fashion-MNIST with the
2NN at 0.05, the sequential and vectorized executors (1e-8 apart with p_i fixed) drift 1e-4
apart in 60 local steps.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.peers import model_table, training_clients, with_uploads
from fedloom.algorithms.sgd_program import StepProgram
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.core.rng import generator
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, ClientRun, Ops, Update


class APPLEConfig(AlgorithmConfig):
    M: int | None = Field(
        default=None, ge=1, description="other clients' cores downloaded a round (None: all)"
    )
    dr_learning_rate: float = Field(
        default=0.001, ge=0.0, description="step size of the DR vectors p_i (authors: 0.001)"
    )
    mu: float = Field(default=0.1, ge=0.0, description="weight of the proximal term on p_i")
    L: float = Field(
        default=0.1, ge=0.0, le=1.0, description="share of train.rounds the scheduler decays over"
    )
    decay: Literal["cosine", "exponential"] = Field(
        default="exponential", description="shape of the loss scheduler lambda(r)"
    )
    p_init: Literal["samples", "own"] = Field(
        default="samples", description="p_i^0: FedAvg weights n_j/n, or one-hot on client i"
    )
    thresh: float = Field(default=1.5, gt=1.0, description="least base of the download draw")
    lamb: float = Field(default=1.0, ge=0.0, description="growth of the download draw's base")


def scheduler(r: int, rounds: int, cfg: APPLEConfig) -> float:
    """lambda(r) mu: the proximal term's weight at round r (0 from round L T on)."""
    span = int(rounds * cfg.L)
    if cfg.mu == 0 or r >= span:
        return 0.0
    if cfg.decay == "cosine":
        return (math.cos(math.pi * r / span) + 1.0) / 2.0 * cfg.mu
    return 0.001 ** (r / span) * cfg.mu


def personalized(cores: Tree, p: torch.Tensor) -> Tree:
    """Eq. 2: theta^ = sum_j p_j theta_j from a table of cores."""
    return {k: torch.tensordot(p.to(v.dtype), v, dims=1) for k, v in cores.items()}


class APPLE(Algorithm):
    name = "apple"
    summary = "APPLE: personalized mixtures of peers' core models with learned weights (Luo, Wu)"
    Config = APPLEConfig
    capabilities = Capabilities(has_global_model=False)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.m = training_clients(ctx, self.name)
        m = self.m
        self.peers_each = m - 1 if self.config.M is None else min(self.config.M, m - 1)
        self.wire = Wire(rows={"cores": self.peers_each})
        sizes = torch.tensor([float(ctx.population.get(j, 1)) for j in range(m)])
        self.fedavg_weights = sizes / sizes.sum()

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {"params": params, "buffers": buffers, "models": model_table(params, self.m)}

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"cores": server["models"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return {**server, "models": with_uploads(server["models"], results)}

    # -- client ---------------------------------------------------------------------------
    def prior(self, client_id: int) -> torch.Tensor:
        """p_i^0: the FedAvg weights, or e_i."""
        if self.config.p_init == "own" and client_id < self.m:
            return torch.nn.functional.one_hot(torch.tensor(client_id), self.m).float()
        return self.fedavg_weights.clone()

    def init_client_state(self, server: State, client_id: int) -> State:
        """Copies of every core at the common initialization (a held-out new client: the
        server's latest cores), p_i = p_i^0, and which cores it has downloaded."""
        if client_id < self.m:
            cores = model_table(server["params"], self.m)
        else:
            cores = clone(server["models"])
        seen = torch.zeros(self.m, dtype=torch.bool)
        if client_id < self.m:
            seen[client_id] = True
        p0 = self.prior(client_id)
        return {
            "cores": cores,
            "p": p0.clone(),
            "p0": p0,
            "seen": seen,
            "buffers": clone(server["buffers"]),
            "index": torch.tensor(client_id, dtype=torch.int64),
        }

    def downloads(self, state: State, round: int, client_id: int) -> torch.Tensor:
        """The ids of the M cores client i downloads this round (the authors' rule)."""
        m, k = self.m, self.peers_each
        others = [j for j in range(m) if j != client_id]
        if k >= m - 1:
            return torch.tensor(others, dtype=torch.long)
        gen = generator(self.ctx.seed, "apple/download", round, client_id)
        seen = state["seen"]
        fresh = torch.tensor([j for j in others if not bool(seen[j])], dtype=torch.long)
        fresh = fresh[torch.randperm(fresh.numel(), generator=gen)]
        if fresh.numel() >= k:
            return fresh[:k]
        rest = torch.tensor([j for j in others if j not in set(fresh.tolist())], dtype=torch.long)
        base = max(self.config.thresh, round * k / m * self.config.lamb)
        probs = torch.tensor(base, dtype=torch.float64) ** state["p"][rest].abs().double()
        drawn = rest[torch.multinomial(probs, k - fresh.numel(), replacement=False, generator=gen)]
        return torch.cat([fresh, drawn])

    def make_program(self) -> ClientProgram:
        return APPLEProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state or self.init_client_state(server, task.client_id)
        return personalized(state["cores"], state["p"]), state["buffers"]


class APPLEProgram(StepProgram):
    """The client side: the downloads into the client's copies in ``init`` (one client, in
    Python), Eq. 5-6 as one step (both backends; stacked for a chunk on a stackable model,
    :meth:`stacked_step`), the upload in ``finish``."""

    def __init__(self, algorithm: APPLE) -> None:
        super().__init__(algorithm)
        self.apple = algorithm
        if self.model.stacked() is not None:  # APPLE refuses sample-level DP
            self.updates = (Update(self.STEP, (BATCHES,), self.step, stacked=self.stacked_step),)

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        """The client's copies with this round's downloads, split into its own core (which
        trains) and the others (fixed this round; the own row zero)."""
        assert state is not None
        i = task.client_id
        ids = self.apple.downloads(state, task.round, i)
        others = {k: v.clone() for k, v in state["cores"].items()}
        for k, v in message["cores"].items():
            others[k][ids] = v[ids]
        core = {k: v[i].clone() for k, v in others.items()}
        for v in others.values():
            v[i] = 0.0
        own = torch.nn.functional.one_hot(state["index"], self.apple.m).to(state["p"].dtype)
        return {
            "core": core,
            "others": others,
            "p": state["p"].clone(),
            "p0": state["p0"],
            "own": own,
            "buffers": clone(state["buffers"]),
        }

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        cfg, ctx = self.apple.config, self.apple.ctx
        return {
            "lr": task.lr,
            "dr_lr": cfg.dr_learning_rate,
            "coef": scheduler(task.round, ctx.rounds, cfg),
        }

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        """Eq. 5-6 from one gradient g at theta^ = p_ii theta_i + sum_{j != i} p_ij theta_j."""
        (batch,) = batches
        core, others, p, own = carry["core"], carry["others"], carry["p"], carry["own"]
        share = (p * own).sum()  # p_ii
        mixed = {k: torch.tensordot(p, v, dims=1) + share * core[k] for k, v in others.items()}
        grads, loss = ops.loss_grad(self.model, mixed, carry["buffers"], batch)
        m = p.shape[0]
        # <g, theta_j>: the others' rows, and the own core's on e_i
        grad_p = sum(others[k].reshape(m, -1) @ g.reshape(-1) for k, g in grads.items())
        grad_p = grad_p + own * sum((g * core[k]).sum() for k, g in grads.items())
        grad_p = grad_p + 2.0 * shared["coef"] * (p - carry["p0"])
        moved = {k: v - shared["lr"] * share * grads[k] for k, v in core.items()}
        new = {**carry, "core": moved, "p": p - shared["dr_lr"] * grad_p}
        return new, {"loss": loss}

    def stacked_step(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        """``step`` for a whole chunk of C clients on a stackable model (core/stacked.py):
        the mixtures and <g, theta_j> as batched products over the chunk, the gradient at the
        mixtures stacked."""
        (batch,) = batches
        core, others, p, own = carry["core"], carry["others"], carry["p"], carry["own"]
        clients, m = p.shape
        share = (p * own).sum(1)  # p_ii, (C,)

        def per_client(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            return v.view(clients, *[1] * (like.dim() - 1))

        mixed = {
            k: torch.bmm(p.unsqueeze(1), v.reshape(clients, m, -1)).view_as(core[k])
            + per_client(share, core[k]) * core[k]
            for k, v in others.items()
        }
        stacked = self.model.stacked()
        assert stacked is not None
        grad, loss = stacked.value_and_grad(
            mixed, batch.x, batch.y, batch.w, self.model.per_sample_loss, None, self.model.task
        )
        with torch.no_grad():
            grads = {k: grad.materialize(k) for k in mixed}
            flat = {k: g.reshape(clients, -1, 1) for k, g in grads.items()}
            grad_p = sum(torch.bmm(others[k].reshape(clients, m, -1), g) for k, g in flat.items())
            own_dot = sum(
                (g.squeeze(-1) * core[k].reshape(clients, -1)).sum(1) for k, g in flat.items()
            )
            grad_p = grad_p.squeeze(-1) + own * own_dot.unsqueeze(1)
            grad_p = grad_p + 2.0 * shared["coef"] * (p - carry["p0"])
            moved = {k: v - shared["lr"] * per_client(share, v) * grads[k] for k, v in core.items()}
        return {**carry, "core": moved, "p": p - shared["dr_lr"] * grad_p}, {"loss": loss}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        assert state is not None
        carry, i = run.carry, task.client_id
        ids = self.apple.downloads(state, task.round, i)
        seen = state["seen"].clone()
        seen[ids] = True
        cores = {k: v.clone() for k, v in carry["others"].items()}
        for k, v in carry["core"].items():
            cores[k][i] = v
        new_state = {
            "cores": cores,
            "p": carry["p"],
            "p0": state["p0"],
            "seen": seen,
            "buffers": carry["buffers"],
            "index": state["index"],
        }
        upload = {"params": carry["core"], "downloaded": {"ids": ids}}
        return ClientResult(upload, task.data.num_train, run.metric(self.STEP), state=new_state)
