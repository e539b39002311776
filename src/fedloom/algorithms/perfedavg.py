"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, "Personalized Federated Learning with
Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", arXiv:2002.07948, Algorithm 1);
seed 004, first article, sections 2.1 (FedMeta / Per-FedAvg: MAML made federated) and 2.2
(the first-order approximation).

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
                                                       # samples (n_k / n, the seed's 2.1)

H(w; D'') g is computed exactly (reverse-over-reverse autograd: the gradient of
<grad f(w; D''), g>, one double backward; 1.1x to 2x faster than torch.func's forward-over-
reverse jvp(grad) on the 2NN, one client at a time, in our measurements), or, with
``hvp_delta`` = delta, by the paper's central finite difference
(grad f(w + delta g; D'') - grad f(w - delta g; D'')) / (2 delta). Measured cost on the 2NN
(10 clients x 20 local steps of 32 samples, 2 shared cores): fo 1.0 s, so 2.6 s, hf 3.5 s per
round (exact and finite difference alike); FedAvg 0.5 s.
``so`` with inner_steps = 1 is ``hf`` with D'' = D; ``fo`` drops the curvature term.

Deployment (:mod:`fedloom.algorithms.meta`): every client serves w after ``adapt_steps`` SGD
steps at alpha on its own training data (the paper: one step); new clients in the cold-start
evaluation start at w and fine-tune at alpha (``adaptation_lr``).

