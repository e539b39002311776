"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, "Exploiting Shared Representations
for Personalized Federated Learning", arXiv:2102.07078, Algorithm 1); seed 004, section 三 3.2
(decoupled models phi_k = [psi, omega_k]: shared representation psi, personal head omega_k).

FedPer's split (:mod:`fedloom.algorithms.fedper`, the model's ``FedModel.head_modules``): the
body phi (the representation) is shared and averaged by the server, each client's head h_k
stays on the client. Where FedPer trains both together, FedRep alternates: the head first, on
the round's fresh body, then the body under the new head. One round (Algorithm 1)::

    client k: h <- h_k, phi <- phi^t                    # server body, own head
              repeat tau_h times:  h   <- h   - lr grad_h   F_k(h, phi; B)   # body frozen
              repeat tau_phi times: phi <- phi - lr grad_phi F_k(h, phi; B)  # head frozen
              keep h_k <- h, upload phi
    server:   phi^{t+1} <- sum_k p_k phi_k / sum_k p_k  # body only

- tau_h: ``head_steps`` SGD steps, or ``head_epochs`` passes over the client's training data in
  ``train.batch_size`` minibatches (default 10: the paper's 10 local epochs for the head); the
  minibatches come from the stream (seed, 'head', round, client).
- tau_phi: the round's local steps (``train.local_steps`` / ``local_epochs``, the engine's plan).
  A straggler completes its whole head phase and then fewer body steps (``len(task.plan)``):
  the head phase comes first, so the work it runs out of is the body's.
- p_k: 1/K (``weighting: uniform``, Algorithm 1's 1/(rn) sum over the round's clients, the
  default) or n_k / n (``samples``, what the authors' code does; equal on their equal-size
  shards).

Both phases run on the shared minibatch solver :func:`fedloom.engine.objective_sgd.objective_sgd`
with ``trainable`` set to the head, then the body (the frozen part stays bit for bit; buffers,
e.g. BatchNorm statistics, evolve in training mode through both phases and the body's are
uploaded with it). FedRep runs its own client update, so the vectorized executor runs its
clients one at a time: same numbers, no speed-up.

Upload and download: the body only (the communication bytes count it alone). There is no global
model. A client that never trained (a held-out new client, ``eval.new_clients``) gets the body
with the initial head and learns only the head, the body fixed, as the paper does for new
clients: the cold-start evaluation fine-tunes the head (``adaptation_keys``), and
``finetune_steps`` > 0 fine-tunes it before deployment, both inherited from FedPer.
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from fedloom.algorithms.base import (
    ClientResult,
    ClientTask,
    Message,
    State,
    Weighting,
    weighting_field,
)
from fedloom.algorithms.fedper import FedPer, FedPerConfig
from fedloom.engine.objective_sgd import objective_sgd
from fedloom.engine.workload import steps_per_epoch

HEAD_EPOCHS = 10
"""tau_h when neither ``head_steps`` nor ``head_epochs`` is set: the paper's 10 local epochs."""


class FedRepConfig(FedPerConfig):
    weighting: Weighting = weighting_field(
        "uniform", "body averaging weights (Algorithm 1: uniform)"
    )
    head_epochs: int | None = Field(
        default=None,
        ge=0,
        description=f"head-only epochs per round, before the body (default {HEAD_EPOCHS}: paper)",
    )
    head_steps: int | None = Field(
        default=None, ge=0, description="head-only SGD steps per round, instead of head_epochs"
    )

    @field_validator("head_steps")
    @classmethod
    def _one_head_budget(cls, head_steps: int | None, info: ValidationInfo) -> int | None:
        if head_steps is not None and info.data.get("head_epochs") is not None:
            raise ValueError(
                "set head_steps or head_epochs (the length of the head phase), not both"
            )
        return head_steps


class FedRep(FedPer):
    name = "fedrep"
    summary = "FedRep: per round, train the personal head (body frozen), then the shared body"
    Config = FedRepConfig

    def head_phase_steps(self, task: ClientTask) -> int:
        """tau_h: ``head_steps``, or ``head_epochs`` passes over the client's training data."""
        cfg = self.config
        if cfg.head_steps is not None:
            return cfg.head_steps
        epochs = HEAD_EPOCHS if cfg.head_epochs is None else cfg.head_epochs
        return epochs * steps_per_epoch(task.data.num_train, self.ctx.batch_size)

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        assert state is not None
        model, data, lr = self.ctx.model, task.data, self.local_lr(task)
        params, buffers = self.local_start(message, state, task)  # [phi^t, h_k]
        head_plan = self.ctx.make_plan(
            data, self.head_phase_steps(task), "head", task.round, task.client_id
        )
        with model.random_stream(self.ctx.seed, task.round, task.client_id):
            head = objective_sgd(
                model,
                params,
                buffers,
                data.x_train,
                data.y_train,
                head_plan,
                lr,
                trainable=self.split.local_params,
            )
            body = objective_sgd(
                model,
                head.params,
                head.buffers,
                data.x_train,
                data.y_train,
                self.client_plan(task),
                lr,
                trainable=self.split.shared_params,
            )
        steps = head.steps + body.steps
        loss = (head.loss * head.steps + body.loss * body.steps) / max(1, steps)
        return ClientResult(
            self.split.shared(body.params, body.buffers),
            self.client_weight(task),
            loss,
            state=self.personal_state(state, body.params, body.buffers, steps),
            info={"head_loss": head.loss, "body_loss": body.loss},
        )
