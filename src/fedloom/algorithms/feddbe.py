"""FedDBE (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan, NeurIPS 2023, "Eliminating Domain Bias
for Federated Learning in Representation Space", arXiv:2311.14975, Section 4, Eq. 4-8): FedAvg
with the Domain Bias Eliminator, a personalized representation bias memory (PRBM) and a mean
regularization (MR) of the representation.

The model is a body (feature extractor) and a head, one ``nn.Linear`` (the model's declared
head, :func:`fedloom.solvers.objective_sgd.single_head`) whose input h(x) of dimension D is the
representation. Client k keeps a vector r_k in R^D (the PRBM, zero at first) added to it::

    logits = head(h(x) + r_k)                                         # Eq. 4-5

so the body can learn the representation every client shares and r_k the client's own shift.
MR pulls the client's mean representation towards the global one, g (Eq. 6-7); as in the
authors' code (TsingZ0/DBE, ``clientDBE.train``) the client's mean is a running mean over the
round's minibatches, reset to 0 at the start of every round, with momentum mu (``momentum``)::

    m <- (1 - mu) m + mu mean_{x in B} h(x)      (the earlier steps' m is a constant)
    L = CE(head(h(x) + r_k), y) + kappa * 1/D sum_d 1/2 (m_d - g_d)^2          # Eq. 8

and one SGD step at ``train.lr`` moves the whole model and r_k together on L (the code's two
optimizers have the same learning rate). The server averages the models as FedAvg does; r_k
never leaves the client.

g is fixed once (the authors' code computes it in an initialization period before FL and
never updates it): here the round before it exists is the initialization period, whose clients
train FedAvg's objective (no r_k, no MR; the code's initialization trains every client, then
discards the models) and also upload their final running mean m; the server sets g to their
n_k-weighted average and fixes it. From then on every client trains L.

For a linear head, head(h + r) = W h + (b + W r): the deployed (personalized) model of client k
is the global model with its head bias replaced by b + W r_k, exactly the authors' evaluation
(global model, the client's PRBM), and training uses the same identity, the gradient reaching
W through both terms. A client that never trained deploys the global model (r = 0).

``prbm: false`` is the ablation without the memory (r_k = 0); with it and ``kappa: 0`` FedDBE
is FedAvg.

Refused: sample-level DP (its objective is its own), client-level DP and asynchrony (the
initialization round uploads a mean representation besides the model: the server step is not
only an average of models), ``train.optimizer: adamw`` (its step moves r_k by SGD).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.errors import ConfigError
from fedloom.solvers.objective_sgd import single_head
from fedloom.solvers.program import Batch, Carry, ClientProgram, ClientRun, Ops, weighted_mean


class FedDBEConfig(AlgorithmConfig):
    kappa: float = Field(
        default=50.0, ge=0.0, description="weight of MR (the authors' FMNIST run: 50)"
    )
    momentum: float = Field(
        default=0.1, ge=0.0, le=1.0, description="momentum of the running mean (code: 0.1)"
    )
    prbm: bool = Field(default=True, description="train the PRBM r_k (false: the ablation)")


PRBM = "feddbe/prbm"
"""r_k's key among the trained tensors of a step (beside the model's parameters)."""


def shifted_head(params: Tree, head: str, prbm: torch.Tensor) -> Tree:
    """``params`` with the linear head's bias b replaced by b + W r: head(h + r) as head(h)."""
    weight, bias = f"{head}.weight", f"{head}.bias"
    return {**params, bias: params[bias] + params[weight] @ prbm}


class FedDBE(FedAvg):
    name = "feddbe"
    summary = "FedDBE: FedAvg with a personal representation bias and mean regularization (2023)"
    Config = FedDBEConfig
    capabilities = FedAvg.capabilities.but(
        classification_only="a linear classifier head",
        supports_sample_dp=False,
        averages_client_models=False,  # the initialization round also uploads a mean
    )

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head = single_head(ctx.model, self.name)
        linear = ctx.model.module.get_submodule(self.head)
        assert isinstance(linear, nn.Linear)
        if linear.bias is None:
            raise ConfigError(
                f"algorithm.name: feddbe adds r_k through the head's bias, and the head "
                f"{self.head} has none; use a model whose last layer has a bias (mlp, cnn)"
            )
        self.dim = linear.in_features

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        dtype = params[f"{self.head}.weight"].dtype
        return {
            "params": params,
            "buffers": buffers,
            "mean": torch.zeros(self.dim, dtype=dtype),
            "known": torch.zeros((), dtype=torch.bool),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        message = super().server_message(server, round)
        if bool(server["known"]):
            message["feddbe"] = {"mean": server["mean"]}
        return message

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        new = {**server, **super().aggregate(server, results)}
        if not bool(server["known"]) and results:
            means = [{"mean": r.upload["feddbe"]["mean"]} for r in results]
            weights = [float(r.weight) for r in results]
            new["mean"] = self.ctx.aggregate(means, weights)["mean"]
            new["known"] = torch.ones((), dtype=torch.bool)
        return new

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        return {"prbm": torch.zeros_like(server["mean"])}

    def make_program(self) -> ClientProgram:
        return FedDBEProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The global model with head(h + r_k) folded into the head's bias."""
        if state is None:
            return server["params"], server["buffers"]
        return shifted_head(server["params"], self.head, state["prbm"]), server["buffers"]


class FedDBEProgram(SGDProgram):
    """SGD on Eq. 8 of the model and r_k together; the running mean m in the carry."""

    private_step = False  # its own objective, not DP-SGD's per-sample loss
    takes_optimizer = False  # r_k and the model take SGD steps

    def __init__(self, algorithm: FedDBE) -> None:
        super().__init__(algorithm)
        self.config: FedDBEConfig = algorithm.config  # type: ignore[assignment]
        self.head = algorithm.head

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        return {**super().shared(message, task), "known": "feddbe" in message}

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        carry = super().init(message, state, task)
        carry["prbm"] = state["prbm"].clone()
        carry["running"] = torch.zeros_like(state["prbm"])
        return carry

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        cfg, head = self.config, self.head
        known = shared["known"]
        memory = known and cfg.prbm  # the initialization round trains FedAvg's objective
        trained = {**carry["params"], PRBM: carry["prbm"]} if memory else carry["params"]
        mu = cfg.momentum

        def loss(p: Tree, b: Tree) -> tuple[torch.Tensor, torch.Tensor]:
            model = {k: v for k, v in p.items() if k != PRBM}
            if memory:
                model = shifted_head(model, head, p[PRBM])
            out, h = self.model.forward_with_features(model, b, batch.x, head)
            mean = (h * batch.w[:, None]).sum(0) / batch.w.sum().clamp_min(1.0)
            running = (1 - mu) * carry["running"] + mu * mean
            value = weighted_mean(self.model.per_sample_loss(out, batch.y), batch.w)
            if known and cfg.kappa:
                gap = running - shared["message"]["feddbe"]["mean"]
                value = value + cfg.kappa * (0.5 * gap**2).mean()
            return value, running.detach()

        grads, value, running = ops.value_and_grad_aux(loss, trained, carry["buffers"])
        moved = ops.descend(trained, grads, shared["lr"])
        new = {**carry, "running": running}
        new["params"] = {k: v for k, v in moved.items() if k != PRBM}
        if memory:
            new["prbm"] = moved[PRBM]
        return new, {"loss": value}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        result = super().finish(message, state, task, run)
        if "feddbe" not in message:  # the initialization round: the client's mean too
            result.upload["feddbe"] = {"mean": run.carry["running"]}
        result.state = {"prbm": run.carry["prbm"]}
        return result
