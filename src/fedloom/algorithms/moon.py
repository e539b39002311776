"""MOON (Li, He, Song, CVPR 2021, "Model-Contrastive Federated Learning", arXiv:2103.16257,
Section 3, Eq. (3)-(4), Algorithm 1): a regularizer in representation space.

FedAvg whose local objective adds a contrastive term on the representation z (the input of the
model's head, :func:`fedloom.solvers.objective_sgd.single_head`): the representation of the
model being trained is pulled towards the one of the global model received this round and
pushed away from the one of the client's own model of its previous round. One round::

    server sends w^t (the global model)
    client k:  SGD from w^t on, per minibatch B,
                 L = CE(f(x; w), y) + mu * l_con                                  # Eq. (4)
                 l_con = 1/|B| sum_{n in B} -log( exp(sim(z, z_glob) / tau)
                         / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )   # Eq. (3)
               z = z(x_n; w), z_glob = z(x_n; w^t), z_prev = z(x_n; w_k^{t-1}),
               sim the cosine similarity; w^t and w_k^{t-1} frozen (no gradient, evaluation
               mode: BatchNorm's running statistics, so neither model is modified)
               keep w_k^t (the next round's w_k^{t-1}), upload w_k^t
    server:    w^{t+1} <- sum_k p_k w_k^t / sum_k p_k        # FedAvg (``aggregate_models``)

with p_k = n_k (``weighting: samples``, FedAvg's and the paper's, the default) or 1
(``uniform``). ``mu`` defaults to 1 (PFLlib's default; the paper uses 5 on CIFAR-10, 1 on
CIFAR-100 and Tiny-ImageNet), ``tau`` to 0.5 (the paper's). mu = 0 is FedAvg, bit for bit.

The previous local model w_k^{t-1} is the client's state. A client's state starts as the global
model of its first round, so in that round z_prev = z_glob and l_con is the constant log 2 with
zero gradient: the paper's code (github.com/QinbinLi/MOON) likewise has no negative in the first
round (its pool of previous models is empty). The projection head of the paper's networks is
not added: z is the representation the model's own head classifies. The global model is
deployed and serves new clients, as FedAvg's.

The local step is a client program (:class:`MOONProgram`, algorithms/objective.py) that the
sequential and the vmap backends both run; w^t is the round's broadcast model, shared by every
client of a chunk, w_k^{t-1} rides in each client's carry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.objective import Forward, ObjectiveProgram, Shared, model_result
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.functional import FunctionalModel, evaluation_mode
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.errors import ConfigError
from fedloom.solvers.local import LocalSolution
from fedloom.solvers.objective_sgd import single_head
from fedloom.solvers.program import Batch, Carry, ClientProgram


class MOONConfig(AlgorithmConfig):
    mu: float = Field(
        default=1.0, ge=0.0, description="weight of the contrastive loss (paper: 5 on CIFAR-10)"
    )
    tau: float = Field(default=0.5, gt=0.0, description="temperature of Eq. (3) (paper: 0.5)")
    weighting: Weighting = weighting_field("samples", "model averaging weights (FedAvg: samples)")


def contrastive_loss(
    z: torch.Tensor,
    z_glob: torch.Tensor,
    z_prev: torch.Tensor,
    tau: float,
    w: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. (3) averaged over the batch: -log(e^{s_g} / (e^{s_g} + e^{s_p})) with s_g =
    cos(z, z_glob) / tau, s_p = cos(z, z_prev) / tau, i.e. log(1 + e^{s_p - s_g}); ``w``: the
    sample weights of a padded batch (None: all real)."""
    z, z_glob, z_prev = (v.flatten(1) for v in (z, z_glob, z_prev))  # one vector a sample
    s_glob = F.cosine_similarity(z, z_glob, dim=-1) / tau
    s_prev = F.cosine_similarity(z, z_prev, dim=-1) / tau
    per = F.softplus(s_prev - s_glob)
    if w is None:
        return per.mean()
    return (per * w).sum() / w.sum().clamp_min(1.0)


@torch.no_grad()
def frozen_features(
    model: FunctionalModel, params: Tree, buffers: Tree, x: torch.Tensor, head: str
) -> torch.Tensor:
    """The head's input h(x) of (params, buffers) in evaluation mode, without gradient."""
    with evaluation_mode(model.module):
        return model.forward_with_features(params, buffers, x, head)[1]


class MOON(FedAvg):
    name = "moon"
    summary = "MOON: FedAvg with a model-contrastive loss on the representation"
    capabilities = FedAvg.capabilities.but(
        supports_sample_dp=False,  # its own contrastive objective
    )
    Config = MOONConfig

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head = single_head(ctx.model, self.name)
        head = {k for k in ctx.model.param_keys if k.startswith(self.head + ".")}
        if not set(ctx.model.param_keys) - head:
            raise ConfigError(
                f"algorithm.name: moon contrasts the representation the model's body computes, "
                f"and {type(ctx.model.module).__name__} has no body (no parameters outside its "
                "head); use e.g. model.name: mlp or cnn4"
            )

    def init_client_state(self, server: State, client_id: int) -> State:
        """w_k^{t-1} before the client's first round: the global model (no negative yet)."""
        return {"params": clone(server["params"]), "buffers": clone(server["buffers"])}

    def make_program(self) -> ClientProgram:
        return MOONProgram(self)


class MOONProgram(ObjectiveProgram):
    """L = CE(f(x; w), y) + mu l_con(z, z_glob, z_prev): Eq. (4)."""

    def __init__(self, algorithm: MOON) -> None:
        super().__init__(algorithm, algorithm.head, finish=self.keep_model)
        self.config: MOONConfig = algorithm.config

    def regularized(self, message: Message) -> bool:
        return self.config.mu > 0

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        carry = super().init(message, state, task)
        assert state is not None
        carry["previous"] = {"params": state["params"], "buffers": state["buffers"]}
        return carry

    def keep_model(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """Upload w_k^t weighted by ``weighting``, keep it as the next round's w_k^{t-1}."""
        result = model_result(task, solved, self.config.weighting)
        result.state = {"params": solved.params, "buffers": clone(solved.buffers)}
        return result

    def objective(self, fwd: Forward, batch: Batch, carry: Carry, shared: Shared) -> torch.Tensor:
        assert fwd.h is not None and self.head is not None
        glob, previous = shared["message"], carry["previous"]
        z_glob = frozen_features(self.model, glob["params"], glob["buffers"], batch.x, self.head)
        z_prev = frozen_features(
            self.model, previous["params"], previous["buffers"], batch.x, self.head
        )
        con = contrastive_loss(fwd.h, z_glob, z_prev, self.config.tau, batch.w)
        return self.data_loss(fwd.out, batch) + self.config.mu * con
