"""pFedMe (Dinh, Tran & Nguyen, NeurIPS 2020, arXiv:2006.08848, Section 3 and
Algorithm 1). The labels (3)-(7) are this docstring's own.

The weak-consensus problem (3), sum_k {f_k(theta_k) + lam/2 ||theta_k - theta||^2}, is solved as
the bi-level problem (4): the global model theta minimizes the mean of the Moreau envelopes
F_k(theta) = min_{theta_k} f_k(theta_k) + lam/2 ||theta_k - theta||^2, whose gradient (5) is
lam (theta - prox_{f_k/lam}(theta)). Each round::

    server sends theta; client k in S (train.clients_per_round):
      omega <- theta;  theta_k <- theta
      for r = 0 .. R-1, minibatch b_r (R = train.local_steps: the engine's plan):
        theta_k <- approx argmin l_k(theta_k; b_r) + lam/2 ||theta_k - omega||^2   # (6), left:
                   inner_steps gradient steps of size inner_lr on b_r, warm-started
                   from the previous theta_k (the authors' code)
        omega <- omega - eta lam (omega - theta_k)                                 # (6), right
      personalized model theta_k (kept as client state); upload omega
    theta <- (1 - beta) theta + beta sum_S p_k omega_k / sum_S p_k                 # (7)

eta is ``train.lr``. With ``weighting: uniform`` (default) the server step is (7) exactly, the
plain mean over S; ``samples`` weights omega_k by n_k as the authors' code does. beta = 1 is
plain averaging (FedAvg's server step); beta > 1 extrapolates, which the paper reports to speed
up convergence (its fine-tuned MNIST runs use beta = 2). Defaults are the paper's MNIST setting:
lam = 15, K = 5 inner steps, personal learning rate 0.09 (its non-convex/DNN runs; 0.1 for the
convex model), R = 20 local rounds (``train.local_steps: 20``), eta = 0.005, beta = 1.

Deviations: the pseudocode trains every client each round and aggregates a sampled subset;
here only the sampled clients train (identical without ``train.clients_per_round``), and a
client that has not trained yet deploys the global model. The authors' personal optimizer adds
a weight decay 0.001 theta_k to each inner step, which is not in the paper and not here.

With ``train.optimizer: adamw`` (docs/optimizers.md) the inner solver is the local optimizer:
its K steps on l_k(theta_k; b_r) + lam/2 ||theta_k - omega||^2 are AdamW's at ``inner_lr`` on
that gradient, with moments carried across the K steps and the R local rounds (kept in the
client state with ``moments: client``); the authors' personal optimizer is what the inner
steps replace. omega's step (6) stays the gradient step eta lam (omega - theta_k) on the Moreau
envelope (5): it moves omega the fraction eta lam of the way to theta_k, which Adam's
normalization would turn into a step of about eta whatever the distance.

``lam_schedule`` decays lam over the rounds (algorithms/schedule.py; docs/cold_start.md): round t
uses lam_t both in the prox problem and in omega's step (6).
"""

from __future__ import annotations

from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, average_buffers
from fedloom.algorithms.local_optimizer import LocalOptimizer
from fedloom.algorithms.schedule import Schedule, schedule_field
from fedloom.algorithms.sgd_program import StepProgram
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers.program import Batch, Carry, ClientProgram, ClientRun, Ops
from fedloom.solvers.steps import loss_grad


class PFedMeConfig(AlgorithmConfig):
    lam: float = Field(default=15.0, gt=0.0, description="Moreau-envelope penalty lambda of (3)")
    inner_steps: int = Field(
        default=5, ge=1, description="K: gradient steps of the inner prox solver per local round"
    )
    inner_lr: float = Field(default=0.09, gt=0.0, description="personal learning rate")
    beta: float = Field(
        default=1.0, gt=0.0, description="server step (7): 1 averages, > 1 extrapolates"
    )
    weighting: Weighting = weighting_field("uniform", "server weights of (7) (paper: uniform)")
    lam_schedule: Schedule = schedule_field("lam")


