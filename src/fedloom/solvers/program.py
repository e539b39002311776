"""The client program: one statement of a client's local work that every backend runs.

An algorithm states its client side once, as a :class:`ClientProgram` (FedJAX's
``client_init`` / ``client_step`` / ``client_final``)::

    carry  <- program.init(message, state, task)          # per client, in Python
    for each local step s (the longest client's budget):
        for each update u of program.updates, in order:
            if client c has a minibatch of u's plans at step s:
                carry_c, metrics <- u.fn(ops, carry_c, batches_c, shared)   # pure tensors
    result <- program.finish(message, state, task, carry, metrics)   # per client, in Python

An update that needs random tensors at each step (DP-SGD's Gaussian noise) declares ``u.draw``:
the backends call it outside ``vmap`` with the client's own generator, stream (seed, round,
client, 'draws/<u.name>'), once per step the client takes, and hand the result to ``u.fn`` as
the lead minibatch's ``draws``. Generators are not supported under ``vmap``; this way every
backend draws the same numbers for the same client.

``u.fn`` is a pure function of tensors: no Python branching on tensor values, no in-place
writes to its inputs (except what the model's forward does to BatchNorm buffers and what
``ops.descend`` may do to the parameters it is handed), every gradient through ``ops``. The
sequential backend (solvers/sequential.py) calls it on one client at a time with reverse-mode
autograd; the vmap backend (solvers/vmap.py) calls it once per step for a whole chunk of
clients under ``torch.func.vmap``, masking out the clients that have no minibatch at that
step. Both follow the same trajectory up to float summation order.

Each update consumes one minibatch of each of its named plans per step (the engine's plan
``batches``, or the algorithm's own streams such as Per-FedAvg's ``perfedavg/outer``), and a
client's plans may start at a later step (FedRep's body phase starts after its head phase):
:class:`Plan` holds the minibatches and that start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from fedloom.data.augment import Augmentation, Augmenter

if TYPE_CHECKING:
    from fedloom.core.functional import FunctionalModel
    from fedloom.core.protocol import ClientResult, ClientTask, Message, State

Carry = dict[str, Any]
"""A client's working variables during its local steps: a nested dict of tensors."""

BATCHES = "batches"
"""Name of the engine's minibatch plan of the round (``ClientTask.plan``)."""


