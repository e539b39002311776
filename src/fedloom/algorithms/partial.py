"""Partial model sharing: part of the model is federated, the rest stays on each client.

FedBN keeps the normalization layers local, FedPer and FedCR the head, LG-FedAvg the body. All
of them follow one pattern, written here once::

    server state:  the shared parameters and buffers (+ the initial local part, for clients
                   that have none yet; kept on the server, never sent)
    client state:  its local parameters and buffers, and how many local steps it has taken
    client round:  local SGD from [shared from the server, own local part]   (local_start)
                   upload the shared part, keep the local part                (local_finish)
    server:        average the shared uploads with the engine's aggregation rule
    deploy:        [shared, own local part]; a client that never trained gets
                   ``fresh_client_model`` (FedBN calibrates its statistics, FedPer may
                   fine-tune the head)

A subclass says which keys are local (``local_keys``) and how clients are weighted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, aggregate_models
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.deployment import LocalPartDeployment
from fedloom.algorithms.sgd_program import PlainSGDProgram, model_copy
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone, select
from fedloom.errors import ConfigError
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


@dataclass(frozen=True)
class KeySplit:
    """A model's parameter and buffer keys, split into the shared and the local part."""

    param_keys: list[str]
    buffer_keys: list[str]
    shared_params: list[str]
    shared_buffers: list[str]
    local_params: list[str]
    local_buffers: list[str]

    @classmethod
    def of(cls, model: FunctionalModel, local: set[str]) -> KeySplit:
        params, buffers = list(model.param_keys), list(model.buffer_keys)
        return cls(
            param_keys=params,
            buffer_keys=buffers,
            shared_params=[k for k in params if k not in local],
            shared_buffers=[k for k in buffers if k not in local],
            local_params=[k for k in params if k in local],
            local_buffers=[k for k in buffers if k in local],
        )

    def merge(self, shared: Tree, local: Tree, params: bool = True) -> Tree:
        """Shared and local entries in the model's own key order."""
        keys = self.param_keys if params else self.buffer_keys
        return {k: shared[k] if k in shared else local[k] for k in keys}

    def start(self, message: Message, own: State) -> tuple[Tree, Tree]:
        """(params, buffers) a client starts from: the received shared part, its own local
        part (``own``: its state, holding at least the local keys)."""
        return (
            self.merge(message["params"], own["params"]),
            self.merge(message["buffers"], own["buffers"], params=False),
        )

    def shared(self, params: Tree, buffers: Tree) -> Message:
        return {
            "params": select(params, self.shared_params),
            "buffers": select(buffers, self.shared_buffers),
        }

    def local(self, params: Tree, buffers: Tree) -> State:
        return {
            "params": select(params, self.local_params),
            "buffers": select(buffers, self.local_buffers),
        }


class FreshLocalPart(LocalPartDeployment):
    """A new client starts from ``fresh_client_model`` of the shared and initial local part
    (FedBN: calibrated statistics) and the cold-start evaluation fine-tunes the local part."""

    algorithm: PartialSharing

    def new_client_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        algorithm = self.algorithm
        return algorithm.fresh_client_model(*algorithm.initial_client_model(server), task)


class PartialSharing(Algorithm):
    """Base of the algorithms that federate only part of the model (see the module doc)."""

    capabilities = Capabilities(
        has_global_model=False,
        supports_sample_dp=True,
    )
    Deployment = FreshLocalPart

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.split = KeySplit.of(ctx.model, self.local_keys())

    def local_keys(self) -> set[str]:
        """The parameter and buffer keys that stay on each client."""
        raise NotImplementedError

    def client_weight(self, task: ClientTask) -> float:
        """Aggregation weight of the client's shared part (default: its sample count)."""
        return float(task.data.num_train)

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        local = self.split.local(params, buffers)
        return {
            **self.split.shared(params, buffers),
            "initial_local": {k: clone(v) for k, v in local.items()},
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"params": server["params"], "buffers": server["buffers"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return {**aggregate_models(self.ctx, results), "initial_local": server["initial_local"]}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        steps = torch.zeros((), dtype=torch.int64)
        return {**model_copy(server["initial_local"]), "steps": steps}

    def make_program(self) -> ClientProgram:
        """Local SGD of [shared, own local part], uploading the shared part."""
        return PlainSGDProgram(self, start=self.local_start, finish=self.local_finish)

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        assert state is not None
        return self.split.start(message, state)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        assert state is not None
        upload = self.split.shared(solved.params, solved.buffers)
        new_state = self.personal_state(state, solved.params, solved.buffers, solved.steps)
        return ClientResult(upload, self.client_weight(task), solved.loss, state=new_state)

    def personal_state(self, state: State, params: Tree, buffers: Tree, steps: int) -> State:
        """The client's new state: the local part of its trained model, and its step count."""
        return {**self.split.local(params, buffers), "steps": state["steps"] + steps}

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """[shared, the client's local part]; ``fresh_client_model`` for a client that never
        took a local step."""
        state = state if state is not None else self.init_client_state(server, task.client_id)
        params = self.split.merge(server["params"], state["params"])
        buffers = self.split.merge(server["buffers"], state["buffers"], params=False)
        if int(state["steps"]) == 0:
            return self.fresh_client_model(params, buffers, task)
        return params, buffers

    def fresh_client_model(
        self, params: Tree, buffers: Tree, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The model of a client that never trained (default: shared + initial local part)."""
        return params, buffers

    def initial_client_model(self, server: State) -> tuple[Tree, Tree]:
        """The shared part with the initial local part."""
        initial = server["initial_local"]
        params = self.split.merge(server["params"], initial["params"])
        buffers = self.split.merge(server["buffers"], initial["buffers"], params=False)
        return params, buffers


class HeadBodySplitConfig(AlgorithmConfig):
    weighting: Weighting = weighting_field(
        "samples", "averaging weights of the shared part (paper: samples)"
    )


class HeadBodySplit(PartialSharing):
    """The model split at its declared head (``FedModel.head_keys``): FedPer (Arivazhagan et
    al., 2019, arXiv:1912.00818) keeps the head on each client and shares the body, LG-FedAvg
    (Liang et al., 2019, arXiv:2001.01523, Algorithm 1) the reverse. The shared part is
    averaged with the objective weights of the config's ``weighting`` (algorithms/weights.py)."""

    Config = HeadBodySplitConfig
    personal_head: ClassVar[bool] = True
    """True: the head stays on each client (FedPer); False: the body does (LG-FedAvg)."""

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        module = ctx.model.module
        head_keys = getattr(module, "head_keys", None)
        self.head = set(head_keys()) if callable(head_keys) else set()
        self.head_modules = tuple(getattr(module, "head_modules", ()))
        super().__init__(config, ctx)
        if not self.split.local_params or not self.split.shared_params:
            roles = (
                "shares the body and personalizes the head"
                if self.personal_head
                else "keeps the body local and shares the head"
            )
            problem = (
                "declares no head"
                if not self.head
                else "has no body (no parameters outside the head)"
            )
            raise ConfigError(
                f"algorithm.name: {self.name} {roles} of the model (FedModel.head_modules), "
                f"and {type(module).__name__} {problem}; use e.g. model.name: mlp, cnn or "
                "char_lstm"
            )

    def local_keys(self) -> set[str]:
        if self.personal_head:
            return self.head
        model = self.ctx.model
        return (set(model.param_keys) | set(model.buffer_keys)) - self.head

    def client_weight(self, task: ClientTask) -> float:
        return self.ctx.objective_weight(task.client_id, self.config.weighting)
