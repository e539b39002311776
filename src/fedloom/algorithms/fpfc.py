"""FPFC, fusion penalized federated clustering (Yu, Liu, Wang, Sun, "Clustered Federated
Learning based on Nonconvex Pairwise Fusion", arXiv:2211.04218). The label (19) is
this docstring's own; the paper's equation numbers are given as "the paper's Eq.".

Problem (19), over the m training clients' models omega_i and the pairwise differences::

    minimize  sum_i f_i(omega_i) + 1/(2m) sum_{i,j} g~(||theta_ij||)
    s.t.      omega_i - omega_j = theta_ij                                          (19)

with g~ the smoothed SCAD penalty of parameters (xi, lam, a): SCAD (Fan and Li, 2001) whose kink
at 0 is replaced by a quadratic on [0, xi], for t = ||theta|| >= 0::

    g~(t) = lam t^2 / (2 xi)                                   t <= xi
          = lam t - lam xi / 2                                 xi < t <= lam
          = (2 a lam t - t^2 - lam^2) / (2 (a - 1)) - lam xi/2 lam < t <= a lam
          = (a + 1) lam^2 / 2 - lam xi / 2                     t > a lam

Its (groupwise) proximal map, the paper's Eq. (6), prox(delta) = argmin_theta g~(||theta||)
+ rho/2 ||theta - delta||^2, is with n = ||delta|| (``scad_prox``)::

    xi rho / (lam + xi rho) delta                                    n <= xi + lam/rho
    (1 - lam / (rho n)) delta                                        n <= lam + lam/rho
    S(delta, a lam / ((a - 1) rho)) / (1 - 1 / ((a - 1) rho))       n <= a lam
    delta                                                            n > a lam

with S(z, t) = (1 - t/||z||)_+ z; it needs xi < lam and (a - 1) rho > 1 (checked). The 1/(2m)
of (19) cancels against the augmented Lagrangian's, as each pair appears twice (i, j) and (j,
i). These formulas are those of the authors' released code (xueyu-ubc/FPFC); the paper's text
could not be retrieved here to compare the typesetting.

ADMM as in the pseudocode, with dual variables v_ij and penalty rho (round k, active set A_k)::

    server: send zeta_i to each i in A_k
    client i: T_i local steps omega <- omega - alpha [grad f_i(omega) + rho (omega - zeta_i)]
              from its own omega_i (the engine's local SGD, correction rho (omega - zeta_i);
              alpha = train.lr, T_i = train.local_steps / local_epochs), upload omega_i
    server, for i < j both in A_k (``pairs: active``; ``touching``: at least one in A_k,
    as the authors' code does):
        delta_ij = omega_i - omega_j + v_ij / rho
        theta_ij = prox(delta_ij);  v_ij <- v_ij + rho (omega_i - omega_j - theta_ij)
        theta_ji = -theta_ij, v_ji = -v_ij
    server, for every i: zeta_i = 1/m sum_j (omega_j + theta_ij - v_ij / rho)

Initial state: all omega_i equal (the common initialization), zeta_i = omega_i, theta = v = 0.

Defaults are those of the authors' code: lam = 0.6, a = 3.7, xi = 1e-4, rho = 1. Their
clustering threshold on ||theta_ij|| (3 in their synthetic experiments) is replaced here by xi,
which needs no tuning (see Clusters below).

Storage: only the pairs i < j are kept, as two (m(m-1)/2, d) float32 tensors (theta, v) in the
server state, plus (m, d) tables of the latest omega_j, of zeta_i and of the running sums
sum_j (theta_ij - v_ij / rho) (float64, updated pair by pair): O(m^2 d) memory is
inherent to the pairwise formulation (100 clients and a 200k-parameter model: 7.9 GB).

What travels: client i needs only zeta_i. The engine hands one message to all sampled
clients, so the message holds the whole (m, d) zeta table and client i reads its row (its index
is in its state); ``download_bytes(message, clients)`` counts what a real deployment sends,
one zeta_i per client. The upload is omega_i (d floats).

Clusters: i and j are in one cluster when the pair was updated at least once and
||theta_ij|| <= ``threshold`` (default xi: the prox maps exactly the pairs it fuses into the
ball of radius xi), closed under connected components (``clusters``); ``summary_extras``
reports them. There is no global model. Client i deploys its own omega_i (``deploy: own``), or
the sample-weighted mean of the latest omega_j over its cluster (``cluster``, what the
authors' code evaluates). A client outside the ADMM (a held-out new client) deploys the mean
of all omega_j.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.clusters import DisjointSets
from fedloom.algorithms.peers import training_clients
from fedloom.algorithms.sgd_program import PlainSGDProgram, own_model
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class FPFCConfig(AlgorithmConfig):
    lam: float = Field(default=0.6, gt=0.0, description="SCAD level lambda (authors' code: 0.6)")
    a: float = Field(default=3.7, gt=2.0, description="SCAD concavity a (Fan and Li: 3.7)")
    xi: float = Field(default=1e-4, gt=0.0, description="smoothing radius of g~ near zero")
    rho: float = Field(default=1.0, gt=0.0, description="ADMM penalty rho")
    threshold: float | None = Field(
        default=None, ge=0.0, description="||theta_ij|| at most this: same cluster (default xi)"
    )
    pairs: Literal["active", "touching"] = Field(
        default="active", description="pairs updated: both in A_k (seed) or one (authors' code)"
    )
    deploy: Literal["own", "cluster"] = Field(
        default="own", description="deployed model: own omega_i or its cluster's mean"
    )

    @model_validator(mode="after")
    def _prox_is_defined(self) -> FPFCConfig:
        if self.xi >= self.lam:
            raise ValueError(f"xi must be smaller than lam (got xi={self.xi}, lam={self.lam})")
        if (self.a - 1.0) * self.rho <= 1.0:
            raise ValueError(
                f"rho must exceed 1/(a - 1) for the SCAD prox (got rho={self.rho}, a={self.a})"
            )
        return self


def smoothed_scad(t: torch.Tensor, lam: float, a: float, xi: float) -> torch.Tensor:
    """g~(t) of the module docstring, entrywise for t >= 0."""
    quad = lam * t**2 / (2 * xi)
    lasso = lam * t - lam * xi / 2
    concave = (2 * a * lam * t - t**2 - lam**2) / (2 * (a - 1)) - lam * xi / 2
    flat = torch.full_like(t, (a + 1) * lam**2 / 2 - lam * xi / 2)
    return torch.where(
        t <= xi, quad, torch.where(t <= lam, lasso, torch.where(t <= a * lam, concave, flat))
    )


def scad_prox(delta: torch.Tensor, lam: float, a: float, xi: float, rho: float) -> torch.Tensor:
    """argmin_theta g~(||theta||) + rho/2 ||theta - delta||^2 for each row of ``delta``
    (shape (P, d)): the piecewise map of the module docstring (the paper's Eq. (6))."""
    n = delta.norm(dim=1, keepdim=True)
    safe = n.clamp_min(torch.finfo(delta.dtype).tiny)
    ridge = torch.full_like(n, xi * rho / (lam + xi * rho))
    lasso = 1.0 - lam / (rho * safe)
    inv = 1.0 / ((a - 1.0) * rho)
    concave = (1.0 - a * lam * inv / safe).clamp_min(0.0) / (1.0 - inv)
    factor = torch.where(
        n <= xi + lam / rho,
        ridge,
        torch.where(
            n <= lam + lam / rho,
            lasso,
            torch.where(n <= a * lam, concave, torch.ones_like(n)),
        ),
    )
    return factor * delta


def connected_components(m: int, edges: list[tuple[int, int]]) -> list[list[int]]:
    """Components of the graph on 0..m-1 with ``edges``, each sorted, ordered by first member."""
    sets = DisjointSets(m)
    for i, j in edges:
        sets.union(i, j)
    groups: dict[int, list[int]] = {}
    for i in range(m):
        groups.setdefault(sets.find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


class FPFC(Algorithm):
    name = "fpfc"
    summary = "FPFC: clusters found by a pairwise SCAD fusion penalty, solved by ADMM"
    Config = FPFCConfig
    capabilities = Capabilities(has_global_model=False)
    wire = Wire(rows={"zeta": 1})

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.m = training_clients(ctx, self.name)
        rows, cols = torch.triu_indices(self.m, self.m, offset=1)
        self.left, self.right = rows, cols

    # -- flat <-> tree ----------------------------------------------------------------------
    @staticmethod
    def flat(tree: Tree) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for v in tree.values()])

    @staticmethod
    def table_tree(table: torch.Tensor, like: Tree) -> Tree:
        """Rows of a (rows, d) table -> tree of (rows, *shape) tensors keyed like ``like``."""
        out: Tree = {}
        offset = 0
        for k, v in like.items():
            out[k] = table[:, offset : offset + v.numel()].reshape(-1, *v.shape).clone()
            offset += v.numel()
        return out

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        m, pairs = self.m, self.left.numel()
        omega = self.flat(params).unsqueeze(0).repeat(m, 1)
        d = omega.shape[1]
        return {
            "params": params,  # the common initialization, the template of every tree
            "buffers": buffers,
            "omega": omega,
            "theta": torch.zeros(pairs, d, dtype=omega.dtype),
            "dual": torch.zeros(pairs, d, dtype=omega.dtype),
            "pair_norm": torch.zeros(pairs, dtype=torch.float64),
            "updated": torch.zeros(pairs, dtype=torch.bool),
            "spread": torch.zeros_like(omega, dtype=torch.float64),
            "zeta": omega.clone(),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"zeta": self.table_tree(server["zeta"], server["params"])}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        """The server step of the pseudocode. The pairwise tables theta and v (the bulk of the
        state, O(m^2 d)) are updated in place, row by updated pair, and so is ``spread``, the
        running sum_j (theta_ij - v_ij / rho) per client: a round costs O(|pairs updated| d +
        m d), not O(m^2 d). The engine never reuses a server state after aggregating it."""
        cfg = self.config
        ids = torch.tensor([r.client_id for r in results])
        omega = server["omega"].clone()
        omega[ids] = torch.stack([self.flat(r.upload["params"]) for r in results])
        active = torch.zeros(self.m, dtype=torch.bool)
        active[ids] = True
        on_left, on_right = active[self.left], active[self.right]
        mask = on_left & on_right if cfg.pairs == "active" else on_left | on_right
        sel = mask.nonzero().squeeze(1)
        theta, dual, spread = server["theta"], server["dual"], server["spread"]
        pair_norm = server["pair_norm"]
        if sel.numel():
            i, j = self.left[sel], self.right[sel]
            residual = omega[i].sub_(omega[j])  # omega_i - omega_j, then minus theta_ij
            theta_rows, dual_rows = theta[sel], dual[sel]  # copies, updated in place below
            old_u = theta_rows.double().sub_(dual_rows.double(), alpha=1.0 / cfg.rho)
            new_theta = scad_prox(
                torch.add(residual, dual_rows, alpha=1.0 / cfg.rho), cfg.lam, cfg.a, cfg.xi, cfg.rho
            )
            residual.sub_(new_theta)
            dual_rows.add_(residual, alpha=cfg.rho)
            theta.index_copy_(0, sel, new_theta)
            dual.index_copy_(0, sel, dual_rows)
            # theta_ji = -theta_ij and v_ji = -v_ij: pair (i, j) adds u = theta_ij - v_ij / rho
            # to client i's sum and -u to client j's (in float64: no float32 drift over rounds)
            change = new_theta.double().sub_(dual_rows.double(), alpha=1.0 / cfg.rho).sub_(old_u)
            spread.index_add_(0, i, change)
            spread.index_add_(0, j, change, alpha=-1.0)
            pair_norm = pair_norm.index_copy(0, sel, new_theta.double().norm(dim=1))
        # zeta_i = 1/m sum_j (omega_j + theta_ij - v_ij / rho)
        zeta = ((omega.double().sum(dim=0, keepdim=True) + spread) / self.m).to(omega.dtype)
        return {
            **server,
            "omega": omega,
            "pair_norm": pair_norm,
            "updated": server["updated"] | mask,
            "zeta": zeta,
        }

    def global_model(self, server: State) -> tuple[Tree, Tree] | None:
        return None

    def cluster_threshold(self) -> float:
        return self.config.threshold if self.config.threshold is not None else self.config.xi

    def clusters(self, server: State) -> list[list[int]]:
        """Clients i, j joined when their pair was updated and ||theta_ij|| <= threshold;
        the connected components of that graph (singletons included)."""
        fused = server["updated"] & (server["pair_norm"] <= self.cluster_threshold())
        edges = list(zip(self.left[fused].tolist(), self.right[fused].tolist(), strict=True))
        return connected_components(self.m, edges)

    def summary_extras(self, server: State) -> dict:
        """summary.json extras: the clusters found, with the threshold that defined them."""
        found = self.clusters(server)
        return {
            "clusters": found,
            "num_clusters": len(found),
            "cluster_threshold": self.cluster_threshold(),
            "pairs_updated": int(server["updated"].sum()),
        }

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        if client_id < self.m:
            params = self.table_tree(server["omega"][client_id : client_id + 1], server["params"])
        else:  # outside the ADMM (a held-out new client): the mean of all omega_j
            params = self.table_tree(server["omega"].mean(dim=0, keepdim=True), server["params"])
        return {
            "params": {k: v[0] for k, v in params.items()},
            "buffers": clone(server["buffers"]),
            "index": torch.tensor(client_id, dtype=torch.int64),
        }

    def make_program(self) -> ClientProgram:
        """Local SGD of each client's own omega_i with the ADMM pull toward zeta_i."""
        return PlainSGDProgram(
            self, start=own_model, correction=self.local_correction, finish=self.local_finish
        )

    def local_correction(self, params: Tree, message: Message, state: State | None) -> Tree:
        """rho (omega - zeta_i): the gradient of rho/2 ||omega - zeta_i||^2, zeta_i the row
        ``state['index']`` of the broadcast table (pure, so it vmaps over clients)."""
        assert state is not None
        rho, zeta, row = self.config.rho, message["zeta"], state["index"]
        return {k: rho * (params[k] - zeta[k][row]) for k in params}

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        assert state is not None
        new_state = {"params": solved.params, "buffers": solved.buffers, "index": state["index"]}
        return ClientResult(
            {"params": solved.params},
            task.data.num_train,
            solved.loss,
            state=new_state,
        )

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state or self.init_client_state(server, task.client_id)
        cid = task.client_id
        if self.config.deploy == "own" or cid >= self.m:
            return state["params"], state["buffers"]
        members = next(c for c in self.clusters(server) if cid in c)
        weights = torch.tensor(
            [float(self.ctx.population[j]) for j in members], dtype=torch.float64
        )
        mean = (weights / weights.sum()) @ server["omega"][members].double()
        params = self.table_tree(mean.to(server["omega"].dtype).unsqueeze(0), server["params"])
        return {k: v[0] for k, v in params.items()}, state["buffers"]
