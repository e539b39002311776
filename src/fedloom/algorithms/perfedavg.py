"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, "Personalized Federated Learning with
Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", arXiv:2002.07948, Algorithm 1):
MAML (Finn, Abbeel, Levine, ICML 2017, arXiv:1703.03400) made federated, with the paper's
first-order (FO) and Hessian-free (HF) approximations of the meta-gradient.

The federated MAML objective: find theta whose one-step adaptation is good on every client,

    min_w  1/K sum_k F_k(w - alpha grad F_k(w)),
    grad_w F_k(w - alpha grad F_k(w)) = (I - alpha hess F_k(w)) grad F_k(w - alpha grad F_k(w)).

Algorithm 1, one round::

    server sends w                                     # FedAvg's downlink
    client k, local step t = 1..tau (len(task.plan): a straggler takes fewer):
        D, D', D'' independent minibatches             # D: the engine's plan (seed, round, k,
                                                       # 'batches'); D', D'': the streams
                                                       # 'perfedavg/outer', 'perfedavg/hessian'
        temp <- w - alpha grad f(w; D)
        fo: w <- w - beta grad f(temp; D')                                    # Per-FedAvg (FO)
        hf: w <- w - beta (I - alpha H(w; D'')) grad f(temp; D')              # Per-FedAvg (HF)
        so: w <- w - beta grad_w f(u_K(w); D'),  u_0 = w, u_{j+1} = u_j - alpha grad f(u_j; D)
            (the exact MAML gradient: autograd through the K = inner_steps inner steps on D)
    upload w
    server: w <- (1/|S|) sum_{k in S} w_k              # weighting: uniform (the paper), or
                                                       # samples (n_k / n)

H(w; D'') g is computed exactly (reverse-over-reverse autograd: the gradient of
<grad f(w; D''), g>, one double backward; faster than torch.func's forward-over-reverse
jvp(grad) one client at a time), or, with
``hvp_delta`` = delta, by the paper's central finite difference
(grad f(w + delta g; D'') - grad f(w - delta g; D'')) / (2 delta). Per round, fo costs the
least, then so, then hf (exact and finite difference alike); measured costs in
benchmarks/README.md, Design measurements.
``so`` with inner_steps = 1 is ``hf`` with D'' = D; ``fo`` drops the curvature term.

Deployment (:mod:`fedloom.algorithms.meta`): every client serves w after ``adapt_steps`` SGD
steps at alpha on its own training data (the paper: one step); new clients in the cold-start
evaluation start at w and fine-tune at alpha (``Deployment.adaptation_lr``).

With ``train.optimizer: adamw`` (docs/optimizers.md) the outer (meta) step is the local
optimizer's: w <- AdamW's step at beta on the meta-gradient, its moments zero at every
round's start (Per-FedAvg keeps no client state, so ``moments: client`` is refused). The inner
step temp = w - alpha grad f(w; D) stays the paper's SGD step: it is part of the objective
F_k(w - alpha grad F_k(w)) that w is meta-learned for, and the deployment (one or
``adapt_steps`` SGD steps at alpha) takes that same step.

Buffers (BatchNorm running statistics) are updated only by the forward pass at w on D, once per
local step as in plain local SGD; the passes at temp and the curvature pass use throwaway
copies. Per-FedAvg keeps no client state. Its local step is one client program
(:class:`PerFedAvgProgram`) for both backends: torch.func's nested transforms under vmap give
the hf and so variants' second derivatives for a whole chunk of clients at once.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from fedloom.algorithms.base import AlgorithmConfig
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.local_optimizer import LocalOptimizer
from fedloom.algorithms.meta import Adaptation, AdaptedDeployment, adapt_steps_field
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, ClientRun, Ops, Plan, Update
from fedloom.solvers.steps import descend, loss_grad

Variant = Literal["fo", "hf", "so"]


class PerFedAvgConfig(AlgorithmConfig):
    alpha: float = Field(default=0.01, gt=0.0, description="inner (adaptation) step size alpha")
    beta: float | None = Field(
        default=None, gt=0.0, description="outer (meta) step size beta (default: train.lr)"
    )
    variant: Variant = Field(
        default="hf",
        description="fo: first-order; hf: Hessian-free (H(w; D'') g); so: exact MAML gradient",
    )
    inner_steps: int = Field(
        default=1, ge=1, description="inner steps differentiated through (variant so only)"
    )
    hvp_delta: float | None = Field(
        default=None,
        gt=0.0,
        description="hf: the paper's finite-difference HVP with this delta (default: exact)",
    )
    weighting: Weighting = weighting_field("uniform", "server average over S (paper: uniform)")
    adapt_steps: int = adapt_steps_field()

    @field_validator("inner_steps")
    @classmethod
    def _inner_steps_need_so(cls, steps: int, info: ValidationInfo) -> int:
        if steps > 1 and info.data.get("variant") != "so":
            raise ValueError("inner_steps > 1 needs variant: so (fo and hf take one inner step)")
        return steps

    @field_validator("hvp_delta")
    @classmethod
    def _delta_needs_hf(cls, delta: float | None, info: ValidationInfo) -> float | None:
        if delta is not None and info.data.get("variant") != "hf":
            raise ValueError("hvp_delta is the Hessian-free variant's option (variant: hf)")
        return delta


# -- the meta-gradient ----------------------------------------------------------------------
def hessian_vector_product(
    ops: Ops, model: FunctionalModel, params: Tree, buffers: Tree, batch: Batch, v: Tree
) -> Tree:
    """H(params; batch) v exactly: the gradient of <grad f(params; batch), v>."""

    def directional(w: Tree) -> torch.Tensor:
        g, _ = loss_grad(ops, model, w, buffers, batch)
        return sum((g[k] * v[k]).sum() for k in w)

    return ops.value_and_grad(directional, params)[0]


def finite_difference_hvp(
    ops: Ops,
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    batch: Batch,
    v: Tree,
    delta: float,
) -> Tree:
    """The paper's H v ~ (grad f(w + delta v) - grad f(w - delta v)) / (2 delta)."""
    plus = {k: params[k] + delta * v[k] for k in params}
    minus = {k: params[k] - delta * v[k] for k in params}
    g_plus, _ = loss_grad(ops, model, plus, clone(buffers), batch)
    g_minus, _ = loss_grad(ops, model, minus, clone(buffers), batch)
    return {k: (g_plus[k] - g_minus[k]) / (2.0 * delta) for k in params}


def meta_gradient(
    ops: Ops,
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    batches: tuple[Batch, ...],
    cfg: PerFedAvgConfig,
) -> tuple[Tree, torch.Tensor, torch.Tensor]:
    """One local step's meta-gradient at w = ``params`` (see the module doc) from the batches
    (D, D'[, D'']): inner steps on D, meta-loss on D', curvature on D'' (hf only). Returns
    (gradient, f(w; D), f(temp; D')). ``buffers`` are updated in place by the forward pass at
    w on D (training mode); the other passes use throwaway copies."""
    inner, outer = batches[0], batches[1]
    alpha = cfg.alpha
    if cfg.variant == "so":
        first: dict[str, torch.Tensor] = {}

        def adapted_loss(w: Tree) -> torch.Tensor:
            u = w
            for j in range(cfg.inner_steps):
                g, loss = loss_grad(ops, model, u, buffers if j == 0 else clone(buffers), inner)
                if j == 0:
                    first["loss"] = loss
                u = {k: u[k] - alpha * g[k] for k in u}
            return model.weighted_loss(u, clone(buffers), outer.x, outer.y, outer.w)

        grads, meta = ops.value_and_grad(adapted_loss, params)
        return grads, first["loss"].detach(), meta
    g, loss = loss_grad(ops, model, params, buffers, inner)
    temp = descend(params, g, alpha)
    g_out, meta = loss_grad(ops, model, temp, clone(buffers), outer)
    if cfg.variant == "hf":
        hess = batches[2]
        if cfg.hvp_delta is None:
            hv = hessian_vector_product(ops, model, params, clone(buffers), hess, g_out)
        else:
            hv = finite_difference_hvp(ops, model, params, buffers, hess, g_out, cfg.hvp_delta)
        g_out = descend(g_out, hv, alpha)
    return g_out, loss, meta


OUTER = "perfedavg/outer"
HESSIAN = "perfedavg/hessian"


# -- the algorithm --------------------------------------------------------------------------
class AlphaAdaptation(Adaptation):
    """A client (new or deployed) adapts at alpha, the step the model was meta-learned for."""

    def adaptation_lr(self) -> float:
        return self.algorithm.config.alpha  # type: ignore[attr-defined]


class PerFedAvg(AdaptedDeployment, FedAvg):
    name = "perfedavg"
    summary = "Per-FedAvg: federated MAML, a global model meant for one-step adaptation"
    capabilities = FedAvg.capabilities.but(
        supports_sample_dp=False,  # its own meta-gradient steps
    )
    Config = PerFedAvgConfig
    Deployment = AlphaAdaptation

    def make_program(self) -> ClientProgram:
        return PerFedAvgProgram(self)


class PerFedAvgProgram(ClientProgram):
    """Algorithm 1's local steps: w <- w - beta * meta_gradient(w; D, D', D'') (with
    ``train.optimizer: adamw``, AdamW's step at beta on the meta-gradient)."""

    takes_optimizer = True

    def __init__(self, algorithm: PerFedAvg) -> None:
        super().__init__(algorithm.ctx.model, algorithm.ctx.seed)
        self.algorithm = algorithm
        self.config: PerFedAvgConfig = algorithm.config
        self.optimizer = LocalOptimizer(algorithm.ctx.optimizer)
        plans = (BATCHES, OUTER, HESSIAN) if self.config.variant == "hf" else (BATCHES, OUTER)
        self.updates = (Update("meta", plans, self.step),)

    def passes_per_step(self) -> float:
        """The inner step's gradient and the outer one (fo); a Hessian-vector product more
        (hf); the outer gradient through K inner steps (so)."""
        return {"fo": 2.0, "hf": 3.0}.get(self.config.variant, 2.0 * self.config.inner_steps + 1)

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        """D from the engine's plan; D' and D'' as many from their own streams."""
        steps = len(task.plan)
        make = self.algorithm.ctx.make_plan
        plans = {
            BATCHES: Plan(task.plan),
            OUTER: Plan(make(task.data, steps, OUTER, task.round, task.client_id)),
        }
        if self.config.variant == "hf":
            plans[HESSIAN] = Plan(make(task.data, steps, HESSIAN, task.round, task.client_id))
        return plans

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        carry = {"params": message["params"], "buffers": clone(message["buffers"])}
        return self.optimizer.start(carry, state, {"params": message["params"]})

    def shared(self, message: Message, task: ClientTask) -> dict:
        beta = self.config.beta if self.config.beta is not None else self.algorithm.ctx.lr
        return {"beta": beta}

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        grads, loss, meta = meta_gradient(
            ops, self.model, carry["params"], carry["buffers"], batches, self.config
        )
        new = dict(carry)
        new["params"] = self.optimizer.step(
            new, "params", carry["params"], grads, shared["beta"], ops.descend
        )
        return new, {"loss": loss, "meta_loss": meta}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        weight = self.algorithm.ctx.objective_weight(task.client_id, self.config.weighting)
        return ClientResult(
            {"params": run.carry["params"], "buffers": run.carry["buffers"]},
            weight,
            run.metric("meta"),
            info={"meta_loss": run.metric("meta", "meta_loss")},
        )
