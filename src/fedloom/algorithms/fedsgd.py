"""FedSGD (McMahan et al., AISTATS 2017, arXiv:1602.05629, Section 2: FedSGD, the C-fraction
baseline with B = infinity and one local step).

The server sends w_t; each selected client computes the gradient g_k of its loss on ALL its
local data at w_t and uploads it; the server takes one step w_{t+1} = w_t - eta sum_k (n_k/n)
g_k. With every client selected this is full-batch gradient descent on the pooled objective.
Local epochs, steps and batch size do not apply: the client's local solver runs exactly one
full-batch step, and the uploaded gradient is read off it as (w_t - w_1) / eta.
"""

from __future__ import annotations

import torch

from fedloom.algorithms.base import Algorithm
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import add
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class FedSGD(Algorithm):
    name = "fedsgd"
    summary = "FedSGD: one full-batch client gradient per round, server gradient step"

    capabilities = Capabilities(
        sgd_only="uploads the gradient read off one SGD step as (w_t - w_1) / eta"
    )

    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        return [torch.arange(task.data.num_train)]

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, finish=self.local_finish)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        grad = {k: (solved.start[k] - solved.params[k]) / solved.lr for k in solved.params}
        upload = {"grad": grad, "buffers": solved.buffers}
        return ClientResult(upload, task.data.num_train, solved.loss)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        weights = [r.weight for r in results]
        grad = self.ctx.aggregate([r.upload["grad"] for r in results], weights)
        buffers = server["buffers"]
        if buffers:
            buffers = self.ctx.aggregate([r.upload["buffers"] for r in results], weights)
        return {"params": add(server["params"], grad, alpha=-self.ctx.lr), "buffers": buffers}
