"""FedNTD (Lee et al., NeurIPS 2022, "Preservation of the Global Knowledge by Not-True
Distillation in Federated Learning", arXiv:2106.03097): a regularizer in function
(output) space rather than parameter space.

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

The local step is a client program (:class:`FedNTDProgram`, algorithms/objective.py) that the
sequential and the vmap backends both run; the teacher is the round's broadcast model, shared by
every client of a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.objective import Forward, ObjectiveProgram, Shared, weighted_upload
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.functional import FunctionalModel, evaluation_mode
from fedloom.core.protocol import Message
from fedloom.core.pytree import Tree
from fedloom.solvers.program import Batch, Carry, ClientProgram, weighted_mean


class FedNTDConfig(AlgorithmConfig):
    beta: float = Field(default=1.0, ge=0.0, description="weight of the NTD loss (paper: 1)")
    tau: float = Field(default=1.0, gt=0.0, description="distillation temperature (paper: 1)")
    weighting: Weighting = weighting_field("samples", "model averaging weights (FedAvg: samples)")


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The logits without each sample's true class, in class order: shape (batch, classes - 1).
    A gather with fixed shapes (no boolean mask), so it runs under ``vmap``."""
    classes = logits.shape[-1]
    others = torch.arange(classes - 1, device=logits.device)[None, :]
    index = others + (others >= y[:, None]).to(others.dtype)  # skip the true class
    return logits.gather(1, index)


def ntd_loss(
    local: torch.Tensor,
    global_: torch.Tensor,
    y: torch.Tensor,
    tau: float,
    w: torch.Tensor | None = None,
) -> torch.Tensor:
    """tau^2 * mean over the batch of KL(q~_g^tau || q~_l^tau) on the not-true classes; ``w``:
    sample weights of a padded batch (None: all real)."""
    log_q_local = F.log_softmax(not_true(local, y) / tau, dim=-1)
    log_q_global = F.log_softmax(not_true(global_, y) / tau, dim=-1)
    kl = F.kl_div(log_q_local, log_q_global, reduction="none", log_target=True).sum(dim=-1)
    return tau**2 * weighted_mean(kl, w)


@torch.no_grad()
def teacher_logits(
    model: FunctionalModel, params: Tree, buffers: Tree, x: torch.Tensor
) -> torch.Tensor:
    """The logits of (params, buffers) on x in evaluation mode, without gradient."""
    with evaluation_mode(model.module):
        return model.forward(params, buffers, x)


class FedNTD(FedAvg):
    name = "fedntd"
    summary = "FedNTD: FedAvg with not-true-class distillation from the global model"
    capabilities = FedAvg.capabilities.but(
        supports_sample_dp=False,  # its own distillation objective
        classification_only="not-true classes",
    )
    Config = FedNTDConfig

    def make_program(self) -> ClientProgram:
        return FedNTDProgram(self)


class FedNTDProgram(ObjectiveProgram):
    """L = CE(z_l, y) + beta L_NTD(z_l, z_g, y), z_g the broadcast model's logits."""

    def __init__(self, algorithm: FedNTD) -> None:
        super().__init__(algorithm, finish=weighted_upload(algorithm.config.weighting))
        self.config: FedNTDConfig = algorithm.config

    def regularized(self, message: Message) -> bool:
        return self.config.beta > 0

    def objective(self, fwd: Forward, batch: Batch, carry: Carry, shared: Shared) -> torch.Tensor:
        out = fwd.out
        cfg, teacher = self.config, shared["message"]
        z_global = teacher_logits(self.model, teacher["params"], teacher["buffers"], batch.x)
        return self.data_loss(out, batch) + cfg.beta * ntd_loss(
            out, z_global, batch.y, cfg.tau, batch.w
        )
