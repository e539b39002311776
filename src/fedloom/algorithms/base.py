"""The algorithm interface: four small pure pieces around a shared engine
(docs/adding_an_algorithm.md).

An algorithm says what the server sends (``server_message``), what one client does with it
(``client_update``), how the server folds the uploads into its state (``aggregate``) and which
model each client deploys (``deployed_model``). Persistent per-client state is declared by
``init_client_state`` and owned by the engine, which stores, checkpoints and (later) stacks it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedloom.algorithms.weights import objective_weight
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone, num_bytes
from fedloom.core.settings import FrozenModel
from fedloom.errors import ConfigError
from fedloom.models.base import FedModel
from fedloom.registry import Registry
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, ClientRun, Ops, Plan, Update
from fedloom.solvers.adamw import MOMENTS, AdamW, Moments, adamw_step, init_moments
from fedloom.solvers.dpsgd import DPSGD
from fedloom.solvers.local import BatchObjective, LocalSolution, PlanMaker, local_sgd
from fedloom.solvers.ops import DP_BATCH, PrivacyRefused, private_update
from fedloom.solvers.program import takes_optimizer
from fedloom.solvers.sequential import run_client
from fedloom.solvers.stacked_sgd import finetune_stacked, stacked_correction, stacked_sgd_step


class AlgorithmConfig(FrozenModel):
    """Base of every algorithm's hyperparameters; unknown keys are errors."""

    name: str


@dataclass
class AlgorithmContext:
    """What the engine hands an algorithm: the model as functions, training settings, the
    server's aggregation rule (the single place robust rules plug in), and how to make the
    fine-tuning plan for a client."""

    model: FunctionalModel
    seed: int
    num_clients: int
    lr: float
    batch_size: int | None
    aggregate: Callable[[list[Tree], list[float]], Tree]
    """(trees, weights) -> tree: weighted mean unless a robust rule replaces it."""
    make_plan: PlanMaker
    """(client_data, num_steps, purpose, round, client_id) -> minibatch index tensors."""
    rounds: int = 1
    """train.rounds: the horizon T of round schedules (algorithms/schedule.py)."""
    population: dict[int, int] = field(default_factory=dict)
    """Training samples of every training client (held-out new clients excluded): the
    weights of the global objective sum_k p_k F_k."""
    sample_dp: DPSGD | None = None
    """DP-SGD's settings when ``privacy.kind`` is ``sample_dp``: the local steps of programs
    that support it (``SGDProgram.private_step``) clip per-sample gradients and add noise."""
    optimizer: AdamW | None = None
    """AdamW's settings when ``train.optimizer.kind`` is ``adamw`` (solvers/adamw.py): the
    local steps of programs that take it (``SGDProgram``) are AdamW's; None: SGD's."""

    def objective_weight(self, client_id: int, weighting: str) -> float:
        """p_k of client k in the global objective (algorithms/weights.py)."""
        return objective_weight(weighting, client_id, self.population)


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "algorithm.name")
"""Every algorithm by name: a subclass of :class:`Algorithm` that sets ``name`` registers itself
when its module is imported (``fedloom.algorithms`` imports every module of the package)."""


