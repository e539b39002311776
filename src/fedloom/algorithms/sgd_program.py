"""The FedAvg family's client program: local SGD from a start, with an algorithm's
differences stated as options (start, correction, momentum, step size, finish), on both
backends (docs/adding_an_algorithm.md)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.errors import ConfigError
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, ClientRun, Ops, Plan, Update
from fedloom.solvers.adamw import MOMENTS, Moments, adamw_step, init_moments
from fedloom.solvers.local import BatchObjective, LocalSolution, local_sgd
from fedloom.solvers.ops import DP_BATCH, PrivacyRefused, private_update
from fedloom.solvers.program import StackedFn
from fedloom.solvers.stacked_sgd import stacked_correction, stacked_sgd_step

if TYPE_CHECKING:
    from fedloom.algorithms.base import Algorithm


class StepProgram(ClientProgram):
    """A client program of one update, ``step``, per minibatch of the engine's plan
    (``client_plan``): a subclass states ``init``, ``step`` and ``finish``."""

    STEP = "step"
    """The update's name (``ClientRun.metric(STEP)``)."""

    def __init__(self, algorithm: Algorithm) -> None:
        super().__init__(algorithm.ctx.model, algorithm.ctx.seed)
        self.algorithm = algorithm
        self.updates = (Update(self.STEP, (BATCHES,), self.step),)

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        return {BATCHES: Plan(self.algorithm.client_plan(task))}

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        raise NotImplementedError


Start = Callable[[Message, State | None, ClientTask], tuple[Tree, Tree]]
"""(message, state, task) -> (params, buffers): where a client's local SGD starts."""
Correction = Callable[[Tree, Message, State | None], Tree | None]
"""(params, message, state) -> the extra gradient term of the local objective at ``params``
(None: none this call). Pure in its arguments (no captured per-client tensors): the vmap
backend calls it with ``state`` stacked over clients."""
Finish = Callable[[Message, State | None, ClientTask, LocalSolution], ClientResult]
"""(message, state, task, solved) -> the upload and new state once local SGD has run."""
StepSize = Callable[[ClientTask], float]
"""(task) -> the local step size of the round, the same for every client of the round (the
vectorized executor steps them together)."""


def server_model(message: Message, state: State | None, task: ClientTask) -> tuple[Tree, Tree]:
    """FedAvg's start: the broadcast model."""
    return message["params"], message["buffers"]


def own_model(message: Message, state: State | None, task: ClientTask) -> tuple[Tree, Tree]:
    """The start of a client that trains a model of its own: the one its state keeps (local
    training, FedProto, FPFC)."""
    assert state is not None
    return state["params"], state["buffers"]


def model_copy(initial: State) -> State:
    """A client's own model at the start: a copy of ``initial``'s params and buffers (Ditto's
    and APFL's personal model, FedALA's local one, the kept part of partial sharing)."""
    return {"params": clone(initial["params"]), "buffers": clone(initial["buffers"])}


def round_lr(task: ClientTask) -> float:
    """The default step size: ``train.lr`` (as the engine hands it to the round's tasks)."""
    return task.lr


def upload_model(
    message: Message, state: State | None, task: ClientTask, solved: LocalSolution
) -> ClientResult:
    """FedAvg's finish: upload the local model, weighted by the client's sample count n_k."""
    upload = {"params": solved.params, "buffers": solved.buffers}
    return ClientResult(upload, task.data.num_train, solved.loss)


