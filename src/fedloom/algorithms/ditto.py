"""Ditto (Li et al., ICML 2021, arXiv:2012.04221, Algorithm 1). The labels
(8) (the paper's bilevel objective, Section 3) and (9) (the personal update of Algorithm 1) are
this docstring's own.

The bilevel problem (8): each client k keeps a personal model omega_k that minimizes
h_k(omega; theta*) = f_k(omega) + mu/2 ||omega - theta*||^2 (mu: the paper's lambda), while
theta* solves the ordinary federated problem G(f_1(theta), ..., f_K(theta)). The two are
decoupled: omega_k never enters the global update. One round::

    server broadcasts theta^t                       # the global algorithm's server_message
    client k (in parallel):
      theta_k^t <- UpdateGlobal(theta^t, f_k)       # the global algorithm's local work
      omega_k   <- omega_k - eta_p (grad f_k(omega_k) + mu (omega_k - theta^t))   # (9),
                   personal_steps times on minibatches of the stream (seed, round, k,
                   'ditto/personal'); eta_p = personal_lr (default train.lr)
      upload what the global algorithm uploads (Delta_k^t or theta_k^t, ...)
    server: theta^{t+1} <- Aggregate(theta^t, uploads)   # the global algorithm's aggregate

``UpdateGlobal`` / ``Aggregate`` are any registered horizontal algorithm (one with a global
model that communicates; FedAvg by default): ``global_algorithm: {name: scaffold, ...}`` is
validated with that algorithm's own config and built with the same AlgorithmContext. Ditto
delegates to it the server state, the server message, the local solver's hooks (start point,
plan, step size, momentum, gradient correction), the upload, the client weight and the
aggregation, so the global model is bit for bit the one the global algorithm alone computes.

The states are namespaced. Server: ``inner`` (the global algorithm's server state) and
``initial`` (theta^(0), never sent). Client: ``personal`` (omega_k: params and buffers, e.g. its
own BatchNorm statistics), ``steps`` (personal steps taken so far) and ``inner`` (the global
algorithm's client state; absent when it keeps none). omega_k^(0) = theta^(0) for every client,
as the pseudocode initializes all clients at the start, also for one first sampled late. A
client without a personal step (never sampled, or a held-out new client) deploys the global
model theta.

``mu_schedule`` decays mu over the rounds (strong alignment early, room to personalize late;
algorithms/schedule.py; docs/cold_start.md, "Decaying the proximal coefficient"): round t uses
mu_t in (9).

As in the paper's Algorithm 1, which runs s local iterations for both problems, the personal
problem gets as many steps as the global update completed (so a straggler doing partial work
does as many fewer); ``personal_steps`` fixes the number instead (``personal_steps: 1``: one
step of (9) per round). :class:`DittoProgram` is the global algorithm's
client program (whatever it is: FedAvg's SGD, SCAFFOLD's corrected SGD, APFL's two models)
with update (9) beside it at each local step, so the vmap backend runs both for whole chunks of
clients.

Deployed (personalized) model: omega_k. Global model: theta.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from pydantic import AliasChoices, Field, ValidationError, field_validator

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.client import client_program
from fedloom.algorithms.schedule import Schedule, schedule_field
from fedloom.algorithms.sgd_program import model_copy
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.errors import unknown_name_message
from fedloom.solvers.adamw import MOMENTS, adamw_step, init_moments
from fedloom.solvers.program import (
    BATCHES,
    Batch,
    Carry,
    ClientProgram,
    ClientRun,
    Ops,
    Plan,
    StackedFn,
    Update,
    UpdateFn,
)
from fedloom.solvers.sequential import run_steps
from fedloom.solvers.stacked_sgd import stacked_sgd_step
from fedloom.solvers.steps import loss_grad, prox_sgd_step

NOT_GLOBAL = ("ditto",)
"""Registered algorithms that cannot be Ditto's global algorithm besides those without a
global model: Ditto itself (its own personal models would be dropped)."""


def horizontal(cls: type[Algorithm]) -> bool:
    """Whether ``cls`` can serve as Ditto's UpdateGlobal/Aggregate: it trains one global
    model by communicating with clients that each hold their own data."""
    caps = cls.capabilities
    return (
        caps.has_global_model
        and caps.communicates
        and not caps.pooled
        and cls.name not in NOT_GLOBAL
    )


def validate_global_algorithm(value: Any) -> dict[str, Any]:
    """``global_algorithm`` (a name or a mapping with ``name``) validated by that algorithm's
    own Config; returns the full mapping (defaults filled in)."""
    from fedloom.algorithms import ALGORITHMS  # the registry imports this module
    from fedloom.core.validation import format_validation_error

    raw = {"name": value} if isinstance(value, str) else value
    if not isinstance(raw, dict) or "name" not in raw:
        raise ValueError("expected an algorithm name or a mapping with a 'name' key")
    name = str(raw["name"])
    allowed = [n for n in ALGORITHMS.names() if horizontal(ALGORITHMS.get(n))]
    if name not in ALGORITHMS:
        raise ValueError(unknown_name_message("algorithm", name, allowed))
    cls = ALGORITHMS.get(name)
    if not horizontal(cls):
        raise ValueError(
            f"'{name}' cannot be Ditto's global algorithm, which must train one global model "
            f"from the clients' data; allowed: {', '.join(allowed)}"
        )
    try:
        parsed = cls.Config.model_validate(raw)
    except ValidationError as err:
        raise ValueError(format_validation_error(err, cls.Config)) from None
    return parsed.model_dump()


class DittoConfig(AlgorithmConfig):
    mu: float = Field(
        default=0.1,
        ge=0.0,
        validation_alias=AliasChoices("mu", "lam"),
        description="proximal coefficient of (8)-(9), the paper's lambda (0 = local training)",
    )
    mu_schedule: Schedule = schedule_field("mu")
    personal_steps: int | None = Field(
        default=None, ge=1, description="steps of (9) per round (default: the global update's)"
    )
    personal_lr: float | None = Field(
        default=None, gt=0.0, description="step size of (9) (default: train.lr)"
    )
    global_algorithm: dict[str, Any] = Field(
        default={"name": "fedavg"},
        description="UpdateGlobal/Aggregate: any horizontal algorithm and its options",
    )

    @field_validator("global_algorithm", mode="before")
    @classmethod
    def _global_algorithm(cls, value: Any) -> dict[str, Any]:
        return validate_global_algorithm(value)


class Ditto(Algorithm):
    name = "ditto"
    summary = "Ditto: personal models proximal to a global model of any algorithm (Li et al.)"
    Config = DittoConfig

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.inner: Algorithm = self.global_algorithm(ctx)
        has_global_model = self.inner.capabilities.has_global_model
        self.capabilities = self.capabilities.but(has_global_model=has_global_model)
        self.wire = self.inner.wire  # the message and uploads are the global algorithm's

    def global_algorithm(self, ctx: AlgorithmContext) -> Algorithm:
        """UpdateGlobal/Aggregate: ``global_algorithm`` built with the same context."""
        from fedloom.algorithms import build_algorithm  # the registry imports this module

        return build_algorithm(self.config.global_algorithm, ctx)

    # -- server: the global algorithm's, next to the initial model -------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {
            "inner": self.inner.init_server_state(params, buffers),
            "initial": {"params": clone(params), "buffers": clone(buffers)},
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return self.inner.server_message(server["inner"], round)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return {**server, "inner": self.inner.aggregate(server["inner"], results)}

    def global_model(self, server: State) -> tuple[Tree, Tree] | None:
        return self.inner.global_model(server["inner"])

    def summary_extras(self, server: State) -> dict[str, Any]:
        return self.inner.summary_extras(server["inner"])

    # -- client state ----------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        """omega_k^(0) = theta^(0), the initial model (pseudocode: every client's personal model
        is initialized at the start), and the global algorithm's client state."""
        initial = server["initial"]
        state: State = {
            "personal": model_copy(initial),
            "steps": torch.zeros((), dtype=torch.int64),
        }
        inner = self.inner.init_client_state(server["inner"], client_id)
        if inner is not None:
            state["inner"] = inner
        return state

    @staticmethod
    def _inner_state(state: State | None) -> State | None:
        return None if state is None else state.get("inner")

    def make_program(self) -> ClientProgram:
        return DittoProgram(self)

    def personal_plan(self, task: ClientTask, global_steps: int) -> Plan:
        """Minibatches of (9) from the stream (seed, round, k, 'ditto/personal')."""
        cfg = self.config
        steps = cfg.personal_steps if cfg.personal_steps is not None else global_steps
        plan = self.ctx.make_plan(task.data, steps, "ditto/personal", task.round, task.client_id)
        return Plan(plan)

    def personal_view(
        self, personal: State, global_buffers: Tree, inner: State | None
    ) -> tuple[Tree, Tree]:
        """omega_k as the client trains and deploys it (default: its state's params and
        buffers; a PEFT strategy truncates it at the client's rank and gives it the
        server's residuals from ``global_buffers``, docs/peft.md)."""
        return personal["params"], personal["buffers"]

    def personal_anchor(
        self, message: Message, inner: State | None, task: ClientTask
    ) -> Tree | None:
        """theta in (9) when it differs per client (a PEFT strategy's: the global
        algorithm's start model of client k, with the keys it keeps on the client); None:
        the broadcast theta^t."""
        return None

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """omega_k; a client without a personal step yet (never sampled, or a held-out new
        client) deploys the global model theta instead of the initial omega_k^(0) (without
        one, e.g. under FedSA, the global algorithm's model of the client)."""
        inner = self._inner_state(state)
        if state is None or int(state["steps"]) == 0:
            model = self.global_model(server)
            if model is not None:
                return model
            return self.inner.deployed_model(server["inner"], inner, task)
        buffers = server["inner"].get("buffers", {})
        return self.personal_view(state["personal"], buffers, inner)


