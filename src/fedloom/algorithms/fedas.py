"""FedAS (Yang, Huang, Ye, CVPR 2024, "FedAS: Bridging Inconsistency in Personalized Federated
Learning"; its federated parameter alignment and client synchronization, checked against the
authors' code, xiyuanyang45/FedAS): FedPer's split (a shared body, a personal head, the model's
one ``nn.Linear`` head) with federated parameter alignment on the client and client
synchronization by Fisher information on the server.

One round of client k, with theta_k = [phi_k, h_k] its model after its latest round (body,
head; initially the initial model) and phi the downloaded body::

    parameter alignment (intra-client consistency):
      z_c <- mean of phi_k(x) over the client's training samples of class c   # eval mode
      phi <- phi - align_lr grad_phi sum_{c in B} MSE(phi(x_B)[y = c], z_c)   # align_epochs
                                                   # epochs of minibatches of train.batch_size
    local training: SGD on CE of [phi, h_k] on the engine's plan
    client synchronization: the empirical Fisher information of the trained model on its
      training data (evaluation mode), sum over minibatches B of train.batch_size of
      (grad of the mean negative log-likelihood on B)^2, element-wise;
      its trace F_k (a number) is the client's aggregation weight
    upload the trained body (and, ``aggregation: fisher_diagonal``, its Fisher diagonal)
    keep [phi, h_k]: the next round's theta_k and the deployed (personalized) model

    server: phi <- sum_k F_k phi_k / sum_k F_k                        (``aggregation: fisher``)
            phi <- sum_k F_k ⊙ phi_k / sum_k F_k, element-wise       (``fisher_diagonal``)
            phi <- sum_k n_k phi_k / sum_k n_k                        (``samples``: FedPer's)

The alignment makes the new shared body produce, class by class, the representation the
client's own head was trained on, before it trains (the paper: the shared part learns from
the previous local model). The Fisher weighting counts each client by how much information
its trained parameters hold about its data, so an under-trained straggler's model counts
less. Where the paper leaves details open this module follows the authors' code
(xiyuanyang45/FedAS): the prototypes are the old local body's class means, the alignment
loss sums the per-class mean squared errors over the classes of the minibatch, one epoch at
lr 0.01 (here on minibatches of train.batch_size, the code's are 16), the Fisher trace counts
every parameter (body and head) and squares minibatch gradients (not per-sample ones), and
the weights are the traces normalized over the round's clients. The element-wise variant is
offered as ``fisher_diagonal`` (the diagonal empirical Fisher of the body's parameters).

``align_steps`` fixes the alignment's minibatches a round instead. ``align_epochs: 0`` (or
``align_lr: 0``) with ``aggregation: samples`` is FedPer's training.
A client that never trained deploys [phi, initial head]. The alignment and the local training
are updates of one client program that both backends run (the prototypes and the Fisher
information are computed per client, outside the steps, as FedProto's prototypes are).

With ``train.optimizer: adamw`` the local training takes AdamW's steps (the alignment stays
SGD's).

Refused: sample-level DP (the alignment and the Fisher information take non-private
gradients), client-level DP and asynchrony (the server step is not FedAvg's average).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, aggregate_models
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.deployment import LocalPartDeployment
from fedloom.algorithms.fedproto import class_prototypes
from fedloom.algorithms.partial import KeySplit
from fedloom.algorithms.sgd_program import SGDProgram, model_copy
from fedloom.core.functional import FunctionalModel, evaluation_mode
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers.local import LocalSolution, steps_per_epoch
from fedloom.solvers.objective_sgd import single_head
from fedloom.solvers.program import BATCHES, Batch, Carry, ClientProgram, Ops, Plan, Update

Aggregation = Literal["fisher", "fisher_diagonal", "samples"]


class FedASConfig(AlgorithmConfig):
    align_lr: float = Field(
        default=0.01, ge=0.0, description="step size of the parameter alignment (code: 0.01)"
    )
    align_epochs: int = Field(
        default=1, ge=0, description="epochs of parameter alignment a round (code: 1)"
    )
    align_steps: int | None = Field(
        default=None, ge=0, description="alignment steps a round (default: align_epochs epochs)"
    )
    aggregation: Aggregation = Field(
        default="fisher",
        description="body averaging weights: fisher (FIM trace), fisher_diagonal, samples",
    )


def fisher_information(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int | None,
) -> Tree:
    """The empirical Fisher information's diagonal as the authors compute it: over the
    minibatches of ``batch_size`` of (x, y) in order, in evaluation mode, the sum of the
    squared gradients of each minibatch's mean negative log-likelihood."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    width = int(x.shape[0]) if batch_size is None else batch_size
    with evaluation_mode(model.module):
        for start in range(0, int(x.shape[0]), width):
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            xb, yb = x[start : start + width], y[start : start + width]
            with torch.enable_grad():
                out = model.forward(leaves, {k: b.clone() for k, b in buffers.items()}, xb)
                nll = F.cross_entropy(out, yb)
                grads = torch.autograd.grad(nll, list(leaves.values()))
            for k, g in zip(leaves, grads, strict=True):
                total[k].add_(g.detach() ** 2)
    return total


