"""The algorithm interface: what an algorithm author decides, around a shared engine
(docs/adding_an_algorithm.md).

An algorithm states its server state (``init_server_state``) and what the server sends
(``server_message``), what one client does with it (``make_program``: one client program
that every executor runs, on the minibatches of ``client_plan``), how the server folds the
uploads into its state (``aggregate``) and which model each client deploys
(``deployed_model``; ``global_model`` when there is one). Persistent per-client state is
declared by ``init_client_state`` and owned by the engine. Everything other subsystems need
is declared beside these, not as methods: the traits the config rules read in one frozen
:class:`~fedloom.algorithms.capabilities.Capabilities` (``capabilities``), serving many
clients, fine-tuning and cold start in a :class:`~fedloom.algorithms.deployment.Deployment`
(``Deployment``), and the bytes and update deltas of what crosses the network in a
:class:`~fedloom.algorithms.wire.Wire` (``wire``). The engine enters every algorithm the same
way: ``client_program(algorithm)`` (algorithms/client.py), run by the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedloom.algorithms import deployment
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.weights import objective_weight
from fedloom.algorithms.wire import Wire
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.core.settings import FrozenModel
from fedloom.errors import ConfigError
from fedloom.models.base import FedModel
from fedloom.registry import Registry
from fedloom.solvers import ClientProgram
from fedloom.solvers.adamw import AdamW
from fedloom.solvers.dpsgd import DPSGD
from fedloom.solvers.local import PlanMaker


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
    """Base class. Subclasses set ``name``, ``summary`` and ``Config`` (and, where they differ
    from the defaults, ``capabilities``, ``Deployment`` and ``wire``) and override the hooks;
    setting ``name`` registers the class in ``ALGORITHMS``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            ALGORITHMS.add(cls.name, cls, replace_same=True)

    name: ClassVar[str]
    summary: ClassVar[str]
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    capabilities: Capabilities = Capabilities()
    """What the algorithm can take part in (read by the config rules and the engine); an
    instance whose traits depend on its config replaces it in ``__init__``."""
    Deployment: ClassVar[type[deployment.Deployment]] = deployment.Deployment
    """How its clients are served (``self.deployment``, made with the algorithm)."""
    wire: Wire = Wire()
    """What its clients download of a message and what an upload moved, declared (counted and
    monitored by the engine); an instance whose traffic depends on its config or population
    replaces it in ``__init__``."""

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        self.config = config
        self.ctx = ctx
        self.deployment = self.Deployment(self)
        self._program: ClientProgram | None = None
        needs = self.capabilities.classification_only
        if needs and ctx.model.task != "classification":
            raise ConfigError(
                f"algorithm.name: {self.name} needs a classification task "
                f"({needs}), got {ctx.model.task}"
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
        if not self.capabilities.has_global_model:
            return None
        return server["params"], server["buffers"]

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

    def make_program(self) -> ClientProgram:
        """The client side as one program (solvers/program.py) that every executor runs. By
        default FedAvg's local SGD (:class:`PlainSGDProgram` with its default options); the
        FedAvg family states its differences as options of that program (FedProx's
        correction, SCAFFOLD's finish, ...), algorithms with other local work return their own
        program (pFedMe, Ditto, APFL, Per-FedAvg, ...)."""
        return PlainSGDProgram(self)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The model client ``task.client_id`` uses for inference (its personalized model)."""
        model = self.global_model(server)
        assert model is not None, f"{self.name} must override deployed_model"
        return model


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
