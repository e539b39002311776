"""How an algorithm's clients are served: every client's deployed model (one at a time or all
at once), whether deploying trains, and where a client that never trained starts and what it
fine-tunes (docs/cold_start.md). An algorithm supplies a :class:`Deployment` subclass when it
differs from the default: deploy ``Algorithm.deployed_model`` one client at a time, serve a
new client the global model, fine-tune every parameter at ``train.lr``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from fedloom.core.protocol import ClientTask, State
from fedloom.core.pytree import Tree
from fedloom.solvers.stacked_sgd import finetune_stacked

if TYPE_CHECKING:
    from fedloom.algorithms.base import Algorithm, AlgorithmContext


class Deployment:
    """The default deployment of ``algorithm`` (see the module doc)."""

    def __init__(self, algorithm: Algorithm) -> None:
        self.algorithm = algorithm

    def deployed_models(
        self,
        server: State,
        states: Sequence[State | None],
        tasks: Sequence[ClientTask],
        batched: bool = False,
    ) -> list[tuple[Tree, Tree]]:
        """Every client's ``deployed_model``. ``batched``: the executor runs clients stacked,
        and a deployment that trains does it for all of them at once (``batched``). One at a
        time, a deployment that trains a model with dropout draws the client's masks from the
        stream (seed, 'dropout', round, client) (``FunctionalModel.random_stream``), not from
        torch's unseeded global generator."""
        models = self.batched(server, tasks) if batched else None
        if models is not None:
            return models
        algorithm = self.algorithm
        model, seed = algorithm.ctx.model, algorithm.ctx.seed
        out = []
        for state, task in zip(states, tasks, strict=True):
            with model.random_stream(seed, task.round, task.client_id):
                out.append(algorithm.deployed_model(server, state, task))
        return out

    def batched(self, server: State, tasks: Sequence[ClientTask]) -> list[tuple[Tree, Tree]] | None:
        """Every client's deployed model trained at once (``finetuned_models``), or None:
        deploy one client at a time (the default; deployments that do not train)."""
        return None

    def trains(self) -> bool:
        """Whether ``deployed_model`` trains (fine-tunes on the client's data): executors
        with worker processes then run the deployments there (engine/processes.py)."""
        return False

    # -- a client that never trained (cold start, ``eval.new_clients``) ---------------------
    def new_client_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        """Where a new client starts: adaptation step 0 of the cold-start evaluation (the
        global model; without one, what a client with fresh state deploys)."""
        algorithm = self.algorithm
        model = algorithm.global_model(server)
        if model is not None:
            return model
        state = algorithm.init_client_state(server, task.client_id)
        return algorithm.deployed_model(server, state, task)

    def adaptation_keys(self) -> list[str] | None:
        """The parameters a new client fine-tunes (None: all; FedPer and FedRep: the head)."""
        return None

    def adaptation_lr(self) -> float | None:
        """Step size of a new client's fine-tuning when ``eval.adapt_lr`` is not set (None:
        ``train.lr``; Per-FedAvg: its inner step size alpha)."""
        return None


class LocalPartDeployment(Deployment):
    """A new client fine-tunes only the part of the model that stays on the clients
    (``algorithm.split.local_params``: the partial-sharing family, FedAS)."""

    def adaptation_keys(self) -> list[str] | None:
        return list(self.algorithm.split.local_params)  # type: ignore[attr-defined]


def finetuned_models(
    ctx: AlgorithmContext,
    start: tuple[Tree, Tree],
    tasks: Sequence[ClientTask],
    steps: int,
    purpose: str,
    lr: float,
    trainable: Collection[str] | None = None,
) -> list[tuple[Tree, Tree]] | None:
    """``start`` after ``steps`` SGD steps at ``lr`` on each client's training data (minibatches
    from the stream (seed, purpose, round, client)), every client at once on the stacked model
    (solvers/stacked_sgd.py): a ``Deployment.batched`` that fine-tunes (FedAvg-FT, the
    meta-learners, FedBABU), moving only the ``trainable`` parameters (default: all); None when
    the model cannot run stacked, or has dropout (then each client fine-tunes alone, its masks
    from its own stream: docs/executors.md, "Dropout")."""
    model = ctx.model
    if model.stacked() is None or model.has_dropout:
        return None
    plans = [
        ctx.make_plan(t.data, steps, purpose, t.round, t.client_id) if steps else [] for t in tasks
    ]
    augments = [
        ctx.make_plan.augmentation(p, purpose, t.round, t.client_id)
        for p, t in zip(plans, tasks, strict=True)
    ]
    datas = [t.data for t in tasks]
    starts = [start] * len(tasks)
    return finetune_stacked(model, starts, datas, plans, lr, trainable, augments=augments)
