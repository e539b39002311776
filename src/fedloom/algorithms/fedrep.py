"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, "Exploiting Shared Representations
for Personalized Federated Learning", arXiv:2102.07078, Algorithm 1): decoupled models
phi_k = [psi, omega_k], a shared representation psi and a personal head omega_k.

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

The two phases are two updates of one client program (:class:`FedRepProgram`), the body's
starting where the client's head phase ends, so the vmap backend runs whole chunks of clients
through both (the frozen part stays bit for bit; buffers, e.g. BatchNorm statistics, evolve in
training mode through both phases and the body's are uploaded with it).

Upload and download: the body only (the communication bytes count it alone). There is no global
model. A client that never trained (a held-out new client, ``eval.new_clients``) gets the body
with the initial head and learns only the head, the body fixed, as the paper does for new
clients: the cold-start evaluation fine-tunes the head (``adaptation_keys``), and
``finetune_steps`` > 0 fine-tunes it before deployment, both inherited from FedPer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field, ValidationInfo, field_validator

from fedloom.algorithms.fedper import FedPer, FedPerConfig
from fedloom.algorithms.frozen_body import (
    body_features,
    frozen_body_head,
    head_loss,
    stacked_head_step,
)
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.errors import ConfigError
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, ClientRun, Ops, Plan, Update
from fedloom.solvers.adamw import MOMENTS, adamw_step, init_moments
from fedloom.solvers.local import LocalSolution, steps_per_epoch
from fedloom.solvers.stacked_sgd import stacked_update
from fedloom.solvers.steps import subset_loss_grad

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
    capabilities = FedPer.capabilities.but(
        supports_sample_dp=False,  # its own head and body phases
    )
    Config = FedRepConfig

    default_head_epochs: ClassVar[int] = HEAD_EPOCHS
    """tau_h in epochs when neither ``head_steps`` nor ``head_epochs`` is set."""

    def head_phase_steps(self, task: ClientTask) -> int:
        """tau_h: ``head_steps``, or ``head_epochs`` passes over the client's training data."""
        cfg = self.config
        if cfg.head_steps is not None:
            return cfg.head_steps
        epochs = self.default_head_epochs if cfg.head_epochs is None else cfg.head_epochs
        return epochs * steps_per_epoch(task.data.num_train, self.ctx.batch_size)

    def phase_keys(self) -> tuple[list[str], list[str]]:
        """The parameters of the head phase (the model's head) and of the body phase (every
        other parameter: the shared body, and any other key kept on the client, e.g. a PEFT
        strategy's personal factors, docs/peft.md)."""
        params = self.split.param_keys
        head = sorted(k for k in params if k in self.head)
        return head, sorted(k for k in params if k not in self.head)

    def make_program(self) -> ClientProgram:
        return FedRepProgram(self)


HEAD = "fedrep/head"


class FedRepProgram(ClientProgram):
    """Algorithm 1's two phases as two updates: ``head`` on the plan (seed, 'head', round, k)
    from step 0, then ``body`` on the engine's plan from step tau_h (each client's own).

    With ``train.optimizer: adamw`` each phase's step is AdamW's, with moments of its own
    keys (as ``torch.optim.AdamW`` counts steps per parameter), zero at every round's start."""

    takes_optimizer = True

    def __init__(self, algorithm: FedRep) -> None:
        super().__init__(algorithm.ctx.model, algorithm.ctx.seed)
        self.algorithm = algorithm
        self.optimizer = algorithm.ctx.optimizer
        if self.optimizer is not None and self.optimizer.persist:
            raise ConfigError(
                "train.optimizer.moments: client: FedRep's head and body phases start their "
                "AdamW moments at zero every round; use moments: round (docs/optimizers.md)"
            )
        self.head_keys, self.body_keys = algorithm.phase_keys()
        self.feature_head: str | None = None
        """The linear head's name when the head phase reads the frozen body's features
        (``Plan.inputs``), decided by ``_decide_features``; None: it runs the whole model."""
        self._features_decided = False
        # the stacked forms (core/stacked.py) are FedRep's steps: a subclass that replaces a
        # step has it vmapped, unless it replaces the step's stacked form too (FedPAC's body)
        stackable = self.model.stacked() is not None
        head_stacked = stackable and self._stacked_matches("head_step", "stacked_head_step")
        body_stacked = stackable and self._stacked_matches("body_step", "stacked_body_step")
        head = self.stacked_head_step if head_stacked else None
        body = self.stacked_body_step if body_stacked else None
        self.updates = (
            Update("head", (HEAD,), self.head_step, stacked=head),
            Update("body", (BATCHES,), self.body_step, stacked=body),
        )

    def _stacked_matches(self, step: str, stacked: str) -> bool:
        """Whether the stacked form ``stacked`` computes this program's ``step``: the step is
        FedRep's own, or a subclass that replaces it gives its stacked form too."""
        cls = type(self)
        own_step = getattr(cls, step) is not getattr(FedRepProgram, step)
        own_stacked = getattr(cls, stacked) is not getattr(FedRepProgram, stacked)
        return own_stacked or not own_step

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        algorithm = self.algorithm
        head = algorithm.ctx.make_plan(
            task.data, algorithm.head_phase_steps(task), "head", task.round, task.client_id
        )
        features = None
        if self.feature_head is not None or self._decide_features(message, state, task):
            assert self.feature_head is not None
            params, buffers = algorithm.local_start(message, state, task)
            features = body_features(
                self.model, self.feature_head, params, buffers, task.data.x_train
            )
        return {
            HEAD: Plan(head, inputs=features),
            BATCHES: Plan(algorithm.client_plan(task), start=len(head)),
        }

    def _decide_features(self, message: Message, state: State | None, task: ClientTask) -> bool:
        """Whether the head phase trains on the frozen body's features, computed once per
        round (algorithms/frozen_body.py), decided at the run's first plan: when it runs whole
        epochs (``head_epochs``, the default; ``head_steps`` may visit fewer samples than one
        forward over the set) without augmentation, on a model whose linear head is its last
        layer, without dropout or buffers."""
        if self._features_decided:
            return False
        self._features_decided = True
        cfg = self.algorithm.config
        if cfg.head_steps is not None or cfg.head_epochs == 0 or self.augment is not None:
            return False
        params, buffers = self.algorithm.local_start(message, state, task)
        x = task.data.x_train
        probe = torch.zeros((1, *x.shape[1:]), dtype=x.dtype)  # any client's, even an empty one
        self.feature_head = frozen_body_head(self.model, self.head_keys, params, buffers, probe)
        return self.feature_head is not None

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        params, buffers = self.algorithm.local_start(message, state, task)  # [phi^t, h_k]
        carry: Carry = {"params": params, "buffers": clone(buffers)}
        if self.optimizer is not None:
            for phase, keys in (("head", self.head_keys), ("body", self.body_keys)):
                carry[f"{MOMENTS}/{phase}"] = init_moments({k: params[k] for k in keys})
        return carry

    def shared(self, message: Message, task: ClientTask) -> dict:
        return {"lr": task.lr}

    def _phase(
        self, phase: str, keys: list[str], ops: Ops, carry: Carry, batch: Batch, lr: float
    ) -> tuple[Carry, dict]:
        grads, loss = subset_loss_grad(
            ops, self.model, carry["params"], keys, carry["buffers"], batch
        )
        return self.phase_descend(phase, ops, carry, grads, lr), {"loss": loss}

    def phase_descend(self, phase: str, ops: Ops, carry: Carry, grads: Tree, lr: float) -> Carry:
        """The carry after the phase's SGD step on ``grads`` (its keys), or AdamW's with the
        phase's own moments (``train.optimizer``)."""
        if self.optimizer is None:
            return {**carry, "params": ops.descend(carry["params"], grads, lr)}
        slot = f"{MOMENTS}/{phase}"
        params, moments = adamw_step(carry["params"], grads, carry[slot], lr, self.optimizer)
        return {**carry, "params": params, slot: moments}

    def head_step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """h <- h - lr grad_h F_k(h, phi; B), the body frozen; on the body's features when
        the round computed them (``feature_head``)."""
        if self.feature_head is None:
            return self._phase("head", self.head_keys, ops, carry, batches[0], shared["lr"])
        head = {k: carry["params"][k] for k in self.head_keys}
        grads, loss = ops.value_and_grad(
            lambda p, b: head_loss(self.model, self.feature_head, p, b), head, batches[0]
        )
        return self.phase_descend("head", ops, carry, grads, shared["lr"]), {"loss": loss}

    def body_step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """phi <- phi - lr grad_phi F_k(h, phi; B), the head frozen."""
        return self._phase("body", self.body_keys, ops, carry, batches[0], shared["lr"])

    def stacked_head_step(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """``head_step`` for a whole chunk on a stackable model (core/stacked.py), in place."""
        lr, moments = float(shared["lr"]), carry.get(f"{MOMENTS}/head")
        if self.feature_head is None:
            return stacked_update(
                self.model, carry, batches[0], lr, self.head_keys, self.optimizer, moments
            )
        params = carry["params"]
        loss = stacked_head_step(
            self.model, self.feature_head, params, batches[0], lr, self.optimizer, moments
        )
        return carry, {"loss": loss}

    def stacked_body_step(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """``body_step`` for a whole chunk on a stackable model, in place."""
        lr, moments = float(shared["lr"]), carry.get(f"{MOMENTS}/body")
        return stacked_update(
            self.model, carry, batches[0], lr, self.body_keys, self.optimizer, moments
        )

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        assert state is not None
        algorithm, carry = self.algorithm, run.carry
        head_steps, body_steps = run.steps.get("head", 0), run.steps.get("body", 0)
        steps = head_steps + body_steps
        head_loss, body_loss = run.metric("head"), run.metric("body")
        loss = (head_loss * head_steps + body_loss * body_steps) / max(1, steps)
        start, _ = algorithm.local_start(message, state, task)
        solved = LocalSolution(carry["params"], carry["buffers"], loss, start, task.lr, steps)
        result = algorithm.local_finish(message, state, task, solved)  # body up, head kept
        result.info = {"head_loss": head_loss, "body_loss": body_loss}
        return result
