"""APFL: Adaptive Personalized Federated Learning (Deng, Kamani and Mahdavi, 2020,
arXiv:2003.13461, Algorithm 1); seed 000, APFL section, equations (10)-(11) and its pseudocode.

The bilevel problem (10): client k keeps a local model omega_k and mixture weight alpha_k and
minimizes h_k(omega_k) = f_k(alpha_k omega_k + (1 - alpha_k) theta*), with theta* the
minimizer of 1/K sum_k f_k. Its personalized model is (11):
omega_hat_k = alpha_k omega_k + (1 - alpha_k) theta*.

Mapping the pseudocode onto fedloom's rounds: one round is one synchronization period of tau
iterations, tau = the round's local steps of the client (``train.local_steps`` or
``local_epochs``); iteration t of the pseudocode is t = (r - 1) tau + s for local step
s = 0..tau-1 of round r. The sampled set S is fixed within a round (the pseudocode's
S^(t+1) <- S^(t) between synchronizations) and synchronization happens at the round's end.
Client k, from theta_k <- theta^r (the broadcast), at each local step on minibatch xi::

    omega_bar <- alpha_k omega_k + (1 - alpha_k) theta_k           # mixture model
    theta_k   <- theta_k - eta_t grad f_k(theta_k; xi)               # global model's update
    omega_k   <- omega_k - eta_t grad f_k(omega_bar; xi)             # personal update
    alpha_k   <- clip(alpha_k - eta_t <omega_k - theta_k, grad f_k(omega_bar; xi)>, 0, 1)
                 (only with ``adaptive_alpha``; all three right-hand sides use the values
                 before the step; ``alpha_lr`` replaces eta_t here if set)

then uploads theta_k; the server averages theta^{r+1} = sum_S p_k theta_k / sum_S p_k with
p_k = 1/K (``weighting: uniform``, the pseudocode's plain mean over S) or n_k / n (samples).

The personal step is the seed pseudocode's: grad f_k(omega_bar), the gradient of h_k in
omega_k divided by alpha_k (the chain rule gives alpha_k grad f_k(omega_bar)). Same direction,
same stationary point (11), step size eta_t / alpha_k; with alpha_k = 1 both are local training.
With the exact gradient omega_k would learn alpha_k times slower than theta_k, lag behind it,
and adaptive alpha_k would collapse to 0, where omega_k stops moving: on the shared
Fashion-MNIST shards setup (10 rounds) the mean alpha_k went from 0.25 to 0.03 and the
personalized accuracy to 0.41 (FedAvg's 0.40); with the seed's step alpha_k rises to 0.34-1.0
(the paper's observation: more heterogeneity, larger alpha) and the accuracy to 0.93.

Step size (``lr_schedule``): ``constant`` eta_t = train.lr (the paper's experiments), or
``decay`` eta_t = 16 / (mu (t + a)), a = max(128 kappa, tau) (the pseudocode's; mu the
strong-convexity constant, kappa = L / mu the condition number).

``final_averaging``: the deployed models are the pseudocode's weighted averages over the
rounds r = 1..R, p_r = (t_r + a)^2 with t_r = r tau the iteration count at the end of round r
(a = max(128 kappa, tau), or tau when kappa is not given)::

    global:       theta_hat = sum_r p_r theta^r / sum_r p_r               (server state)
    personalized: alpha_k omega_hat_k + (1 - alpha_k) theta_hat,
                  omega_hat_k = sum_r p_r omega_k^r / sum_r p_r             (client state)

omega_k^r is the client's local model after round r (unchanged in rounds it sat out; theta^r
likewise in a round where nobody reported), tau is the client's own (the server uses the
largest tau of the round's reports), and the running averages live in the states, so a
resumed run continues them. With a fixed alpha_k this is the pseudocode's final personalized
model exactly; with ``adaptive_alpha`` it mixes with the final alpha_k (the pseudocode leaves
which alpha_k open). Only floating-point tensors are averaged; integer buffers (BatchNorm's
counter) are the latest.

The client's two models need their own local loop (two gradients per step), so APFL overrides
``client_update``: every executor runs it one client at a time (same numbers). Buffers
(BatchNorm statistics): theta_k's forward passes update the uploaded ones, omega_bar's update
omega_k's own, which the personalized model deploys. The reported training loss is
theta_k's (as FedAvg's). States: the server keeps theta and the
initial model theta^(0) (``initial``, never sent: every omega_k^(0)); a client keeps
``personal`` (omega_k), ``alpha`` (alpha_k), ``steps`` (local steps so far; a client without any
deploys the global model) and, with ``final_averaging``, its running average.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

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
from fedloom.engine.pytree import Tree, clone

F64 = torch.float64


class APFLConfig(AlgorithmConfig):
    alpha: float = Field(
        default=0.25, ge=0.0, le=1.0, description="initial mixture weight alpha_k (paper: 0.25)"
    )
    adaptive_alpha: bool = Field(default=False, description="update alpha_k by its gradient")
    alpha_lr: float | None = Field(
        default=None, gt=0.0, description="step size of the alpha update (default: eta_t)"
    )
    lr_schedule: Literal["constant", "decay"] = Field(
        default="constant", description="constant train.lr, or 16 / (mu (t + a))"
    )
    mu: float | None = Field(
        default=None, gt=0.0, description="strong convexity constant, for lr_schedule: decay"
    )
    kappa: float | None = Field(
        default=None, ge=1.0, description="condition number L / mu: a = max(128 kappa, tau)"
    )
    final_averaging: bool = Field(
        default=False, description="deploy the (t + a)^2-weighted averages over rounds"
    )
    weighting: Weighting = weighting_field("uniform", "server average over S (pseudocode: uniform)")

    @model_validator(mode="after")
    def _schedule_options(self) -> APFLConfig:
        if self.lr_schedule == "decay" and (self.mu is None or self.kappa is None):
            raise ValueError("lr_schedule: decay needs mu and kappa (eta_t = 16 / (mu (t + a)))")
        if self.lr_schedule != "decay" and self.mu is not None:
            raise ValueError("mu applies only to lr_schedule: decay")
        if self.kappa is not None and self.lr_schedule != "decay" and not self.final_averaging:
            raise ValueError("kappa applies only to lr_schedule: decay or final_averaging")
        if self.alpha_lr is not None and not self.adaptive_alpha:
            raise ValueError("alpha_lr applies only to adaptive_alpha: true")
        return self


def mix(alpha: float, omega: Tree, theta: Tree) -> Tree:
    """alpha omega + (1 - alpha) theta (alpha = 1 gives omega and 0 gives theta exactly)."""
    return {k: alpha * omega[k] + (1.0 - alpha) * theta[k] for k in omega}


def running_average(average: Tree, tree: Tree, fraction: float) -> Tree:
    """average + fraction (tree - average) for floating-point entries; the others (integer
    counters) take ``tree``'s value."""
    return {
        k: a + fraction * (tree[k] - a) if a.is_floating_point() else tree[k].clone()
        for k, a in average.items()
    }


