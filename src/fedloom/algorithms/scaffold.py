"""SCAFFOLD (Karimireddy et al., ICML 2020, arXiv:1910.06378, Algorithm 1).

Control variates correct client drift. The server holds the model x and the control c; client
i holds its control c_i across rounds (its persistent state). Each round::

    server sends (x, c)                                        # two model-size tensors down
    y_i <- x;  K times: y_i <- y_i - eta_l (g_i(y_i) - c_i + c) # local_correction: c - c_i
    c_i+ <- option I:  grad f_i(x)  (one extra pass over the local data)
            option II: c_i - c + (x - y_i) / (K eta_l)          # reuses the trajectory
    upload (dy_i, dc_i) = (y_i - x, c_i+ - c_i);  c_i <- c_i+  # two model-size tensors up
    x <- x + eta_g sum_S p_i dy_i / sum_S p_i                   # eta_g: server_lr
    c <- c + sum_S p_i dc_i                                     # keeps c = sum_i p_i c_i

With ``weighting: uniform`` p_i = 1/N and these are the paper's mean over S and (|S|/N) mean
over S exactly; ``samples`` (p_i = n_i/n) targets FedAvg's sample-weighted objective instead.
K is the number of steps the client actually completed, so stragglers doing partial work
(``train.stragglers``) get a correct option-II control, as the paper's analysis allows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, average_buffers
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, add, clone, sub, zeros_like
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class ScaffoldConfig(AlgorithmConfig):
    option: Literal["I", "II"] = Field(
        default="II", description="control update: I = gradient at x, II = from the trajectory"
    )
    server_lr: float = Field(default=1.0, gt=0.0, description="global step size eta_g")
    weighting: Weighting = weighting_field("uniform", "objective weights p_i (paper: uniform)")


class Scaffold(Algorithm):
    name = "scaffold"
    summary = "SCAFFOLD: control variates c, c_i correct client drift (Karimireddy et al., 2020)"
    Config = ScaffoldConfig
    capabilities = Capabilities(supports_sample_dp=True)

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        if self.config.option != "I":
            self.capabilities = self.capabilities.but(
                sgd_only="option II reads the mean gradient off the SGD trajectory; set option: I"
            )

    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {"params": params, "buffers": buffers, "control": zeros_like(params)}

    def server_message(self, server: State, round: int = 0) -> Message:
        return {
            "params": server["params"],
            "buffers": server["buffers"],
            "control": server["control"],
        }

    def init_client_state(self, server: State, client_id: int) -> State:
        return {"control": zeros_like(server["params"])}

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, correction=self.local_correction, finish=self.local_finish)

    def local_correction(self, params: Tree, message: Message, state: State | None) -> Tree:
        assert state is not None
        return {k: message["control"][k] - state["control"][k] for k in params}

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        assert state is not None
        x, y, c_i = message["params"], solved.params, state["control"]
        if self.config.option == "I":
            data = task.data
            c_new = self.ctx.model.full_gradient(x, message["buffers"], data.x_train, data.y_train)
        else:
            scale = 1.0 / (max(1, solved.steps) * solved.lr)
            c_new = {k: c_i[k] - message["control"][k] + scale * (x[k] - y[k]) for k in x}
        upload = {
            "delta": sub(y, x),
            "control_delta": sub(c_new, c_i),
            "buffers": solved.buffers,
        }
        weight = self.ctx.objective_weight(task.client_id, self.config.weighting)
        return ClientResult(upload, weight, solved.loss, state={"control": clone(c_new)})

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        p = [r.weight for r in results]
        mean_delta = self.ctx.aggregate([r.upload["delta"] for r in results], p)
        mean_control = self.ctx.aggregate([r.upload["control_delta"] for r in results], p)
        return {
            "params": add(server["params"], mean_delta, alpha=self.config.server_lr),
            "buffers": average_buffers(self.ctx, server, results, p),
            "control": add(server["control"], mean_control, alpha=sum(p)),
        }
