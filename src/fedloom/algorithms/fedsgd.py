"""FedSGD (McMahan et al., AISTATS 2017); seed 002, section 一, FedSGD card.

The server sends w_t; each selected client computes the gradient of its loss on ALL its local
data at w_t and uploads it; the server takes one step w_{t+1} = w_t - eta sum_k (n_k/n) g_k.
With every client selected this is full-batch gradient descent on the pooled objective.
Local epochs, steps and batch size do not apply (one full-batch gradient per round).
"""

from __future__ import annotations

from fedloom.algorithms.base import Algorithm, ClientResult, ClientTask, Message, State
from fedloom.engine.pytree import add


class FedSGD(Algorithm):
    name = "fedsgd"
    summary = "FedSGD: one full-batch client gradient per round, server gradient step"

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        data = task.data
        buffers = {k: v.clone() for k, v in message["buffers"].items()}
        grads, loss = self.ctx.model.grad_and_loss(
            message["params"], buffers, data.x_train, data.y_train
        )
        return ClientResult({"grad": grads, "buffers": buffers}, data.num_train, float(loss))

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        weights = [r.weight for r in results]
        grad = self.ctx.aggregate([r.upload["grad"] for r in results], weights)
        buffers = server["buffers"]
        if buffers:
            buffers = self.ctx.aggregate([r.upload["buffers"] for r in results], weights)
        return {"params": add(server["params"], grad, alpha=-self.ctx.lr), "buffers": buffers}
