"""A PEFT sharing strategy as one composable piece (docs/peft.md, "Algorithms"): what the
strategy decides about a model track, whichever algorithm trains that track.

A personalization algorithm keeps one or two model tracks per client (FedAvg, FedPer, FedRep:
one; Ditto, APFL, pFedMe: a global track and a personal model). The strategy acts on the
track the server aggregates:

    personal keys   never leave the client (FedSA's B, share b's A, the personal prompt,
                    a personal head): kept in the client's state as ``own`` parameters;
    start           client k trains [the server's shared keys, its own keys], truncated to
                    its rank r_k (HetLoRA: entries past r_k zero, shapes kept for the vmap
                    backend);
    upload          the shared keys; HetLoRA's factors at the client's actual rank
                    (A[:r_k], B[:, :r_k]: the bytes count r_k, not r_max);
    server step     the strategy's (``step``): the weighted mean through the engine's
                    aggregation rule, FLoRA's stacking, FedEx's residual, HetLoRA's
                    zero-padded norm-weighted mean, the spherical prompt mean;
    buffers         the LoRA residuals R are the server's: sent down, never uploaded, and
                    every model of the client (a personal one too) uses the server's.

HetLoRA's rank self-pruning (Cho et al. 2024, sec. 3.2): with ``prune_strength`` lambda > 0
the local objective gains lambda sum_m ||B_m[:, t:r_k] A_m[t:r_k, :]||_F over the tail
t = max(1, floor(gamma r_k)) of the client's rank (``correction``); after local training,
when the tail's norm is below that of the model the client received, the client prunes to
r_k <- t (``prune``), and the server learns the new rank from the upload's shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedloom.core.pytree import Tree, num_bytes, select
from fedloom.core.rng import generator
from fedloom.models.transformer import PeftSpec
from fedloom.peft import strategies as S

RANK = "rank"
"""The client state's (and the server's ``ranks``) entry of HetLoRA's current rank."""


@dataclass(frozen=True)
class Pruning:
    """HetLoRA's self-pruning: lambda (0: off) and the decay gamma in (0, 1)."""

    strength: float = 0.0
    decay: float = 0.9

    def keep(self, rank: int) -> int:
        """t = max(1, floor(gamma r)): the rank after one pruning."""
        return max(1, math.floor(self.decay * rank))


