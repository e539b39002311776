"""APFL: Adaptive Personalized Federated Learning (Deng, Kamani and Mahdavi, 2020,
arXiv:2003.13461, Section 3 and Algorithm 1). The labels (10) (the bilevel problem) and (11)
(the personalized model) are this docstring's own.

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

The personal step uses grad f_k(omega_bar), the gradient of h_k in
omega_k divided by alpha_k (the chain rule gives alpha_k grad f_k(omega_bar)). Same direction,
same stationary point (11), step size eta_t / alpha_k; with alpha_k = 1 both are local training.
With the exact gradient omega_k would learn alpha_k times slower than theta_k, lag behind it,
and adaptive alpha_k would collapse to 0, where omega_k stops moving: on the shared
Fashion-MNIST shards setup (10 rounds) the mean alpha_k went from 0.25 to 0.03 and the
personalized accuracy to 0.41 (FedAvg's 0.40); with the step used here alpha_k rises to 0.34-1.0
(the paper's observation: more heterogeneity, larger alpha) and the accuracy to 0.93.

Step size (``lr_schedule``): ``constant`` eta_t = train.lr (the paper's experiments), or
``decay`` eta_t = 16 / (mu (t + a)), a = max(128 kappa, tau) (the pseudocode's; mu the
strong-convexity constant, kappa = L / mu the condition number).

``final_averaging``: the deployed models are the pseudocode's weighted averages over every
iteration t = 1..T, p_t = (t + a)^2 (a = max(128 kappa, tau), or tau when kappa is not given)::

    global:       theta_hat = sum_t p_t theta_bar^(t) / S_T,  theta_bar^(t) = the mean over S of
                  the clients' iterates theta_k^(t)                          (server state)
    personalized: alpha_k omega_hat_k + (1 - alpha_k) theta_hat,
                  omega_hat_k = sum_t p_t omega_k^(t) / S_T                  (client state)

Each client folds its iterates into p_t-weighted running averages at every local step; it
uploads the average of its theta_k iterates of the round (``iterate_params``, with its buffers)
and their total weight, which the server averages over S with the aggregation weights and folds
into theta_hat. Iterations where a client sat out keep its last omega_k, and rounds without any
report keep the server's theta, each with the p_t of those iterations (tau: the client's own;
the server uses the largest tau of the latest reports). With a fixed alpha_k this is the
pseudocode's final personalized model exactly (equal tau, uniform weights); with
``adaptive_alpha`` it mixes with the final alpha_k (the pseudocode leaves which alpha_k open).
Only floating-point tensors are averaged; integer buffers (BatchNorm's counter) are the latest.

The client's two models take two gradients per local step: :class:`APFLProgram` states the
step once for both backends (the vmap backend runs whole chunks of clients). Buffers
(BatchNorm statistics): theta_k's forward passes update the uploaded ones, omega_bar's update
omega_k's own, which the personalized model deploys. The reported training loss is
theta_k's (as FedAvg's). States: the server keeps theta and the
initial model theta^(0) (``initial``, never sent: every omega_k^(0)); a client keeps
``personal`` (omega_k), ``alpha`` (alpha_k), ``steps`` (local steps so far; a client without any
deploys the global model) and, with ``final_averaging``, its running average.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, aggregate_models
from fedloom.algorithms.local_optimizer import LocalOptimizer
from fedloom.algorithms.sgd_program import StepProgram, model_copy
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers.program import Batch, Carry, ClientProgram, ClientRun, Ops
from fedloom.solvers.steps import loss_grad

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


def mix(alpha: float | torch.Tensor, omega: Tree, theta: Tree) -> Tree:
    """alpha omega + (1 - alpha) theta (alpha = 1 gives omega and 0 gives theta exactly): one
    ``lerp`` kernel per tensor."""
    return {k: torch.lerp(theta[k], omega[k], _like(alpha, theta[k])) for k in omega}


def running_average(average: Tree, tree: Tree, fraction: float) -> Tree:
    """average + fraction (tree - average) for floating-point entries; the others (integer
    counters) take ``tree``'s value."""
    return {
        k: torch.lerp(a, tree[k], _like(fraction, a)) if a.is_floating_point() else tree[k].clone()
        for k, a in average.items()
    }


