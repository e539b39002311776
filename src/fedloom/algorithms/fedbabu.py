"""FedBABU (Oh, Kim, Yun, ICLR 2022, "FedBABU: Towards Enhanced Representation for Federated
Image Classification", arXiv:2106.06042, Algorithm 1): FedAvg that trains and aggregates only
the body, the head fixed at its random initialization, then fine-tunes on each client.

The model is split by its own declaration (``FedModel.head_modules``, as FedPer and FedRep
split it): the head (the final classifier) and the body (every other parameter). One round
(Algorithm 1)::

    server sends the body theta_ext^t (the head theta_cls^0 is the same on every client
                                        since initialization, never sent)
    client k:  from [theta_ext^t, theta_cls^0], local SGD on the body only:
                 theta_ext <- theta_ext - lr grad_ext F_k(theta_ext, theta_cls^0; B)
               upload theta_ext,k (and the body's buffers)
    server:    theta_ext^{t+1} <- sum_k n_k theta_ext,k / sum_k n_k      # FedAvg on the body
    deploy:    client k fine-tunes [theta_ext^t, theta_cls^0] on its own training data:
               ``finetune_steps`` SGD steps at ``finetune_lr`` (default train.lr), minibatches
               from the stream (seed, 'finetune', round, k), moving ``finetune_part``: ``full``
               (the whole network, the paper's choice), ``head`` or ``body``

The fine-tuning is FedAvg-FT's (:mod:`fedloom.algorithms.fedavg_ft`): one client at a time on
the fused trainer, or every client at once on the stacked model. The global model (evaluated
as ``global``) is the aggregated body with the initial head: the paper's "FedBABU without
fine-tuning". ``freeze_head: false`` trains and aggregates the head too: that is FedAvg-FT,
and with ``finetune_steps: 0`` FedAvg, bit for bit (a test checks it).

Communication with the head frozen: the body each way (the head's bytes are not counted: every
client holds theta_cls^0 from the shared initialization). The upload is the body, not a whole
model, so the mechanisms that need whole uploaded models (client-level DP, asynchrony, secure
aggregation) are refused when the config is parsed. Sample-level DP applies to the body's
steps (their gradient is DP-SGD's, the head's part dropped) when there is no fine-tuning
(``finetune_steps: 0``), whose steps are not private. ``train.optimizer: adamw`` takes AdamW
steps on the body (``moments: round``; FedBABU keeps no client state for ``client``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext, aggregate_models
from fedloom.algorithms.fedavg_ft import FedAvgFT, FedAvgFTConfig, FineTuning
from fedloom.algorithms.sgd_program import PlainSGDProgram, SGDProgram
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import select
from fedloom.errors import ConfigError
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, Ops, Update
from fedloom.solvers.adamw import MOMENTS
from fedloom.solvers.local import LocalSolution
from fedloom.solvers.stacked_sgd import stacked_update


class FedBABUConfig(FedAvgFTConfig):
    freeze_head: bool = Field(
        default=True, description="keep the head at its initialization in training (paper)"
    )
    finetune_part: Literal["full", "head", "body"] = Field(
        default="full", description="what the deployment fine-tunes (paper: the full network)"
    )


class BABUFineTuning(FineTuning):
    """FedAvg-FT's deployment; a new client fine-tunes what the deployment does
    (``finetune_part``)."""

    def adaptation_keys(self) -> list[str] | None:
        return self.algorithm.finetune_keys()


class FedBABU(FedAvgFT):
    name = "fedbabu"
    summary = "FedBABU: FedAvg on the body with a frozen random head, fine-tuned per client"
    Config = FedBABUConfig
    Deployment = BABUFineTuning
    capabilities = FedAvgFT.capabilities.but(
        averages_client_models=False,  # the upload is the body (with the head frozen)
    )

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        cfg: FedBABUConfig = self.config  # type: ignore[assignment]
        head_keys = getattr(ctx.model.module, "head_keys", None)
        params = set(ctx.model.param_keys)
        self.head = [k for k in (head_keys() if callable(head_keys) else []) if k in params]
        self.body = [k for k in ctx.model.param_keys if k not in self.head]
        if cfg.freeze_head:  # every client holds the head theta_cls^0: the body is sent
            self.wire = Wire(only={"params": tuple(self.body)})
        if (cfg.freeze_head or cfg.finetune_part != "full") and not (self.head and self.body):
            raise ConfigError(
                f"algorithm.name: fedbabu splits the model into body and head "
                f"(FedModel.head_modules), and {type(ctx.model.module).__name__} has "
                f"{'no head' if not self.head else 'no body'}; use e.g. model.name: mlp or cnn4"
            )

    def make_program(self) -> ClientProgram:
        if not self.config.freeze_head:
            return PlainSGDProgram(self)
        return BodySGDProgram(self)

    def upload_body(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """The body's parameters and the model's buffers, weighted n_k."""
        upload = {"params": select(solved.params, self.body), "buffers": solved.buffers}
        return ClientResult(upload, task.data.num_train, solved.loss)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        """FedAvg's average of the uploads; with the head frozen, of the body, beside the
        initial head."""
        averaged = aggregate_models(self.ctx, results)
        params = {**server["params"], **averaged["params"]}
        return {**averaged, "params": {k: params[k] for k in server["params"]}}

    def finetune_keys(self) -> list[str] | None:
        part = self.config.finetune_part
        return None if part == "full" else list(self.head if part == "head" else self.body)


class BodySGDProgram(SGDProgram):
    """FedAvg's local SGD with the head frozen: the step's data gradient (DP-SGD's under
    sample-level DP) on the body only; the body uploaded (``FedBABU.upload_body``). The
    sequential backend runs it on the lean trainer (``run_lean``). With ``train.optimizer:
    adamw`` the step on the body is AdamW's (``descend``); the head and its moments stay."""

    takes_optimizer = True

    def __init__(self, algorithm: FedBABU) -> None:
        super().__init__(algorithm, finish=algorithm.upload_body)
        self.body = set(algorithm.body)
        if self.private is None and self.model.stacked() is not None:
            self.updates = (Update(self.STEP, (BATCHES,), self.step, stacked=self.stacked_body),)

    def stacked_body(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        """``step`` for a whole chunk on a stackable model (core/stacked.py), in place: the
        body moves, the head keeps its random initialization."""
        lr, moments = float(shared["lr"]), carry.get(MOMENTS)
        return stacked_update(self.model, carry, batches[0], lr, self.body, self.optimizer, moments)

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        grads, loss = self.data_grad(ops, carry, batch)
        body = {k: g for k, g in grads.items() if k in self.body}
        return self.descend(ops, carry, body, shared["lr"]), {"loss": loss}

    def run_lean(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult | None:
        """The sequential backend's fused path: the same steps on the lean trainer, the head
        not trainable (DP-SGD's per-sample steps go through ``step``)."""
        if self.private is not None:
            return None
        return self.lean_sgd(message, state, task, trainable=self.body)
