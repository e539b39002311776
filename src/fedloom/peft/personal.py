"""The PEFT strategy (``peft.sharing.StrategySharing``) under the personalization algorithms
with two models per client: Ditto, APFL and pFedMe (docs/peft.md, "Algorithms").

Each has a global track (theta, what the server aggregates) and a personal model. The
strategy acts on the global track exactly as under FedAvg: client k's theta_k starts from
[the server's shared keys, its own kept keys] truncated at its rank, the shared keys go up
(HetLoRA's at the actual rank, no residuals), the kept ones (FedSA's B, ...) stay in the
client's state (``own``), and the server takes the strategy's step. The personal model is a
whole PEFT model of the client's; it is truncated at the client's rank too, and it uses the
server's residuals (FLoRA, FedEx-LoRA: the frozen weight is W0 + R for every model).

- Ditto: the global algorithm is FedAvg with the strategy (``PeftFedAvg``); (9)'s theta is
  client k's global-track start model (its own B under FedSA, truncated under HetLoRA).
- APFL: theta_k and the mixture alpha omega + (1 - alpha) theta_k use client k's theta.
- pFedMe: omega (the local copy of the global model) and theta_k start from client k's
  theta; (7)'s beta extrapolates the averaged keys (beta must be 1 where the strategy's step
  is not a mean).
"""

from __future__ import annotations

from fedloom.algorithms.apfl import APFL
from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.ditto import Ditto
from fedloom.algorithms.pfedme import PFedMe
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone, select
from fedloom.peft.algorithm import PeftFedAvg, StrategyServer
from fedloom.peft.sharing import RANK, StrategySharing


class PeftDitto(Ditto):
    """Ditto whose global algorithm is FedAvg with the strategy."""

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext, sharing: StrategySharing):
        self.sharing = sharing
        super().__init__(config, ctx)

    def global_algorithm(self, ctx: AlgorithmContext) -> Algorithm:
        return PeftFedAvg(AlgorithmConfig(name="fedavg"), ctx, self.sharing)

    def personal_view(
        self, personal: State, global_buffers: Tree, inner: State | None
    ) -> tuple[Tree, Tree]:
        return self.sharing.personal_model(personal, global_buffers, inner)

    def personal_anchor(
        self, message: Message, inner: State | None, task: ClientTask
    ) -> Tree | None:
        if not self.sharing.personal and not self.sharing.hetlora:
            return None  # the broadcast theta^t is every client's
        assert isinstance(self.inner, PeftFedAvg)
        return self.inner.local_start(message, inner, task)[0]


class TrackSharing(StrategyServer):
    """The strategy on an algorithm's global track (module doc): the server keeps the
    shared keys and the full initial model (``initial``), a client its kept keys (``own``)
    and its rank."""

    sharing: StrategySharing

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext, sharing: StrategySharing):
        self.sharing = sharing
        super().__init__(config, ctx)
        self.capabilities = self.capabilities.but(has_global_model=not sharing.personal)

    def _keys(self) -> list[str]:
        return list(self.ctx.model.param_keys)

    def _server(self, server: State) -> State:
        """The server state with theta reduced to the shared keys and the strategy's own
        entries."""
        params = server["params"]
        return {
            **server,
            "params": select(params, self.sharing.shared_keys(list(params))),
            **self.sharing.initial_server(),
        }

    def _client(self, server: State, client_id: int) -> State:
        initial = server["initial"]["params"]
        own = clone(select(initial, sorted(self.sharing.personal)))
        return {"own": own, **self.sharing.client_extras(client_id)}

    def _theta(self, params: Tree, buffers: Tree, state: State | None) -> tuple[Tree, Tree]:
        """Client k's theta: the server's shared keys with its own, truncated at its rank."""
        own = state["own"] if state is not None else {}
        return self.sharing.start(params, own, state, self._keys()), buffers

    def _result(self, state: State | None, params: Tree, buffers: Tree) -> tuple[Message, State]:
        assert state is not None
        rank = int(state[RANK]) if RANK in state else None
        upload = {
            "params": self.sharing.upload(params, rank),
            "buffers": self.sharing.upload_buffers(buffers),
        }
        kept = {"own": select(params, sorted(self.sharing.personal))}
        if rank is not None:
            kept[RANK] = state[RANK]
        return upload, kept

    def global_model(self, server: State) -> tuple[Tree, Tree] | None:
        if self.sharing.personal:
            return None
        return server["params"], server["buffers"]


class PeftAPFL(TrackSharing, APFL):
    """APFL with the strategy on theta (``final_averaging`` is refused, peft/build.py)."""

    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return self._server(super().init_server_state(params, buffers))

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return self.strategy_step(server, results)

    def init_client_state(self, server: State, client_id: int) -> State:
        return {**super().init_client_state(server, client_id), **self._client(server, client_id)}

    def client_global(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state if state is not None else self.init_client_state(server, task.client_id)
        return self._theta(server["params"], server["buffers"], state)

    def theta_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        return self._theta(message["params"], message["buffers"], state)

    def personal_view(
        self, personal: State, global_buffers: Tree, state: State | None
    ) -> tuple[Tree, Tree]:
        return self.sharing.personal_model(personal, global_buffers, state)

    def theta_result(
        self, message: Message, state: State | None, task: ClientTask, theta: Tree, buffers: Tree
    ) -> tuple[Message, State]:
        return self._result(state, theta, buffers)


class PeftPFedMe(TrackSharing, PFedMe):
    """pFedMe with the strategy on the global model; (7) extrapolates the averaged keys."""

    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        full = {"params": params, "buffers": buffers, "initial": {"params": clone(params)}}
        return self._server(full)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        """The strategy's step, then (7) theta + beta (step - theta) on the averaged keys."""
        new = self.strategy_step(server, results)
        beta = self.config.beta
        if beta != 1.0:
            old, params = server["params"], dict(new["params"])
            for k in results[0].upload["params"]:
                params[k] = old[k] + beta * (params[k] - old[k])
            new["params"] = params
        return new

    def init_client_state(self, server: State, client_id: int) -> State:
        extras = self._client(server, client_id)
        params = self.sharing.view(clone(server["initial"]["params"]), extras)
        return {"params": params, "buffers": clone(server["buffers"]), **extras}

    def round_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        return self._theta(message["params"], message["buffers"], state)

    def omega_result(
        self, message: Message, state: State | None, task: ClientTask, omega: Tree, buffers: Tree
    ) -> tuple[Message, State]:
        return self._result(state, omega, buffers)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        if state is None:  # never trained: theta as the client would receive it
            state = self.init_client_state(server, task.client_id)
            return self._theta(server["params"], server["buffers"], state)
        buffers = self.sharing.with_server_buffers(state["buffers"], server["buffers"])
        return state["params"], buffers
