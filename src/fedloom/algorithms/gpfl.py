"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan, ICCV 2023, "GPFL: Simultaneously Learning
Global and Personalized Feature Information for Personalized Federated Learning",
arXiv:2308.10279, Section 4, Eq. 3-10): a conditional valve (CoV) makes a global and a
personalized feature out of the body's feature; global category embeddings (GCE) guide the
global one, the personalized head classifies the personalized one.

The model is the user's, split at the input h in R^D of its head (one ``nn.Linear``,
``FedModel.head_modules``), with modules beside it (:class:`GPFLModel`,
algorithms/feature_heads.py): the CoV (two branches gamma(.), beta(.), each
Linear(D, D) -> ReLU -> LayerNorm(D)), the GCE embedding table E (C x D) and client k's
personalized conditional input p_k (a buffer)::

    CoV(h, c)  = ReLU(h * (gamma(c) + 1) + beta(c))      # affine modulation, conditioned on c
    g          = 1/C sum_c E_c                           # the global conditional input
    p_k        = sum_c alpha_{k,c} E_c                   # alpha_k: client k's label shares
    f_G = CoV(h, g),  f_P = CoV(h, p_k),  y_hat = W^h_k f_P + b^h_k

    L_k = CE(y_hat, y)                                             # the personalized task
        + 1/|B| sum_i -log softmax_c(cos(f_G,i, E_c))[y_i]         # angle-level guidance
        + lamda ||F_G - E'_Y||_F                                   # magnitude-level guidance
        + mu/2 (||theta_CoV||^2 + ||E||^2)                         # as SGD's weight decay