PERSONAL = "ditto/personal"
PERSONAL_MOMENTS = f"{MOMENTS}/personal"


class DittoProgram(ClientProgram):
    """The global algorithm's client program with the personal update (9) beside it: at each
    local step, the global algorithm's updates (on its carry ``inner``), then one step of (9) on
    omega_k (``personal``) while the client has personal minibatches left. (9) reads only
    omega_k and the broadcast theta^t, so running it beside the global update rather than after
    it changes nothing."""

    takes_optimizer = True
    """AdamW reaches the global algorithm's program (refused there if it takes none) and
    the personal update (9)."""

    def __init__(self, algorithm: Ditto) -> None:
        super().__init__(algorithm.ctx.model, algorithm.ctx.seed)
        self.algorithm = algorithm
        self.inner = client_program(algorithm.inner)
        # on a stackable model (core/stacked.py) the vectorized executor runs (9) and the
        # global algorithm's updates that have a stacked form without vmap
        personal = self.stacked_personal_step if self.model.stacked() is not None else None
        self.updates = (
            *(
                Update(u.name, u.plans, self._lift(u.fn), stacked=self._lift_stacked(u.stacked))
                for u in self.inner.updates
            ),
            Update("personal", (PERSONAL,), self.personal_step, stacked=personal),
        )

    @staticmethod
    def _lift(fn: UpdateFn) -> UpdateFn:
        def lifted(ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict) -> Any:
            inner, metrics = fn(ops, carry["inner"], batches, shared["inner"])
            return {**carry, "inner": inner}, metrics

        return lifted

    @staticmethod
    def _lift_stacked(fn: StackedFn | None) -> StackedFn | None:
        if fn is None:
            return None

        def lifted(carry: Carry, batches: tuple[Batch, ...], shared: dict) -> Any:
            inner, metrics = fn(carry["inner"], batches, shared["inner"])
            return {**carry, "inner": inner}, metrics

        return lifted

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        plans = self.inner.plans(message, Ditto._inner_state(state), task)
        global_steps = len(plans[BATCHES].batches)
        return {**plans, PERSONAL: self.algorithm.personal_plan(task, global_steps)}

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        return {
            "inner": self.inner.init(message, Ditto._inner_state(state), task),
            **self._personal_carry(message, state, task),
        }

    def _personal_carry(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        """omega_k (``personal``) and, when theta differs per client, its ``anchor``."""
        assert state is not None
        algorithm, inner = self.algorithm, Ditto._inner_state(state)
        params, buffers = algorithm.personal_view(state["personal"], message["buffers"], inner)
        carry: Carry = {"personal": {"params": params, "buffers": clone(buffers)}}
        if algorithm.ctx.optimizer is not None:
            carry[PERSONAL_MOMENTS] = init_moments(params)
        anchor = algorithm.personal_anchor(message, inner, task)
        if anchor is not None:
            carry["anchor"] = anchor
        return carry

    def shared(self, message: Message, task: ClientTask) -> dict:
        cfg = self.algorithm.config
        return {
            "inner": self.inner.shared(message, task),
            "anchor": message["params"],
            "mu": cfg.mu_schedule.at(cfg.mu, task.round, self.algorithm.ctx.rounds),
            "lr": cfg.personal_lr or task.lr,
        }

    def personal_step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """(9): omega <- omega - eta_p (grad f_k(omega) + mu (omega - theta^t)); with
        ``train.optimizer: adamw``, AdamW's step on that gradient (its own moments, zero at
        every round's start)."""
        (batch,) = batches
        personal, new = carry["personal"], dict(carry)
        anchor, mu, lr = carry.get("anchor", shared["anchor"]), shared["mu"], shared["lr"]
        optimizer = self.algorithm.ctx.optimizer
        if optimizer is None:
            params, loss = prox_sgd_step(
                ops, self.model, personal["params"], personal["buffers"], batch, lr, anchor, mu
            )
        else:
            omega = personal["params"]
            grads, loss = loss_grad(ops, self.model, omega, personal["buffers"], batch)
            grads = {k: g + mu * (omega[k] - anchor[k]) for k, g in grads.items()}
            params, new[PERSONAL_MOMENTS] = adamw_step(
                omega, grads, carry[PERSONAL_MOMENTS], lr, optimizer
            )
        new["personal"] = {"params": params, "buffers": personal["buffers"]}
        return new, {"loss": loss}

    def stacked_personal_step(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """(9) for a whole chunk at once, in place on the stacked omega: the proximal pull
        mu (omega - theta^t) as the step's extra gradient term."""
        omega = carry["personal"]["params"]
        anchor, mu = carry.get("anchor", shared["anchor"]), shared["mu"]
        pull = {k: mu * (w - anchor[k]) for k, w in omega.items()}
        loss = stacked_sgd_step(
            self.model,
            omega,
            batches[0],
            float(shared["lr"]),
            pull,
            adamw=self.algorithm.ctx.optimizer,
            moments=carry.get(PERSONAL_MOMENTS),
        )
        return carry, {"loss": loss}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        inner_run = ClientRun(run.carry["inner"], run.metrics, run.steps)
        inner = self.inner.finish(message, Ditto._inner_state(state), task, inner_run)
        return self._result(state, inner, run.carry["personal"], run.steps.get("personal", 0))

    def run_lean(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult | None:
        """Where the global algorithm has a fused sequential trainer (the FedAvg family), its
        round runs there (the global model bit for bit the global algorithm's alone), then the
        steps of (9). Not for a model with dropout: its masks come from one stream per client,
        drawn in the order the updates run, and the vmap backend interleaves (9) with the
        global steps (docs/executors.md, "Dropout"); the generic path does the same."""
        if self.model.has_dropout:
            return None
        inner = self.inner.run_lean(message, Ditto._inner_state(state), task)
        if inner is None:
            return None
        assert state is not None
        global_steps = len(
            self.inner.plans(message, Ditto._inner_state(state), task)[BATCHES].batches
        )
        plans = {PERSONAL: self.algorithm.personal_plan(task, global_steps)}
        carry = self._personal_carry(message, state, task)
        only = SimpleNamespace(updates=self.updates[-1:], augmentations=self.augmentations)
        run = run_steps(only, carry, plans, self.shared(message, task), task, 0)  # type: ignore[arg-type]
        return self._result(state, inner, run.carry["personal"], run.steps["personal"])

    @staticmethod
    def _result(
        state: State | None, inner: ClientResult, personal: State, personal_steps: int
    ) -> ClientResult:
        """The global algorithm's result, with omega_k moved by (9) in the client state."""
        assert state is not None
        new_state: State = {"personal": personal, "steps": state["steps"] + personal_steps}
        kept = inner.state if inner.state is not None else Ditto._inner_state(state)
        if kept is not None:
            new_state["inner"] = kept
        return ClientResult(inner.upload, inner.weight, inner.loss, new_state, inner.info)
