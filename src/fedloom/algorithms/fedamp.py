"""FedAMP, federated attentive message passing (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, AAAI
2021, "Personalized Cross-Silo Federated Learning on Non-IID Data", arXiv:2007.03797, Section 4,
Eq. 5-9, Algorithm 1; the heuristic HeurFedAMP of Section 5).

Every client i trains a personalized model w_i of the problem (Eq. 5)::

    min_W  G(W) = sum_i F_i(w_i) + lamda sum_{i<j} A(||w_i - w_j||^2)

with the attention-inducing A(x) = 1 - exp(-x / sigma). The server keeps every client's
latest w_j (algorithms/peers.py). One round, alternating a message-passing gradient step on the
attention term with a proximal step on the clients' losses::

    server:   u_i = sum_j xi_ij w_j  for every client i                  # Eq. 6-8, aggregate
              xi_ij = alpha_k A'(||w_i - w_j||^2) = alpha_k exp(-||w_i - w_j||^2 / sigma) / sigma
              (j != i),  xi_ii = 1 - sum_{j != i} xi_ij
    client i: downloads u_i, and from its own w_i takes the round's SGD steps on
              F_i(w) + lamda / (2 alpha_k) ||w - u_i||^2                    # Eq. 9
              keeps w_i and uploads it

``attention: cosine`` is HeurFedAMP (Section 5), for deep models whose Euclidean distances say
little: xi_ij = alpha_k exp(sigma cos(w_i, w_j)) / sum_{h != i} exp(sigma cos(w_i, w_h)) for
j != i and xi_ii = 1 - alpha_k: the paper's self-attention hyperparameter xi_ii is 1 - alpha_k
here, so that one key says how much of u_i comes from the other clients (at most 1). The
paper's exponential A' (``attention: exp``) is also PFLlib's; PFLlib's proximal term is
lamda / (2 alpha_k) ||w - u_i|| without the square, this module's is the paper's square.

alpha_k = 0 sends no messages: xi = I, u_i = w_i, and the proximal step Eq. 9 is replaced by
the plain local step (the proximal coefficient lamda / alpha_k is taken as 0, not as its limit,
which would freeze every model), so FedAMP with alpha_k = 0 is local training exactly.

The exponential attention needs alpha_k small enough that xi_ii >= 0 (the paper's condition
on alpha_k; it holds for every distance when alpha_k (m - 1) <= sigma). It is not enforced:
with PFLlib's defaults and many similar clients xi_ii goes negative, u_i extrapolates, and
small differences grow from round to round (executors that agree to 1e-4 under FedAvg drift
apart by 1e-2 in three rounds of batch-10 Fashion-MNIST). summary.json's extras report the
smallest xi_ii of the run (``min_self_weight``).

The cloud models u_i are computed for all m training clients from their latest models after
each round's uploads; only clients that have uploaded pass messages (the sums over j run over
them): a client never sampled holds the common initialization, and m - 1 such identical
copies, each at attention alpha_k A'(0) = alpha_k / sigma, would swamp xi_ii. The
round's message holds the table; each client reads its own row (its index is in its state),
and ``download_bytes`` counts one model a client. Only parameters travel; buffers stay on the
clients. Defaults are PFLlib's: alpha_k = lamda = sigma = 1. Deployment: w_i. A held-out new
client starts from the mean of the clients' latest models.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.peers import (
    flat_rows,
    model_table,
    row,
    table_mean,
    training_clients,
    with_uploads,
)
from fedloom.algorithms.sgd_program import PlainSGDProgram, own_model
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class FedAMPConfig(AlgorithmConfig):
    alpha_k: float = Field(
        default=1.0, ge=0.0, description="message-passing step alpha_k (0: local training)"
    )
    lamda: float = Field(
        default=1.0, ge=0.0, description="lambda of Eq. 5; proximal coefficient lamda / alpha_k"
    )
    sigma: float = Field(default=1.0, gt=0.0, description="scale of the attention function")
    attention: Literal["exp", "cosine"] = Field(
        default="exp", description="exp: A' of Section 4; cosine: HeurFedAMP (Section 5)"
    )

    @model_validator(mode="after")
    def _self_weight(self) -> FedAMPConfig:
        if self.attention == "cosine" and self.alpha_k > 1.0:
            raise ValueError(
                f"alpha_k is the other clients' share of u_i under attention: cosine, at most 1 "
                f"(got {self.alpha_k})"
            )
        return self


def attention_matrix(
    flat: torch.Tensor, cfg: FedAMPConfig, senders: torch.Tensor | None = None
) -> torch.Tensor:
    """xi (m x m, rows sum to 1) of the module docstring from the clients' flat models; only
    the ``senders`` (a boolean mask; None: all) pass messages to the others."""
    m = flat.shape[0]
    w = flat.double()
    eye = torch.eye(m, dtype=torch.float64, device=w.device)
    off = ~eye.bool()
    if senders is not None:
        off = off & senders.view(1, -1)
    if m == 1 or cfg.alpha_k == 0.0 or not bool(off.any()):
        return eye
    if cfg.attention == "exp":
        dist = torch.stack([((w - w[i]) ** 2).sum(dim=1) for i in range(m)])
        xi = cfg.alpha_k * torch.exp(-dist / cfg.sigma) / cfg.sigma
    else:
        unit = w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)
        logits = (cfg.sigma * unit @ unit.T).masked_fill(~off, -torch.inf)
        has = off.any(dim=1, keepdim=True)  # a row without senders: no message
        xi = cfg.alpha_k * torch.softmax(logits.masked_fill(~has, 0.0), dim=1)
    xi = xi * off
    return xi + torch.diag(1.0 - xi.sum(dim=1))


def cloud_models(
    models: Tree, cfg: FedAMPConfig, senders: torch.Tensor | None = None
) -> tuple[Tree, float]:
    """u_i = sum_j xi_ij w_j for every client, as a table (computed in float64), and the
    smallest self weight xi_ii (negative: alpha_k too large for the paper's condition)."""
    xi = attention_matrix(flat_rows(models), cfg, senders)
    m = xi.shape[0]
    cloud = {
        k: (xi @ v.reshape(m, -1).double()).to(v.dtype).reshape(v.shape) for k, v in models.items()
    }
    return cloud, float(xi.diagonal().min())


class FedAMP(Algorithm):
    name = "fedamp"
    summary = "FedAMP: clients proximal to attention-weighted cloud models of peers (Huang et al.)"
    Config = FedAMPConfig
    capabilities = Capabilities(has_global_model=False)
    wire = Wire(rows={"cloud": 1})

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.m = training_clients(ctx, self.name)

    def proximal_coefficient(self) -> float:
        """lamda / alpha_k of Eq. 9; 0 when alpha_k = 0 (no message passing: local training)."""
        cfg = self.config
        return cfg.lamda / cfg.alpha_k if cfg.alpha_k > 0 else 0.0

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        models = model_table(params, self.m)
        return {
            "params": params,  # the common initialization
            "buffers": buffers,
            "models": models,
            "cloud": clone(models),
            "uploaded": torch.zeros(self.m, dtype=torch.bool),
            "self_weight": torch.tensor(1.0, dtype=torch.float64),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"cloud": server["cloud"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        models = with_uploads(server["models"], results)
        uploaded = server["uploaded"].clone()
        uploaded[[r.client_id for r in results]] = True
        cloud, least = cloud_models(models, self.config, uploaded)
        self_weight = torch.tensor(least, dtype=torch.float64)
        return {
            **server,
            "models": models,
            "cloud": cloud,
            "uploaded": uploaded,
            "self_weight": torch.minimum(server["self_weight"], self_weight),
        }

    def summary_extras(self, server: State) -> dict[str, Any]:
        """summary.json extras: the smallest self weight xi_ii of any round (below 0, the
        message passing extrapolated: alpha_k too large for the paper's condition)."""
        return {"min_self_weight": float(server["self_weight"])}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        models = server["models"]
        params = row(models, client_id) if client_id < self.m else table_mean(models)
        return {
            "params": clone(params),
            "buffers": clone(server["buffers"]),
            "index": torch.tensor(client_id, dtype=torch.int64),
        }

    def make_program(self) -> ClientProgram:
        """Local SGD of the client's own w_i, pulled toward u_i (no pull when alpha_k = 0)."""
        pulled = self.proximal_coefficient() > 0
        return PlainSGDProgram(
            self,
            start=own_model,
            correction=self.local_correction if pulled else None,
            finish=self.local_finish,
        )

    def local_correction(self, params: Tree, message: Message, state: State | None) -> Tree:
        """lamda / alpha_k (w - u_i), u_i the row ``state['index']`` of the broadcast table
        (pure, so it vmaps over clients)."""
        assert state is not None
        coef, cloud, i = self.proximal_coefficient(), message["cloud"], state["index"]
        return {k: coef * (params[k] - cloud[k][i]) for k in params}

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        assert state is not None
        new_state = {"params": solved.params, "buffers": solved.buffers, "index": state["index"]}
        return ClientResult(
            {"params": solved.params}, task.data.num_train, solved.loss, state=new_state
        )

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state or self.init_client_state(server, task.client_id)
        return state["params"], state["buffers"]
