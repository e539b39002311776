"""FedAvg + local fine-tuning: train with FedAvg, and before evaluation each client runs k
local SGD steps from the global model on its own training data (the simplest personalization
baseline; the "FedAvg + fine-tuning" baseline of Per-FedAvg, Fallah et al., NeurIPS 2020,
arXiv:2002.07948, and of Ditto, Li et al., ICML 2021, arXiv:2012.04221)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig
from fedloom.algorithms.deployment import Deployment, finetuned_models
from fedloom.algorithms.fedavg import FedAvg
from fedloom.core.protocol import ClientTask, State
from fedloom.core.pytree import Tree
from fedloom.solvers.local import local_sgd


class FedAvgFTConfig(AlgorithmConfig):
    finetune_steps: int = Field(default=10, ge=0, description="local SGD steps before evaluation")
    finetune_lr: float | None = Field(default=None, gt=0, description="default: train.lr")


class FineTuning(Deployment):
    """Every client deploys the global model after ``finetune_steps`` SGD steps on its data,
    all clients at once when the executor runs them stacked."""

    algorithm: FedAvgFT

    def trains(self) -> bool:
        return self.algorithm.config.finetune_steps > 0  # type: ignore[attr-defined]

    def batched(self, server: State, tasks: Sequence[ClientTask]) -> list[tuple[Tree, Tree]] | None:
        algorithm = self.algorithm
        cfg: FedAvgFTConfig = algorithm.config  # type: ignore[assignment]
        start = (server["params"], server["buffers"])
        lr = cfg.finetune_lr or algorithm.ctx.lr
        steps, keys = cfg.finetune_steps, algorithm.finetune_keys()
        return finetuned_models(algorithm.ctx, start, tasks, steps, "finetune", lr, keys)


class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    summary = "FedAvg, then k local fine-tuning steps per client before evaluation"
    Config = FedAvgFTConfig
    Deployment = FineTuning

    def finetune_keys(self) -> list[str] | None:
        """The parameters the fine-tuning moves (None: all; FedBABU may tune only the head)."""
        return None

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        data = task.data
        plan = self.ctx.make_plan(
            data, self.config.finetune_steps, "finetune", task.round, task.client_id
        )
        lr = self.config.finetune_lr or self.ctx.lr
        solved = local_sgd(
            self.ctx.model,
            server["params"],
            server["buffers"],
            data.x_train,
            data.y_train,
            plan,
            lr,
            trainable=self.finetune_keys(),
            augment=self.ctx.make_plan.augmentation(plan, "finetune", task.round, task.client_id),
        )
        return solved.params, solved.buffers