class PFedMe(Algorithm):
    name = "pfedme"
    summary = "pFedMe: Moreau-envelope personalization, prox inner solver (Dinh et al., 2020)"
    Config = PFedMeConfig

    def init_client_state(self, server: State, client_id: int) -> State:
        return {"params": clone(server["params"]), "buffers": clone(server["buffers"])}

    def make_program(self) -> ClientProgram:
        return PFedMeProgram(self)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        p = [r.weight for r in results]
        mean = self.ctx.aggregate([r.upload["params"] for r in results], p)
        beta, theta = self.config.beta, server["params"]
        return {
            "params": {k: (1.0 - beta) * theta[k] + beta * mean[k] for k in theta},  # (7)
            "buffers": average_buffers(self.ctx, server, results, p),
        }

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        if state is None:
            return server["params"], server["buffers"]
        return state["params"], state["buffers"]

    # -- hooks of a model track with keys kept on the client (PEFT strategies, docs/peft.md)
    def round_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """theta (omega's and theta_k's start) as client k receives it (default: the
        broadcast)."""
        return message["params"], message["buffers"]

    def omega_result(
        self, message: Message, state: State | None, task: ClientTask, omega: Tree, buffers: Tree
    ) -> tuple[Message, State]:
        """omega's upload and what the client keeps of it (default: all of it up)."""
        return {"params": omega, "buffers": buffers}, {}


class PFedMeProgram(StepProgram):
    """pFedMe's local rounds: per minibatch, K prox steps on theta_k, then omega's step (6);
    the K steps are ``train.optimizer``'s (the module doc)."""

    takes_optimizer = True
    keeps_moments = True

    def __init__(self, algorithm: PFedMe) -> None:
        super().__init__(algorithm)
        self.optimizer = LocalOptimizer(algorithm.ctx.optimizer)

    def passes_per_step(self) -> float:
        return float(self.algorithm.config.inner_steps)

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        """omega <- theta, theta_k <- theta (the broadcast model)."""
        params, buffers = self.algorithm.round_start(message, state, task)
        carry = {
            "theta": params,
            "buffers": clone(buffers),  # updated in place by BatchNorm
            "omega": params,
        }
        return self.optimizer.start(carry, state, {"theta": params})

    def shared(self, message: Message, task: ClientTask) -> dict:
        cfg = self.algorithm.config
        lam = cfg.lam_schedule.at(cfg.lam, task.round, self.algorithm.ctx.rounds)
        return {"lam": lam, "eta": task.lr, "inner_lr": cfg.inner_lr}

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """(6): theta_k <- K gradient steps on l_k(.; b) + lam/2 ||. - omega||^2 (warm start),
        then omega <- omega - eta lam (omega - theta_k)."""
        (batch,) = batches
        lam, omega, new = shared["lam"], carry["omega"], dict(carry)
        theta, loss_sum = carry["theta"], 0.0
        for _ in range(self.algorithm.config.inner_steps):
            grads, loss = loss_grad(ops, self.model, theta, carry["buffers"], batch)
            theta = self.optimizer.step(
                new, "theta", theta, grads, shared["inner_lr"], ops.descend, omega, lam
            )
            loss_sum = loss_sum + loss
        new["omega"] = {k: w - shared["eta"] * lam * (w - theta[k]) for k, w in omega.items()}
        new["theta"] = theta
        return new, {"loss": loss_sum / self.algorithm.config.inner_steps}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        carry, cfg, algorithm = run.carry, self.algorithm.config, self.algorithm
        upload, kept = algorithm.omega_result(
            message, state, task, clone(carry["omega"]), carry["buffers"]
        )
        weight = algorithm.ctx.objective_weight(task.client_id, cfg.weighting)
        new_state = {
            **kept,
            **self.optimizer.kept(carry, ("theta",)),
            "params": carry["theta"],
            "buffers": carry["buffers"],
        }
        return ClientResult(upload, weight, run.metric(self.STEP), state=new_state)
