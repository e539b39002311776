"""L2SGD, loopless local SGD (Hanzely & Richtarik 2020, "Federated Learning of a Mixture
of Global and Local Models", arXiv:2002.05516: its loopless local gradient descent L2GD,
Algorithm 1, with stochastic local gradients). The labels (1) (the mixed-model problem) and
(2) (the unbiased stochastic gradient) are this docstring's own.

The mixed-model problem (1) over the K training clients' personal models theta_k::

    min F(Theta) = (1/K) sum_k f_k(theta_k) + lam/(2K) sum_k ||theta_k - theta_bar||^2,
    theta_bar = (1/K) sum_k theta_k

is solved with the unbiased stochastic gradient (2): every iteration a coin shared by all
clients says "no communication" with probability 1 - p (each client steps on its own loss,
scaled 1 / (K (1 - p))) or "communicate" with probability p (each client steps towards the
average, scaled lam / (K p)). One fedloom round is one communication::

    N ~ the coin: 'no communication' flips before the first 'communicate'    # client_plan
        (stream (seed, 'l2sgd', round), shared by every client; E[N] = (1-p)/p)
    client k:  theta_k <- theta_k - eta lam / (K p) (theta_k - theta_bar)  # local_start:
                                                    # the previous communication's step
               N times: theta_k <- theta_k - eta / (K (1-p)) grad f_k(theta_k; b)
               upload theta_k - theta_k(previous upload)                   # local_finish
    server:    theta_bar <- theta_bar + (1/K) sum_S (uploads)              # = mean_k theta_k

eta is ``train.lr`` and K the number of training clients, the pseudocode's scalings exactly;
``train.local_steps`` / ``local_epochs`` are not used (the coin sets the work). Each local
step uses a ``train.batch_size`` minibatch (the pseudocode samples one f_{k,j}; ``batch_size:
null`` is the full gradient of f_k, the mean loss).

The averaging step of a communication needs theta_bar, which the server knows only after the
uploads: the client takes it at the start of its next round (the same sequence of operations).
``global_model`` is theta_bar (the same before and after that step); ``deployed_model`` is the
client's theta_k after its local steps, i.e. the pseudocode's theta_k just before the last
communication's averaging step. That snapshot is unbiased: the coin is independent of the
iterate, so in the stationary regime its mean is the solution of (1) (exactly for quadratic
f_k), whereas the iterate right after an averaging step is biased towards theta_bar by the
step's fraction eta lam / (K p) (a fraction of 1 would deploy theta_bar itself).

Extension (not in the paper, which has every client at every communication): with
``train.clients_per_round`` or dropped stragglers, only the reporting clients take part in a
communication; the others stay frozen. The server keeps theta_bar = mean of all K clients'
latest models by adding (1/K) times the uploaded changes, so (1) stays the objective (clients
start from the initial model ``init``, which the server keeps). With full participation this is
the algorithm above. Partial-mode stragglers take the share of the N steps that the engine
gives them of their ``train`` budget.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, average_buffers
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, add, clone, sub
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class L2SGDConfig(AlgorithmConfig):
    lam: float = Field(
        default=1.0, ge=0.0, description="penalty lambda of (1): 0 local models, large consensus"
    )
    p: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="communication probability per iteration; E[local steps] = (1 - p) / p",
    )


def local_step_count(seed: int, round: int, p: float) -> int:
    """The coin of (2) for one communication round: how many times it says 'no communication'
    (probability 1 - p each) before it says 'communicate'. One stream per round, shared by all
    clients, so every executor and every client draws the same number."""
    gen = generator(seed, "l2sgd", round)
    steps = 0
    while float(torch.rand((), generator=gen)) < 1.0 - p:
        steps += 1
    return steps


class L2SGD(Algorithm):
    name = "l2sgd"
    summary = "L2SGD: loopless local SGD on the mixed global/local problem (Hanzely & Richtarik)"
    Config = L2SGDConfig

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        assert isinstance(config, L2SGDConfig)
        self.num_clients = len(ctx.population) or ctx.num_clients
        pull = self.averaging_step()
        if pull > 2.0:
            raise ConfigError(
                f"algorithm.lam: the averaging step train.lr * lam / (K p) = {pull:.3g} "
                f"(K = {self.num_clients} clients) is above 2 and diverges; lower lam or "
                "train.lr, or raise p"
            )

    def averaging_step(self) -> float:
        """The fraction eta lam / (K p) of the way to theta_bar of the communication step."""
        return self.ctx.lr * self.config.lam / (self.num_clients * self.config.p)

    def _pulled(self, params: Tree, average: Tree) -> Tree:
        """theta_k - eta lam / (K p) (theta_k - theta_bar): (2)'s communication step."""
        return add(params, sub(params, average), alpha=-self.averaging_step())

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        return {"params": params, "buffers": buffers, "init": clone(params)}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        ones = [1.0] * len(results)
        mean_change = self.ctx.aggregate([r.upload["delta"] for r in results], ones)
        return {
            "params": add(server["params"], mean_change, alpha=len(results) / self.num_clients),
            "buffers": average_buffers(self.ctx, server, results, ones),
            "init": server["init"],
        }

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        return {"params": clone(server["init"]), "buffers": clone(server["buffers"])}

    def coin(self, round: int) -> int:
        """The round's N of (2), the same for every client (``local_step_count``)."""
        return local_step_count(self.ctx.seed, round, self.config.p)

    def round_steps(self, task: ClientTask) -> int:
        """The client's local steps this round: the coin's N (``local_step_count``), or a
        partial-mode straggler's share of it."""
        steps = self.coin(task.round)
        if task.full:  # a partial-mode straggler does its share of the round's steps
            steps = steps * len(task.plan) // task.full
        return steps

    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        steps = self.round_steps(task)
        return self.ctx.make_plan(task.data, steps, "batches", task.round, task.client_id)

    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(
            self, start=self.local_start, lr=self.local_lr, finish=self.local_finish
        )

    def local_lr(self, task: ClientTask) -> float:
        return task.lr / (self.num_clients * (1.0 - self.config.p))

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        assert state is not None
        return self._pulled(state["params"], message["params"]), state["buffers"]

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        assert state is not None
        upload = {"delta": sub(solved.params, state["params"]), "buffers": solved.buffers}
        new_state = {"params": solved.params, "buffers": solved.buffers}
        return ClientResult(upload, 1.0, solved.loss, state=new_state)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        if state is None or (self.ctx.population and task.client_id not in self.ctx.population):
            return server["params"], server["buffers"]  # held-out new clients: theta_bar
        return state["params"], state["buffers"]