Buffers (BatchNorm running statistics) are updated only by the forward pass at w on D, once per
local step as in plain local SGD; the passes at temp and the curvature pass use throwaway
copies. Per-FedAvg keeps no client state; it runs its own local loop, so the vectorized executor
runs its clients one at a time (same numbers, no speed-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from fedloom.algorithms.base import (
    AlgorithmConfig,
    ClientResult,
    ClientTask,
    Message,
    State,
    Weighting,
    weighting_field,
)
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.meta import AdaptedDeployment, adapt_steps_field
from fedloom.engine.functional import FunctionalModel
from fedloom.engine.pytree import Tree, clone

Variant = Literal["fo", "hf", "so"]
Batch = tuple[torch.Tensor, torch.Tensor]
"""Inputs and labels of one minibatch."""


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
def _leaves(params: Tree) -> Tree:
    return {k: v.detach().requires_grad_(True) for k, v in params.items()}


def loss_and_grad(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    batch: Batch,
    create_graph: bool = False,
) -> tuple[torch.Tensor, Tree]:
    """f(params; batch) and its gradient with respect to ``params`` (which must require grad);
    ``create_graph`` keeps the gradient differentiable."""
    with torch.enable_grad():
        loss = model.loss(params, buffers, *batch)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
    return loss, dict(zip(params, grads, strict=True))


def hessian_vector_product(
    model: FunctionalModel, params: Tree, buffers: Tree, batch: Batch, v: Tree
) -> Tree:
    """H(params; batch) v exactly: the gradient of <grad f(params; batch), v>."""
    w = _leaves(params)
    with torch.enable_grad():
        _, g = loss_and_grad(model, w, buffers, batch, create_graph=True)
        dot = sum((g[k] * v[k]).sum() for k in w)
        hv = torch.autograd.grad(dot, list(w.values()))
    return dict(zip(w, hv, strict=True))


def finite_difference_hvp(
    model: FunctionalModel, params: Tree, buffers: Tree, batch: Batch, v: Tree, delta: float
) -> Tree:
    """The paper's H v ~ (grad f(w + delta v) - grad f(w - delta v)) / (2 delta)."""
    plus = {k: (params[k] + delta * v[k]).detach().requires_grad_(True) for k in params}
    minus = {k: (params[k] - delta * v[k]).detach().requires_grad_(True) for k in params}
    _, g_plus = loss_and_grad(model, plus, clone(buffers), batch)
    _, g_minus = loss_and_grad(model, minus, clone(buffers), batch)
    return {k: (g_plus[k] - g_minus[k]) / (2.0 * delta) for k in params}


@dataclass
class MetaStep:
    grad: Tree
    """The variant's estimate of grad_w F(w - alpha grad F(w))."""
    loss: float
    """f(w; D): the loss at the iterate."""
    meta_loss: float
    """f(temp; D') (so: f(u_K; D')): the loss after adaptation."""


def meta_gradient(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    inner: Batch,
    outer: Batch,
    hess: Batch | None,
    variant: Variant,
    alpha: float,
    inner_steps: int = 1,
    hvp_delta: float | None = None,
) -> MetaStep:
    """One local step's meta-gradient at w = ``params`` (see the module doc): inner steps on
    ``inner`` (D), meta-loss on ``outer`` (D'), curvature on ``hess`` (D'', hf only).
    ``buffers`` are updated in place by the first forward pass at w on D (training mode)."""
    w = _leaves(params)
    if variant == "so":
        with torch.enable_grad():
            u, loss0 = w, None
            for j in range(inner_steps):
                loss, g = loss_and_grad(
                    model, u, buffers if j == 0 else clone(buffers), inner, create_graph=True
                )
                loss0 = loss if loss0 is None else loss0
                u = {k: u[k] - alpha * g[k] for k in u}
            meta = model.loss(u, clone(buffers), *outer)
            grads = torch.autograd.grad(meta, list(w.values()))
        assert loss0 is not None
        return MetaStep(
            dict(zip(w, grads, strict=True)), float(loss0.detach()), float(meta.detach())
        )
    loss, g = loss_and_grad(model, w, buffers, inner)
    temp = {k: (w[k] - alpha * g[k]).detach().requires_grad_(True) for k in w}
    meta, g_out = loss_and_grad(model, temp, clone(buffers), outer)
    if variant == "hf":
        assert hess is not None
        if hvp_delta is None:
            hv = hessian_vector_product(model, params, clone(buffers), hess, g_out)
        else:
            hv = finite_difference_hvp(model, params, buffers, hess, g_out, hvp_delta)
        g_out = {k: g_out[k] - alpha * hv[k] for k in g_out}
    return MetaStep(g_out, float(loss.detach()), float(meta.detach()))


# -- the algorithm --------------------------------------------------------------------------
class PerFedAvg(AdaptedDeployment, FedAvg):
    name = "perfedavg"
    summary = "Per-FedAvg: federated MAML, a global model meant for one-step adaptation"
    Config = PerFedAvgConfig

    def adaptation_lr(self) -> float:
        """A new client fine-tunes at alpha, the step the model was meta-learned for."""
        return self.config.alpha

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        cfg, model, data = self.config, self.ctx.model, task.data
        beta = cfg.beta if cfg.beta is not None else self.ctx.lr
        plan, steps = task.plan, len(task.plan)
        outer = self.ctx.make_plan(data, steps, "perfedavg/outer", task.round, task.client_id)
        hess = (
            self.ctx.make_plan(data, steps, "perfedavg/hessian", task.round, task.client_id)
            if cfg.variant == "hf"
            else [None] * steps
        )
        x, y = data.x_train, data.y_train
        w, buffers = clone(message["params"]), clone(message["buffers"])
        total, total_meta = 0.0, 0.0
        model.module.train()
        with model.random_stream(self.ctx.seed, task.round, task.client_id):
            for d, d_out, d_hess in zip(plan, outer, hess, strict=True):
                step = meta_gradient(
                    model,
                    w,
                    buffers,
                    (x[d], y[d]),
                    (x[d_out], y[d_out]),
                    None if d_hess is None else (x[d_hess], y[d_hess]),
                    cfg.variant,
                    cfg.alpha,
                    cfg.inner_steps,
                    cfg.hvp_delta,
                )
                w = {k: (w[k] - beta * step.grad[k]).detach() for k in w}
                total += step.loss
                total_meta += step.meta_loss
        weight = self.ctx.objective_weight(task.client_id, cfg.weighting)
        n = max(1, steps)
        return ClientResult(
            {"params": w, "buffers": buffers},
            weight,
            total / n,
            info={"meta_loss": total_meta / n},
        )