def _like(weight: float | torch.Tensor, tensor: torch.Tensor) -> float | torch.Tensor:
    """A lerp weight in ``tensor``'s dtype (lerp takes no mixed dtypes)."""
    return weight.to(tensor.dtype) if isinstance(weight, torch.Tensor) else weight


class APFL(Algorithm):
    name = "apfl"
    summary = "APFL: mixture alpha_k omega_k + (1 - alpha_k) theta, adaptive alpha (Deng et al.)"
    Config = APFLConfig

    # -- schedule ---------------------------------------------------------------------------
    def offset(self, tau: Any) -> Any:
        """a = max(128 kappa, tau) (tau when kappa is not given); ``tau`` a number or tensor."""
        kappa = self.config.kappa
        if kappa is None:
            return tau
        if isinstance(tau, torch.Tensor):
            return tau.clamp_min(128.0 * kappa)
        return max(128.0 * kappa, tau)

    def step_size(self, task: ClientTask, step: int, tau: int) -> float:
        """eta_t at local step ``step`` of round ``task.round`` (t = (r - 1) tau + step)."""
        if self.config.lr_schedule == "constant":
            return task.lr
        t = (task.round - 1) * tau + step
        return 16.0 / (self.config.mu * (t + self.offset(tau)))

    def iteration_weight(self, t: float, tau: float) -> float:
        """p_t = (t + a)^2."""
        return (t + self.offset(tau)) ** 2

    def rounds_weight(self, rounds: range, tau: float) -> float:
        """sum of p_t over the iterations t = (r - 1) tau + 1 .. r tau of ``rounds``."""
        if len(rounds) == 0 or tau <= 0:
            return 0.0
        first, last = (rounds.start - 1) * tau + 1, (rounds.stop - 1) * tau
        a, count = self.offset(tau), last - first + 1

        def squares(n: float) -> float:  # sum_{t=1}^{n} t^2
            return n * (n + 1) * (2 * n + 1) / 6

        def naturals(n: float) -> float:
            return n * (n + 1) / 2

        return (
            squares(last)
            - squares(first - 1)
            + 2 * a * (naturals(last) - naturals(first - 1))
            + count * a * a
        )

    # -- server ----------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        server: State = {
            "params": params,
            "buffers": buffers,
            "initial": {"params": clone(params), "buffers": clone(buffers)},
        }
        if self.config.final_averaging:
            server |= averaging_slots(params, buffers)
        return server

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        new = aggregate_models(self.ctx, results)
        if not self.config.final_averaging:
            return {**new, "initial": server["initial"]}
        round = results[0].round
        tau = max(float(r.upload["iterate_weight"]["tau"]) for r in results)
        old = {"params": server["params"], "buffers": server["buffers"]}
        weight = float(server["average_weight"])
        # rounds without any report kept the old model
        stale = self.rounds_weight(range(int(server["last_round"]) + 1, round), tau)
        average, weight = combine(server["average"], weight, old, stale)
        # this round: the mean over S of the clients' iterate averages (theta_bar^(t))
        shares = [r.weight * float(r.upload["iterate_weight"]["weight"]) for r in results]
        total = sum(r.weight for r in results)
        if sum(shares) > 0:
            uploads = [r.upload for r in results]
            iterates = {
                "params": self.ctx.aggregate([u["iterate_params"] for u in uploads], shares),
                "buffers": self.ctx.aggregate([u["iterate_buffers"] for u in uploads], shares)
                if uploads[0]["iterate_buffers"]
                else {},
            }
            average, weight = combine(average, weight, iterates, sum(shares) / total)
        return {
            **new,
            "initial": server["initial"],
            "average": average,
            "average_weight": torch.tensor(weight, dtype=F64),
            "last_round": torch.tensor(round, dtype=torch.int64),
            "tau": torch.tensor(tau, dtype=F64),
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
            "personal": model_copy(server["initial"]),
            "alpha": torch.tensor(self.config.alpha, dtype=F64),
            "steps": torch.zeros((), dtype=torch.int64),
        }
        if self.config.final_averaging:
            state |= averaging_slots(params, buffers)
        return state

    def make_program(self) -> ClientProgram:
        return APFLProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """(11): alpha_k omega_k + (1 - alpha_k) theta, with omega_k's buffers (both averaged
        over the iterations with ``final_averaging``). A client that never trained (never
        sampled, or a held-out new client) deploys the global model."""
        if state is None or int(state["steps"]) == 0:
            return self.client_global(server, state, task)
        theta, global_buffers = self.client_global(server, state, task)
        personal = state["personal"]
        if self.config.final_averaging:  # up to this round, omega_k unchanged since it trained
            rounds = range(int(state["last_round"]) + 1, task.round + 1)
            weight, tau = float(state["average_weight"]), float(state["tau"])
            stale = self.rounds_weight(rounds, tau)
            personal, _ = combine(state["average"], weight, personal, stale)
        params, buffers = self.personal_view(personal, global_buffers, state)
        return mix(state["alpha"], params, theta), buffers

    # -- hooks of a model track with keys kept on the client (PEFT strategies, docs/peft.md)
    def client_global(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """theta as client k mixes it (default: the global model)."""
        return self.global_model(server)

    def theta_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """theta_k at the start of the round (default: the broadcast theta^r)."""
        return message["params"], message["buffers"]

    def personal_view(
        self, personal: State, global_buffers: Tree, state: State | None
    ) -> tuple[Tree, Tree]:
        """omega_k as the client trains and deploys it (default: its state's)."""
        return personal["params"], personal["buffers"]

    def theta_result(
        self, message: Message, state: State | None, task: ClientTask, theta: Tree, buffers: Tree
    ) -> tuple[Message, State]:
        """theta_k's upload and what the client keeps of it (default: all of it up)."""
        return {"params": theta, "buffers": buffers}, {}


def averaging_slots(params: Tree, buffers: Tree) -> State:
    """The running average of ``final_averaging`` (the server's of theta, a client's of its
    omega), starting at (params, buffers): the average, its accumulated weight, the last round
    it covers and tau."""
    return {
        "average": {"params": clone(params), "buffers": clone(buffers)},
        "average_weight": torch.zeros((), dtype=F64),
        "last_round": torch.zeros((), dtype=torch.int64),
        "tau": torch.zeros((), dtype=F64),
    }


def combine(average: State, weight: float, model: State, added: float) -> tuple[State, float]:
    """The running average ``average`` (total weight ``weight``) with ``model`` ({params,
    buffers}) folded in at weight ``added``."""
    if added <= 0.0:
        return average, weight
    fraction = added / (weight + added)
    return {
        part: running_average(average[part], model[part], fraction) for part in average
    }, weight + added


MODELS = ("theta", "omega")
"""The models the local optimizer moves: theta_k and omega_k (alpha_k's step stays SGD's)."""


class APFLProgram(StepProgram):
    """APFL's local step (the module doc): theta_k's and omega_k's updates from one minibatch,
    alpha_k's optional step, and with ``final_averaging`` the p_t-weighted iterate averages.

    With ``train.optimizer: adamw`` theta_k's and omega_k's updates are AdamW's steps on the
    same gradients, grad f_k(theta_k) and grad f_k(omega_bar), at eta_t, each model with
    moments of its own (kept in the client state with ``moments: client``); alpha_k's
    projected step on its scalar slope stays the pseudocode's."""

    takes_optimizer = True
    keeps_moments = True

    def __init__(self, algorithm: APFL) -> None:
        super().__init__(algorithm)
        self.config = algorithm.config
        self.optimizer = LocalOptimizer(algorithm.ctx.optimizer)

    def passes_per_step(self) -> float:
        return 2.0  # theta_k's gradient and the mixed model's

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        plan_length = len(self.algorithm.client_plan(task))
        tau = float(task.full if task.full is not None else plan_length)
        algorithm = self.algorithm
        theta, theta_buffers = algorithm.theta_start(message, state, task)
        omega, omega_buffers = algorithm.personal_view(state["personal"], message["buffers"], state)
        carry: Carry = {
            "theta": theta,
            "theta_buffers": clone(theta_buffers),
            "omega": omega,
            "omega_buffers": clone(omega_buffers),
            "alpha": state["alpha"],
            "tau": torch.tensor(tau, dtype=F64),
            "t": torch.tensor((task.round - 1) * tau, dtype=F64),
        }
        if self.config.final_averaging:
            carry["iterates"] = {"params": message["params"], "buffers": message["buffers"]}
            carry["personal_average"] = state["personal"]
            carry["average_weight"] = torch.zeros((), dtype=F64)
        return self.optimizer.start(carry, state, {"theta": theta, "omega": omega})

    def shared(self, message: Message, task: ClientTask) -> dict:
        return {"lr": task.lr}

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        cfg, model = self.config, self.model
        theta, omega, alpha = carry["theta"], carry["omega"], carry["alpha"]
        t, tau = carry["t"], carry["tau"]
        a = self.algorithm.offset(tau)
        lr = shared["lr"] if cfg.lr_schedule == "constant" else 16.0 / (cfg.mu * (t + a))
        grad_theta, loss = loss_grad(ops, model, theta, carry["theta_buffers"], batch)
        grad_mixed, personal_loss = loss_grad(
            ops, model, mix(alpha, omega, theta), carry["omega_buffers"], batch
        )
        new = dict(carry)
        if cfg.adaptive_alpha:  # d/d alpha f_k(omega_bar) = <omega - theta, grad>
            slope = sum(
                ((omega[k] - theta[k]).to(F64) * grad_mixed[k].to(F64)).sum() for k in omega
            )
            new["alpha"] = (alpha - (cfg.alpha_lr or lr) * slope).clamp(0.0, 1.0)
        new["theta"] = self.optimizer.step(new, "theta", theta, grad_theta, lr, ops.descend)
        new["omega"] = self.optimizer.step(new, "omega", omega, grad_mixed, lr, ops.descend)
        new["t"] = t + 1.0
        if cfg.final_averaging:  # fold iterate t + 1 in at p_{t+1} = (t + 1 + a)^2
            p = (t + 1.0 + a) ** 2
            fraction = p / (carry["average_weight"] + p)
            new["average_weight"] = carry["average_weight"] + p
            new["iterates"] = {
                "params": running_average(carry["iterates"]["params"], new["theta"], fraction),
                "buffers": running_average(
                    carry["iterates"]["buffers"], carry["theta_buffers"], fraction
                ),
            }
            new["personal_average"] = {
                "params": running_average(
                    carry["personal_average"]["params"], new["omega"], fraction
                ),
                "buffers": running_average(
                    carry["personal_average"]["buffers"], carry["omega_buffers"], fraction
                ),
            }
        return new, {"loss": loss, "personal_loss": personal_loss, "alpha": new["alpha"]}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        assert state is not None
        algorithm, carry = self.algorithm, run.carry
        steps = run.steps.get(self.STEP, 0)
        personal = {"params": carry["omega"], "buffers": carry["omega_buffers"]}
        upload, kept = algorithm.theta_result(
            message, state, task, carry["theta"], carry["theta_buffers"]
        )
        new_state: State = {
            **kept,
            **self.optimizer.kept(carry, MODELS),
            "personal": personal,
            "alpha": carry["alpha"].clone(),
            "steps": state["steps"] + steps,
        }
        if self.config.final_averaging:
            tau = float(carry["tau"])
            # iterations the client sat out kept its old omega_k, then this round's iterates
            stale = algorithm.rounds_weight(range(int(state["last_round"]) + 1, task.round), tau)
            average, weight = combine(
                state["average"], float(state["average_weight"]), state["personal"], stale
            )
            round_weight = float(carry["average_weight"])
            average, weight = combine(average, weight, carry["personal_average"], round_weight)
            new_state |= {
                "average": average,
                "average_weight": torch.tensor(weight, dtype=F64),
                "last_round": torch.tensor(task.round, dtype=torch.int64),
                "tau": carry["tau"].clone(),
            }
            upload |= {
                "iterate_params": carry["iterates"]["params"],
                "iterate_buffers": carry["iterates"]["buffers"],
                "iterate_weight": {
                    "weight": carry["average_weight"].clone(),
                    "tau": carry["tau"].clone(),
                },
            }
        info = {
            "alpha": float(carry["alpha"]),
            "personal_loss": run.metric(self.STEP, "personal_loss"),
        }
        weight_k = algorithm.ctx.objective_weight(task.client_id, self.config.weighting)
        return ClientResult(upload, weight_k, run.metric(self.STEP), state=new_state, info=info)