class SGDProgram(StepProgram):
    """The FedAvg family's client program. An algorithm states how its local SGD differs from
    FedAvg's as options of this program, not as methods of the algorithm::

        w <- start(message, state);  v <- 0
        for each minibatch B of algorithm.client_plan:
            g <- grad F_k(w; B) + correction(w, message, state)
            v <- momentum v + g  (momentum 0: v = g)
            w <- w - lr(task) v            (train.optimizer: adamw: AdamW's step on g)
        finish(message, state, task, solved)

    ``start`` defaults to the broadcast model (``server_model``), ``correction`` to none
    (plain ERM; the program then skips the call and the client state's stacking),
    ``momentum`` to 0 (plain SGD), ``lr`` to ``train.lr`` and ``finish`` to uploading the model
    weighted n_k (``upload_model``).

    Both backends step through ``step``; :class:`PlainSGDProgram`, the program used as it is,
    runs on the lean flat-buffer trainer in the sequential backend. Subclass this one to change
    the step (FedCR, the objective programs).

    With sample-level DP (``ctx.sample_dp``) grad F_k(w; B) is DP-SGD's noised mean of clipped
    per-sample gradients (solvers/dpsgd.py) on a Poisson minibatch, its noise drawn per step
    from the client's stream. Private by construction, for ``step`` and any override of it:
    the step runs with ``ops.PrivateOps`` and a sealed minibatch (``ops.private_update``), so
    its only data gradient is the private one (``data_grad``, ``steps.loss_grad``), taken
    ``private_grads`` times a step, and a step that takes one any other way raises
    ``PrivacyRefused`` naming the algorithm (docs/privacy.md).

    With ``train.optimizer: adamw`` (``ctx.optimizer``) the step on g is AdamW's
    (solvers/adamw.py; on DP-SGD's private gradient under sample-level DP, post-processing),
    its moments in the carry (``MOMENTS``): zero every round, or, with ``moments: client``,
    kept in the client's state across rounds (``descend``, ``keep_moments``). A subclass
    with a step of its own takes it by calling ``descend`` and declaring ``takes_optimizer``."""

    takes_optimizer: ClassVar[bool] = True
    keeps_moments: ClassVar[bool] = True

    private_step: ClassVar[bool] = True
    """Whether the program can run under sample-level DP: its steps take their data gradients
    through ``data_grad`` / ``loss_grad`` only, so the DP ops make them private (a step that
    does not is refused when it runs). False: the run is refused when it is built (a step
    with an objective of its own, FedCR's)."""

    private_grads: ClassVar[int] = 1
    """Private gradients ``step`` takes per step under sample-level DP (FedSAM's two, at w and
    at the perturbed point): each is noised sigma sqrt(private_grads), so the step is one
    Gaussian mechanism of multiplier sigma and the accountant counts it once (PrivateOps)."""

    def __init__(
        self,
        algorithm: Algorithm,
        *,
        start: Start = server_model,
        correction: Correction | None = None,
        momentum: float = 0.0,
        lr: StepSize = round_lr,
        finish: Finish = upload_model,
    ) -> None:
        super().__init__(algorithm)
        self.start, self.correction, self.momentum = start, correction, momentum
        self.step_size, self.upload = lr, finish
        self.optimizer = algorithm.ctx.optimizer
        if self.optimizer is not None and momentum:
            raise ConfigError(
                f"train.optimizer: adamw: {algorithm.name}'s local steps have heavy-ball "
                f"momentum {momentum}, which AdamW's first moment replaces; use "
                "train.optimizer: sgd or turn the momentum off"
            )
        self.corrected = correction is not None
        self.private = algorithm.ctx.sample_dp if self.private_step else None
        if self.private is not None:
            if algorithm.deployment.trains():  # fine-tuning's steps are not DP-SGD's
                raise PrivacyRefused(
                    f"privacy.kind: sample_dp: {algorithm.name} fine-tunes each client's "
                    "deployed model on its training data with non-private SGD steps; set its "
                    "fine-tuning steps (finetune_steps, adapt_steps) to 0 (docs/privacy.md)"
                )
            shapes = [(k, p.shape) for k, p in self.model.module.named_parameters()]
            self.updates = (
                private_update(
                    self.STEP,
                    (BATCHES,),
                    self.step,
                    self.private,
                    shapes,
                    self.private_grads,
                    algorithm.name,
                ),
            )
        elif (stacked := self.stacked_form()) is not None:
            self.updates = (Update(self.STEP, (BATCHES,), self.step, stacked=stacked),)

    def data_grad(self, ops: Ops, carry: Carry, batch: Batch) -> tuple[Tree, torch.Tensor]:
        """grad F_k(w; B) and F_k(w; B) at the carry's ``params`` (``ops.loss_grad``): the
        minibatch's mean-loss gradient, or, with the private ops of sample-level DP, DP-SGD's
        private estimate of it (divided by the client's expected batch size q n)."""
        return ops.loss_grad(self.model, carry["params"], carry["buffers"], batch)

    def step_bytes(self, width: int) -> int:
        if self.private is None:
            return 0
        param_bytes = sum(p.numel() * p.element_size() for p in self.model.module.parameters())
        return self.private.step_bytes(param_bytes, width)

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        params, buffers = self.start(message, state, task)
        # own buffers: the forward pass updates BatchNorm statistics in place
        carry: Carry = {"params": params, "buffers": clone(buffers)}
        if self.momentum:
            carry["velocity"] = {k: torch.zeros_like(v) for k, v in params.items()}
        if self.optimizer is not None:
            carry[MOMENTS] = self.initial_moments(params, state)
        if self.corrected and state is not None:
            carry["state"] = {k: v for k, v in state.items() if k != MOMENTS}
        if self.private is not None:
            carry[DP_BATCH] = torch.tensor(self.private.expected_batch(task.data.num_train))
        return carry

    def initial_moments(self, params: Tree, state: State | None) -> Moments:
        """AdamW's moments at the first step: the client's kept ones (``moments: client``,
        once it has trained), else zero."""
        kept = self.kept_moments(state)
        return kept if kept is not None else init_moments(params)

    def kept_moments(self, state: State | None) -> Moments | None:
        """The client's AdamW moments from its state (``moments: client``), or None."""
        if self.optimizer is None or not self.optimizer.persist or state is None:
            return None
        return state.get(MOMENTS)

    def keep_moments(
        self, result: ClientResult, state: State | None, moments: Moments | None
    ) -> ClientResult:
        """``result`` with AdamW's final moments in the client's new state (``moments:
        client``; a result that leaves the state as it was keeps it with new moments)."""
        if self.optimizer is None or not self.optimizer.persist or moments is None:
            return result
        before = result.state if result.state is not None else state
        if before is None:
            raise ConfigError(
                f"train.optimizer.moments: client: {self.algorithm.name} keeps no client state; "
                "use moments: round (docs/optimizers.md)"
            )
        result.state = {**before, MOMENTS: moments}
        return result

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        return {"message": message, "lr": self.step_size(task)}

    def descend(self, ops: Ops, carry: Carry, grads: Tree, lr: float) -> Carry:
        """The carry after the local optimizer's step on ``grads`` (the keys that move): SGD's,
        with heavy-ball momentum when the program has it, or AdamW's (``train.optimizer``)."""
        new = dict(carry)
        params = carry["params"]
        if self.optimizer is not None:
            new["params"], new[MOMENTS] = adamw_step(
                params, grads, carry[MOMENTS], lr, self.optimizer
            )
            return new
        if self.momentum:
            grads = {
                k: torch.add(g, carry["velocity"][k], alpha=self.momentum) for k, g in grads.items()
            }
            new["velocity"] = grads
        new["params"] = ops.descend(params, grads, lr)
        return new

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        params = carry["params"]
        grads, loss = self.data_grad(ops, carry, batch)
        if self.correction is not None:
            extra = self.correction(params, shared["message"], carry.get("state"))
            if extra is not None:
                grads = {k: g + extra[k] for k, g in grads.items()}
        return self.descend(ops, carry, grads, shared["lr"]), {"loss": loss}

    def stacked_form(self) -> StackedFn | None:
        """``stacked_step`` where it is this program's ``step`` (not replaced by a subclass)
        on a stackable model (core/stacked.py) outside sample-level DP: the stacked form of
        the SGD steps of the FedAvg family, FedFomo, and FedALA's and FedAS's after their own
        phases; None: the step is vmapped."""
        if self.private is not None or self.model.stacked() is None:
            return None
        cls = type(self)
        own = all(
            getattr(cls, name) is getattr(SGDProgram, name)
            for name in ("step", "data_grad", "descend")
        )
        return self.stacked_step if own else None

    def stacked_step(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        """``step`` for C clients at once, in place on the stacked carry."""
        (batch,) = batches
        params = carry["params"]
        extra, rule = None, self.correction
        if rule is not None:
            message = shared["message"]

            def correction(p: Tree, state: State | None) -> Tree | None:
                return rule(p, message, state)

            extra = stacked_correction(correction, params, carry.get("state"))
        loss = stacked_sgd_step(
            self.model,
            params,
            batch,
            float(shared["lr"]),
            extra,
            carry.get("velocity"),
            self.momentum,
            adamw=self.optimizer,
            moments=carry.get(MOMENTS),
        )
        return carry, {"loss": loss}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        carry = run.carry
        start, _ = self.start(message, state, task)
        solved = LocalSolution(
            carry["params"],
            carry["buffers"],
            run.metric(self.STEP),
            start,
            self.step_size(task),
            run.steps.get(self.STEP, 0),
            carry.get("velocity"),
            carry.get(MOMENTS),
        )
        return self.keep_moments(self.upload(message, state, task, solved), state, solved.moments)

    def lean_sgd(
        self,
        message: Message,
        state: State | None,
        task: ClientTask,
        objective: BatchObjective | None = None,
        head: str | None = None,
        trainable: Collection[str] | None = None,
    ) -> ClientResult:
        """This program's SGD for one client on the one fused trainer
        (:func:`fedloom.solvers.local.local_sgd`): ``step`` as it is, or, with ``objective``,
        plain SGD on that minibatch objective (the objective programs), moving the
        ``trainable`` parameters (default: all; FedBABU's body). Its gradients are not
        private: under sample-level DP it refuses."""
        if self.private is not None:
            raise PrivacyRefused(
                f"privacy.kind: sample_dp: {self.algorithm.name}'s client program runs the "
                "lean trainer, whose gradients are not private (docs/privacy.md)"
            )
        params, buffers = self.start(message, state, task)
        correction, rule = None, self.correction
        if rule is not None:

            def correction(p: Tree) -> Tree | None:
                return rule(p, message, state)

        data, plan = task.data, self.algorithm.client_plan(task)
        solved = local_sgd(
            self.model,
            params,
            buffers,
            data.x_train,
            data.y_train,
            plan,
            self.step_size(task),
            correction,
            self.momentum,
            objective=objective,
            trainable=trainable,
            head=head,
            adamw=self.optimizer,
            moments=self.kept_moments(state),
            augment=self.augmentations({BATCHES: Plan(plan)}, task).get(BATCHES),
        )
        return self.keep_moments(self.upload(message, state, task, solved), state, solved.moments)


class PlainSGDProgram(SGDProgram):
    """:class:`SGDProgram` as it is (the FedAvg family's default program): the sequential
    backend runs it on the lean flat-buffer trainer, the same SGD fused for one client
    (executor-equivalence tests hold the two paths to 1e-4). Not for subclassing: a program
    with a step of its own derives from :class:`SGDProgram`.

    On a stackable model (core/stacked.py) the vmap backend runs the step for a whole chunk
    without ``vmap`` (``stacked_step``, as for every :class:`SGDProgram` that keeps its
    step: ``stacked_form``), except under sample-level DP."""

    def run_lean(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult | None:
        if self.private is not None:  # DP-SGD's per-sample steps: through ``step``
            return None
        return self.lean_sgd(message, state, task)
