"""FedCR (Zhang et al., ICML 2023, "FedCR: Personalized Federated Learning Based on Across-Client
Common Representation with Conditional Mutual Information Regularization", PMLR 202). The
labels (20) (the objective), (21)-(22) (the local and global class statistics) and (23) (the
local objective) are this docstring's own.

FedPer's split (:mod:`fedloom.algorithms.fedper`): the body w^f (feature extractor) is shared and
averaged, the head w^p (a single ``nn.Linear``, the final classifier) stays personal. FedCR makes
the representation stochastic and aligns it across clients class by class.

Representation, for the head input h(x) of dimension d (generic: read by
``FunctionalModel.forward_with_features``, a forward pre-hook on the head module, so every model
whose head is one Linear layer works)::

    p(z | x) = N(mu(x), diag(sigma^2(x))),  mu(x) = h(x),  sigma(x) = softplus(V h(x) + b - alpha)
    z = mu + sigma * eps,  eps ~ N(0, I)     # reparameterization; eps from the client's stream
                                             # (seed, round, client, 'fedcr')
    logits = head(z)

The variance branch (V, b) is FedCR's own, extra SHARED parameters: kept in the server state
next to the body (``variance``), sent, trained by every client and averaged like the body. As
in the paper's code (``Nets_VIB.encoder_result``: sigma = softplus(out - alpha), alpha = 0 by
default) sigma goes through a softplus with an offset ``alpha``; the paper's layer is randomly
initialized, ours starts at V = 0, b = 0, so sigma(x) = softplus(-alpha) for every x at first
(0.69 for alpha = 0; alpha = 3: 0.049).

Local objective (23), estimated on each minibatch B with S = ``num_samples`` draws of z per
sample (the paper's ``num_avg_train``, default 15)::

    L_i = 1/|B| sum_n [ 1/S sum_s CE(head(z_s^(n)), y^(n))
                        + beta KL[ N(mu^c, Sigma^c) || N(mu(x^(n)), sigma^2(x^(n))) ] ],  c = y^(n)

The KL direction is (23)'s, KL[p(z^c | x) || p(z | x_i)] (global class posterior first; the
paper's code computes the same, ``KL_between_normals(prior_Z_distr, encoder_Z_distr)``),
analytic for diagonal Gaussians::

    KL[N(m, v) || N(mu, s^2)] = 1/2 sum_d [ log(s_d^2 / v_d) + (v_d + (m_d - mu_d)^2) / s_d^2 - 1 ]

All parameters (body, variance branch, head) take plain SGD steps on L_i together (the
pseudocode's "update the whole network by SGD on the local objective"); with
``train.optimizer: adamw`` AdamW's steps on the same gradient, one set of moments over all
of them (docs/optimizers.md; kept in the client state with ``moments: client``). At
inference a client uses head(mu(x)): for a linear head this is exactly the expectation
E_eps[head(z)] of the logits the paper's code averages over ``num_avg`` draws.

The local step is one client program (:class:`FedCRProgram`, solvers/program.py) that both
backends run: the sequential one client at a time with autograd, the vmap backend a chunk of
clients at once under ``torch.func.vmap`` (sequential == vectorized within 1e-4, tested). It is
a pure function of the carry: the noise eps of every step is drawn in ``init`` from the
client's stream (S x n_s x d per step, in step order: the same draws as drawing at each step),
a step counter picks the step's row; the class statistics (21) are sums in the carry that
a step adds its real samples to (padding weights ``batch.w`` > 0) when the counter lies in the
client's window of the last complete epoch (tensor comparisons, no Python branch); the
forward pass's mu(x) and sigma^2(x) leave the differentiated function as auxiliary outputs
(``Ops.value_and_grad_aux``), so there is no second forward pass. The noise table costs
steps x S x width x d floats per client of a chunk (digits, 2NN, 16 steps of 16: 3 MB).

Local class statistics (21), the geometric-mean product of experts of the N_i^c samples of
class c seen by the forward passes of the client's last complete local epoch (the latest forward
passes of local training; the paper's code: the last epoch). With
E = ceil(n_i / B) steps an epoch (B = ``train.batch_size``) and K local steps, that is steps
(k-1) E .. k E - 1 for k = floor(K / E) full epochs, so every training sample enters exactly
once; the passes of a trailing partial epoch are left out (the last E steps would span two
epochs, counting some samples twice and missing others). With K < E, all K steps (each sample
at most once). With mu_n, Lambda_n = diag(1 / sigma_n^2) of sample n::

    prod_n N(z; mu_n, Lambda_n^-1)^(1/N)  ∝  exp(-1/2 sum_n (1/N) (z - mu_n)^T Lambda_n (z - mu_n))
                                          ∝  N(z; mu_i^c, (Lambda_i^c)^-1)   (completing the square)
    Lambda_i^c = 1/N sum_n Lambda_n                       (mean precision)
    mu_i^c     = (Lambda_i^c)^-1 1/N sum_n Lambda_n mu_n  (precision-weighted mean)
    Sigma_i^c  = (Lambda_i^c)^-1

A client uploads (mu_i^c, diag Sigma_i^c) for the classes c it saw (with their ids). The
server's product of experts (22) with the prior N(0, I), for each class held by some reporting
client P_t^c::

    Sigma^c = (I + sum_{i in P_t^c} (Sigma_i^c)^-1)^-1
    mu^c    = Sigma^c sum_{i in P_t^c} (Sigma_i^c)^-1 mu_i^c

(the sums are |P_t^c| times a mean through the engine's aggregation rule, so a robust rule
plugged in there applies to them too). Classes no reporting client holds keep last round's
(mu^c, Sigma^c); all start at (0, I) (the pseudocode's initialization). The body and the variance
branch are averaged with weights 1/K (``weighting: uniform``: the pseudocode's plain mean over
P_t, the default) or n_k / n (``samples``).

``deterministic: true`` drops the variance branch (Sigma(x) = 0, z = mu) and the class
statistics: the KL of (23) is then infinite, so beta is 0 (its default there; a beta > 0 with it
is a config error), and FedCR is FedPer (with beta = 0 and Sigma(x) = 0, (23) is
FedPer's cross-entropy): it runs FedPer's plain SGD program, and a test checks it on every
client's deployed model.

Communication: down, body + variance branch + every class's (mu^c, diag Sigma^c); up, body +
variance branch + the client's classes' (mu_i^c, diag Sigma_i^c) and their int64 ids. There is
no global model (the heads are personal); new clients are FedPer's (initial head, optionally
fine-tuned for ``finetune_steps``).

The per-sample KL in (23) is the alignment term of (20), I(z; x | y_i) - I_i(z; x_i | y_i), with
the intractable global posterior replaced by its PoE estimate (21)-(22).

Where the paper's code differs (haozzh/FedCR, ``distributed_training_utils.py``): its local
statistics are the plain product of the last epoch's per-sample Gaussians (no 1/N exponent), (21)
here is the geometric mean; mu and sigma come from a dedicated layer of
2 x dimZ outputs, ours are the head input itself and a d x d branch on it; it clips gradient
norms at 10 and can smooth the server statistics (``beta2``; 1 = replace, as its FedCR runs use):
neither is done here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationInfo, field_validator, model_validator
from torch import nn

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedgen import at_step
from fedloom.algorithms.fedper import FedPer, FedPerConfig
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers import (
    Batch,
    Carry,
    ClientProgram,
    ClientRun,
    CoveringPlans,
    Ops,
)
from fedloom.solvers.adamw import MOMENTS, adamw_step, init_moments
from fedloom.solvers.steps import descend

DEFAULT_BETA = 0.001
"""beta of the stochastic representation (the paper's 1e-3)."""

MIN_SIGMA = 1e-8
"""sigma is clamped here before its log (the paper's code clamps at the same value)."""


class FedCRConfig(FedPerConfig):
    weighting: Weighting = weighting_field(
        "uniform", "body averaging weights (pseudocode: uniform)"
    )
    deterministic: bool = Field(
        default=False, description="Sigma(x) = 0: z = mu, no variance branch (beta is then 0)"
    )
    beta: float = Field(
        default=DEFAULT_BETA,
        ge=0.0,
        description="CMI regularization weight of (23) (paper: 1e-3, 1e-4; 0 if deterministic)",
    )
    num_samples: int = Field(
        default=15, ge=1, description="draws of z per sample in the loss (paper: 15)"
    )
    alpha: float = Field(
        default=0.0, description="sigma = softplus(V h + b - alpha); starts at softplus(-alpha)"
    )

    @field_validator("beta")
    @classmethod
    def _finite_kl(cls, beta: float, info: ValidationInfo) -> float:
        if beta > 0 and info.data.get("deterministic"):
            raise ValueError(
                "deterministic features (Sigma(x) = 0) make the KL term of (23) infinite; "
                "use beta: 0 with deterministic: true"
            )
        return beta

    @model_validator(mode="after")
    def _no_kl_without_variance(self) -> FedCRConfig:
        """Deterministic features have no KL term: beta defaults to 0 there, not 1e-3."""
        if self.deterministic and "beta" not in self.model_fields_set:
            object.__setattr__(self, "beta", 0.0)
        return self


def gaussian_kl(
    m: torch.Tensor, v: torch.Tensor, mu: torch.Tensor, s2: torch.Tensor
) -> torch.Tensor:
    """KL[N(m, diag v) || N(mu, diag s2)] over the last dimension."""
    return 0.5 * (torch.log(s2 / v) + (v + (m - mu) ** 2) / s2 - 1.0).sum(dim=-1)


@dataclass(frozen=True)
class ClassStatistics:
    """Sums of the local geometric-mean product of experts (21), per class: the precisions,
    the precision-weighted means and the sample count (float64). Pure: ``add`` returns new
    sums, so they live in a client program's carry (a dict: ``tree`` / ``ClassStatistics(**)``)."""

    precision: torch.Tensor
    shift: torch.Tensor
    count: torch.Tensor

    @classmethod
    def zeros(cls, num_classes: int, dim: int) -> ClassStatistics:
        return cls(
            torch.zeros(num_classes, dim, dtype=torch.float64),
            torch.zeros(num_classes, dim, dtype=torch.float64),
            torch.zeros(num_classes, dtype=torch.float64),
        )

    def tree(self) -> Tree:
        return {"precision": self.precision, "shift": self.shift, "count": self.count}

    def add(
        self,
        mu: torch.Tensor,
        var: torch.Tensor,
        y: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> ClassStatistics:
        """The sums with the samples (mu_n, diag var_n) of classes ``y`` added, those where
        the boolean ``keep`` is True only (default: all). A one-hot product instead of
        ``index_add``, so it runs under ``vmap``; dropped samples add exact zeros."""
        precision = 1.0 / var.to(torch.float64)
        shift = precision * mu.to(torch.float64)
        member = y[:, None] == torch.arange(self.count.shape[0], device=y.device)
        if keep is not None:
            member = member & keep[:, None]
            precision = torch.where(keep[:, None], precision, 0.0)  # no 0 * inf or 0 * nan
            shift = torch.where(keep[:, None], shift, 0.0)
        onehot = member.to(torch.float64)  # (n, classes)
        return ClassStatistics(
            self.precision + onehot.T @ precision,
            self.shift + onehot.T @ shift,
            self.count + onehot.sum(dim=0),
        )

    def upload(self, dtype: torch.dtype) -> Tree:
        """(ids, mu_i^c, diag Sigma_i^c) of the classes seen: Lambda = sum / N, mu = shift / sum."""
        ids = torch.nonzero(self.count > 0).flatten()
        precision, shift = self.precision[ids], self.shift[ids]
        return {
            "ids": ids,
            "mean": (shift / precision).to(dtype),
            "var": (self.count[ids, None] / precision).to(dtype),
        }


class FedCR(FedPer):
    name = "fedcr"
    summary = "FedCR: FedPer with a stochastic representation aligned class-wise across clients"
    capabilities = FedPer.capabilities.but(
        supports_sample_dp=False,  # its own variational step
        classification_only="class-wise statistics",
    )
    Config = FedCRConfig

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        module = ctx.model.module
        heads = self.head_modules
        head = module.get_submodule(heads[0]) if len(heads) == 1 else None
        if not isinstance(head, nn.Linear):
            raise ConfigError(
                f"algorithm.name: fedcr needs a model whose head (FedModel.head_modules) is one "
                f"nn.Linear layer, and {type(module).__name__}'s is {heads}"
            )
        self.head_name = heads[0]
        self.dim = head.in_features
        self.num_classes = head.out_features
        self.stochastic = not self.config.deterministic

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        state = super().init_server_state(params, buffers)
        if self.stochastic:
            d, dtype = self.dim, params[self.split.local_params[0]].dtype
            state["variance"] = {
                "weight": torch.zeros(d, d, dtype=dtype),
                "bias": torch.zeros(d, dtype=dtype),
            }
            state["classes"] = {
                "mean": torch.zeros(self.num_classes, d, dtype=dtype),
                "var": torch.ones(self.num_classes, d, dtype=dtype),
            }
        return state

    def server_message(self, server: State, round: int = 0) -> Message:
        message = super().server_message(server, round)
        if self.stochastic:
            message["variance"] = server["variance"]
            message["classes"] = server["classes"]
        return message

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        new = super().aggregate(server, results)
        if self.stochastic:
            weights = [r.weight for r in results]
            new["variance"] = self.ctx.aggregate([r.upload["variance"] for r in results], weights)
            new["classes"] = self.product_of_experts(server["classes"], results)
        return new

    def product_of_experts(self, classes: Tree, results: list[ClientResult]) -> Tree:
        """(22): the prior N(0, I) times the reporting clients' class Gaussians, per class;
        classes nobody reported keep their statistics."""
        mean, var = classes["mean"].clone(), classes["var"].clone()
        for c in range(self.num_classes):
            experts = []
            for r in results:
                up = r.upload["classes"]
                rows = torch.nonzero(up["ids"] == c).flatten()
                if rows.numel():
                    m, v = (
                        up["mean"][rows[0]].to(torch.float64),
                        up["var"][rows[0]].to(torch.float64),
                    )
                    experts.append({"precision": 1.0 / v, "shift": m / v})
            if not experts:
                continue
            n = len(experts)
            avg = self.ctx.aggregate(experts, [1.0] * n)
            precision = 1.0 + n * avg["precision"]
            var[c] = (1.0 / precision).to(var.dtype)
            mean[c] = (n * avg["shift"] / precision).to(mean.dtype)
        return {"mean": mean, "var": var}

    # -- client ---------------------------------------------------------------------------
    def epoch_steps(self, num_train: int) -> int:
        b = self.ctx.batch_size
        return 1 if b is None or b >= num_train else math.ceil(num_train / b)

    def statistics_steps(self, num_steps: int, num_train: int) -> range:
        """The local steps whose forward passes give the class statistics (21): the last
        complete epoch of the ``num_steps`` (all of them when fewer than an epoch)."""
        epoch = self.epoch_steps(num_train)
        full = num_steps // epoch
        return range(num_steps) if full == 0 else range((full - 1) * epoch, full * epoch)

    def make_program(self) -> ClientProgram:
        """FedCRProgram; deterministic features: FedPer's plain SGD program."""
        return FedCRProgram(self) if self.stochastic else super().make_program()


KEY = "fedcr"
"""The carry's key of FedCR's own variables: the variance branch, the noise table, the step
counter, the statistics window and the class statistics."""

VARIANCE = "fedcr.variance."
"""Prefix of the variance branch's tensors among the differentiated parameters."""


def representation_loss(
    h: torch.Tensor,
    batch: Batch,
    head: tuple[torch.Tensor, torch.Tensor],
    variance: Tree,
    eps: torch.Tensor,
    classes: Tree,
    config: FedCRConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(23) on a minibatch with head inputs ``h`` = mu(x) (n, d) and noise ``eps``
    (S, n, d): the CE of the (linear) ``head`` on z = mu + sigma eps, averaged over the S draws
    and the real samples, plus beta times the mean KL from the class posteriors ``classes``;
    also returns sigma^2(x) (n, d)."""
    sigma = F.softplus(F.linear(h, variance["weight"], variance["bias"]) - config.alpha)
    sigma = sigma.clamp_min(MIN_SIGMA)
    logits = F.linear(h + sigma * eps, *head)  # (samples, batch, classes)
    s, n = eps.shape[0], eps.shape[1]
    ce = F.cross_entropy(logits.reshape(s * n, -1), batch.y.repeat(s), reduction="none")
    loss = batch.mean(ce.view(s, n).mean(dim=0))
    s2 = sigma**2
    if config.beta > 0:
        kl = gaussian_kl(classes["mean"][batch.y], classes["var"][batch.y], h, s2)
        loss = loss + config.beta * batch.mean(kl)
    return loss, s2


class FedCRProgram(CoveringPlans, SGDProgram):
    """FedCR's local step, one client program for both backends: SGD on (23) over the body,
    the head and the variance branch together, the class statistics (21) of the last
    complete epoch accumulated in the carry.

    The carry adds, under ``fedcr``: the variance branch (V, b); the noise eps of every step,
    drawn in ``init`` from the client's stream (seed, 'fedcr', round, client), step by step,
    (S, n_s, d) each, into a table zero-padded to the round's longest and widest plan
    (:class:`CoveringPlans`); the step counter s; the window [first, last) of
    ``FedCR.statistics_steps``; and the sums of :class:`ClassStatistics`. Step s adds its
    samples to the sums where first <= s < last and the sample is real (``batch.w`` > 0):
    tensor comparisons, no Python branch, so a chunk of clients with their own windows steps
    together under vmap. mu(x) = h(x) comes from ``forward_with_features``."""

    private_step = False  # the variational objective (23), not DP-SGD's per-sample loss
    takes_optimizer = True  # ``train.optimizer``'s step on (23)'s gradient, variance included

    def __init__(self, algorithm: FedCR) -> None:
        super().__init__(algorithm, start=algorithm.local_start, finish=algorithm.local_finish)
        self.algorithm: FedCR = algorithm
        self.config: FedCRConfig = algorithm.config
        head = algorithm.head_name
        self.head_keys = (f"{head}.weight", f"{head}.bias")

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        carry = super().init(message, state, task)
        plan = self.algorithm.client_plan(task)
        window = self.algorithm.statistics_steps(len(plan), task.data.num_train)
        stats = ClassStatistics.zeros(self.algorithm.num_classes, self.algorithm.dim)
        carry[KEY] = {
            "variance": dict(message["variance"]),
            "eps": self.draws(task, message["variance"]["bias"].dtype),
            "step": torch.zeros((), dtype=torch.long),
            "window": torch.tensor([window.start, window.stop]),
            "stats": stats.tree(),
        }
        if self.optimizer is not None and self.kept_moments(state) is None:
            carry[MOMENTS] = init_moments(self.trainable(carry))  # the variance branch's too
        return carry

    @staticmethod
    def trainable(carry: Carry) -> Tree:
        """What a step differentiates: the model's parameters and the variance branch."""
        variance = carry[KEY]["variance"]
        return {**carry["params"], **{VARIANCE + k: v for k, v in variance.items()}}

    def draws(self, task: ClientTask, dtype: torch.dtype) -> torch.Tensor:
        """eps of every local step s, (S, n_s, d), from the stream (seed, 'fedcr', round,
        client) in step order, in a (steps, S, width, d) table padded with zeros."""
        plan = self.algorithm.client_plan(task)
        steps, width = self.extent.covering(task.round, plan)
        samples, dim = self.config.num_samples, self.algorithm.dim
        stream = generator(self.seed, "fedcr", task.round, task.client_id)
        eps = torch.zeros(steps, samples, width, dim, dtype=dtype)
        for s, idx in enumerate(plan):
            n = idx.shape[0]
            eps[s, :, :n] = torch.randn((samples, n, dim), generator=stream, dtype=dtype)
        return eps

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        params, buffers, own = carry["params"], carry["buffers"], carry[KEY]
        step = own["step"]
        eps = at_step(own["eps"], step)[:, : batch.y.shape[0]]  # padded under vmap
        classes = shared["message"].get("classes")
        trainable = self.trainable(carry)

        # buffers as an argument: BatchNorm's forward updates them in place
        def loss(p: Tree, b: Tree) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            model = {k: p[k] for k in params}
            variance = {k: p[VARIANCE + k] for k in own["variance"]}
            _, h = self.model.forward_with_features(model, b, batch.x, self.algorithm.head_name)
            head = (model[self.head_keys[0]], model[self.head_keys[1]])
            value, s2 = representation_loss(h, batch, head, variance, eps, classes, self.config)
            return value, (h.detach(), s2.detach())

        grads, value, (h, s2) = ops.value_and_grad_aux(loss, trainable, buffers)
        moments = {}
        if self.optimizer is None:
            moved = descend(trainable, grads, shared["lr"])
        else:
            moved, moments[MOMENTS] = adamw_step(
                trainable, grads, carry[MOMENTS], shared["lr"], self.optimizer
            )
        window = own["window"]
        keep = (batch.w > 0) & (window[0] <= step) & (step < window[1])
        stats = ClassStatistics(**own["stats"]).add(h, s2, batch.y, keep)
        new = {
            "variance": {k: moved[VARIANCE + k] for k in own["variance"]},
            "eps": own["eps"],
            "step": step + 1,
            "window": window,
            "stats": stats.tree(),
        }
        moved_params = {k: moved[k] for k in params}
        return {**carry, **moments, "params": moved_params, KEY: new}, {"loss": value}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        """FedPer's result (body up, head kept) plus the variance branch and the statistics
        (mu_i^c, diag Sigma_i^c) of the classes seen in the window."""
        result = super().finish(message, state, task, run)
        own = run.carry[KEY]
        dtype = own["variance"]["bias"].dtype
        result.upload["variance"] = own["variance"]
        result.upload["classes"] = ClassStatistics(**own["stats"]).upload(dtype)
        return result