with E' the received (frozen) embeddings, F_G the minibatch's f_G as rows and E'_Y their labels'
embeddings. One round::

    server -> client k: body, CoV, E
    client k: g, p_k from the received E (fixed for the round); SGD on body, CoV, E and its
              head W^h_k from [server's, own head] along L_k; upload body, CoV, E; keep W^h_k
    server:   body, CoV, E <- sum_k p_k (their uploads) / sum_k p_k

Choices, and where they come from (the authors' code, TsingZ0/GPFL ``clientgp`` / ``servergp``
and PFLlib's ``clientgpfl`` / ``servergpfl``):

- CoV and GCE are the code's modules (``CoV``: Linear -> ReLU -> LayerNorm per branch, the
  output ``ReLU(x * (gamma + 1) + beta)``; ``GCE``: ``nn.Embedding``, initialized N(0, 1), its
  loss the cross-entropy of the cosines between normalized features and normalized
  embeddings, no scale). The magnitude term is the code's ``torch.norm(feat_G - emb, 2)``: the
  Frobenius norm of the whole minibatch's difference, not a per-sample mean, so its scale
  grows with the batch size. Defaults ``lamda`` 0.01 and ``mu`` 0.1: the authors' script for
  4-layer CNNs and MLPs (0.0001 and 0 for ResNet-18).
- mu is the SGD weight decay of the CoV's and GCE's optimizers (added to their gradients, with
  ``train.optimizer: adamw`` too: an L2 term, not AdamW's decoupled decay); the body and the
  head take none.
- g and p_k are made from the embeddings the client receives (detached, fixed for the round;
  in the deployed model from the server's current ones). The code computes them from the
  client's own copy before the new one is set and starts from zero vectors; here they are the
  received embeddings' from the first round on. alpha_k: the label shares of the client's whole
  training set (the code's ``sample_per_class``).
- p_k: n_k / n (``weighting: samples``, the code's) or 1/K (``uniform``).
- Deployed model of client k: [server body, CoV, E; own head], f_P = CoV(h, p_k). A client that
  never trained gets the initial head (FedPer's: ``finetune_steps``, ``adaptation_keys``).

The local step is one client program (:class:`GPFLProgram`) that the sequential and the vmap
backends both run; sample-level DP is refused (the objective is GPFL's own).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.func import functional_call

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.feature_heads import (
    CONDITION,
    FeatureHeads,
    FeatureHeadsProgram,
    HeadBeside,
    call_module,
)
from fedloom.algorithms.fedper import FedPerConfig
from fedloom.core.protocol import ClientTask, Message
from fedloom.core.pytree import Tree
from fedloom.solvers import Batch, Carry, ClientProgram

EMBEDDING = "embedding.weight"
"""The GCE's table E (C x D) among the model's parameters."""


class GPFLConfig(FedPerConfig):
    lamda: float = Field(
        default=0.01, ge=0.0, description="weight of the magnitude-level guidance (authors: 0.01)"
    )
    mu: float = Field(
        default=0.1, ge=0.0, description="weight decay of the CoV and the GCE (authors: 0.1)"
    )


class Conditioner(nn.Module):
    """One branch of the CoV: Linear(D, D) -> ReLU -> LayerNorm(D) of a conditional input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.norm(F.relu(self.linear(c)))


def valve(h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """CoV's affine modulation of the features h: ReLU(h * (gamma + 1) + beta)."""
    return F.relu(h * (gamma + 1.0) + beta)


class GPFLModel(HeadBeside):
    """The user's model with the CoV (``gamma``, ``beta``) and the GCE (``embedding``) beside
    its head: ``route(h) = head(CoV(h, p_k))``, p_k the ``condition`` buffer."""

    def __init__(self, model: nn.Module, head: str) -> None:
        super().__init__(model, head)
        self.gamma = Conditioner(self.dim)
        self.beta = Conditioner(self.dim)
        self.embedding = nn.Embedding(self.num_classes, self.dim)

    def route(self, h: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        c = self.get_buffer(CONDITION)
        return F.linear(valve(h, self.gamma(c), self.beta(c)), head.weight, head.bias)


def guidance(f: torch.Tensor, y: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """The angle-level guidance, per sample: the cross-entropy of the cosines between each
    feature f_i and every embedding E_c (both L2-normalized) at the sample's label."""
    cosine = F.normalize(f, dim=-1) @ F.normalize(embeddings, dim=-1).T
    return F.cross_entropy(cosine, y, reduction="none")


def magnitude(f: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The magnitude-level guidance ||F - T||_F over the real samples (weights ``w`` in {0, 1})."""
    return torch.linalg.vector_norm((f - targets) * w[:, None].to(f.dtype))


class GPFL(FeatureHeads):
    name = "gpfl"
    summary = "GPFL: a conditional valve gives global (embedding-guided) and personalized features"
    Config = GPFLConfig
    Model = GPFLModel

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.decayed = tuple(
            k for k in ctx.model.param_keys if k.split(".")[0] in ("gamma", "beta", "embedding")
        )

    def condition(self, params: Tree, task: ClientTask) -> torch.Tensor:
        """p_k = sum_c alpha_{k,c} E_c, alpha_k the label shares of the client's training data."""
        table = params[EMBEDDING].detach()
        counts = torch.bincount(task.data.y_train, minlength=table.shape[0]).to(table.dtype)
        return counts @ table / counts.sum().clamp_min(1.0)

    def make_program(self) -> ClientProgram:
        return GPFLProgram(self)


class GPFLProgram(FeatureHeadsProgram):
    """SGD on L_k over every parameter (body, CoV, GCE, personalized head), with mu's weight
    decay on the CoV's and the GCE's; g and the frozen embeddings E' are the round's shared
    values (the received E)."""

    def __init__(self, algorithm: GPFL) -> None:
        super().__init__(algorithm, decayed=algorithm.decayed)
        self.config: GPFLConfig = algorithm.config

    def decay(self) -> float:
        return self.config.mu

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        frozen = message["params"][EMBEDDING].detach()
        return {**super().shared(message, task), "embeddings": frozen, "generic": frozen.mean(0)}

    def objective(
        self, params: Tree, buffers: Tree, batch: Batch, carry: Carry, shared: dict[str, Any]
    ) -> torch.Tensor:
        out, h = functional_call(
            self.module, (params, buffers), (batch.x,), {"with_features": True}
        )
        g = shared["generic"]
        gamma = call_module(self.module, "gamma", params, g)
        beta = call_module(self.module, "beta", params, g)
        f_global = valve(h, gamma, beta)
        loss = batch.mean(self.model.per_sample_loss(out, batch.y))
        loss = loss + batch.mean(guidance(f_global, batch.y, params[EMBEDDING]))
        if self.config.lamda > 0:
            targets = shared["embeddings"][batch.y]
            loss = loss + self.config.lamda * magnitude(f_global, targets, batch.w)
        return loss