class StrategySharing:
    """The strategy of ``spec`` on a model with ``param_keys`` and ``buffer_keys``."""

    def __init__(
        self,
        spec: PeftSpec,
        param_keys: Sequence[str],
        buffer_keys: Sequence[str],
        *,
        head: str,
        scale: float,
        seed: int,
        population: dict[int, int],
        num_clients: int,
        rank_by_size: bool,
        aggregation: str,
        pruning: Pruning,
    ) -> None:
        self.spec, self.scale, self.seed = spec, scale, seed
        self.aggregation, self.pruning = aggregation, pruning
        self.personal = S.personal_keys(param_keys, spec.share, spec.kind, head)
        self.modules = S.lora_modules(param_keys) if spec.kind == "lora" else []
        self.lora = {f"{m}.{f}" for m in self.modules for f in (S.A, S.B)}
        self.residuals = {k for k in buffer_keys if k.endswith(".residual")}
        self.hetlora = bool(self.modules) and (rank_by_size or pruning.strength > 0)
        self.initial_ranks = [spec.r] * num_clients
        if rank_by_size and population:
            n_max = max(population.values())
            for c, n in population.items():
                self.initial_ranks[c] = S.rank_by_size(n, n_max, spec.r)

    # -- what the strategy needs ----------------------------------------------------------
    @property
    def own_step(self) -> bool:
        """Whether the server step of the LoRA factors is the strategy's own (not a mean)."""
        return self.spec.share in ("flora", "fedex") or self.hetlora

    @property
    def exact(self) -> bool:
        """Whether the server step computes with each upload (products, norms, directions),
        which client-level DP and secure aggregation hide."""
        spherical = self.spec.kind == "prompt" and self.aggregation == "spherical"
        return self.own_step or spherical

    def shared_keys(self, keys: Sequence[str]) -> list[str]:
        return [k for k in keys if k not in self.personal]

    # -- client ---------------------------------------------------------------------------
    def initial_rank(self, client: int) -> torch.Tensor:
        return torch.tensor(self.initial_ranks[client], dtype=torch.int64)

    def client_extras(self, client: int) -> dict[str, torch.Tensor]:
        """What a client's state adds for the strategy: its rank under HetLoRA."""
        return {RANK: self.initial_rank(client)} if self.hetlora else {}

    def view(self, params: Tree, state: dict[str, Any] | None) -> Tree:
        """``params`` as the client holds them: HetLoRA's factors truncated at its rank
        (entries past r_k zeroed, shapes kept)."""
        if not self.hetlora or state is None or RANK not in state:
            return params
        r = int(state[RANK])
        if r >= self.spec.r:
            return params
        out = dict(params)
        for key in self.lora & set(out):
            out[key] = S.rank_mask(out[key], r, 0 if key.endswith(S.A) else 1)
        return out

    def start(self, shared: Tree, own: Tree, state: dict[str, Any] | None, keys: Sequence[str]):
        """Client k's model: [the server's shared keys, its own keys] in the model's key
        order, truncated to its rank."""
        merged = {k: shared[k] if k in shared else own[k] for k in keys}
        return self.view(merged, state)

    def upload(self, params: Tree, rank: int | None) -> Tree:
        """The shared keys of ``params``; HetLoRA's factors at the actual rank ``rank``."""
        out = {k: v for k, v in params.items() if k not in self.personal}
        if not self.hetlora or rank is None:
            return out
        for key in self.lora & set(out):
            out[key] = out[key][:rank] if key.endswith(S.A) else out[key][:, :rank]
        return out

    def upload_buffers(self, buffers: Tree) -> Tree:
        """The buffers a client uploads: none of the server's residuals."""
        return {k: v for k, v in buffers.items() if k not in self.residuals}

    def with_server_buffers(self, buffers: Tree, server_buffers: Tree) -> Tree:
        """A client's buffers with the server's residuals in place of its own."""
        return {k: server_buffers[k] if k in self.residuals else v for k, v in buffers.items()}

    def personal_model(
        self, personal: dict[str, Tree], server_buffers: Tree, state: dict[str, Any] | None
    ) -> tuple[Tree, Tree]:
        """A client's personal model ({params, buffers}) truncated at its rank (``state``'s),
        on the server's residuals."""
        buffers = self.with_server_buffers(personal["buffers"], server_buffers)
        return self.view(personal["params"], state), buffers

    # -- HetLoRA's self-pruning -----------------------------------------------------------
    def tail_mask(self, rank: torch.Tensor, r: int) -> torch.Tensor:
        """1 on the rank positions [t, r_k) that the regularizer penalizes (tensor ops only:
        the vmap backend calls it with a batched rank)."""
        keep = torch.clamp(torch.floor(self.pruning.decay * rank.to(torch.float64)), min=1.0)
        pos = torch.arange(r, dtype=torch.float64)
        return ((pos >= keep) & (pos < rank.to(torch.float64))).to(torch.float32)

    def correction(self, params: Tree, state: dict[str, Any] | None) -> Tree | None:
        """The regularizer's gradient, lambda (M / ||M||) A_t^T for B and lambda B_t^T
        (M / ||M||) for A, M = B_t A_t per LoRA target (zero where M = 0)."""
        if self.pruning.strength <= 0 or state is None or RANK not in state:
            return None
        lam = self.pruning.strength
        mask = self.tail_mask(state[RANK], self.spec.r)
        out = {k: torch.zeros_like(v) for k, v in params.items()}
        for m in self.modules:
            a, b = params[f"{m}.{S.A}"], params[f"{m}.{S.B}"]
            m_a, m_b = mask.to(a.dtype).unsqueeze(-1), mask.to(b.dtype)
            at, bt = a * m_a, b * m_b
            prod = bt @ at
            unit = prod / prod.norm().clamp_min(1e-12)
            out[f"{m}.{S.B}"] = lam * (unit @ at.transpose(-1, -2)) * m_b
            out[f"{m}.{S.A}"] = lam * (bt.transpose(-1, -2) @ unit) * m_a
        return out

    def tail_norm(self, params: Tree, rank: int) -> float:
        """sum_m ||B_m[:, t:r_k] A_m[t:r_k, :]||_F."""
        t = self.pruning.keep(rank)
        total = 0.0
        for m in self.modules:
            a, b = params[f"{m}.{S.A}"], params[f"{m}.{S.B}"]
            total += float((b[:, t:rank] @ a[t:rank]).norm())
        return total

    def prune(self, rank: int, received: Tree, trained: Tree) -> int:
        """The client's rank after its round: t when the tail's norm fell below the
        received model's (the regularizer pushed it toward zero), else r_k."""
        if self.pruning.strength <= 0 or self.pruning.keep(rank) >= rank:
            return rank
        if self.tail_norm(trained, rank) < self.tail_norm(received, rank):
            return self.pruning.keep(rank)
        return rank

    # -- server ---------------------------------------------------------------------------
    def initial_server(self) -> dict[str, torch.Tensor]:
        """The server's own entries: the round counter and, under HetLoRA, every client's
        last known rank (from its uploads' shapes)."""
        out = {"round": torch.zeros((), dtype=torch.int64)}
        if self.hetlora:
            out["ranks"] = torch.tensor(self.initial_ranks, dtype=torch.int64)
        return out

    def step(
        self,
        aggregate: Any,
        server: dict[str, Any],
        uploads: list[Tree],
        weights: list[float],
        clients: Sequence[int],
    ) -> dict[str, Any]:
        """One server step of ``server`` ({params, buffers, round[, ranks]}) on the clients'
        shared ``uploads``: one ``aggregate`` (the engine's rule) of every key that is a
        weighted mean, then the strategy's own step for the rest (module doc)."""
        p = S.normalized(weights)
        shared = list(uploads[0])
        spherical = "prompts.shared" in shared and self.aggregation == "spherical"
        averaged = [k for k in shared if not (spherical and k == "prompts.shared")]
        averaged = [k for k in averaged if not (self.own_step and k in self.lora)]
        params, buffers = dict(server["params"]), dict(server["buffers"])
        if averaged:
            params |= aggregate([select(u, averaged) for u in uploads], weights)
        if spherical:
            params["prompts.shared"] = S.spherical_mean([u["prompts.shared"] for u in uploads], p)
        rnd = server["round"] + 1
        out = {"round": rnd}
        if self.modules and self.spec.share in ("flora", "fedex"):
            self.merge_factors(params, buffers, uploads, p, int(rnd))
        elif self.hetlora:
            out["ranks"] = self.hetlora_merge(params, server["ranks"], uploads, p, clients)
        return {"params": params, "buffers": buffers, **out}

    def merge_factors(
        self, params: Tree, buffers: Tree, uploads: list[Tree], p: list[float], rnd: int
    ) -> None:
        """FLoRA / FedEx-LoRA, in place: each target's exact weighted mean of B_k A_k goes
        into its frozen residual (FLoRA: all of it, with fresh factors; FedEx: what the mean
        factors miss)."""
        for m in self.modules:
            a = [u[f"{m}.{S.A}"] for u in uploads]
            b = [u[f"{m}.{S.B}"] for u in uploads]
            key = f"{m}.residual"
            if self.spec.share == "flora":
                a_stack, b_stack = S.flora_stack(a, b, p)
                buffers[key] = buffers[key] + self.scale * (b_stack @ a_stack)
                params[f"{m}.{S.A}"] = self.fresh_a(params[f"{m}.{S.A}"], m, rnd)
                params[f"{m}.{S.B}"] = torch.zeros_like(b[0])
            else:
                buffers[key] = buffers[key] + self.scale * S.fedex_residual(a, b, p)
                params[f"{m}.{S.A}"], params[f"{m}.{S.B}"] = S.fedit(a, b, p)

    def hetlora_merge(
        self,
        params: Tree,
        ranks: torch.Tensor,
        uploads: list[Tree],
        p: list[float],
        clients: Sequence[int],
    ) -> torch.Tensor:
        """HetLoRA, in place: the LoRA factors zero-padded to r_max and weighted by
        p_k ||B_k A_k||_F; returns every client's rank with the uploaders' updated."""
        ranks = ranks.clone()
        for c, u in zip(clients, uploads, strict=True):
            if self.modules:
                ranks[c] = u[f"{self.modules[0]}.{S.A}"].shape[0]
        w = S.hetlora_weights(uploads, self.modules, p)
        padded = [self.padded(u) for u in uploads]
        for key in (k for k in uploads[0] if k in self.lora):
            params[key] = S.weighted_sum([u[key] for u in padded], w)
        return ranks

    def padded(self, upload: Tree) -> Tree:
        """A HetLoRA upload zero-padded back to r_max (B A unchanged)."""
        out = dict(upload)
        for m in self.modules:
            ka, kb = f"{m}.{S.A}", f"{m}.{S.B}"
            if ka in out and kb in out:
                out[ka], out[kb] = S.pad(out[ka], out[kb], self.spec.r)
        return out

    def fresh_a(self, like: torch.Tensor, module: str, rnd: int) -> torch.Tensor:
        """FLoRA's new A of a round (peft's Kaiming-uniform), the same for every client."""
        g = generator(self.seed, f"flora_A/{module}", round=rnd)
        bound = 1.0 / math.sqrt(like.shape[1])
        return (torch.rand(like.shape, generator=g, dtype=like.dtype) * 2 - 1) * bound

    # -- traffic and monitoring -----------------------------------------------------------
    def download_bytes(self, message: dict[str, Tree], ranks: Sequence[int]) -> int:
        """Each client receives the message with its LoRA factors truncated at its rank."""
        dense = sum(num_bytes(tree) for tree in message.values())
        if not self.hetlora:
            return len(ranks) * dense
        factors = num_bytes(select(message["params"], sorted(self.lora & set(message["params"]))))
        r = self.spec.r
        return sum(dense - factors + factors * rank // r for rank in ranks)

    def delta(self, sent: Tree, uploaded: Tree) -> Tree | None:
        """What an upload moved on the keys both have (HetLoRA's re-padded)."""
        uploaded = self.padded(uploaded) if self.hetlora else uploaded
        common = [k for k in uploaded if k in sent]
        return {k: uploaded[k] - sent[k] for k in common} if common else None
