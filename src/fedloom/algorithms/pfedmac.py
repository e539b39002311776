"""pFedMac (Li et al., "Personalized Federated Learning via Maximizing Correlation with Sparse
and Hierarchical Extensions", arXiv:2107.05330). The labels (16)-(18) are this docstring's own.

Problem (16), with the global model theta and client k's personalized model omega_k::

    minimize F(theta) = 1/K sum_k F_k(theta),
    F_k(theta) = min_omega  f_k(omega) - lam <omega, theta> + lam/2 ||theta||^2         (16)
               = min_omega  f_k(omega) + lam/2 ||omega - theta||^2 - lam/2 ||omega||^2  (17)

By Danskin's theorem grad F_k(theta) = lam (theta - omega_k*(theta)), omega_k*(theta) the inner
argmin, so the client's theta-step of the pseudocode is a gradient step on F_k. With the l1 term
of (18) the inner problem gets + gamma ||omega||_1 (a sparse personalized model).

ClientUpdate of the pseudocode, line by line (``lam`` is the pseudocode's lambda, the
equations' mu; eta is ``train.lr``; R the engine's local steps, one minibatch D_{k,r} each)::

    theta_k <- theta^t;  omega_k <- theta^t
    for r < R:
        omega_k <- argmin_omega l_k(omega; D_{k,r}) - lam <omega, theta_k> [+ gamma ||omega||_1]
        theta_k <- theta_k - eta lam (theta_k - omega_k)
    upload theta_k (and BatchNorm buffers); keep omega_k as the personalized model

The inner argmin is approximated as pFedMe approximates its own: ``inner_steps`` (K)
gradient steps of step ``inner_lr`` on the same minibatch, warm-started from the previous
omega_k (omega_k starts at theta^t each round, as the pseudocode initializes it)::

    omega <- omega - p (grad l_k(omega; D) - lam theta_k)                 (gamma = 0)
    omega <- soft(omega - p (grad l_k(omega; D) - lam theta_k), p gamma)  (gamma > 0)

The second is the proximal-gradient step of (18): the soft threshold soft(x, t) =
sign(x) max(|x| - t, 0) sets weights exactly to zero (the paper itself uses a smooth
approximation of the l1 norm, which gives small but not zero weights). Note that for a loss with
bounded gradients (cross-entropy) the inner problem of (16) is unbounded below along theta_k:
K finite steps are what keeps omega finite, so ``lam`` must be small there (see "Stability").

Server, as in the pseudocode: theta^{t+1} = (1 - beta) theta^t + beta mean_{k in S} theta_k,
the mean uniform over the reporting clients (``weighting: uniform``, the pseudocode's 1/|S|)
or weighted by sample counts (``samples``).

Three tiers (clients -> hubs -> server): ``hubs: [h_0, h_1, ...]`` maps every client to a hub
(the paper's edge servers), or ``num_hubs: H`` assigns them
round-robin (client k -> hub k mod H) or by a draw seeded with the run's seed. Each hub averages
its reporting clients' uploads (same weights as above); the server then averages the hubs'
models, each hub weighted by ``hub_weighting``: ``members`` (default: the number of clients
assigned to it), ``reporting`` (the summed weight of its reporting clients: exactly the flat
mean), or ``uniform``. The seed does not give the hub weights and the paper's text could not be
checked here; with full participation and uniform client weights ``members`` equals the flat
mean. The server learns each upload's client from ``ClientResult.client_id``. Bytes: the
engine counts the client -> hub uploads; the hub -> server uploads (one model per hub that
heard from a client) are counted in the server state and reported by ``summary_extras``.

Defaults: the paper's values could not be retrieved here. beta = 1 (plain averaging) and
K = 5 inner steps follow pFedMe, on which pFedMac builds; inner_lr defaults to ``train.lr``.

Stability and lam. On cross-entropy the inner problem of (16) is unbounded below along theta:
every inner step adds p lam theta_k to omega (p = inner_lr), omega is warm-started across the R
local steps, and theta_k follows omega at rate eta lam. To leading order a round multiplies the
global model by (1 + g) with

    g = eta p K lam^2 R^2 / 2

so the growth compounds over rounds (g T large: the norm explodes, personalized models
collapse while staying finite). Measured (``benchmarks/pfedmac_stability.py``: Fashion-MNIST,
2 label shards per client, 20 clients, 10 a round, the 2NN, batch 32, eta = p = 0.05, so one
local epoch is R = 75 steps; global norm 11.7 at the start):

| lam | local work | g | after the rounds | personalized mean / min |
| --- | --- | --- | --- | --- |
| 0.01 | 1 epoch | 0.0035 | norm 12.7 at round 20 | 0.967 / 0.920 |
| 0.03 | 1 epoch | 0.032 | norm 17.1 at round 12 (x1.032 a round) | 0.964 / 0.877 |
| 0.01 | 3 epochs | 0.032 | norm 17.1 at round 12 (the same g, the same norm) | 0.973 / 0.922 |
| 0.1 | 1 epoch | 0.35 | norm 6.1e4 at round 20 | 0.500 / 0.457 (0.918 at round 4) |

Hence the default lam = 0.01: stable at the examples' one local epoch. The stable range ends
near g T ~ 1 for a run of T rounds (g = 0.03 grows the model 20x over 100 rounds): lower lam
(g ~ lam^2), train.lr / inner_lr (g ~ eta p) or the local work (g ~ R^2) to stay in it; at
R = 20 steps lam = 0.1 is still stable (g = 0.025, the shared test setup). The price of a small
lam is a slowly moving global model (theta moves eta lam = 5e-4 of (omega - theta) a step): the
personalized models, trained from it every round, carry the accuracy. A client that diverges
anyway (non-finite loss or model) stops the run, or is dropped, per ``train.nonfinite``.

With ``train.optimizer: adamw`` (docs/optimizers.md) the inner solver is the local optimizer:
its K steps on l_k(omega; D) - lam <omega, theta_k> are AdamW's at ``inner_lr`` on the
gradient grad l_k(omega; D) - lam theta_k, moments carried across the K steps and the R local
steps (kept in the client state with ``moments: client``), and the l1 term's soft threshold
soft(., p gamma) follows each AdamW step decoupled from Adam's scaling, as AdamW decouples its
weight decay. theta_k's step toward omega stays eta lam (omega - theta_k), the gradient of
F_k by Danskin's theorem: a fraction eta lam of the distance, which Adam's normalization would
turn into a step of about eta whatever the distance. The growth estimate of "Stability" is
SGD's; AdamW's inner steps have size about p per coordinate, whatever lam theta_k is.

The personalized model deployed by client k is its last omega_k (its state); a client that never
trained deploys the current global model. Each client reports the fraction of exactly-zero
weights of its omega_k (``ClientResult.info['sparsity']``; 0 without the l1 term, whose soft
threshold is what makes weights exactly zero); the server keeps the latest value per client
(``sparsity``, 0 until the client reports, with ``sparsity_reported`` marking who has: no NaN
in the state or its checkpoints) and ``summary_extras`` reports the mean over the clients that
reported (None before any did).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, aggregate_models
from fedloom.algorithms.local_optimizer import LocalOptimizer
from fedloom.algorithms.sgd_program import StepProgram
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, add, clone, num_bytes, scale
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers.program import Batch, Carry, ClientProgram, ClientRun, Ops
from fedloom.solvers.steps import loss_grad


class PFedMacConfig(AlgorithmConfig):
    lam: float = Field(
        default=0.01,
        gt=0.0,
        description="correlation coefficient lambda (the equations' mu); small for "
        "cross-entropy: growth g = lr inner_lr K lam^2 R^2 / 2 a round, see the docstring",
    )
    beta: float = Field(
        default=1.0, gt=0.0, le=2.0, description="server mixing (1 - beta) theta + beta mean"
    )
    inner_steps: int = Field(default=5, ge=1, description="K inner steps per local step")
    inner_lr: float | None = Field(
        default=None, gt=0.0, description="step of the inner solver (default: train.lr)"
    )
    gamma: float = Field(default=0.0, ge=0.0, description="l1 coefficient of (18): sparsity")
    weighting: Weighting = weighting_field(
        "uniform", "client weights in the means (paper: uniform)"
    )
    hubs: list[int] | None = Field(
        default=None, description="hub of every client (three tiers); exclusive with num_hubs"
    )
    num_hubs: int | None = Field(default=None, ge=1, description="number of hubs (three tiers)")
    hub_assignment: Literal["round_robin", "random"] = Field(
        default="round_robin", description="with num_hubs: client k -> hub k mod H, or seeded"
    )
    hub_weighting: Literal["members", "reporting", "uniform"] = Field(
        default="members", description="hub weights in the server mean"
    )

    @model_validator(mode="after")
    def _one_hub_source(self) -> PFedMacConfig:
        if self.hubs is not None and self.num_hubs is not None:
            raise ValueError("give either hubs (a client-to-hub map) or num_hubs, not both")
        if self.hubs is not None and (not self.hubs or min(self.hubs) < 0):
            raise ValueError("hubs must be a non-empty list of hub numbers >= 0")
        return self


def soft_threshold(tree: Tree, threshold: float) -> Tree:
    """sign(x) max(|x| - t, 0) entrywise: the prox of t ||.||_1."""
    return {k: torch.sign(v) * torch.clamp(v.abs() - threshold, min=0.0) for k, v in tree.items()}


def zero_fraction(tree: Tree) -> float:
    """Fraction of exactly-zero entries among the floating-point tensors of ``tree``."""
    floats = [v for v in tree.values() if v.is_floating_point()]
    total = sum(v.numel() for v in floats)
    return sum(int((v == 0).sum()) for v in floats) / total if total else 0.0


def assign_hubs(num_clients: int, num_hubs: int, how: str, seed: int) -> list[int]:
    """Client k -> hub: ``round_robin`` k mod H, or ``random``: a seeded balanced draw (a
    permutation of the clients dealt round-robin, so hub sizes differ by at most one)."""
    if how == "round_robin":
        return [k % num_hubs for k in range(num_clients)]
    perm = torch.randperm(num_clients, generator=generator(seed, "pfedmac/hubs"))
    hubs = [0] * num_clients
    for position, client in enumerate(perm.tolist()):
        hubs[client] = position % num_hubs
    return hubs


class PFedMac(Algorithm):
    name = "pfedmac"
    summary = "pFedMac: personalized models maximizing correlation with the global model"
    Config = PFedMacConfig

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        cfg = self.config
        self.hub_of: list[int] | None = None
        if cfg.hubs is not None:
            if len(cfg.hubs) != ctx.num_clients:
                raise ConfigError(
                    f"algorithm.hubs: one hub per client is needed ({ctx.num_clients} clients),"
                    f" got {len(cfg.hubs)}"
                )
            self.hub_of = list(cfg.hubs)
        elif cfg.num_hubs is not None:
            self.hub_of = assign_hubs(ctx.num_clients, cfg.num_hubs, cfg.hub_assignment, ctx.seed)
        self.hub_members: dict[int, int] = {}
        if self.hub_of is not None:
            for client in ctx.population or range(ctx.num_clients):
                hub = self.hub_of[client]
                self.hub_members[hub] = self.hub_members.get(hub, 0) + 1

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {
            "params": params,
            "buffers": buffers,
            "sparsity": torch.zeros(self.ctx.num_clients, dtype=torch.float64),
            "sparsity_reported": torch.zeros(self.ctx.num_clients, dtype=torch.bool),
            "hub_uploads": torch.zeros((), dtype=torch.int64),
        }

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        ids = [r.client_id for r in results]
        weights = [r.weight for r in results]
        hub_uploads = server["hub_uploads"]
        if self.hub_of is None:
            mean = aggregate_models(self.ctx, results, weights)
        else:
            mean, hubs = self.hierarchical_mean(results, ids, weights)
            hub_uploads = hub_uploads + hubs
        beta = self.config.beta
        sparsity, reported = server["sparsity"].clone(), server["sparsity_reported"].clone()
        for cid, r in zip(ids, results, strict=True):
            sparsity[cid], reported[cid] = r.info["sparsity"], True
        return {
            "params": add(scale(server["params"], 1.0 - beta), mean["params"], alpha=beta),
            "buffers": mean["buffers"] if server["buffers"] else server["buffers"],
            "sparsity": sparsity,
            "sparsity_reported": reported,
            "hub_uploads": hub_uploads,
        }

    def hierarchical_mean(
        self, results: list[ClientResult], ids: list[int], weights: list[float]
    ) -> tuple[State, int]:
        """Each hub's weighted mean of its clients' uploads, then the server's weighted mean of
        the hub models (``hub_weighting``); also how many hubs uploaded."""
        assert self.hub_of is not None
        groups: dict[int, list[int]] = {}
        for position, cid in enumerate(ids):
            groups.setdefault(self.hub_of[cid], []).append(position)
        hub_models: list[ClientResult] = []
        hub_weights: list[float] = []
        for hub, members in sorted(groups.items()):
            inner = [results[i] for i in members]
            model = aggregate_models(self.ctx, inner, [weights[i] for i in members])
            hub_models.append(ClientResult(model, 0.0, 0.0))
            how = self.config.hub_weighting
            if how == "members":
                hub_weights.append(float(self.hub_members.get(hub, len(members))))
            elif how == "reporting":
                hub_weights.append(sum(weights[i] for i in members))
            else:
                hub_weights.append(1.0)
        return aggregate_models(self.ctx, hub_models, hub_weights), len(hub_models)

    def summary_extras(self, server: State) -> dict:
        """What the run summary should add for pFedMac (an engine hook; see the report)."""
        sparsity = server["sparsity"][server["sparsity_reported"]]
        extras: dict = {
            "personal_sparsity_mean": float(sparsity.mean()) if sparsity.numel() else None
        }
        if self.hub_of is not None:
            model_bytes = num_bytes(server["params"]) + num_bytes(server["buffers"])
            extras["hub_bytes_up"] = int(server["hub_uploads"]) * model_bytes
            extras["hubs"] = len(set(self.hub_of))
        return extras

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        """The personalized model omega_k; the global model until the client trains."""
        return {"params": clone(server["params"]), "buffers": clone(server["buffers"])}

    def inner_step_size(self) -> float:
        return self.config.inner_lr or self.ctx.lr

    def make_program(self) -> ClientProgram:
        return PFedMacProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state or self.init_client_state(server, task.client_id)
        return state["params"], state["buffers"]


class PFedMacProgram(StepProgram):
    """ClientUpdate of the pseudocode (the module doc): per minibatch, K (proximal) gradient
    steps on omega (``train.optimizer``'s, the module doc), then theta_k's step toward omega."""

    takes_optimizer = True
    keeps_moments = True

    def __init__(self, algorithm: PFedMac) -> None:
        super().__init__(algorithm)
        self.optimizer = LocalOptimizer(algorithm.ctx.optimizer)

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        """theta_k <- theta^t; omega_k <- theta^t."""
        carry = {
            "theta": message["params"],
            "omega": message["params"],
            "buffers": clone(message["buffers"]),  # updated in place by BatchNorm
        }
        return self.optimizer.start(carry, state, {"omega": message["params"]})

    def shared(self, message: Message, task: ClientTask) -> dict:
        cfg = self.algorithm.config
        return {"step": task.lr * cfg.lam, "inner_lr": self.algorithm.inner_step_size()}

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """omega <- K steps of omega - p (grad l_k(omega; D) - lam theta_k) [then soft(., p
        gamma)]; theta_k <- theta_k - eta lam (theta_k - omega)."""
        (batch,) = batches
        cfg, p = self.algorithm.config, shared["inner_lr"]
        theta, omega, loss_sum = carry["theta"], carry["omega"], 0.0
        new = dict(carry)
        for _ in range(cfg.inner_steps):
            grads, loss = loss_grad(ops, self.model, omega, carry["buffers"], batch)
            inner = {k: g - cfg.lam * theta[k] for k, g in grads.items()}
            omega = self.optimizer.step(new, "omega", omega, inner, p)
            if cfg.gamma > 0:
                omega = soft_threshold(omega, p * cfg.gamma)
            loss_sum = loss_sum + loss
        new["theta"] = {k: v + shared["step"] * (omega[k] - v) for k, v in theta.items()}
        new["omega"] = omega
        return new, {"loss": loss_sum / cfg.inner_steps}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        algorithm, carry = self.algorithm, run.carry
        weight = algorithm.ctx.objective_weight(task.client_id, algorithm.config.weighting)
        return ClientResult(
            {"params": carry["theta"], "buffers": carry["buffers"]},
            weight,
            run.metric(self.STEP),
            state={
                "params": carry["omega"],
                "buffers": carry["buffers"],
                **self.optimizer.kept(carry, ("omega",)),
            },
            info={"sparsity": zero_fraction(carry["omega"])},
        )
