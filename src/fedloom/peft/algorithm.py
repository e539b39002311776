"""FedAvg over PEFT parameters with every sharing strategy (docs/peft.md).

The partial-sharing pattern (algorithms/partial.py) with the personal keys of the strategy
(B for share a, A for share b, the personal prompt, the head when personal) and a server step
per strategy, through the engine's aggregation slot (``ctx.aggregate``: robust rules apply)
wherever the step is an average:

    both / a / b / ffa, adapters:  weighted average of the shared keys
    hetlora (rank_by_size):        client k trains the first r_k ranks (rest zeroed);
                                   A, B averaged with weights p_k ||B_k A_k||_F
    flora:   R <- R + s sum_k p_k B_k A_k (the stacked product); A fresh, B <- 0
    fedex:   A, B <- averages;  R <- R + s (sum_k p_k B_k A_k - avg(B) avg(A))
    prompt:  the shared prompt by the spherical mean (or the weighted mean)

R is the server-owned residual buffer of each LoRA target (models/lora.py): it is sent down
with the model (the downlink shows the dense residual) and never uploaded.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.partial import PartialSharing
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, select
from fedloom.core.rng import generator
from fedloom.models.transformer import PeftSpec
from fedloom.peft import strategies as S
from fedloom.solvers.local import LocalSolution


class PeftFedAvg(PartialSharing):
    """FedAvg with the PEFT strategy of ``spec`` (built by fedloom.peft.build_peft_algorithm
    for ``algorithm.name: fedavg``; reported under that name)."""

    summary = "FedAvg over PEFT parameters with the peft.share strategy (docs/peft.md)"
    averages_client_models = True

    def __init__(
        self,
        config: AlgorithmConfig,
        ctx: AlgorithmContext,
        spec: PeftSpec,
        head: str,
        rank_by_size: bool,
        aggregation: str,
    ) -> None:
        self.name = config.name  # type: ignore[misc]
        self.spec, self.head, self.aggregation = spec, head, aggregation
        module = ctx.model.module
        self.scale = float(getattr(module, "scale", 1.0))
        self.personal = S.personal_keys(ctx.model.param_keys, spec.share, spec.kind, head)
        super().__init__(config, ctx)
        self.has_global_model = not self.personal  # type: ignore[misc]
        self.modules = S.lora_modules(ctx.model.param_keys) if spec.kind == "lora" else []
        self.ranks: dict[int, int] = {}
        if rank_by_size and ctx.population:
            n_max = max(ctx.population.values())
            self.ranks = {c: S.rank_by_size(n, n_max, spec.r) for c, n in ctx.population.items()}

    def local_keys(self) -> set[str]:
        return set(self.personal)

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {
            **super().init_server_state(params, buffers),
            "round": torch.zeros((), dtype=torch.int64),
        }

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        """One ``ctx.aggregate`` of every key that is averaged with the clients' weights (so
        client-level DP, secure aggregation and robust rules see one round's update), then
        the strategy's own step for the rest (module doc)."""
        weights = [r.weight for r in results]
        p = S.normalized(weights)
        uploads = [r.upload["params"] for r in results]
        shared = list(uploads[0])
        lora = {f"{m}.{f}" for m in self.modules for f in (S.A, S.B)}
        own = self.spec.share in ("flora", "fedex") or bool(self.ranks)
        averaged = [k for k in shared if k != "prompts.shared" or self.aggregation != "spherical"]
        averaged = [k for k in averaged if not (own and k in lora)]
        params = dict(server["params"])
        if averaged:
            params |= self.ctx.aggregate([select(u, averaged) for u in uploads], weights)
        if "prompts.shared" in shared and "prompts.shared" not in averaged:
            params["prompts.shared"] = S.spherical_mean([u["prompts.shared"] for u in uploads], p)
        buffers = dict(server["buffers"])
        rnd = server["round"] + 1
        share = self.spec.share
        if self.modules and share in ("flora", "fedex"):
            for m in self.modules:
                a = [u[f"{m}.{S.A}"] for u in uploads]
                b = [u[f"{m}.{S.B}"] for u in uploads]
                key = f"{m}.residual"
                if share == "flora":
                    a_stack, b_stack = S.flora_stack(a, b, p)
                    buffers[key] = buffers[key] + self.scale * (b_stack @ a_stack)
                    params[f"{m}.{S.A}"] = self._fresh_a(params[f"{m}.{S.A}"], m, int(rnd))
                    params[f"{m}.{S.B}"] = torch.zeros_like(b[0])
                else:
                    buffers[key] = buffers[key] + self.scale * S.fedex_residual(a, b, p)
                    params[f"{m}.{S.A}"], params[f"{m}.{S.B}"] = S.fedit(a, b, p)
        elif self.modules and self.ranks:  # HetLoRA: zero-padded, norm-weighted average
            w = S.hetlora_weights(uploads, self.modules, p)
            for key in (k for k in shared if k in lora):
                params[key] = S.weighted_sum([u[key] for u in uploads], w)
        return {
            "params": params,
            "buffers": buffers,
            "initial_local": server["initial_local"],
            "round": rnd,
        }

    def _fresh_a(self, like: torch.Tensor, module: str, rnd: int) -> torch.Tensor:
        """FLoRA's new A of a round (peft's Kaiming-uniform), the same for every client."""
        g = generator(self.ctx.seed, f"flora_A/{module}", round=rnd)
        bound = 1.0 / math.sqrt(like.shape[1])
        return (torch.rand(like.shape, generator=g, dtype=like.dtype) * 2 - 1) * bound

    # -- client ---------------------------------------------------------------------------
    def _truncated(self, params: Tree, client: int) -> Tree:
        """HetLoRA: the client's rank-r_k factors (entries past r_k zeroed, shapes kept)."""
        r = self.ranks.get(client)
        if r is None or r >= self.spec.r:
            return params
        out = dict(params)
        for m in self.modules:
            if f"{m}.{S.A}" in out:
                out[f"{m}.{S.A}"] = S.rank_mask(out[f"{m}.{S.A}"], r, 0)
            if f"{m}.{S.B}" in out:
                out[f"{m}.{S.B}"] = S.rank_mask(out[f"{m}.{S.B}"], r, 1)
        return out

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        params, buffers = super().local_start(message, state, task)
        return self._truncated(params, task.client_id), buffers

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """Upload the shared trainable keys only: no buffers (the residual is the server's)."""
        result = super().local_finish(message, state, task, solved)
        result.upload = {"params": result.upload["params"], "buffers": {}}
        return result

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        params, buffers = super().deployed_model(server, state, task)
        return self._truncated(params, task.client_id), buffers

    def global_model(self, server: State) -> tuple[Tree, Tree] | None:
        if self.personal:
            return None
        return server["params"], server["buffers"]

    def summary_extras(self, server: State) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peft": {
                "kind": self.spec.kind,
                "share": self.spec.share,
                "personal_keys": len(self.personal),
            }
        }
        if self.ranks:
            out["peft"]["ranks"] = {str(c): r for c, r in sorted(self.ranks.items())}
        return out
