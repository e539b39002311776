"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, NeurIPS 2021, "Federated Multi-Task Learning
under a Mixture of Distributions", arXiv:2108.10252, Algorithms 1 and 2, (7)-(9)).

Every client's data is a mixture of M shared underlying distributions: M component models
theta_1..theta_M are shared by all clients, each client k keeps its own mixture weights
pi_k, and predicts with the pi_k-mixture of the components' class probabilities. One round
(Algorithm 2)::

    client k, from theta^{t-1} and its pi_k^{t-1}:
        E-step (7):  q_k(z_i = m) <- pi_km^{t-1} exp(-l(theta_m^{t-1}; x_i, y_i)) / normalizer
        M-step (8):  pi_km^t <- 1/n_k sum_i q_k(z_i = m)                  # over its training data
        (9), each m: theta_m <- local SGD from theta_m^{t-1} on
                     1/|B| sum_{i in B} q_k(z_i = m) l(theta_m; x_i, y_i)
        upload theta_1..theta_M
    server:     theta_m^t <- sum_k n_k theta_m^k / sum_k n_k          # each component averaged

The model is :class:`fedloom.models.mixture.MixtureModel` around the configured one (the
algorithm's ``model_for``): parameters ``components.<m>.<key>`` and the buffer ``log_pi``,
whose output log sum_m pi_m softmax(f_m(x)) is the mixture's prediction, so evaluation,
serving-side metrics and the cold start see the mixture. The M components train as one
parameter set (the gradient of sum_m 1/|B| sum_i q_im l_im with respect to theta_m is (9)'s),
and the server's FedAvg average of that set averages each component.

- pi_k is the client's state (``log_pi``, uniform 1/M at the start); M-step (8) uses q over the
  whole training set (evaluation mode, at the start of the round); the weights q of (9) are
  recomputed on each minibatch from theta^{t-1} and pi^{t-1} (the same values for models
  without batch statistics; with BatchNorm the minibatch's, in training mode).
- A client deploys the server's components with its own pi_k; a held-out new client the
  uniform mixture (and the cold start fine-tunes from it).
- ``weighting``: n_k (``samples``, Algorithm 2's n_k / n, the default) or 1 (``uniform``).
- M = 1: q = 1 and FedEM is FedAvg (the same models, up to float rounding).

Classification only; not with sample-level DP (the E-step reads the training data in the clear
and the local objective is weighted by it), client-level DP, secure aggregation or asynchrony
(the server step is not declared a FedAvg average, ``averages_client_models``), nor with the
exported models' loader (``fedloom.serving``, which rebuilds the configured model).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call

from fedloom.algorithms.base import Algorithm, AlgorithmConfig
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.algorithms.weights import Weighting, aggregation_weight, weighting_field
from fedloom.core.functional import evaluation_mode
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.models.base import FedModel
from fedloom.models.mixture import LOG_PI, MixtureModel
from fedloom.solvers import Batch, Carry, ClientProgram, ClientRun, Ops
from fedloom.solvers.adamw import MOMENTS
from fedloom.solvers.program import weighted_mean


class FedEMConfig(AlgorithmConfig):
    num_components: int = Field(
        default=3, ge=1, description="M, the shared component models (paper: 3)"
    )
    weighting: Weighting = weighting_field("samples", "component averaging weights")


def without_pi(buffers: Tree) -> Tree:
    """The components' buffers (BatchNorm statistics), without the mixture weights."""
    return {k: v for k, v in buffers.items() if k != LOG_PI}


class FedEM(Algorithm):
    name = "fedem"
    summary = "FedEM: M shared components, per-client mixture weights by EM (Marfoq et al.)"
    Config = FedEMConfig
    capabilities = Capabilities(
        has_global_model=False,
        classification_only="a mixture of class probabilities",
    )

    @classmethod
    def model_for(cls, module: FedModel, config: AlgorithmConfig) -> FedModel:
        assert isinstance(config, FedEMConfig)
        return MixtureModel(module, config.num_components)

    def init_client_state(self, server: State, client_id: int) -> State:
        return {LOG_PI: server["buffers"][LOG_PI].clone()}  # uniform 1/M

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        weights = [r.weight for r in results]
        params = self.ctx.aggregate([r.upload["params"] for r in results], weights)
        buffers = dict(server["buffers"])
        if results[0].upload["buffers"]:
            buffers |= self.ctx.aggregate([r.upload["buffers"] for r in results], weights)
        return {"params": params, "buffers": buffers}

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        assert state is not None
        return server["params"], {**server["buffers"], LOG_PI: state[LOG_PI]}

    def make_program(self) -> ClientProgram:
        return FedEMProgram(self)


def component_losses(
    module: FedModel, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """l(theta_m; x_i, y_i) of every component m and sample i, shape (M, batch): cross-entropy
    of each component's logits (the forward updates ``buffers`` in training mode)."""
    logits = functional_call(module, (params, buffers), (x,), {"components": True})
    m, b, c = logits.shape
    target = y.unsqueeze(0).expand(m, b).reshape(-1)
    return F.cross_entropy(logits.reshape(m * b, c), target, reduction="none").reshape(m, b)


def posterior(log_pi: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """E-step (7): q(z_i = m) proportional to pi_m exp(-l_m(x_i, y_i)), shape (M, batch)."""
    return torch.softmax(log_pi[:, None] - losses, dim=0)


@torch.no_grad()
def mixture_weights(
    module: FedModel, params: Tree, buffers: Tree, log_pi: torch.Tensor, data: ClientData
) -> torch.Tensor:
    """M-step (8): log pi_m = log of the mean over the client's training data of q(z_i = m),
    q from the components ``params`` and the previous ``log_pi`` (evaluation mode)."""
    if not data.num_train:
        return log_pi
    total = torch.zeros_like(log_pi, dtype=torch.float64)
    with evaluation_mode(module):
        for start in range(0, data.num_train, 1024):
            x, y = data.x_train[start : start + 1024], data.y_train[start : start + 1024]
            q = posterior(log_pi, component_losses(module, params, buffers, x, y))
            total += q.double().sum(dim=1)
    return (total / data.num_train).log().to(log_pi.dtype)


class FedEMProgram(SGDProgram):
    """The E- and M-steps in ``init`` (one client, in Python), the q-weighted SGD step of (9)
    on all components at once (both backends), the components up and pi_k kept in
    ``finish``."""

    private_step = False  # the E-step and the weighted objective read the data in the clear

    def __init__(self, algorithm: FedEM) -> None:
        super().__init__(algorithm)
        self.fedem = algorithm

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        carry = super().init(message, state, task)
        previous = state[LOG_PI]
        carry["log_pi"] = previous
        carry["new_log_pi"] = mixture_weights(
            self.model.module, message["params"], message["buffers"], previous, task.data
        )
        return carry

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        module, start = self.model.module, shared["message"]
        # a throwaway copy of buffers for the E-step's forward (training mode normalizes by the
        # minibatch's statistics, whatever the running ones hold)
        spare = {k: b.clone() for k, b in carry["buffers"].items()}
        before = component_losses(module, start["params"], spare, batch.x, batch.y)
        q = posterior(carry["log_pi"], before).detach()

        def objective(
            params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            losses = component_losses(module, params, buffers, x, y)
            return weighted_mean((q * losses).sum(dim=0), batch.w)

        # the buffers go in as an argument: BatchNorm updates them in place under the transform
        grads, loss = ops.value_and_grad(
            objective, carry["params"], carry["buffers"], batch.x, batch.y
        )
        return self.descend(ops, carry, grads, shared["lr"]), {"loss": loss}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        carry = run.carry
        upload = {"params": carry["params"], "buffers": without_pi(carry["buffers"])}
        weight = aggregation_weight(self.fedem.config.weighting, task.data.num_train)
        result = ClientResult(
            upload, weight, run.metric(self.STEP), state={LOG_PI: carry["new_log_pi"]}
        )
        return self.keep_moments(result, state, carry.get(MOMENTS))
