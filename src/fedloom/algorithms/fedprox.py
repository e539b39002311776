"""FedProx (Li et al., MLSys 2020, arXiv:1812.06127, Section 3, Algorithm 2).

Each client approximately minimizes h_k(w; w_t) = F_k(w) + mu/2 ||w - w_t||^2 with the same
local SGD as FedAvg; the proximal term adds mu (w - w_t) to every step's gradient. mu = 0 is
FedAvg exactly. The server aggregates as FedAvg does.

``mu_schedule`` lets mu decay from ``mu`` over the rounds (algorithms/schedule.py;
docs/cold_start.md); a scheduled mu travels in the round's message (8 bytes), so every executor
applies the same one.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedloom.algorithms.base import AlgorithmConfig
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.schedule import Schedule, schedule_field
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.core.protocol import Message, State
from fedloom.core.pytree import Tree
from fedloom.solvers import ClientProgram
from fedloom.solvers.steps import proximal_gradient


class FedProxConfig(AlgorithmConfig):
    mu: float = Field(default=0.01, ge=0.0, description="proximal coefficient (paper: 0.001-1)")
    mu_schedule: Schedule = schedule_field("mu")


class FedProx(FedAvg):
    name = "fedprox"
    summary = "FedProx: FedAvg with a proximal term mu/2 ||w - w_t||^2 (Li et al., 2020)"
    Config = FedProxConfig

    def server_message(self, server: State, round: int = 0) -> Message:
        message = super().server_message(server, round)
        cfg = self.config
        if not cfg.mu_schedule.constant:
            mu = cfg.mu_schedule.at(cfg.mu, round, self.ctx.rounds)
            message["mu"] = {"mu": torch.tensor(mu, dtype=torch.float64)}
        return message

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, correction=self.local_correction)

    def local_correction(self, params: Tree, message: Message, state: State | None) -> Tree | None:
        mu = message["mu"]["mu"] if "mu" in message else self.config.mu
        return proximal_gradient(params, message["params"], mu)