class Algorithm:
    """Base class. Subclasses set ``name``, ``summary`` and ``Config`` and override the hooks;
    setting ``name`` registers the class in ``ALGORITHMS``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            ALGORITHMS.add(cls.name, cls, replace_same=True)

    name: ClassVar[str]
    summary: ClassVar[str]
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    communicates: ClassVar[bool] = True
    """False for algorithms that send nothing (local-only, centralized): bytes stay 0."""
    pooled: ClassVar[bool] = False
    """True for the centralized reference: one virtual client holds all training data."""
    has_global_model: ClassVar[bool] = True
    classification_only: ClassVar[str] = ""
    """Why the algorithm needs a classification task (class counts, prototypes ...); empty:
    any task. Checked when the algorithm is built."""
    averages_client_models: ClassVar[bool] = False
    """The server step is ``aggregate_models`` of the uploaded models (one ``ctx.aggregate`` of
    the clients' parameters): client-level DP (privacy.kind client_dp) can clip each client's
    update and noise the average. Declared by FedAvg (and what inherits its server), the
    server optimizers of FedOpt and FedLC."""

    supports_sample_dp: ClassVar[bool] = False
    """Sample-level DP-SGD (privacy.kind sample_dp) covers everything the clients compute from
    their data and upload: the client program is an :class:`SGDProgram` whose steps take the
    data gradient through ``data_grad``, on the engine's round plan (one Poisson minibatch a
    step). Declared by FedAvg (and its heirs that keep its program), FedProx, SCAFFOLD,
    FedDyn, FedNova, the server optimizers, the partial-sharing family and local training.
    The declaration is checked when the config is parsed; that the steps really are private
    is enforced when they run (``SGDProgram``: the private ops, docs/privacy.md), so an heir
    that overrides ``step`` is private or refused, never silently neither."""

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        self.config = config
        self.ctx = ctx
        self._program: ClientProgram | None = None
        if self.classification_only and ctx.model.task != "classification":
            raise ConfigError(
                f"algorithm.name: {self.name} needs a classification task "
                f"({self.classification_only}), got {ctx.model.task}"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_program": None}  # programs hold vmapped closures

    @classmethod
    def model_for(cls, module: FedModel, config: AlgorithmConfig) -> FedModel:
        """The model a run of this algorithm trains, evaluates and deploys, made from the
        configured one (or the one handed to ``fedloom.run``) before anything else sees it
        (engine/build.py): ``module`` itself by default. FedCP and GPFL put trainable modules
        of their own beside its head (algorithms/feature_heads.py), FedEM makes a mixture of
        copies of it (models/mixture.py); their parameters are then the run's like the model's
        own: initialized, sent, checkpointed and stacked by every executor."""
        return module

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {"params": params, "buffers": buffers}

    def server_message(self, server: State, round: int = 0) -> Message:
        """What every client of round ``round`` receives (default: the global model; FedProx
        adds its scheduled mu, SCAFFOLD its control variate)."""
        return {"params": server["params"], "buffers": server["buffers"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        raise NotImplementedError

    def global_model(self, server: State) -> tuple[Tree, Tree] | None:
        return (server["params"], server["buffers"]) if self.has_global_model else None

    def download_bytes(self, message: Message, clients: Sequence[int]) -> int:
        """Bytes ``clients`` download of ``message`` together (default: each all of it; FPFC
        sends each client only its own row of a per-client table). Once per round, not per
        client: 1,000 clients a round (W3)."""
        return len(clients) * sum(num_bytes(tree) for tree in message.values())

    def summary_extras(self, server: State) -> dict[str, Any]:
        """Algorithm-specific results for summary.json's ``extras`` (FPFC's clusters,
        pFedMac's sparsity); empty by default."""
        return {}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State | None:
        """Initial persistent state of a client (None: the algorithm keeps none)."""
        return None

    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        """The minibatches of the local solver (default: the engine's plan for the round; the
        engine's load balancing and cost model count them too)."""
        return task.plan

    def client_program(self) -> ClientProgram:
        """The client side as one program (solvers/program.py) that every executor runs,
        made once by ``make_program``, training on augmented minibatches when the dataset
        declares augmentation (``ctx.make_plan.augment``, data/augment.py)."""
        if self._program is None:
            program = self.make_program()
            program.augment = self.ctx.make_plan.augment
            if self.ctx.optimizer is not None:
                refuse_adamw(self, program)
            self._program = program
        return self._program

    def sgd_only(self) -> str:
        """Why this algorithm's local steps must be SGD's (its server reads gradients off the
        SGD trajectory), refusing ``train.optimizer: adamw``; empty (the default): AdamW
        applies wherever its client program takes ``train.optimizer`` (docs/optimizers.md)."""
        return ""

    def make_program(self) -> ClientProgram:
        """By default FedAvg's local SGD (:class:`PlainSGDProgram` with its default options);
        the FedAvg family states its differences as options of that program (FedProx's
        correction, SCAFFOLD's finish, ...), algorithms with other local work return their own
        program (pFedMe, Ditto, APFL, Per-FedAvg, ...)."""
        return PlainSGDProgram(self)

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        """One client's round on the sequential backend (what the sequential executor runs)."""
        return run_client(self.client_program(), message, state, task)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The model client ``task.client_id`` uses for inference (its personalized model)."""
        model = self.global_model(server)
        assert model is not None, f"{self.name} must override deployed_model"
        return model

    def deployed_models(
        self,
        server: State,
        states: Sequence[State | None],
        tasks: Sequence[ClientTask],
        batched: bool = False,
    ) -> list[tuple[Tree, Tree]]:
        """Every client's ``deployed_model``. ``batched``: the executor runs clients stacked,
        and an algorithm whose deployment trains does it for all of them at once
        (``batched_deployment``)."""
        models = self.batched_deployment(server, tasks) if batched else None
        if models is not None:
            return models
        return [self.deployed_model(server, s, t) for s, t in zip(states, tasks, strict=True)]

    def batched_deployment(
        self, server: State, tasks: Sequence[ClientTask]
    ) -> list[tuple[Tree, Tree]] | None:
        """Every client's deployed model trained at once (``finetuned_models``), or None:
        deploy one client at a time (the default; deployments that do not train)."""
        return None

    def deployment_trains(self) -> bool:
        """Whether ``deployed_model`` trains (fine-tunes on the client's data): executors
        with worker processes then run the deployments there (engine/processes.py)."""
        return False

    # -- monitoring -------------------------------------------------------------------------
    def client_delta(self, message: Message, result: ClientResult) -> Tree | None:
        """What a client's round moved, for the update norms and cosine similarities of the
        monitoring (engine/monitoring.py): the uploaded ``params`` minus the broadcast ones
        on the keys both have, an uploaded ``delta``, or minus an uploaded gradient; None
        when the upload holds no model-shaped update (FedProto's prototypes)."""
        upload = result.upload
        if "delta" in upload:
            return upload["delta"]
        if "grad" in upload:
            return {k: -g for k, g in upload["grad"].items()}
        if "params" in upload and "params" in message:
            sent = message["params"]
            common = [k for k in upload["params"] if k in sent]
            if common:
                return {k: upload["params"][k] - sent[k] for k in common}
        return None

    # -- serving a client that never trained (cold start, ``eval.new_clients``) -----------
    def new_client_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        """Where a new client starts: adaptation step 0 of the cold-start evaluation (default:
        the global model; without one, what a client with fresh state deploys). pFedHN
        generates it from an embedding fitted on the client's data."""
        model = self.global_model(server)
        if model is not None:
            return model
        state = self.init_client_state(server, task.client_id)
        return self.deployed_model(server, state, task)

    def adaptation_keys(self) -> list[str] | None:
        """The parameters a new client fine-tunes in the cold-start evaluation (None: all;
        FedPer and FedRep: the head)."""
        return None

    def adaptation_lr(self) -> float | None:
        """Step size of a new client's fine-tuning when ``eval.adapt_lr`` is not set (None:
        ``train.lr``; Per-FedAvg: its inner step size alpha, the step it meta-learned for)."""
        return None


def refuse_adamw(algorithm: Algorithm, program: ClientProgram) -> None:
    """A config error naming ``algorithm`` when ``train.optimizer: adamw`` cannot apply to it:
    it declares its steps SGD-only (``sgd_only``), its program's steps are its own
    (solvers/program.py, ``takes_optimizer``), or its moments should persist (``moments:
    client``) in a client state it does not keep, or its program does not keep them
    (``keeps_moments``)."""
    reason = algorithm.sgd_only()
    if not reason and not takes_optimizer(program):
        reason = (
            "has local steps of its own (its client program does not take the shared SGD "
            "step that AdamW replaces)"
        )
    if reason:
        raise ConfigError(
            f"train.optimizer: adamw: {algorithm.name} {reason}; use train.optimizer: sgd "
            "or another algorithm (docs/optimizers.md)"
        )
    optimizer = algorithm.ctx.optimizer
    keeps_state = type(algorithm).init_client_state is not Algorithm.init_client_state
    if optimizer is not None and optimizer.persist and not keeps_state:
        raise ConfigError(
            f"train.optimizer.moments: client: {algorithm.name} keeps no client state to hold "
            "AdamW's moments across rounds; use moments: round (docs/optimizers.md)"
        )
    if optimizer is not None and optimizer.persist and not program.keeps_moments:
        raise ConfigError(
            f"train.optimizer.moments: client: {algorithm.name}'s client program starts AdamW's "
            "moments from zero every round; use moments: round (docs/optimizers.md)"
        )


def finetuned_models(
    ctx: AlgorithmContext,
    start: tuple[Tree, Tree],
    tasks: Sequence[ClientTask],
    steps: int,
    purpose: str,
    lr: float,
    trainable: Collection[str] | None = None,
) -> list[tuple[Tree, Tree]] | None:
    """``start`` after ``steps`` SGD steps at ``lr`` on each client's training data (minibatches
    from the stream (seed, purpose, round, client)), every client at once on the stacked model
    (solvers/stacked_sgd.py): a ``batched_deployment`` that fine-tunes (FedAvg-FT, the
    meta-learners, FedBABU), moving only the ``trainable`` parameters (default: all); None when
    the model cannot run stacked."""
    model = ctx.model
    if model.stacked() is None:
        return None
    plans = [
        ctx.make_plan(t.data, steps, purpose, t.round, t.client_id) if steps else [] for t in tasks
    ]
    augments = [
        ctx.make_plan.augmentation(p, purpose, t.round, t.client_id)
        for p, t in zip(plans, tasks, strict=True)
    ]
    datas = [t.data for t in tasks]
    starts = [start] * len(tasks)
    return finetune_stacked(model, starts, datas, plans, lr, trainable, augments=augments)


def average_buffers(
    ctx: AlgorithmContext, server: State, results: list[ClientResult], weights: list[float]
) -> Tree:
    """Weighted mean of the uploaded ``buffers`` (BatchNorm statistics) by ``ctx.aggregate``,
    or the server's when the model has none; for algorithms whose parameter update is not an
    average."""
    if not server["buffers"]:
        return server["buffers"]
    return ctx.aggregate([r.upload["buffers"] for r in results], weights)


def aggregate_models(
    ctx: AlgorithmContext, results: list[ClientResult], weights: list[float] | None = None
) -> State:
    """Weighted mean (``ctx.aggregate``) of the uploaded ``params`` and ``buffers``: FedAvg's
    server step, weighted by the results' weights unless ``weights`` are given."""
    w = weights if weights is not None else [r.weight for r in results]
    return {
        "params": ctx.aggregate([r.upload["params"] for r in results], w),
        "buffers": ctx.aggregate([r.upload["buffers"] for r in results], w)
        if results[0].upload["buffers"]
        else {},
    }


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
            if algorithm.deployment_trains():  # fine-tuning's steps are not DP-SGD's
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
    without ``vmap`` (``stacked_step``), except under sample-level DP."""

    def __init__(self, algorithm: Algorithm, **options: Any) -> None:
        super().__init__(algorithm, **options)
        if self.private is None and self.model.stacked() is not None:
            self.updates = (Update(self.STEP, (BATCHES,), self.step, stacked=self.stacked_step),)

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

    def run_lean(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult | None:
        if self.private is not None:  # DP-SGD's per-sample steps: through ``step``
            return None
        return self.lean_sgd(message, state, task)
