"""FedDyn (Acar et al., ICLR 2021, arXiv:2111.04263, Section 3 and
Algorithm 1). The labels (12) (the local problem) and (15) (the update of g_k) are this
docstring's own.

Client k keeps a local gradient estimate g_k (0 at the start) and, from the server model
theta, approximately solves the dynamically regularized problem (12)::

    theta_k <- argmin f_k(theta) - <g_k, theta> + mu/2 ||theta - theta^t||^2
               (local SGD; local_correction adds -g_k + mu (theta - theta^t) to each gradient)
    g_k <- g_k - mu (theta_k - theta^t)                         # (15): no extra gradient
    upload theta_k

and the server keeps h (0 at the start)::

    h <- h - mu sum_{k in S} p_k (theta_k - theta^t)
    theta^{t+1} <- (sum_S p_k theta_k / sum_S p_k) - h / mu

With ``weighting: uniform`` (p_k = 1/K, the default) these are the paper's formulas
exactly: its objective weights the clients uniformly, which must not be silently replaced by
sample weights; ``samples`` (p_k = n_k / n) is the documented
alternative. Invariant: h = sum_k p_k g_k after every round, so at a fixed point
sum_k p_k grad f_k(theta) = 0, the global stationarity FedAvg lacks.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, average_buffers
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, add, sub, zeros_like
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class FedDynConfig(AlgorithmConfig):
    mu: float = Field(
        default=0.01,
        gt=0.0,
        validation_alias=AliasChoices("mu", "alpha"),
        description="dynamic regularization coefficient (the paper's alpha: 0.1, 0.01, 0.001)",
    )
    weighting: Weighting = weighting_field("uniform", "objective weights p_k (paper: uniform)")


class FedDyn(Algorithm):
    name = "feddyn"
    summary = "FedDyn: dynamic regularization aligns local and global stationary points"
    capabilities = Capabilities(supports_sample_dp=True)
    Config = FedDynConfig

    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {"params": params, "buffers": buffers, "h": zeros_like(params)}

    def init_client_state(self, server: State, client_id: int) -> State:
        return {"grad": zeros_like(server["params"])}

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, correction=self.local_correction, finish=self.local_finish)

    def local_correction(self, params: Tree, message: Message, state: State | None) -> Tree:
        assert state is not None
        mu, anchor, g = self.config.mu, message["params"], state["grad"]
        return {k: mu * (params[k] - anchor[k]) - g[k] for k in params}

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        assert state is not None
        moved = sub(solved.params, message["params"])
        new_grad = add(state["grad"], moved, alpha=-self.config.mu)
        upload = {"params": solved.params, "buffers": solved.buffers}
        weight = self.ctx.objective_weight(task.client_id, self.config.weighting)
        return ClientResult(upload, weight, solved.loss, state={"grad": new_grad})

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        p = [r.weight for r in results]
        mean = self.ctx.aggregate([r.upload["params"] for r in results], p)
        mu, theta = self.config.mu, server["params"]
        h = add(server["h"], sub(mean, theta), alpha=-mu * sum(p))
        return {
            "params": add(mean, h, alpha=-1.0 / mu),
            "buffers": average_buffers(self.ctx, server, results, p),
            "h": h,
        }
