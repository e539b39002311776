"""FedNTD (Lee et al., NeurIPS 2022, "Preservation of the Global Knowledge by Not-True
Distillation in Federated Learning", arXiv:2106.03097); seed 004, first article, section 三 3.4
(功能空间正则化: FedNTD).

FedAvg whose local objective adds a distillation from the global model received this round,
restricted to the not-true classes (the true class's logit is removed before the softmax), so
the client learns its labels freely while keeping the global model's view of the other
classes. One round::

    server sends w (the global model)
    client k:  SGD from w on, per minibatch B,
                 L = CE(z_l, y) + beta * L_NTD
                 L_NTD = tau^2 * 1/|B| sum_{n in B} KL( q~_g^tau(x_n) || q~_l^tau(x_n) )
                 q~^tau(x)_c = exp(z_c / tau) / sum_{c' != y} exp(z_c' / tau),   c != y
               z_l: the local model's logits; z_g: the logits of w (no grad, evaluation mode)
               upload w_k
    server:    w <- sum_k p_k w_k / sum_k p_k          # FedAvg (``aggregate_models``)

with p_k = n_k (``weighting: samples``, FedAvg's, the default) or 1 (``uniform``).

tau^2: the paper's default tau = 1 (beta = 1) makes the factor moot; for other temperatures we
follow the authors' criterion (github.com/Lee-Gihun/FedNTD, ``algorithms/fedntd/criterion.py``:
``tau ** 2 * KLDivLoss(reduction="batchmean")``), Hinton's scaling that keeps the gradient size
independent of tau. The teacher runs in evaluation mode (BatchNorm's running statistics, no
dropout), so the received model, buffers included, is never modified. beta = 0 is FedAvg, bit
for bit. The global model is deployed and serves new clients, as FedAvg's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedloom.algorithms.base import (
    AlgorithmConfig,
    AlgorithmContext,
    ClientResult,
    ClientTask,
    Message,
    State,
    Weighting,
    weighting_field,
)
from fedloom.algorithms.fedavg import FedAvg
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree
from fedloom.solvers.objective_sgd import Batch


class FedNTDConfig(AlgorithmConfig):
    beta: float = Field(default=1.0, ge=0.0, description="weight of the NTD loss (paper: 1)")
    tau: float = Field(default=1.0, gt=0.0, description="distillation temperature (paper: 1)")
    weighting: Weighting = weighting_field("samples", "model averaging weights (FedAvg: samples)")


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The logits without each sample's true class: shape (batch, classes - 1)."""
    classes = logits.shape[-1]
    mask = torch.ones_like(logits, dtype=torch.bool).scatter_(1, y[:, None], False)
    return logits[mask].view(-1, classes - 1)


def ntd_loss(
    local: torch.Tensor, global_: torch.Tensor, y: torch.Tensor, tau: float
) -> torch.Tensor:
    """tau^2 * mean over the batch of KL(q~_g^tau || q~_l^tau) on the not-true classes."""
    log_q_local = F.log_softmax(not_true(local, y) / tau, dim=-1)
    log_q_global = F.log_softmax(not_true(global_, y) / tau, dim=-1)
    kl = F.kl_div(log_q_local, log_q_global, reduction="batchmean", log_target=True)
    return tau**2 * kl


@torch.no_grad()
def teacher_logits(
    model: FunctionalModel, params: Tree, buffers: Tree, x: torch.Tensor
) -> torch.Tensor:
    """The logits of (params, buffers) on x in evaluation mode, without gradient."""
    model.module.eval()
    try:
        return model.forward(params, buffers, x)
    finally:
        model.module.train()


class FedNTD(FedAvg):
    name = "fedntd"
    summary = "FedNTD: FedAvg with not-true-class distillation from the global model"
    Config = FedNTDConfig

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.require_classification("not-true classes")

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        cfg, model = self.config, self.ctx.model
        params, buffers = message["params"], message["buffers"]

        def objective(batch: Batch) -> torch.Tensor:
            loss = model.loss_from_output(batch.out, batch.y)
            if cfg.beta > 0:
                z_global = teacher_logits(model, params, buffers, batch.x)
                loss = loss + cfg.beta * ntd_loss(batch.out, z_global, batch.y, cfg.tau)
            return loss

        solved = self.solve_objective(message, state, task, objective)
        upload = {"params": solved.params, "buffers": solved.buffers}
        return ClientResult(upload, self.upload_weight(task, cfg.weighting), solved.loss)
