"""FedReptile: Reptile (Nichol, Achiam, Schulman, 2018, "On First-Order Meta-Learning
Algorithms", arXiv:1803.02999) made federated (Algorithm 2 of
the paper, its batched Reptile, with the K tasks read as the clients): each client trains T steps
from theta to phi_k, and the server updates theta <- theta + epsilon 1/K sum_k (phi_k - theta).

One round::

    server sends theta                                       # FedAvg's downlink
    client k: phi_k <- T SGD steps from theta at train.lr    # the engine's shared local solver
                                                             # (vectorized; stragglers: fewer)
    upload phi_k
    server: theta <- theta + epsilon sum_{k in S} p_k (phi_k - theta)
            p_k = 1/|S| (weighting: uniform, Reptile's 1/K) or n_k / sum_S n_j (samples)

The server step is FedAvgM's with momentum 0 and server_lr = epsilon (the shared
:class:`fedloom.algorithms.fedopt.ServerOptimizer`: Delta = ctx.aggregate({phi_k}) - theta, so a
robust aggregation rule plugs in; the step in float64). epsilon = 1 is FedAvg with uniform
weights; epsilon < 1 interpolates between theta and the clients' mean. BatchNorm buffers are
averaged as in FedAvg.

Deployment (:mod:`fedloom.algorithms.meta`): every client serves theta after ``adapt_steps`` SGD
steps at train.lr on its own training data; cold-start clients start at theta. Reptile keeps
no client state.
"""

from __future__ import annotations

from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig
from fedloom.algorithms.fedopt import ServerOptimizer, Slots
from fedloom.algorithms.meta import AdaptedDeployment, adapt_steps_field
from fedloom.algorithms.sgd_program import PlainSGDProgram, upload_model
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class ReptileConfig(AlgorithmConfig):
    epsilon: float = Field(
        default=1.0, gt=0.0, description="outer step epsilon: theta += epsilon mean(phi - theta)"
    )
    weighting: Weighting = weighting_field("uniform", "server mean over S (Reptile: uniform 1/K)")
    adapt_steps: int = adapt_steps_field()

    @property
    def server_lr(self) -> float:
        """ServerOptimizer's step size: epsilon."""
        return self.epsilon


class Reptile(AdaptedDeployment, ServerOptimizer):
    name = "reptile"
    summary = "FedReptile: local SGD, server moves theta by epsilon toward the clients' mean"
    Config = ReptileConfig
    slots = ()

    def init_slots(self, params: Tree) -> Slots:
        return {}

    def step(self, delta: Tree, state: Slots) -> tuple[Tree, Slots]:
        return delta, {}

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, finish=self.local_finish)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        result = upload_model(message, state, task, solved)
        result.weight = self.ctx.objective_weight(task.client_id, self.config.weighting)
        return result
