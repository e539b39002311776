"""FedNova (Wang et al., NeurIPS 2020, arXiv:2007.07481).

When clients do different amounts of local work (tau_i steps, or different solvers), FedAvg
silently optimizes the inconsistent objective sum_i (p_i tau_i / sum_j p_j tau_j) F_i. FedNova
normalizes each client's progress. With local updates x - y_i = eta G_i a_i (a_i: how much each
of the tau_i stochastic gradients in G_i contributes), client i uploads the normalized direction

    d_i = (x - y_i) / ||a_i||_1   (and the scalar ||a_i||_1)

and the server, with p_i = n_i / sum_{j in S} n_j, steps

    tau_eff = sum_i p_i ||a_i||_1,     x <- x - tau_eff sum_i p_i d_i

which optimizes sum_i p_i F_i whatever the tau_i (the paper's Theorem 2). ||a_i||_1 for the
three local solvers of the paper (section 4 and appendix):
- sgd:       a_i = [1, ..., 1]                          ||a||_1 = tau
- momentum:  heavy-ball rho, a_ik = (1 - rho^(tau-k)) / (1 - rho)
             ||a||_1 = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
- proximal:  FedProx's mu, a_ik = (1 - eta mu)^(tau-1-k)
             ||a||_1 = [1 - (1 - eta mu)^tau] / (eta mu)
tau is what the client completed, so stragglers doing partial work are normalized correctly.
A client that completed no step (no training samples: tau_i = 0, ||a_i||_1 = 0) made no
progress: its direction is undefined (0/0), so it uploads a zero direction and the server
leaves it out of p_i and tau_eff (the aggregate of the others; the server keeps its state if
no sampled client progressed).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, average_buffers
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, add
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution
from fedloom.solvers.steps import proximal_gradient


class FedNovaConfig(AlgorithmConfig):
    local_solver: Literal["sgd", "momentum", "proximal"] = Field(
        default="sgd", description="the clients' local solver (sets the normalizer a_i)"
    )
    rho: float | None = Field(
        default=None, ge=0.0, lt=1.0, description="momentum, for local_solver: momentum (0.9)"
    )
    mu: float | None = Field(
        default=None, gt=0.0, description="proximal coefficient, for local_solver: proximal (0.01)"
    )

    @model_validator(mode="after")
    def _options_of_the_solver(self) -> FedNovaConfig:
        owner = {"rho": "momentum", "mu": "proximal"}
        for key, solver in owner.items():
            if getattr(self, key) is not None and self.local_solver != solver:
                raise ValueError(
                    f"{key} applies only to local_solver: {solver} (got local_solver: "
                    f"{self.local_solver})"
                )
        if self.local_solver == "momentum" and self.rho is None:
            object.__setattr__(self, "rho", 0.9)
        if self.local_solver == "proximal" and self.mu is None:
            object.__setattr__(self, "mu", 0.01)
        return self


def normalizer(solver: str, steps: int, lr: float, rho: float, mu: float) -> float:
    """||a_i||_1 for ``steps`` local steps of ``solver`` (see the module docstring)."""
    if solver == "momentum":
        return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)
    if solver == "proximal":
        shrink = 1.0 - lr * mu
        return (1.0 - shrink**steps) / (lr * mu)
    return float(steps)


class FedNova(Algorithm):
    name = "fednova"
    summary = "FedNova: normalized averaging of heterogeneous local progress (Wang et al., 2020)"
    capabilities = Capabilities(
        supports_sample_dp=True,
        sgd_only="normalizes each client's progress by ||a_i||_1 of SGD, heavy-ball or prox steps",
    )
    Config = FedNovaConfig

    def make_program(self) -> ClientProgram:
        """Local SGD with the solver of the config: heavy-ball rho, or FedProx's pull mu."""
        proximal = self.config.local_solver == "proximal"
        return PlainSGDProgram(
            self,
            correction=self.local_correction if proximal else None,
            momentum=self.config.rho or 0.0,
            finish=self.local_finish,
        )

    def local_correction(self, params: Tree, message: Message, state: State | None) -> Tree | None:
        return proximal_gradient(params, message["params"], self.config.mu or 0.0)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        cfg = self.config
        norm = normalizer(cfg.local_solver, solved.steps, solved.lr, cfg.rho or 0.0, cfg.mu or 0.0)
        x = message["params"]
        if norm > 0.0:
            direction = {k: (x[k] - solved.params[k]) / norm for k in x}
        else:  # tau_i = 0: no progress, nothing to normalize
            direction = {k: torch.zeros_like(v) for k, v in x.items()}
        upload = {
            "direction": direction,
            "norm": {"a": torch.tensor(norm, dtype=torch.float64)},
            "buffers": solved.buffers,
        }
        return ClientResult(upload, task.data.num_train, solved.loss)

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        results = [r for r in results if float(r.upload["norm"]["a"]) > 0.0]
        if not results:
            return server
        weights = [r.weight for r in results]
        total = sum(weights)
        tau_eff = sum(
            w * float(r.upload["norm"]["a"]) for w, r in zip(weights, results, strict=True)
        )
        direction = self.ctx.aggregate([r.upload["direction"] for r in results], weights)
        return {
            "params": add(server["params"], direction, alpha=-tau_eff / total),
            "buffers": average_buffers(self.ctx, server, results, weights),
        }
