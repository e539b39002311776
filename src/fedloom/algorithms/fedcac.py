"""FedCAC (Wu, Li, Li, Zhang, Wang, Yuan, Hu, ICCV 2023, "Bold but Cautious: Unlocking the
Potential of Personalized Federated Learning through Cautiously Aggressive Collaboration",
arXiv:2309.11103, Section 4, eq. 3-8): each client's parameters split into critical ones
(sensitive to its own data), shared only with clients whose critical parameters lie in similar
places, and non-critical ones, averaged over everyone.

One round (client k of the m training clients)::

    client k:  w <- w_k^t (its personalized model from the server; round 1: the initial one)
               local SGD on CE (FedAvg's program, the engine's plan) -> w_k
               s = |(w_k - w_k^t) * w_k|                   # eq. 3-4: the update as -lr grad
               per parameter tensor (layer) l: c_k[l] = s[l] >= the
                 floor(tau |l|)-th largest value of s[l]   # eq. 5: the top tau of each layer
               upload w_k and its critical mask c_k
    server:    w_bar <- sum_k n_k w_k / sum_k n_k over the round's clients     # non-critical
               keep each client's latest w_k, c_k; over the clients that have trained:
               o_kj  = 1 - ||c_k - c_j||_1 / (2 ||c_k||_1)                   # eq. 6: overlap
               T     = o_avg + ((t + 1) / beta) (o_max - o_avg)  over pairs k != j # eq. 7
               u_k   = mean of w_j over j in {k} and {j : o_kj >= T}             # eq. 8
               w_k^{t+1} = c_k * u_k + (1 - c_k) * w_bar   # k's start in round t + 1

with t the (1-based) round just trained: early rounds collaborate widely
on critical parameters, and from round beta on only the most similar pairs (then none).
A layer whose top-tau threshold is below 1e-10 uses its smallest metric above 1e-20 (the
authors' guard against a layer that barely moved); tau |l| < 1 selects nothing.

Defaults: ``tau`` 0.5 and ``beta`` 170 (the public implementations' defaults), ``weighting``
samples (FedAvg's n_k for w_bar). The server keeps m models, masks and personalized models
(3 m d numbers); each client downloads only its own personalized model (with the averaged
buffers, e.g. BatchNorm statistics, which are not masked) and uploads its model and mask (one
byte a parameter). There is no global model in the evaluation sense: client k deploys
w_k^{t+1}; a client that never trained (or a held-out new one) deploys w_bar.

Its local steps are FedAvg's and the mask is a function of the uploaded parameters alone,
so sample-level DP applies (``supports_sample_dp``); asynchrony and secure aggregation are
refused (the server needs each client's model and mask in the clear).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, aggregate_models
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.peers import training_clients
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.weights import Weighting, aggregation_weight, weighting_field
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution

FLAT_METRIC = 1e-10
"""A layer whose top-tau threshold is at most this uses its smallest metric above ``TINY``."""
TINY = 1e-20


class FedCACConfig(AlgorithmConfig):
    tau: float = Field(
        default=0.5, ge=0.0, le=1.0, description="fraction of critical parameters per layer"
    )
    beta: float = Field(
        default=170.0, gt=0.0, description="rounds until only the most similar clients collaborate"
    )
    weighting: Weighting = weighting_field("samples", "averaging weights of w_bar (FedAvg's)")


def critical_mask(before: Tree, after: Tree, tau: float) -> Tree:
    """Per parameter tensor, the mask of its top ``tau`` fraction by |(after - before) * after|
    (ties at the threshold included; see the module doc for flat layers)."""
    masks = {}
    for key, new in after.items():
        metric = ((new - before[key]) * new).abs().flatten()
        count = int(tau * metric.numel())
        if count == 0:
            masks[key] = torch.zeros_like(new, dtype=torch.bool)
            continue
        threshold = torch.topk(metric, count).values[-1]
        if float(threshold) <= FLAT_METRIC:
            moved = metric[metric > TINY]
            if moved.numel():
                threshold = moved.min()
        masks[key] = (metric >= threshold).reshape(new.shape)
    return masks


def overlap_rates(masks: torch.Tensor) -> torch.Tensor:
    """The (K, K) matrix 1 - ||c_k - c_j||_1 / (2 ||c_k||_1) of K flat 0/1 masks (eq. 6),
    in float64; a client with no critical parameter overlaps nobody."""
    c = masks.to(torch.float64)
    sizes = c.sum(dim=1)
    distance = sizes[:, None] + sizes[None, :] - 2.0 * c @ c.T  # ||c_k - c_j||_1
    rates = 1.0 - distance / (2.0 * sizes[:, None])
    return torch.where(sizes[:, None] > 0, rates, torch.zeros_like(rates))


def collaborators(rates: torch.Tensor, t: int, beta: float) -> torch.Tensor:
    """The (K, K) boolean matrix of who averages whose critical parameters: the diagonal,
    and o_kj >= T_t = o_avg + (t / beta)(o_max - o_avg) over the pairs k != j (eq. 7)."""
    k = rates.shape[0]
    eye = torch.eye(k, dtype=torch.bool)
    if k < 2:
        return eye
    others = rates[~eye]
    avg, top = others.mean(), others.max()
    threshold = torch.lerp(avg, top, t / beta)  # exactly o_max at t = beta
    return eye | ((rates >= threshold) & ~eye)


class FedCAC(Algorithm):
    name = "fedcac"
    summary = "FedCAC: critical parameters shared among similar clients, the rest with everyone"
    Config = FedCACConfig
    capabilities = Capabilities(
        has_global_model=False,
        supports_sample_dp=True,
    )
    wire = Wire(rows={"personal": 1})

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.m = training_clients(ctx, self.name)

    def table(self, params: Tree) -> Tree:
        return {k: v.unsqueeze(0).repeat(self.m, *[1] * v.ndim) for k, v in params.items()}

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        """w_bar, and per training client its latest model, critical mask and personalized
        model (all the initial model until it trains) and whether it has trained."""
        return {
            "params": params,
            "buffers": buffers,
            "models": self.table(params),
            "masks": {
                k: torch.zeros(self.m, *v.shape, dtype=torch.bool) for k, v in params.items()
            },
            "personal": self.table(params),
            "trained": torch.zeros(self.m, dtype=torch.bool),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {"personal": server["personal"], "buffers": server["buffers"]}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        if not results:
            return server
        mean = aggregate_models(self.ctx, results)
        ids = torch.tensor([r.client_id for r in results])
        models = {
            k: v.index_copy(0, ids, torch.stack([r.upload["params"][k] for r in results]))
            for k, v in server["models"].items()
        }
        masks = {
            k: v.index_copy(0, ids, torch.stack([r.upload["critical"][k] for r in results]))
            for k, v in server["masks"].items()
        }
        trained = server["trained"].clone()
        trained[ids] = True
        personal = self.personalize(mean["params"], models, masks, trained, results[0].round + 1)
        return {
            **server,
            **mean,
            "models": models,
            "masks": masks,
            "personal": personal,
            "trained": trained,
        }

    def personalize(
        self, mean: Tree, models: Tree, masks: Tree, trained: torch.Tensor, t: int
    ) -> Tree:
        """Every client's model of round t: c_k * u_k + (1 - c_k) * w_bar for the clients that
        have trained (u_k: the mean of its collaborators' models), w_bar for the others."""
        ids = torch.nonzero(trained).flatten()
        flat = torch.cat([masks[k][ids].flatten(1) for k in masks], dim=1)
        peers = collaborators(overlap_rates(flat), t, self.config.beta).to(torch.float64)
        share = peers / peers.sum(dim=1, keepdim=True)
        personal = {}
        for key, w_bar in mean.items():
            custom = torch.tensordot(share, models[key][ids].to(torch.float64), dims=1)
            critical = masks[key][ids]
            rows = w_bar.unsqueeze(0).repeat(self.m, *[1] * w_bar.ndim)
            rows[ids] = torch.where(critical, custom.to(w_bar.dtype), w_bar)
            personal[key] = rows
        return personal

    # -- client ---------------------------------------------------------------------------
    def make_program(self) -> ClientProgram:
        """FedAvg's local SGD from the client's personalized model, uploading the model and
        its critical mask."""
        return PlainSGDProgram(self, start=self.personal_start, finish=self.critical_finish)

    def personal_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """w_k^t: the client's row of the personalized table, with the averaged buffers."""
        own = {k: v[task.client_id] for k, v in message["personal"].items()}
        return own, message["buffers"]

    def critical_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        before, _ = self.personal_start(message, state, task)
        upload = {
            "params": solved.params,
            "buffers": solved.buffers,
            "critical": critical_mask(before, solved.params, self.config.tau),
        }
        weight = aggregation_weight(self.config.weighting, task.data.num_train)
        return ClientResult(upload, weight, solved.loss)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """w_k^{t+1} for a training client (w_bar until it trains), w_bar for a new one."""
        if task.client_id >= self.m:
            return server["params"], server["buffers"]
        own = {k: v[task.client_id] for k, v in server["personal"].items()}
        return own, server["buffers"]