@dataclass(frozen=True)
class Batch:
    """One minibatch as an update sees it: inputs, targets and per-sample weights (1 for a real
    sample, 0 for padding that the vmap backend adds to equalize batch sizes), and the step's
    random draws (``Update.draw``; on the lead minibatch only, else None). A minibatch may be
    empty (a Poisson-sampled step that drew no sample): the update still runs."""

    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    draws: dict[str, torch.Tensor] | None = None

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The mean of ``per_sample`` over the real samples (0 for an all-padding batch)."""
        return weighted_mean(per_sample, self.w)


def weighted_mean(per_sample: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """sum_i w_i v_i / sum_i w_i of one value per sample: the mean over the real samples of a
    padded batch (0 if there are none); the plain mean when ``w`` is None."""
    if w is None:
        return per_sample.mean()
    return (per_sample * w).sum() / w.sum().clamp_min(1.0)


class Ops(Protocol):
    """How an update takes gradients: the one thing that differs between backends, and what
    sample-level DP replaces. Under ``privacy.kind: sample_dp`` an update receives
    ``ops.PrivateOps``: ``loss_grad`` is DP-SGD's private gradient, counted per step, and
    ``value_and_grad`` / ``value_and_grad_aux`` raise (docs/privacy.md)."""

    def loss_grad(
        self,
        model: FunctionalModel,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        batch: Batch,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The data gradient: (d F / d params, F) of the model's mean loss F on ``batch``'s
        real samples; under sample-level DP, DP-SGD's noised mean of clipped per-sample
        gradients on it. In training mode the forward pass updates ``buffers`` in place."""
        ...

    def value_and_grad(
        self, f: Callable[..., torch.Tensor], params: dict[str, torch.Tensor], *args: Any
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(d f / d params, f) at ``params``; ``f(params, *args)`` returns a scalar. May be
        nested inside ``f`` of an outer call (second-order methods)."""
        ...

    def value_and_grad_aux(
        self,
        f: Callable[..., tuple[torch.Tensor, Any]],
        params: dict[str, torch.Tensor],
        *args: Any,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any]:
        """(d f / d params, f, aux) for ``f(params, *args)`` returning (scalar, aux): values of
        the same forward pass the gradient needs no part of (FedCR's class statistics)."""
        ...

    def descend(
        self,
        params: dict[str, torch.Tensor],
        grads: dict[str, torch.Tensor],
        lr: float | torch.Tensor,
        anchor: dict[str, torch.Tensor] | None = None,
        mu: float = 0.0,
    ) -> dict[str, torch.Tensor]:
        """params - lr (grads + mu (params - anchor)) on the keys of ``grads`` (mu = 0: plain
        SGD). The vmap backend may write into ``params`` (see FuncOps): a caller hands over
        ``params`` and uses only the result."""
        ...


UpdateFn = Callable[[Ops, Carry, tuple[Batch, ...], dict[str, Any]], tuple[Carry, dict]]
"""(ops, carry, batches, shared) -> (new carry, metrics): one update of one client at one step.
``metrics`` maps names to 0-d tensors (``loss`` at least); the backends average each over the
steps the update ran."""


Draw = Callable[[torch.Generator], dict[str, torch.Tensor]]
"""(generator) -> tensors of fixed shapes: one step's random inputs of an update."""

StackedFn = Callable[[Carry, tuple[Batch, ...], dict[str, Any]], tuple[Carry, dict]]
"""(carry, batches, shared) -> (carry, metrics) for C clients at once: every carry tensor and
minibatch stacked along a leading client dimension, every client taking the step; the carry's
tensors may be updated in place. Metrics are (C,) tensors."""


@dataclass(frozen=True)
class Update:
    """One named update of a local step, consuming one minibatch of each plan in ``plans`` (and,
    with ``draw``, one draw of random tensors from the client's stream 'draws/<name>')."""

    name: str
    plans: tuple[str, ...]
    fn: UpdateFn
    draw: Draw | None = None
    stacked: StackedFn | None = None
    """The same update for a whole chunk at once without ``vmap`` (core/stacked.py), which
    the vmap backend runs instead of vmapping ``fn`` when every client of the call takes the
    step; None: ``fn`` is vmapped."""

    @property
    def draw_purpose(self) -> str:
        """The purpose of the client's stream that ``draw`` reads (core/rng.py)."""
        return f"draws/{self.name}"


@dataclass
class Plan:
    """A client's minibatches (index tensors into its training data) for one named plan, and
    the local step at which the first is used."""

    batches: list[torch.Tensor]
    start: int = 0
    inputs: torch.Tensor | None = None
    """The rows the minibatches index, one per training sample (None: the client's training
    inputs; the targets are always its training targets). A program whose update reads a
    fixed function of the inputs computes it once and hands it over here: FedRep's head
    phase trains on the frozen body's features (algorithms/fedrep.py). Such a plan's
    minibatches are not augmented (``ClientProgram.augmentations``)."""

    @property
    def end(self) -> int:
        return self.start + len(self.batches)


class RoundExtent:
    """The most local steps and the widest minibatch among a round's plans so far: the shape
    of tables of per-step draws in a carry (FedCR's noise), which the vmap backend stacks
    over a chunk, so every client's must have one shape. The backends make every client's
    plans before any client's carry; a table padded to this shape holds the same draws."""

    def __init__(self) -> None:
        self.round, self.steps, self.width = -1, 0, 0

    def covering(self, round: int, plan: list[torch.Tensor]) -> tuple[int, int]:
        """(steps, width) of the round's plans seen so far and ``plan``."""
        steps, width = (self.steps, self.width) if round == self.round else (0, 0)
        return max(steps, len(plan)), max([width, *(b.shape[0] for b in plan)])

    def add(self, round: int, plan: list[torch.Tensor]) -> None:
        """Count ``plan`` among the round's plans."""
        self.steps, self.width = self.covering(round, plan)
        self.round = round


@dataclass
class ClientRun:
    """What a backend hands to ``finish``: the final carry and the mean of every metric of
    every update over the steps it ran (``{update: {metric: mean}}``) and the step counts."""

    carry: Carry
    metrics: dict[str, dict[str, float]]
    steps: dict[str, int] = field(default_factory=dict)

    def metric(self, update: str, name: str = "loss") -> float:
        return self.metrics.get(update, {}).get(name, 0.0)


class ClientProgram:
    """Base of client programs. Subclasses set ``updates`` and implement ``init``, ``plans``
    and ``finish``; ``shared`` holds the round's values common to every client.

    ``model`` is the functional model the updates differentiate, ``seed`` the run's seed (the
    sequential backend draws each client's dropout masks from (seed, round, client))."""

    updates: tuple[Update, ...] = ()

    augment: Augmenter | None = None
    """The dataset's train-time augmentation (data/augment.py; set by the algorithm from its
    context): every backend trains on each plan's minibatches augmented by the draws of
    :meth:`augmentations`, so they all see the same samples."""

    takes_optimizer: ClassVar[bool] = False
    """Whether the program's local steps are ``train.optimizer``'s (SGD or AdamW,
    solvers/adamw.py); False: its steps are its own and ``train.optimizer: adamw`` is refused.
    Read on the class that defines ``step`` (or declares this), so a subclass that replaces
    the step must declare it again (:func:`takes_optimizer`)."""

    keeps_moments: ClassVar[bool] = False
    """Whether the program keeps AdamW's moments in the client's state across rounds when
    ``train.optimizer.moments`` is ``client`` (``SGDProgram``); False: that is refused."""

    def __init__(self, model: FunctionalModel, seed: int) -> None:
        self.model = model
        self.seed = seed

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        """The named minibatch plans of client ``task.client_id`` this round."""
        raise NotImplementedError

    def augmentations(self, plans: dict[str, Plan], task: ClientTask) -> dict[str, Augmentation]:
        """Each plan's augmentation draws for client ``task.client_id`` (stream (seed, round,
        client, 'augment') for the round's plan ``batches``, 'augment/<name>' for the others);
        empty without augmentation. A plan with inputs of its own (``Plan.inputs``) is not
        augmented."""
        if self.augment is None:
            return {}
        return {
            name: self.augment.draw(plan.batches, name, task.round, task.client_id)
            for name, plan in plans.items()
            if plan.inputs is None
        }

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        """The client's carry before its first step (fresh tensors the updates may replace)."""
        raise NotImplementedError

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        """Inputs every client of the round shares (broadcast model, step sizes, coefficients):
        not stacked by the vmap backend. ``task`` is any client's of the round."""
        return {}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        """The client's result (upload, weight, new state) from its final carry."""
        raise NotImplementedError

    def passes_per_step(self) -> float:
        """Forward-and-backward passes of one local step, relative to one minibatch gradient
        (default: one per update; pFedMe's K inner steps, Per-FedAvg's second gradient):
        the work auto's cost model (engine/auto.py) counts per step."""
        return float(len(self.updates))

    def step_bytes(self, width: int) -> int:
        """Working memory of one client's step beyond the usual gradients and activations
        (``width`` samples a minibatch): DP-SGD's per-sample gradients. The vmap backend sizes
        its chunks with it."""
        return 0

    def run_lean(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult | None:
        """A fused one-client implementation of this same program for the sequential backend
        (the plain SGD program runs on the lean flat-buffer trainer), or None: the backend
        steps through ``updates``. Executor-equivalence tests hold the two to 1e-4."""
        return None


class CoveringPlans(ClientProgram):
    """A program whose carry holds tables of per-step draws padded to the round's longest and
    widest plan (FedCP's Gumbel noise, FedCR's eps): it counts every plan it makes in
    ``extent`` (:class:`RoundExtent`) for ``init`` to read. Put before the program's base."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extent = RoundExtent()

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        plans = super().plans(message, state, task)
        self.extent.add(task.round, plans[BATCHES].batches)
        return plans


def takes_optimizer(program: ClientProgram) -> bool:
    """``takes_optimizer`` as declared by the first class of the program's MRO that defines
    ``step`` or declares it: a subclass that replaces an optimizer-aware step with one of its
    own is not optimizer-aware until it says so."""
    for cls in type(program).__mro__:
        if "takes_optimizer" in vars(cls) or "step" in vars(cls):
            return bool(vars(cls).get("takes_optimizer", False))
    return False
