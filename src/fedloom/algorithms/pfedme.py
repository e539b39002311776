"""pFedMe (Dinh, Tran & Nguyen, NeurIPS 2020, arXiv:2006.08848); seed 000, pFedMe section,
equations (3)-(7) and its pseudocode.

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

``lam_schedule`` decays lam over the rounds (seed 004, 4.3; algorithms/schedule.py): round t
uses lam_t both in the prox problem and in omega's step (6).
"""

from __future__ import annotations

from pydantic import Field

from fedloom.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    ClientResult,
    ClientTask,
    Message,
    State,
    Weighting,
    weighting_field,
)
from fedloom.algorithms.schedule import Schedule, schedule_field
from fedloom.engine.local import local_sgd
from fedloom.engine.proximal import proximal_gradient
from fedloom.engine.pytree import Tree, add, clone, sub


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

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        cfg, model, data = self.config, self.ctx.model, task.data
        lam = cfg.lam_schedule.at(cfg.lam, task.round, self.ctx.rounds)
        pull = task.lr * lam  # eta lam of (6)
        omega: Tree = message["params"]
        theta, buffers = message["params"], message["buffers"]
        losses: list[float] = []
        with model.random_stream(self.ctx.seed, task.round, task.client_id):
            for batch in self.client_plan(task):

                def prox_term(params: Tree, anchor: Tree = omega) -> Tree | None:
                    return proximal_gradient(params, anchor, lam)

                solved = local_sgd(
                    model,
                    theta,
                    buffers,
                    data.x_train,
                    data.y_train,
                    [batch] * cfg.inner_steps,
                    cfg.inner_lr,
                    prox_term,
                )
                theta, buffers = solved.params, solved.buffers
                omega = add(omega, sub(omega, theta), alpha=-pull)
                losses.append(solved.loss)
        upload = {"params": clone(omega), "buffers": buffers}
        weight = self.ctx.objective_weight(task.client_id, cfg.weighting)
        loss = sum(losses) / len(losses) if losses else 0.0
        new_state = {"params": theta, "buffers": buffers}
        return ClientResult(upload, weight, loss, state=new_state)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        p = [r.weight for r in results]
        mean = self.ctx.aggregate([r.upload["params"] for r in results], p)
        beta, theta = self.config.beta, server["params"]
        return {
            "params": {k: (1.0 - beta) * theta[k] + beta * mean[k] for k in theta},  # (7)
            "buffers": self.average_buffers(server, results, p),
        }

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        if state is None:
            return server["params"], server["buffers"]
        return state["params"], state["buffers"]
