"""FedALA (Zhang, Hua, Wang, Wang, Zheng, Zhu, Guan, AAAI 2023, "FedALA: Adaptive Local
Aggregation for Personalized Federated Learning", arXiv:2212.01197, Section 4, Eq. 4-7,
Algorithm 1).

FedAvg's server; each client, before its local training, blends the downloaded global model
into its old local model element-wise (Adaptive Local Aggregation, ALA) instead of overwriting
it. With the model's parameter tensors in their order, the last ``layer_idx`` of them are the
higher layers (PFLlib's ``layer_idx``: 2, the last layer's weight and bias, is the paper's
p = 1 layer), the others the lower layers. One round of client k::

    theta_k          the client's old local model (its model after its latest training)
    theta            the downloaded global model
    lower layers:    theta_hat <- theta                                   # Eq. 5, the first part
    higher layers:   theta_hat <- theta_k + (theta - theta_k) * W_k       # Eq. 4-5, W_k in [0,1]
    weight learning on a random rand_percent% sample S of the client's training data,
    minibatches of train.batch_size in one fixed order (one pass over S: one epoch):
        W_k <- clip(W_k - eta grad_theta_hat L(theta_hat; B) * (theta - theta_k), 0, 1)  # Eq. 6
        theta_hat <- theta_k + (theta - theta_k) * W_k         (higher layers; Eq. 7)
    local SGD from theta_hat on the engine's plan; upload it weighted n_k (FedAvg)
    keep the trained model as the next round's theta_k, and W_k

W_k starts at ones. A client's first weight learning (Algorithm 1's start phase) runs epochs
over S until the standard deviation of the last ``num_pre_loss`` epoch losses (each epoch's
last minibatch loss, as the authors' code records them) is below ``threshold`` with more than
``num_pre_loss`` epochs recorded, or until ``max_init_epochs`` epochs (a bound the paper does
not have); later rounds learn W_k for one epoch. ALA is skipped (theta_hat = theta) while the
client's old model equals the global one on the higher layers, as in round 1, where every
client's model is the initial one (Algorithm 1, t = 1; the authors' code checks the same).
A client first sampled in a later round starts from the initial model theta^0 as its old
local model (the pseudocode initializes all clients at the start).

Both backends run the weight learning as one update per minibatch of a fixed plan
(``fedala/weights``: the start phase plans ``max_init_epochs`` epochs): the stopping rule is a
per-client flag in the carry (epoch losses in a window of ``num_pre_loss``, their population
standard deviation), and a client that has stopped takes the remaining steps as no-ops
(``torch.where``), so the vmap backend steps clients that stop at different epochs together
and both backends follow the same trajectory. The plan's sample comes from the stream (seed,
round, client, 'fedala/sample'). ``ala_steps`` fixes the minibatches of one epoch (cycling
through S) instead of one pass over S.

The gradient of the weight learning flows through the higher layers only, and its forward
pass's BatchNorm statistics are thrown away (the authors' temporary model); the local
training starts from the global buffers (BatchNorm statistics; the authors' code, which
blends ``parameters()`` only, leaves them local), so that with W_k fixed at ones (``eta: 0``)
theta_hat is the global model and FedALA is FedAvg. The deployed (personalized) model is the
client's model after its latest local training; a client that never trained deploys the
global model.

With ``train.optimizer: adamw`` the local training takes AdamW's steps (W's learning stays
SGD's, Eq. 6); the moments can persist in the client state (``moments: client``).

Refused: sample-level DP (the weight learning takes non-private gradients of the data).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.sgd_program import SGDProgram, model_copy
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers.program import (
    BATCHES,
    Batch,
    Carry,
    ClientProgram,
    ClientRun,
    Ops,
    Plan,
    Update,
)


class FedALAConfig(AlgorithmConfig):
    layer_idx: int = Field(
        default=2,
        ge=1,
        description="trailing parameter tensors blended by ALA (PFLlib: 2, the paper's p = 1)",
    )
    rand_percent: int = Field(
        default=80, gt=0, le=100, description="percent of local data W is learned on (s = 80)"
    )
    eta: float = Field(default=1.0, ge=0.0, description="step size of W's learning (paper: 1.0)")
    threshold: float = Field(
        default=0.1, ge=0.0, description="start phase: loss std that stops W's learning (0.1)"
    )
    num_pre_loss: int = Field(
        default=10, ge=1, description="start phase: epoch losses in the std window (10)"
    )
    max_init_epochs: int = Field(
        default=20, ge=1, description="start phase: most epochs of W's learning (a bound)"
    )
    ala_steps: int | None = Field(
        default=None, ge=1, description="minibatches of one W epoch (default: one pass over S)"
    )


class FedALA(FedAvg):
    name = "fedala"
    summary = "FedALA: element-wise adaptive local aggregation of the global model (Zhang 2023)"
    Config = FedALAConfig
    capabilities = FedAvg.capabilities.but(supports_sample_dp=False)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        keys = list(ctx.model.param_keys)
        cfg: FedALAConfig = self.config  # type: ignore[assignment]
        if cfg.layer_idx > len(keys):
            raise ConfigError(
                f"algorithm.layer_idx: {cfg.layer_idx} is more than the model's {len(keys)} "
                f"parameter tensors; use at most {len(keys)}"
            )
        self.higher = keys[len(keys) - cfg.layer_idx :]

    # -- server: FedAvg's, next to the initial model (every client's first local model) -----
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {
            "params": params,
            "buffers": buffers,
            "initial": {"params": clone(params), "buffers": clone(buffers)},
        }

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return {**super().aggregate(server, results), "initial": server["initial"]}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        """theta_k^0 = theta^0, W_k = 1, no weight learning and no local step yet."""
        initial = server["initial"]
        return {
            "model": model_copy(initial),
            "weights": {k: torch.ones_like(initial["params"][k]) for k in self.higher},
            "started": torch.zeros((), dtype=torch.bool),
            "steps": torch.zeros((), dtype=torch.int64),
        }

    def make_program(self) -> ClientProgram:
        return FedALAProgram(self)

    def blends(self, message: Message, state: State) -> bool:
        """Whether ALA runs: the old local model differs from the global one (higher layers)."""
        old, glob = state["model"]["params"], message["params"]
        return any(not torch.equal(old[k], glob[k]) for k in self.higher)

    def ala_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """theta_hat with the client's current W_k (Eq. 4-5), or theta when ALA is skipped."""
        assert state is not None
        glob = message["params"]
        if not self.blends(message, state):
            return glob, message["buffers"]
        old, weights = state["model"]["params"], state["weights"]
        params = {
            k: old[k] + (glob[k] - old[k]) * weights[k] if k in weights else v
            for k, v in glob.items()
        }
        return params, message["buffers"]

    def epoch_batches(self, task: ClientTask) -> list[torch.Tensor]:
        """One epoch of the weight learning: the round's sample S (stream (seed, round,
        client, 'fedala/sample')) in minibatches of train.batch_size, in one fixed order."""
        cfg: FedALAConfig = self.config  # type: ignore[assignment]
        n = task.data.num_train
        size = max(1, int(cfg.rand_percent / 100 * n))
        gen = generator(self.ctx.seed, "fedala/sample", task.round, task.client_id)
        sample = torch.randperm(n, generator=gen)[:size]
        width = size if self.ctx.batch_size is None else min(size, self.ctx.batch_size)
        if cfg.ala_steps is None:
            return list(sample.split(width))
        cycled = sample.repeat(-(-cfg.ala_steps * width // size))
        return list(cycled[: cfg.ala_steps * width].split(width))

    def weight_plan(self, state: State, task: ClientTask, blends: bool) -> list[torch.Tensor]:
        """The weight learning's minibatches: ``max_init_epochs`` epochs in the start phase,
        one later, none when ALA is skipped."""
        if not blends:
            return []
        cfg: FedALAConfig = self.config  # type: ignore[assignment]
        epochs = 1 if bool(state["started"]) else cfg.max_init_epochs
        return self.epoch_batches(task) * epochs

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The client's model after its latest local training (the global model before)."""
        if state is None or int(state["steps"]) == 0:
            return server["params"], server["buffers"]
        return state["model"]["params"], state["model"]["buffers"]


WEIGHTS = "fedala/weights"
ALA = "ala"


class FedALAProgram(SGDProgram):
    """Weight learning (update ``ala`` on the plan ``fedala/weights``, from step 0), then
    FedAvg's local SGD (``step`` on the engine's plan, from where the weight learning ends)."""

    private_step = False  # the weight learning's gradients are not DP-SGD's

    def __init__(self, algorithm: FedALA) -> None:
        super().__init__(algorithm, start=algorithm.ala_start)
        self.fedala = algorithm
        self.config: FedALAConfig = algorithm.config  # type: ignore[assignment]
        self.updates = (
            Update(ALA, (WEIGHTS,), self.ala_step),
            Update(self.STEP, (BATCHES,), self.step, stacked=self.stacked_form()),
        )

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        assert state is not None
        weights = self.fedala.weight_plan(state, task, self.fedala.blends(message, state))
        train = Plan(self.algorithm.client_plan(task), start=len(weights))
        return {WEIGHTS: Plan(weights), BATCHES: train}

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        carry = super().init(message, state, task)
        higher = self.fedala.higher
        old = state["model"]["params"]
        epoch = len(self.fedala.epoch_batches(task))
        dtype = old[higher[0]].dtype
        carry[ALA] = {
            "weights": {k: state["weights"][k].clone() for k in higher},
            "old": {k: old[k] for k in higher},
            "losses": torch.zeros(self.config.num_pre_loss, dtype=dtype),
            "epochs": torch.zeros((), dtype=torch.int64),
            "step": torch.zeros((), dtype=torch.int64),
            "epoch": torch.tensor(epoch, dtype=torch.int64),
            "done": torch.zeros((), dtype=torch.bool),
        }
        return carry

    def ala_step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        """One minibatch of Eq. 6-7, a no-op once the client's start phase has converged."""
        (batch,) = batches
        cfg, higher = self.config, self.fedala.higher
        ala, params = carry[ALA], carry["params"]
        glob = shared["message"]["params"]
        spare = {k: b.clone() for k, b in carry["buffers"].items()}  # a throwaway forward pass
        lower = {k: v for k, v in params.items() if k not in ala["old"]}

        # the buffers go in as an argument: BatchNorm's forward updates them in place, which
        # torch.func.grad refuses for a captured tensor
        def objective(top: Tree, b: Tree) -> torch.Tensor:
            return self.model.weighted_loss({**lower, **top}, b, batch.x, batch.y, batch.w)

        grads, loss = ops.value_and_grad(objective, {k: params[k] for k in higher}, spare)
        active = ~ala["done"]
        weights, new_params = {}, dict(params)
        for k in higher:
            old, gap = ala["old"][k], glob[k] - ala["old"][k]
            learned = torch.clamp(ala["weights"][k] - cfg.eta * grads[k] * gap, 0.0, 1.0)
            weights[k] = torch.where(active, learned, ala["weights"][k])
            new_params[k] = old + gap * weights[k]
        # the epoch's last minibatch loss enters the window; the start phase stops once the
        # window is full (more than num_pre_loss epochs) and its std is below the threshold
        ends = active & ((ala["step"] + 1) % ala["epoch"] == 0)
        shifted = torch.cat([ala["losses"][1:], loss.detach()[None]])
        losses = torch.where(ends, shifted, ala["losses"])
        epochs = ala["epochs"] + ends.to(torch.int64)
        settled = losses.std(correction=0) < cfg.threshold
        done = ala["done"] | (ends & (epochs > cfg.num_pre_loss) & settled)
        new_ala = {
            **ala,
            "weights": weights,
            "losses": losses,
            "epochs": epochs,
            "step": ala["step"] + 1,
            "done": done,
        }
        return {**carry, "params": new_params, ALA: new_ala}, {"loss": loss}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        assert state is not None
        result = super().finish(message, state, task, run)
        carry = run.carry
        learned = run.steps.get(ALA, 0) > 0
        kept = result.state if result.state is not None else {}
        result.state = {
            **kept,
            "model": {"params": carry["params"], "buffers": carry["buffers"]},
            "weights": carry[ALA]["weights"],
            "started": state["started"] | torch.tensor(learned),
            "steps": state["steps"] + run.steps.get(self.STEP, 0),
        }
        result.info = {
            "ala_loss": run.metric(ALA),
            "ala_epochs": float(carry[ALA]["epochs"]),  # W's epochs before it stopped
        }
        return result
