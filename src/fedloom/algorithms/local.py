"""Local-only training: every client trains its own model from the common initialization and
never communicates. The lower reference of every algorithm card's baselines."""

from __future__ import annotations

from fedloom.algorithms.base import Algorithm
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram, own_model
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class LocalOnly(Algorithm):
    name = "local"
    summary = "Local-only: each client trains its own model, no communication"
    capabilities = Capabilities(
        supports_sample_dp=True,
        communicates=False,
        has_global_model=False,
    )

    def server_message(self, server: State, round: int = 0) -> Message:
        return {}

    def init_client_state(self, server: State, client_id: int) -> State:
        return {"params": clone(server["params"]), "buffers": clone(server["buffers"])}

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, start=own_model, finish=self.local_finish)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        new_state = {"params": solved.params, "buffers": solved.buffers}
        return ClientResult({}, task.data.num_train, solved.loss, state=new_state)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return server

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state or self.init_client_state(server, task.client_id)
        return state["params"], state["buffers"]
