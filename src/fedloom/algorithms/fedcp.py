"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma, Guan, KDD 2023, "FedCP: Separating Feature Information
for Personalized Federated Learning via Conditional Policy", arXiv:2307.01217, Section 4,
Eq. 3-9, Algorithm 1): a conditional policy network (CPN) splits each sample's feature h into a
global part, for a global head, and a personalized part, for a personalized head.

The model is the user's, split at the input h in R^D of its head (one ``nn.Linear``,
``FedModel.head_modules``), with three modules beside it (:class:`FedCPModel`,
algorithms/feature_heads.py): the CPN Theta, a global head W^hg (a second ``nn.Linear`` D -> C)
and client k's conditioning vector v_k (a buffer). For a sample x::

    h      = f(x; W^fe)                                  # the body: feature extractor
    v_k    = normalize(1^T W^hp_k)                       # client-specific: its head's columns
    a      = ReLU(LN(Linear_{D -> 2D}(h * v_k)))         # Theta; (2, D) after a reshape
    (s, r) = softmax_over_2((a + g) / tau)               # g: Gumbel noise (training only)
    y_hat  = W^hp_k (h * s) + b^hp_k + W^hg (h * r) + b^hg       # r + s = 1 elementwise

One round::

    server -> client k: W^fe, Theta, W^hg
    client k: v_k from its head at the round's start (fixed for the round)
              SGD on W^fe, Theta, W^hp_k (W^hg frozen) from [server's, own head] along
                  L_k = CE(y_hat, y) + lamda * MMD^2(f(x_B; W^fe), f(x_B; W^fe_server))
              upload W^fe, Theta and 1/2 (W^hp_k + W^hg); keep W^hp_k
    server:   W^fe, Theta, W^hg <- sum_k p_k (their uploads) / sum_k p_k

Choices, and where they come from (the authors' code: TsingZ0/FedCP and PFLlib's ``clientcp``,
``servercp``):

- CPN: ``ConditionalSelection``: Linear(D, 2D) -> LayerNorm(2D) -> ReLU, reshaped (n, 2, D),
  ``gumbel_softmax`` over the two routes with tau = 1, soft; route 0 is the personalized one
  (s), route 1 the global one (r). Its input is h * v_k (the code's ``gate_in = rep *
  context``), v_k the L2-normalized column sums of the personalized head's weight (PFLlib's
  ``set_head_g``; the authors' repository later used |W^hp - W^hg| instead), taken from the head
  as the round starts and, in the deployed model, from the deployed head. The code's first
  context is random (``torch.rand``); here it is the initial head's, like every later one.
- Gumbel noise: drawn for every local step in ``init`` from the client's stream (seed, 'fedcp',
  round, client), one (2, D) table per sample, outside the vmapped step (``gumbel: false`` drops
  it: the plain softmax of a / tau). The deployed model uses the noise-free policy (the code
  draws noise at test time too; fedloom's evaluation is deterministic).
- MMD: the code's biased estimate with a sum of RBF kernels, k(a, b) = sum_{s in (10, 15, 20, 50)}
  exp(-||a - b||^2 / (2 s)), over the minibatch's features of the local and of the received
  (frozen) feature extractor: mean_{i,j} [k(h_i, h_j) + k(h'_i, h'_j) - 2 k(h_i, h'_j)]. ``lamda``:
  the authors' script's 5 (PFLlib's key name).
- Heads: the global head starts as a copy of the model's head (``copy.deepcopy(model.head)``) and
  is frozen on the client; what a client uploads for it is 1/2 (W^hp_k + W^hg)
  (``generate_upload_head``), so the server's new global head is 1/2 W^hg + 1/2 sum_k p_k W^hp_k.
  The personalized head never leaves the client.
- p_k: n_k / n (``weighting: samples``, the code's) or 1/K (``uniform``).
- Deployed model of client k: [server W^fe, Theta, W^hg; own W^hp_k, v_k]. A client that never
  trained (a held-out new client) gets the initial head (FedPer's: ``finetune_steps`` > 0
  fine-tunes it first, the cold-start evaluation fine-tunes it, ``adaptation_keys``).

The local step is one client program (:class:`FedCPProgram`) that the sequential and the vmap
backends both run; sample-level DP is refused (the objective is FedCP's own).
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
    INNER,
    FeatureHeads,
    FeatureHeadsProgram,
    HeadBeside,
    wrap,
)
from fedloom.algorithms.fedgen import at_step
from fedloom.algorithms.fedper import FedPerConfig
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.core.rng import generator
from fedloom.models.base import FedModel
from fedloom.solvers import Batch, Carry, ClientProgram, CoveringPlans
from fedloom.solvers.local import LocalSolution

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
"""The RBF kernel's scales s of the code's MMD, k = sum_s exp(-d^2 / (2 s))."""

HEAD_MIX = 0.5
"""The uploaded global head: HEAD_MIX W^hp_k + (1 - HEAD_MIX) W^hg (the code's 1/2, 1/2)."""


class FedCPConfig(FedPerConfig):
    lamda: float = Field(
        default=5.0,
        ge=0.0,
        description="weight of the MMD between the local and global extractor (authors: 5)",
    )
    tau: float = Field(default=1.0, gt=0.0, description="temperature of the policy's softmax")
    gumbel: bool = Field(
        default=True, description="Gumbel noise in the policy during local training (code)"
    )


def kernel_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, m) matrix of sum_s exp(-||a_i - b_j||^2 / (2 s)) over ``BANDWIDTHS``; the squared
    distances expanded as the code does (||a||^2 + ||b||^2 - 2 a.b)."""
    d = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None, :] - 2.0 * a @ b.T
    return sum(torch.exp(-0.5 * d / s) for s in BANDWIDTHS)  # type: ignore[return-value]


def mmd(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """The biased MMD^2 estimate between the rows of ``x`` and ``y`` (n, D), paired samples,
    over the real ones (``w``: a padded batch's sample weights; None: all):
    sum_ij w_i w_j [k(x_i, x_j) + k(y_i, y_j) - 2 k(x_i, y_j)] / (sum_i w_i)^2."""
    w = torch.ones(x.shape[0], dtype=x.dtype, device=x.device) if w is None else w.to(x.dtype)
    pairs = w[:, None] * w[None, :]
    terms = kernel_sum(x, x) + kernel_sum(y, y) - 2.0 * kernel_sum(x, y)
    return (terms * pairs).sum() / pairs.sum().clamp_min(1.0)


class ConditionalPolicy(nn.Module):
    """The CPN: Linear(D, 2D) -> LayerNorm(2D) -> ReLU, read as (2, D) logits a per sample,
    whose softmax over the two routes, (a + noise) / tau, is the policy (s, r)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)

    def forward(
        self, c: torch.Tensor, noise: torch.Tensor | None = None, tau: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.relu(self.norm(self.linear(c))).unflatten(-1, (2, self.dim))
        if noise is not None:
            logits = logits + noise
        policy = torch.softmax(logits / tau, dim=-2)
        return policy[..., 0, :], policy[..., 1, :]


class FedCPModel(HeadBeside):
    """The user's model with the CPN (``policy``) and the global head (``global_head``) beside
    its head: ``route(h) = head(h * s) + global_head(h * r)``, (s, r) = policy(h * v_k)."""

    def __init__(self, model: nn.Module, head: str, tau: float = 1.0) -> None:
        super().__init__(model, head)
        self.tau = tau
        self.policy = ConditionalPolicy(self.dim)
        bias = model.get_submodule(head).bias is not None
        self.global_head = nn.Linear(self.dim, self.num_classes, bias=bias)  # the head's copy

    def route(
        self, h: torch.Tensor, head: nn.Linear, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        s, r = self.policy(h * self.get_buffer(CONDITION), noise, self.tau)
        return F.linear(h * s, head.weight, head.bias) + self.global_head(h * r)


class FedCP(FeatureHeads):
    name = "fedcp"
    summary = "FedCP: a conditional policy splits each feature between a global and a personal head"
    Config = FedCPConfig
    Model = FedCPModel

    @classmethod
    def model_for(cls, module: FedModel, config: AlgorithmConfig) -> FedModel:
        assert isinstance(config, FedCPConfig)
        return wrap(cls.Model, module, cls.name, tau=config.tau)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        head = ("weight", "bias")[: len(self.head_keys)]
        self.global_keys = tuple(f"global_head.{k}" for k in head)

    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        """The global head starts as a copy of the model's initial head (the code's deepcopy)."""
        pairs = zip(self.global_keys, self.head_keys, strict=True)
        copied = {g: params[h].clone() for g, h in pairs}
        return super().init_server_state({**params, **copied}, buffers)

    def condition(self, params: Tree, task: ClientTask) -> torch.Tensor:
        """v_k = normalize(1^T W^hp_k): the column sums of the personalized head's weight."""
        return F.normalize(params[self.head_keys[0]].detach().sum(dim=0), dim=0)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """FedPer's (body, CPN and global head up, personalized head kept), the global head's
        upload being HEAD_MIX W^hp_k + (1 - HEAD_MIX) W^hg."""
        result = super().local_finish(message, state, task, solved)
        mixed = {
            g: HEAD_MIX * solved.params[h] + (1.0 - HEAD_MIX) * solved.params[g]
            for g, h in zip(self.global_keys, self.head_keys, strict=True)
        }
        result.upload = {**result.upload, "params": {**result.upload["params"], **mixed}}
        return result

    def make_program(self) -> ClientProgram:
        return FedCPProgram(self)


KEY = "fedcp"
"""The carry's key of the Gumbel noise table and the step counter."""


class FedCPProgram(CoveringPlans, FeatureHeadsProgram):
    """SGD on CE(y_hat, y) + lamda MMD^2 over the body, the CPN and the personalized head, the
    global head frozen. The Gumbel noise of step s sits in row s of a (steps, width, 2, D)
    table in the carry, zero-padded to the round's longest and widest plan
    (:class:`CoveringPlans`), with a step counter; each step's draws take exactly its minibatch
    size from the stream, whatever the padding."""

    def __init__(self, algorithm: FedCP) -> None:
        super().__init__(algorithm, frozen=algorithm.global_keys)
        self.config: FedCPConfig = algorithm.config

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        carry = super().init(message, state, task)
        if self.config.gumbel:
            dtype = carry["params"][self.algorithm.head_keys[0]].dtype
            carry[KEY] = {
                "noise": self.draws(task, dtype),
                "step": torch.zeros((), dtype=torch.long),
            }
        return carry

    def draws(self, task: ClientTask, dtype: torch.dtype) -> torch.Tensor:
        """Standard Gumbel noise -log(E), E ~ Exp(1), (n_s, 2, D) for every local step s, from
        the stream (seed, 'fedcp', round, client) in step order."""
        plan = self.algorithm.client_plan(task)
        steps, width = self.extent.covering(task.round, plan)
        dim = self.module.dim
        stream = generator(self.seed, "fedcp", task.round, task.client_id)
        table = torch.zeros(steps, width, 2, dim, dtype=dtype)
        for s, idx in enumerate(plan):
            n = idx.shape[0]
            exp = torch.empty(n, 2, dim, dtype=torch.float64).exponential_(generator=stream)
            table[s, :n] = -exp.log().to(dtype)
        return table

    def objective(
        self, params: Tree, buffers: Tree, batch: Batch, carry: Carry, shared: dict[str, Any]
    ) -> torch.Tensor:
        cfg = self.config
        noise = None
        if KEY in carry:
            own = carry[KEY]
            noise = at_step(own["noise"], own["step"])[: batch.y.shape[0]]  # padded under vmap
        out, h = functional_call(
            self.module, (params, buffers), (batch.x,), {"with_features": True, "noise": noise}
        )
        loss = batch.mean(self.model.per_sample_loss(out, batch.y))
        if cfg.lamda > 0:
            sent = shared["message"]["params"]
            extractor = {k: v for k, v in sent.items() if k.startswith(INNER)}  # frozen
            spare = clone(buffers)  # the second pass must not move BatchNorm statistics
            h_global = functional_call(
                self.module, ({**params, **extractor}, spare), (batch.x,), {"features_only": True}
            )
            loss = loss + cfg.lamda * mmd(h, h_global, batch.w)
        return loss

    def advance(self, new: Carry, carry: Carry) -> Carry:
        if KEY in carry:
            new[KEY] = {**carry[KEY], "step": carry[KEY]["step"] + 1}
        return new
