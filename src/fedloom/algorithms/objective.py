"""SGD on a custom per-minibatch objective, as one client program (solvers/program.py) that both
backends run: the local step of the function-space regularizers FedNTD, FedLC, FedGen and
FedProto, whose objectives see the logits and (FedProto, FedGen) the head's input features, not
only the model's loss::

    w <- start(message, state)
    for each minibatch B of client_plan:
        out, h <- f(x_B; w), the input of the model's head on x_B     # h: when ``head`` is set
        w      <- w - lr grad_w objective(w, out, h, B, carry, shared)
    finish(w)

It is the FedAvg family's :class:`SGDProgram` (its plan and step size; its ``start`` and
``finish`` options, no momentum, no correction) with its step replaced, so a subclass states
only its objective and what it adds to the carry (per-client tensors: FedLC's class counts,
FedGen's noise) or to the round's shared values (FedNTD's teacher, FedProto's prototype table).
An objective is a pure function of tensors: it branches in Python on the config or on values
fixed in ``init`` / ``shared``, never on tensor values; it averages per-sample terms with
``batch.mean`` (or :func:`fedloom.solvers.program.weighted_mean` with ``batch.w``), so the
weight-0 samples the vmap backend pads minibatches with count for nothing; random draws come
from the client's own stream in ``init``, never inside the objective (vmap would share them
across clients).

A round whose objective adds nothing to the model's loss (``regularized`` False: FedNTD's
beta = 0, FedProto before any prototype exists, FedGen before its generator has trained) is
plain SGD: the sequential backend runs it on the lean flat-buffer trainer, as FedAvg's, so the
reductions to FedAvg and to local training hold bit for bit (losses included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedloom.algorithms.base import Algorithm
from fedloom.algorithms.sgd_program import Finish, SGDProgram, Start, server_model, upload_model
from fedloom.algorithms.weights import aggregation_weight
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.solvers.local import LeanBatch, LocalSolution
from fedloom.solvers.program import Batch, Carry, Ops

Shared = dict[str, Any]
"""The round's values every client shares (``ClientProgram.shared``)."""


@dataclass(frozen=True)
class Forward:
    """The model at ``params`` on a minibatch: its output ``out`` (logits) and the head's
    input ``h`` (None without a head)."""

    params: Tree
    out: torch.Tensor
    h: torch.Tensor | None


class ObjectiveProgram(SGDProgram):
    """Plain SGD steps (no momentum, no gradient correction) on :meth:`objective`, or AdamW's
    (``train.optimizer``, ``SGDProgram.descend``)."""

    private_step = False  # its own objective, not DP-SGD's per-sample loss
    takes_optimizer = True

    head: str | None = None
    """The model's head module whose input the objective sees as ``h`` (None: h is None)."""

    def __init__(
        self,
        algorithm: Algorithm,
        head: str | None = None,
        *,
        start: Start = server_model,
        finish: Finish = upload_model,
    ) -> None:
        super().__init__(algorithm, start=start, finish=finish)
        self.head = head

    def regularized(self, message: Message) -> bool:
        """Whether this round's objective differs from the model's loss (default: yes); decided
        on the config and the message, the same for every client of the round."""
        return True

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        return {**super().shared(message, task), "regularized": self.regularized(message)}

    def run_lean(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult | None:
        """The sequential backend's fused path: the same steps on the lean flat-buffer trainer
        (``SGDProgram.lean_sgd``, cheaper per step than stepping through ``step``), the
        objective seeing the trainer's parameters and a minibatch of real samples."""
        if not self.regularized(message):
            return self.lean_sgd(message, state, task)
        carry = self.init(message, state, task)
        shared = self.shared(message, task)
        ones: dict[int, torch.Tensor] = {}

        def objective(lean: LeanBatch) -> torch.Tensor:
            n = lean.y.shape[0]
            if n not in ones:
                ones[n] = torch.ones(n)
            batch = Batch(lean.x, lean.y, ones[n])
            params = lean.lean.views
            fwd = Forward(params, lean.out, lean.features)
            return self.objective(fwd, batch, self.at_step(carry, lean.step), shared)

        return self.lean_sgd(message, state, task, objective, self.head)

    def at_step(self, carry: Carry, step: int) -> Carry:
        """The carry as ``step`` (0-based) of the client's steps sees it, on the fused path
        (default: the carry itself; FedGen sets its step counter)."""
        return carry

    def objective(self, fwd: Forward, batch: Batch, carry: Carry, shared: Shared) -> torch.Tensor:
        """The minibatch objective at ``fwd.params``: ``fwd.out`` is the model's output on
        ``batch.x``, ``fwd.h`` the head's input. Called only in rounds that are
        ``regularized``."""
        raise NotImplementedError

    def data_loss(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The model's loss (cross-entropy) averaged over the batch's real samples: the same
        operations as ``FunctionalModel.weighted_loss``, so an objective that adds nothing to
        it takes FedAvg's steps bit for bit."""
        return batch.mean(self.model.per_sample_loss(out, batch.y))

    def forward(
        self, params: Tree, buffers: Tree, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.head is None:
            return self.model.forward(params, buffers, x), None
        return self.model.forward_with_features(params, buffers, x, self.head)

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        params, buffers = carry["params"], carry["buffers"]

        # the buffers go in as an argument: BatchNorm's forward updates them in place, which
        # torch.func.grad refuses for a captured tensor
        def loss(p: Tree, b: Tree) -> torch.Tensor:
            if not shared["regularized"]:
                return self.data_loss(self.model.forward(p, b, batch.x), batch)
            out, h = self.forward(p, b, batch.x)
            return self.objective(Forward(p, out, h), batch, carry, shared)

        grads, value = ops.value_and_grad(loss, params, buffers)
        return self.descend(ops, carry, grads, shared["lr"]), {"loss": value}


def model_result(task: ClientTask, solved: LocalSolution, weighting: str) -> ClientResult:
    """FedAvg's answer: the local model as the upload, weighted n_k (``weighting: samples``) or
    1 (``uniform``)."""
    upload = {"params": solved.params, "buffers": solved.buffers}
    return ClientResult(upload, aggregation_weight(weighting, task.data.num_train), solved.loss)


def weighted_upload(weighting: str) -> Finish:
    """The ``finish`` option that uploads the local model weighted by ``weighting``
    (``model_result``): FedNTD's and FedLC's."""

    def finish(
        message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        return model_result(task, solved, weighting)

    return finish
