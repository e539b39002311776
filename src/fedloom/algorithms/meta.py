"""What the meta-learning algorithms (Per-FedAvg, Reptile) share: a client is served the
meta-learned initialization theta adapted to its own data: a global starting point that is
easy to fine-tune (MAML: Finn, Abbeel, Levine, ICML 2017, arXiv:1703.03400; made federated by
Per-FedAvg: Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, arXiv:2002.07948).

Both learn a global theta that is not meant to be used as is: every client (a training client
in the personalized evaluation, or a held-out one) deploys theta after ``adapt_steps`` SGD steps
on its own training data, the inner loop the server meta-learned for::

    phi_k = theta;  repeat adapt_steps times: phi_k <- phi_k - lr grad F_k(phi_k; B_s)
    deploy phi_k                       (adapt_steps = 0: theta itself)

with minibatches B_s from the stream (seed, 'adapt', round, client), the same stream the
engine's cold-start evaluation uses, and lr the algorithm's inner step size (Per-FedAvg: alpha;
Reptile: train.lr). The cold-start evaluation starts a new client from theta
(``Deployment.new_client_model``, the default) and fine-tunes it at ``adaptation_lr``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmContext
from fedloom.algorithms.deployment import Deployment, finetuned_models
from fedloom.core.protocol import ClientTask, State
from fedloom.core.pytree import Tree
from fedloom.solvers.local import local_sgd

ADAPT_PURPOSE = "adapt"
"""Stream of the adaptation minibatches (shared with the engine's cold-start evaluation)."""


def adapt_steps_field() -> Any:
    return Field(
        default=1,
        ge=0,
        description="SGD steps a client takes from theta on its own data before inference",
    )


def adapt(
    ctx: AlgorithmContext,
    params: Tree,
    buffers: Tree,
    task: ClientTask,
    steps: int,
    lr: float,
    purpose: str = ADAPT_PURPOSE,
    trainable: Collection[str] | None = None,
) -> tuple[Tree, Tree]:
    """(params, buffers) after ``steps`` SGD steps at ``lr`` on the client's training data
    (minibatches from the stream (seed, ``purpose``, task.round, client)), moving only the
    ``trainable`` parameters (default: all; FedPer's head); ``steps`` 0, or a client without
    training data: the inputs themselves."""
    data, model = task.data, ctx.model
    if steps == 0 or data.num_train == 0:
        return params, buffers
    plan = ctx.make_plan(data, steps, purpose, task.round, task.client_id)
    augment = ctx.make_plan.augmentation(plan, purpose, task.round, task.client_id)
    with model.random_stream(ctx.seed, task.round, task.client_id):
        solved = local_sgd(
            model,
            params,
            buffers,
            data.x_train,
            data.y_train,
            plan,
            lr,
            trainable=trainable,
            augment=augment,
        )
    return solved.params, solved.buffers


class Adaptation(Deployment):
    """Every client deploys theta adapted by ``config.adapt_steps`` SGD steps (see the module
    doc), all clients at once when the executor runs them stacked."""

    algorithm: AdaptedDeployment

    def trains(self) -> bool:
        return self.algorithm.config.adapt_steps > 0  # type: ignore[attr-defined]

    def batched(self, server: State, tasks: Sequence[ClientTask]) -> list[tuple[Tree, Tree]] | None:
        """Every client's adaptation at once (clients without training data keep theta;
        0 steps: theta itself, one at a time)."""
        algorithm = self.algorithm
        theta = algorithm.global_model(server)
        assert theta is not None
        steps: int = algorithm.config.adapt_steps  # type: ignore[attr-defined]
        if not steps:
            return None
        lr = algorithm.deployment_lr()
        return finetuned_models(algorithm.ctx, theta, tasks, steps, ADAPT_PURPOSE, lr)


class AdaptedDeployment(Algorithm):
    """Mixin: ``deployed_model`` is the global model after ``config.adapt_steps`` SGD steps at
    ``deployment_lr()`` on the client's training data (see the module doc)."""

    Deployment = Adaptation

    def deployment_lr(self) -> float:
        """Step size of the adaptation (default: the algorithm's cold-start step, else
        train.lr)."""
        lr = self.deployment.adaptation_lr()
        return lr if lr is not None else self.ctx.lr

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        theta = self.global_model(server)
        assert theta is not None
        steps: int = self.config.adapt_steps  # type: ignore[attr-defined]
        return adapt(self.ctx, *theta, task, steps, self.deployment_lr())
