"""FedOpt: adaptive server optimizers (Reddi et al., ICLR 2021, "Adaptive Federated
Optimization", arXiv:2003.00295, Algorithm 2): adaptive optimization on the
server. FedAvgM (server momentum; Hsu et al., 2019, arXiv:1909.06335) is the paper's baseline.

Clients run the engine's local SGD from x_t and upload their model, exactly as in FedAvg. The
server turns the uploads into a pseudo-gradient and hands it to a server optimizer::

    Delta_t = sum_{i in S_t} p_i (y_i - x_t),   p_i = n_i / sum_{j in S_t} n_j
              (computed as ctx.aggregate({y_i}, {n_i}) - x_t: robust rules plug in there)

    FedAdagrad / FedYogi / FedAdam (no bias correction; m_{-1} = 0, v_{-1} = tau^2):
        m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
        FedAdagrad: v_t = v_{t-1} + Delta_t^2
        FedYogi:    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
        FedAdam:    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
        x_{t+1} = x_t + server_lr m_t / (sqrt(v_t) + tau)

    FedAvgM (m_{-1} = 0):
        m_t = beta m_{t-1} + Delta_t
        x_{t+1} = x_t + server_lr m_t          (server_lr = 1, beta = 0: FedAvg exactly)

All operations are elementwise. The step is computed in float64 and cast back to the parameters'
dtype (like ``weighted_average``); the optimizer state ``m`` (and ``v``) lives in the server
state next to ``params`` and ``buffers``, so checkpoints carry it. Buffers (BatchNorm running
statistics) are averaged as in FedAvg, not put through the optimizer. The downlink is FedAvg's:
``params`` and ``buffers`` only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, aggregate_models
from fedloom.algorithms.capabilities import Capabilities
from fedloom.core.protocol import ClientResult, State
from fedloom.core.pytree import Tree, zeros_like

Slots = dict[str, Tree]
"""The server optimizer's state trees by name (``m``, ``v``)."""


def _server_lr(default: float) -> Any:
    return Field(default=default, gt=0.0, description="server learning rate eta")


def _beta1() -> Any:
    return Field(
        default=0.9, ge=0.0, lt=1.0, description="first-moment (momentum) decay beta1 in [0, 1)"
    )


def _tau() -> Any:
    return Field(
        default=1e-3, gt=0.0, description="adaptivity / stability term tau > 0 (v_{-1} = tau^2)"
    )


class FedAvgMConfig(AlgorithmConfig):
    server_lr: float = _server_lr(1.0)
    beta: float = Field(default=0.9, ge=0.0, lt=1.0, description="server momentum beta in [0, 1)")


class FedAdagradConfig(AlgorithmConfig):
    server_lr: float = _server_lr(1e-2)
    beta1: float = _beta1()
    tau: float = _tau()


class FedAdaptiveConfig(AlgorithmConfig):
    server_lr: float = _server_lr(1e-2)
    beta1: float = _beta1()
    beta2: float = Field(
        default=0.99, ge=0.0, lt=1.0, description="second-moment decay beta2 in [0, 1)"
    )
    tau: float = _tau()


class ServerOptimizer(Algorithm):
    """FedAvg's clients; the server applies an optimizer step to Delta_t (shared by the four).

    Subclasses name the state trees they keep (``slots``, initialized by ``init_slots``) and
    say how one step maps (Delta_t, state_{t-1}) to (direction, state_t); the server then moves
    by server_lr * direction.
    """

    capabilities = Capabilities(
        averages_client_models=True,
        supports_sample_dp=True,
    )

    slots: ClassVar[tuple[str, ...]] = ("m",)

    def init_slots(self, params: Tree) -> Slots:
        return {"m": zeros_like(params)}

    def step(self, delta: Tree, state: Slots) -> tuple[Tree, Slots]:
        """float64 Delta_t and state_{t-1} -> (direction, state_t), elementwise."""
        raise NotImplementedError

    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {"params": params, "buffers": buffers, **self.init_slots(params)}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        averaged = aggregate_models(
            self.ctx, results
        )  # ctx.aggregate: weighted mean or robust rule
        x = server["params"]
        delta = {k: averaged["params"][k].double() - x[k].double() for k in x}
        state = {n: {k: t.double() for k, t in server[n].items()} for n in self.slots}
        direction, state = self.step(delta, state)
        lr = self.config.server_lr
        params = {k: (x[k].double() + lr * direction[k]).to(x[k].dtype) for k in x}
        kept = {n: {k: t.to(server[n][k].dtype) for k, t in state[n].items()} for n in self.slots}
        return {"params": params, "buffers": averaged["buffers"], **kept}


class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    summary = "FedAvgM: FedAvg with server momentum on the averaged model delta (Hsu et al., 2019)"
    Config = FedAvgMConfig

    def step(self, delta: Tree, state: Slots) -> tuple[Tree, Slots]:
        beta = self.config.beta
        m = {k: beta * state["m"][k] + d for k, d in delta.items()}
        return m, {"m": m}


class AdaptiveServerOptimizer(ServerOptimizer):
    """FedAdagrad, FedYogi and FedAdam: they differ only in ``second_moment``."""

    slots = ("m", "v")

    def init_slots(self, params: Tree) -> Slots:
        tau2 = self.config.tau**2
        return {
            **super().init_slots(params),
            "v": {k: torch.full_like(p, tau2) for k, p in params.items()},
        }

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """v_{t-1}, Delta_t^2 -> v_t."""
        raise NotImplementedError

    def step(self, delta: Tree, state: Slots) -> tuple[Tree, Slots]:
        beta1, tau = self.config.beta1, self.config.tau
        m = {k: beta1 * state["m"][k] + (1.0 - beta1) * d for k, d in delta.items()}
        v = {k: self.second_moment(state["v"][k], d * d) for k, d in delta.items()}
        direction = {k: m[k] / (v[k].sqrt() + tau) for k in delta}
        return direction, {"m": m, "v": v}


class FedAdagrad(AdaptiveServerOptimizer):
    name = "fedadagrad"
    summary = "FedAdagrad: Adagrad server step on the averaged model delta (Reddi et al., 2021)"
    Config = FedAdagradConfig

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v + delta_sq


class FedYogi(AdaptiveServerOptimizer):
    name = "fedyogi"
    summary = "FedYogi: Yogi server step on the averaged model delta (Reddi et al., 2021)"
    Config = FedAdaptiveConfig

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v - (1.0 - self.config.beta2) * delta_sq * torch.sign(v - delta_sq)


class FedAdam(AdaptiveServerOptimizer):
    name = "fedadam"
    summary = "FedAdam: Adam server step on the averaged model delta (Reddi et al., 2021)"
    Config = FedAdaptiveConfig

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        beta2 = self.config.beta2
        return beta2 * v + (1.0 - beta2) * delta_sq


__all__ = ["FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptimizer"]