class FedAS(Algorithm):
    name = "fedas"
    summary = "FedAS: parameter alignment and Fisher-weighted body averaging (Yang et al., 2024)"
    Config = FedASConfig
    capabilities = Capabilities(
        classification_only="class prototypes and the negative log-likelihood's Fisher information",
        has_global_model=False,
    )
    Deployment = LocalPartDeployment

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head = single_head(ctx.model, self.name)
        linear = ctx.model.module.get_submodule(self.head)
        assert isinstance(linear, nn.Linear)
        self.dim, self.num_classes = linear.in_features, linear.out_features
        model = ctx.model
        local = {
            k for k in (*model.param_keys, *model.buffer_keys) if k.startswith(f"{self.head}.")
        }
        self.split = KeySplit.of(model, local)

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        """The shared body, and the initial model (each client's first theta_k, never sent)."""
        return {
            **self.split.shared(params, buffers),
            "initial": {"params": clone(params), "buffers": clone(buffers)},
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"params": server["params"], "buffers": server["buffers"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        if self.config.aggregation != "fisher_diagonal":
            return {**aggregate_models(self.ctx, results), "initial": server["initial"]}
        ones = [1.0] * len(results)
        fishers = [r.upload["fisher"] for r in results]
        weighted = [
            {k: f[k] * r.upload["params"][k] for k in f}
            for f, r in zip(fishers, results, strict=True)
        ]
        num, den = self.ctx.aggregate(weighted, ones), self.ctx.aggregate(fishers, ones)
        plain = self.ctx.aggregate([r.upload["params"] for r in results], ones)
        params = {k: torch.where(den[k] > 0, num[k] / den[k], plain[k]) for k in num}
        samples = [float(r.upload["samples"]["n"]) for r in results]
        buffers = (
            self.ctx.aggregate([r.upload["buffers"] for r in results], samples)
            if results[0].upload["buffers"]
            else {}
        )
        return {"params": params, "buffers": buffers, "initial": server["initial"]}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        return {**model_copy(server["initial"]), "steps": torch.zeros((), dtype=torch.int64)}

    def make_program(self) -> ClientProgram:
        return FedASProgram(self)

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """[phi (downloaded), h_k (own)]."""
        assert state is not None
        return self.split.start(message, state)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """Upload the trained body weighted by its Fisher trace (or n_k); keep the model."""
        assert state is not None
        data, cfg = task.data, self.config
        upload = self.split.shared(solved.params, solved.buffers)
        weight = float(data.num_train)
        info: dict[str, float] = {}
        if cfg.aggregation != "samples":
            fisher = fisher_information(
                self.ctx.model,
                solved.params,
                solved.buffers,
                data.x_train,
                data.y_train,
                self.ctx.batch_size,
            )
            trace = float(sum(f.sum() for f in fisher.values()))
            info["fisher_trace"] = trace
            if cfg.aggregation == "fisher":
                weight = max(trace, 1e-12)
            else:
                upload["fisher"] = {k: fisher[k] for k in self.split.shared_params}
                upload["samples"] = {"n": torch.tensor(float(data.num_train))}
        new_state = {
            "params": solved.params,
            "buffers": solved.buffers,
            "steps": state["steps"] + solved.steps,
        }
        return ClientResult(upload, weight, solved.loss, state=new_state, info=info)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The client's model after its latest round; [phi, initial head] before."""
        state = state if state is not None else self.init_client_state(server, task.client_id)
        if int(state["steps"]) == 0:
            return self.local_start(server, state, task)
        return state["params"], state["buffers"]


ALIGN = "fedas/align"


class FedASProgram(SGDProgram):
    """Parameter alignment (update ``align`` on the plan ``fedas/align``, stream (seed, round,
    client, 'fedas/align'), from step 0), then local SGD on the engine's plan."""

    private_step = False  # the alignment's gradients are not DP-SGD's

    def __init__(self, algorithm: FedAS) -> None:
        super().__init__(algorithm, start=algorithm.local_start, finish=algorithm.local_finish)
        self.fedas = algorithm
        self.config: FedASConfig = algorithm.config  # type: ignore[assignment]
        self.updates = (
            Update("align", (ALIGN,), self.align_step),
            Update(self.STEP, (BATCHES,), self.step, stacked=self.stacked_form()),
        )

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        cfg, ctx = self.config, self.fedas.ctx
        steps = 0
        if cfg.align_lr > 0:
            epoch = steps_per_epoch(task.data.num_train, ctx.batch_size)
            steps = cfg.align_epochs * epoch if cfg.align_steps is None else cfg.align_steps
        align = ctx.make_plan(task.data, steps, ALIGN, task.round, task.client_id) if steps else []
        return {
            ALIGN: Plan(align),
            BATCHES: Plan(self.algorithm.client_plan(task), start=len(align)),
        }

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        carry = super().init(message, state, task)
        fedas, data = self.fedas, task.data
        means, counts = class_prototypes(
            self.model,
            fedas.head,
            state["params"],
            state["buffers"],
            data.x_train,
            data.y_train,
            fedas.num_classes,
            fedas.dim,
        )
        carry["protos"], carry["known"] = means, counts > 0
        return carry

    def shared(self, message: Message, task: ClientTask) -> dict:
        return {**super().shared(message, task), "align_lr": self.config.align_lr}

    def align_step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """phi <- phi - align_lr grad sum_c MSE(phi(x)[y = c], z_c); the head untouched and
        the buffers left alone (a throwaway forward pass)."""
        (batch,) = batches
        params, keys = carry["params"], self.fedas.split.shared_params
        protos, known = carry["protos"], carry["known"]
        spare = {k: b.clone() for k, b in carry["buffers"].items()}

        def loss(body: Tree, b: Tree) -> torch.Tensor:  # b: an argument, as BatchNorm writes it
            _, h = self.model.forward_with_features({**params, **body}, b, batch.x, self.fedas.head)
            sq = ((h - protos[batch.y]) ** 2).mean(-1)
            classes = torch.arange(self.fedas.num_classes, device=batch.y.device)
            onehot = (batch.y[:, None] == classes[None, :]).to(h.dtype)
            per_class = (onehot * batch.w[:, None]).sum(0)  # samples of each class in B
            share = batch.w / per_class[batch.y].clamp_min(1.0) * known[batch.y].to(h.dtype)
            return (share * sq).sum()

        grads, value = ops.value_and_grad(loss, {k: params[k] for k in keys}, spare)
        moved = ops.descend(params, grads, shared["align_lr"])
        return {**carry, "params": moved}, {"loss": value}
