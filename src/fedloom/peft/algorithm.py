"""The PEFT strategy (``peft.sharing.StrategySharing``) on the partial-sharing algorithms
(algorithms/partial.py): FedAvg, FedPer and FedRep (docs/peft.md, "Algorithms").

Their pattern is already "shared keys to the server, local keys kept": the strategy adds its
personal keys to the local ones (B for share a, A for share b, the personal prompt, the head
when personal; FedPer and FedRep keep the head anyway), truncates each client's factors at
its rank (HetLoRA), uploads the shared keys (HetLoRA's at the actual rank, no residuals) and
replaces the server's mean by its own step wherever it is not a mean:

    both / a / b / ffa, adapters:  weighted average of the shared keys (ctx.aggregate)
    hetlora:                       A, B zero-padded, averaged with weights p_k ||B_k A_k||_F
    flora:   R <- R + s sum_k p_k B_k A_k (the stacked product); A fresh, B <- 0
    fedex:   A, B <- averages;  R <- R + s (sum_k p_k B_k A_k - avg(B) avg(A))
    prompt:  the shared prompt by the spherical mean (or the weighted mean)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedper import FedPer
from fedloom.algorithms.fedrep import FedRep
from fedloom.algorithms.partial import PartialSharing
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.peft.sharing import RANK, StrategySharing
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


@dataclass(frozen=True)
class StrategyWire(Wire):
    """Traffic at each client's rank; the deltas on the shared keys (HetLoRA's re-padded).
    Not a declaration: what a client downloads depends on its LoRA rank this round, which
    HetLoRA's server prunes (docs/peft.md), so the strategy counts it."""

    server: StrategyServer = field(kw_only=True, repr=False, compare=False)

    def download_bytes(self, message: Message, clients: Sequence[int]) -> int:
        ranks = self.server.round_ranks
        if ranks is None:
            return super().download_bytes(message, clients)
        return self.server.sharing.download_bytes(message, [ranks[c] for c in clients])

    def delta(self, message: Message, result: ClientResult) -> Tree | None:
        return self.server.sharing.delta(message["params"], result.upload["params"])


class StrategyServer(Algorithm):
    """What every algorithm with a PEFT strategy shares: the strategy's server step, the
    traffic at each client's rank, the monitoring's deltas and the summary's ``peft``."""

    sharing: StrategySharing
    round_ranks: list[int] | None = None
    """Every client's LoRA rank this round (HetLoRA; ``server_message`` reads them from the
    server state), for the download bytes at each client's rank."""

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.wire = StrategyWire(server=self)

    def strategy_step(self, server: State, results: list[ClientResult]) -> State:
        """One ``ctx.aggregate`` of the averaged keys (client-level DP, secure aggregation
        and robust rules see one round's update), the strategy's own step for the rest."""
        step = self.sharing.step(
            self.ctx.aggregate,
            server,
            [r.upload["params"] for r in results],
            [r.weight for r in results],
            [r.client_id for r in results],
        )
        return {**server, **step}

    def server_message(self, server: State, round: int = 0) -> Message:
        if "ranks" in server:  # the clients' ranks, for this round's download_bytes
            self.round_ranks = [int(r) for r in server["ranks"]]
        return super().server_message(server, round)

    def summary_extras(self, server: State) -> dict[str, Any]:
        spec, population = self.sharing.spec, self.ctx.population
        peft: dict[str, Any] = {
            "kind": spec.kind,
            "share": spec.share,
            "personal_keys": len(self.sharing.personal),
        }
        if "ranks" in server:
            initial = self.sharing.initial_ranks
            peft["initial_ranks"] = {str(c): initial[c] for c in sorted(population)}
            peft["ranks"] = {str(c): int(server["ranks"][c]) for c in sorted(population)}
        return {**super().summary_extras(server), "peft": peft}


class StrategyPartial(StrategyServer, PartialSharing):
    """A partial-sharing algorithm with a PEFT strategy (module doc); put before the
    algorithm's class in the bases."""

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext, sharing: StrategySharing):
        self.sharing = sharing
        super().__init__(config, ctx)
        self.capabilities = self.capabilities.but(has_global_model=not self.split.local_params)

    def local_keys(self) -> set[str]:
        return super().local_keys() | self.sharing.personal

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {**super().init_server_state(params, buffers), **self.sharing.initial_server()}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return self.strategy_step(server, results)

    def global_model(self, server: State) -> tuple[Tree, Tree] | None:
        if self.split.local_params:
            return None
        return server["params"], server["buffers"]

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        return {
            **super().init_client_state(server, client_id),
            **self.sharing.client_extras(client_id),
        }

    def make_program(self) -> ClientProgram:
        if self.sharing.pruning.strength <= 0:
            return super().make_program()
        sharing = self.sharing

        def correction(params: Tree, message: Message, state: State | None) -> Tree | None:
            return sharing.correction(params, state)

        return PlainSGDProgram(
            self, start=self.local_start, finish=self.local_finish, correction=correction
        )

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        params, buffers = super().local_start(message, state, task)
        return self.sharing.view(params, state), buffers

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """The upload (shared keys, HetLoRA's at the client's rank after self-pruning) and
        the new state (own keys, step count, rank)."""
        assert state is not None
        sharing, extras, params = self.sharing, {}, solved.params
        rank = int(state[RANK]) if RANK in state else None
        if rank is not None:
            received, _ = self.local_start(message, state, task)
            rank = sharing.prune(rank, received, params)
            extras[RANK] = state[RANK].new_tensor(rank)
            params = sharing.view(params, extras)
        shared = self.split.shared(params, solved.buffers)
        upload = {
            "params": sharing.upload(shared["params"], rank),
            "buffers": sharing.upload_buffers(shared["buffers"]),
        }
        new_state = {**self.personal_state(state, params, solved.buffers, solved.steps), **extras}
        return ClientResult(upload, self.client_weight(task), solved.loss, state=new_state)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        params, buffers = super().deployed_model(server, state, task)
        if state is None:
            state = self.sharing.client_extras(task.client_id)
        return self.sharing.view(params, state), buffers


class FedAvgSplit(PartialSharing):
    """FedAvg as a partial-sharing algorithm with nothing local (the strategy adds its
    personal keys); reported under ``algorithm.name``."""

    capabilities = PartialSharing.capabilities.but(averages_client_models=True)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        self.name = config.name  # type: ignore[misc]
        super().__init__(config, ctx)

    def local_keys(self) -> set[str]:
        return set()


class PeftFedAvg(StrategyPartial, FedAvgSplit):
    """FedAvg over PEFT parameters with the strategy (``algorithm.name: fedavg``)."""

    summary = "FedAvg over PEFT parameters with the peft.share strategy (docs/peft.md)"


class PeftFedPer(StrategyPartial, FedPer):
    """FedPer with the strategy: its personal keys join the personal head."""


class PeftFedRep(StrategyPartial, FedRep):
    """FedRep with the strategy: the head phase trains the head, the body phase every other
    trainable key (the shared ones and the strategy's personal ones, e.g. FedSA's B)."""