class APFL(Algorithm):
    name = "apfl"
    summary = "APFL: mixture alpha_k omega_k + (1 - alpha_k) theta, adaptive alpha (Deng et al.)"
    Config = APFLConfig

    # -- schedule --------------------------------------------------------------------------
    def offset(self, tau: float) -> float:
        """a = max(128 kappa, tau) (tau when kappa is not given)."""
        kappa = self.config.kappa
        return max(128.0 * kappa, tau) if kappa is not None else tau

    def step_size(self, task: ClientTask, step: int, tau: int) -> float:
        """eta_t at local step ``step`` of round ``task.round`` (t = (r - 1) tau + step)."""
        if self.config.lr_schedule == "constant":
            return task.lr
        t = (task.round - 1) * tau + step
        return 16.0 / (self.config.mu * (t + self.offset(tau)))

    def average_weight(self, round: int, tau: float) -> float:
        """p_r = (r tau + a)^2."""
        return (round * tau + self.offset(tau)) ** 2

    def accumulate(
        self, average: State, weight: float, model: State, rounds: range, tau: float
    ) -> tuple[State, float]:
        """Fold ``model`` ({params, buffers}: the model during ``rounds``) into the p_r-weighted
        running average ``average`` of total weight ``weight``."""
        added = sum(self.average_weight(r, tau) for r in rounds)
        if added == 0.0:
            return average, weight
        fraction = added / (weight + added)
        return {
            part: running_average(average[part], model[part], fraction) for part in average
        }, weight + added

    # -- server ----------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        server: State = {
            "params": params,
            "buffers": buffers,
            "initial": {"params": clone(params), "buffers": clone(buffers)},
        }
        if self.config.final_averaging:
            server["average"] = {"params": clone(params), "buffers": clone(buffers)}
            server["average_weight"] = torch.zeros((), dtype=F64)
            server["last_round"] = torch.zeros((), dtype=torch.int64)
        return server

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        new = self.aggregate_models(results)
        if not self.config.final_averaging:
            return {**new, "initial": server["initial"]}
        round = int(results[0].info["round"])
        tau = max(r.info["tau"] for r in results)
        old = {"params": server["params"], "buffers": server["buffers"]}
        weight = float(server["average_weight"])
        # rounds without any report kept the old model, then this round's
        average, weight = self.accumulate(
            server["average"], weight, old, range(int(server["last_round"]) + 1, round), tau
        )
        average, weight = self.accumulate(average, weight, new, range(round, round + 1), tau)
        return {
            **new,
            "initial": server["initial"],
            "average": average,
            "average_weight": torch.tensor(weight, dtype=F64),
            "last_round": torch.tensor(round, dtype=torch.int64),
        }

    def global_model(self, server: State) -> tuple[Tree, Tree]:
        if self.config.final_averaging and float(server["average_weight"]) > 0:
            return server["average"]["params"], server["average"]["buffers"]
        return server["params"], server["buffers"]

    # -- client ----------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        """omega_k^(0) = theta^(0) (the pseudocode initializes every client at the start, also
        one first sampled late) and alpha_k = ``alpha``."""
        params, buffers = server["initial"]["params"], server["initial"]["buffers"]
        state: State = {
            "personal": {"params": clone(params), "buffers": clone(buffers)},
            "alpha": torch.tensor(self.config.alpha, dtype=F64),
            "steps": torch.zeros((), dtype=torch.int64),
        }
        if self.config.final_averaging:
            state["average"] = {"params": clone(params), "buffers": clone(buffers)}
            state["average_weight"] = torch.zeros((), dtype=F64)
            state["last_round"] = torch.zeros((), dtype=torch.int64)
            state["tau"] = torch.zeros((), dtype=F64)
        return state

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        assert state is not None
        cfg, model, data = self.config, self.ctx.model, task.data
        theta, theta_buffers = clone(message["params"]), clone(message["buffers"])
        omega = clone(state["personal"]["params"])
        omega_buffers = clone(state["personal"]["buffers"])
        alpha = float(state["alpha"])
        plan = self.client_plan(task)
        tau = task.full if task.full is not None else len(plan)
        loss_sum, personal_loss_sum = 0.0, 0.0
        with model.random_stream(self.ctx.seed, task.round, task.client_id):
            for step, idx in enumerate(plan):
                x, y = data.x_train[idx], data.y_train[idx]
                lr = self.step_size(task, step, tau)
                grad_theta, loss = model.grad_and_loss(theta, theta_buffers, x, y)
                grad_mixed, personal_loss = model.grad_and_loss(
                    mix(alpha, omega, theta), omega_buffers, x, y
                )
                loss_sum += float(loss)
                personal_loss_sum += float(personal_loss)
                new_alpha = alpha
                if cfg.adaptive_alpha:  # d/d alpha f_k(omega_bar) = <omega - theta, grad>
                    slope = sum(
                        float(torch.sum((omega[k] - theta[k]).to(F64) * grad_mixed[k].to(F64)))
                        for k in omega
                    )
                    new_alpha = min(1.0, max(0.0, alpha - (cfg.alpha_lr or lr) * slope))
                with torch.no_grad():  # own copies: updated in place
                    for k in theta:
                        theta[k].sub_(grad_theta[k], alpha=lr)
                        omega[k].sub_(grad_mixed[k], alpha=lr)
                alpha = new_alpha
        personal = {"params": omega, "buffers": omega_buffers}
        new_state: State = {
            "personal": personal,
            "alpha": torch.tensor(alpha, dtype=F64),
            "steps": state["steps"] + len(plan),
        }
        if cfg.final_averaging:
            # rounds the client sat out kept its old omega_k, then this round's
            average, weight = self.accumulate(
                state["average"],
                float(state["average_weight"]),
                state["personal"],
                range(int(state["last_round"]) + 1, task.round),
                tau,
            )
            average, weight = self.accumulate(
                average, weight, personal, range(task.round, task.round + 1), tau
            )
            new_state |= {
                "average": average,
                "average_weight": torch.tensor(weight, dtype=F64),
                "last_round": torch.tensor(task.round, dtype=torch.int64),
                "tau": torch.tensor(float(tau), dtype=F64),
            }
        steps = max(1, len(plan))
        info = {
            "round": float(task.round),
            "tau": float(tau),
            "alpha": alpha,
            "personal_loss": personal_loss_sum / steps,
        }
        return ClientResult(
            {"params": theta, "buffers": theta_buffers},
            self.ctx.objective_weight(task.client_id, cfg.weighting),
            loss_sum / steps,
            state=new_state,
            info=info,
        )

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """(11): alpha_k omega_k + (1 - alpha_k) theta, with omega_k's buffers (both averaged
        over the rounds with ``final_averaging``). A client that never trained (never sampled,
        or a held-out new client) deploys the global model."""
        if state is None or int(state["steps"]) == 0:
            return self.global_model(server)
        theta, _ = self.global_model(server)
        personal = state["personal"]
        if self.config.final_averaging:  # up to this round, omega_k unchanged since it trained
            rounds = range(int(state["last_round"]) + 1, task.round + 1)
            weight, tau = float(state["average_weight"]), float(state["tau"])
            personal, _ = self.accumulate(state["average"], weight, personal, rounds, tau)
        return mix(float(state["alpha"]), personal["params"], theta), personal["buffers"]
