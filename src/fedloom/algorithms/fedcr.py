"""FedCR (Zhang et al., ICML 2023, "FedCR: Personalized Federated Learning Based on Across-Client
Common Representation with Conditional Mutual Information Regularization"); seed 000, FedCR
section, equations (20)-(23) and its pseudocode.

FedPer's split (:mod:`fedloom.algorithms.fedper`): the body w^f (feature extractor) is shared and
averaged, the head w^p (a single ``nn.Linear``, the final classifier) stays personal. FedCR makes
the representation stochastic and aligns it across clients class by class.

Representation, for the head input h(x) of dimension d (generic: read with a forward pre-hook on
the head module, so every model whose head is one Linear layer works)::

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

All parameters (body, variance branch, head) take plain SGD steps on L_i (autograd; FedCR runs its
own client_update, so the vectorized executor runs its clients one at a time: same numbers, no
speed-up). At inference a client uses head(mu(x)): for a linear head this is exactly the
expectation E_eps[head(z)] of the logits the paper's code averages over ``num_avg`` draws.

Local class statistics (21), the geometric-mean product of experts of the N_i^c samples of
class c seen by the forward passes of the client's last complete local epoch (the seed: "taken
from the latest forward passes of local training"; the paper's code: the last epoch). With
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
is a config error), and FedCR is FedPer (the seed's remark after (23): beta = 0 and
Sigma(x) = 0 give FedPer; a test checks it on every client's deployed model).

Communication: down, body + variance branch + every class's (mu^c, diag Sigma^c); up, body +
variance branch + the client's classes' (mu_i^c, diag Sigma_i^c) and their int64 ids. There is
no global model (the heads are personal); new clients are FedPer's (initial head, optionally
fine-tuned for ``finetune_steps``).

The per-sample KL in (23) is the alignment term of (20), I(z; x | y_i) - I_i(z; x_i | y_i), with
the intractable global posterior replaced by its PoE estimate (21)-(22).

Where the paper's code differs (haozzh/FedCR, ``distributed_training_utils.py``): its local
statistics are the plain product of the last epoch's per-sample Gaussians (no 1/N exponent), the
seed's (21) is the geometric mean, which we follow; mu and sigma come from a dedicated layer of
2 x dimZ outputs, ours are the head input itself and a d x d branch on it; it clips gradient
norms at 10 and can smooth the server statistics (``beta2``; 1 = replace, as its FedCR runs use):
neither is done here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationInfo, field_validator, model_validator
from torch import nn

from fedloom.algorithms.base import (
    AlgorithmConfig,
    AlgorithmContext,
    ClientResult,
    ClientTask,
    Message,
    State,
)
from fedloom.algorithms.fedper import FedPer, FedPerConfig
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers.objective_sgd import head_input

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


class ClassStatistics:
    """Running sums of the local geometric-mean product of experts (21), per class: sum of
    precisions, sum of precision-weighted means and the sample count (float64)."""

    def __init__(self, num_classes: int, dim: int) -> None:
        self.precision = torch.zeros(num_classes, dim, dtype=torch.float64)
        self.shift = torch.zeros(num_classes, dim, dtype=torch.float64)
        self.count = torch.zeros(num_classes, dtype=torch.float64)

    def add(self, mu: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> None:
        precision = 1.0 / var.to(torch.float64)
        self.precision.index_add_(0, y, precision)
        self.shift.index_add_(0, y, precision * mu.to(torch.float64))
        self.count.index_add_(0, y, torch.ones(y.shape[0], dtype=torch.float64))

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
        self.require_classification("class-wise statistics")
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

    def local_objective(
        self,
        h: torch.Tensor,
        y: torch.Tensor,
        head: nn.Linear,
        variance: Tree,
        message: Message,
        eps_stream: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(23) on a minibatch with head inputs ``h`` = mu(x): the CE averaged over
        ``num_samples`` reparameterized draws of z, plus beta times the mean KL from the class
        posteriors in ``message``; also returns sigma^2(x)."""
        cfg = self.config
        sigma = F.softplus(F.linear(h, variance["weight"], variance["bias"]) - cfg.alpha)
        sigma = sigma.clamp_min(MIN_SIGMA)
        eps = torch.randn((cfg.num_samples, *h.shape), generator=eps_stream, dtype=h.dtype)
        logits = F.linear(h + sigma * eps, head.weight, head.bias)  # (samples, batch, classes)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.repeat(cfg.num_samples))
        s2 = sigma**2
        if cfg.beta > 0:
            classes = message["classes"]
            kl = gaussian_kl(classes["mean"][y], classes["var"][y], h, s2)
            loss = loss + cfg.beta * kl.mean()
        return loss, s2

    def client_update(
        self, message: Message, state: State | None, task: ClientTask
    ) -> ClientResult:
        assert state is not None
        cfg, model, data = self.config, self.ctx.model, task.data
        params, buffers = self.local_start(message, state, task)
        lean = model.lean()  # the sequential solver's private copy, loaded with this client
        lean.load(params, buffers)
        flat, flat_grad = lean.flat, lean.flat_grad
        head = lean.module.get_submodule(self.head_name)
        variance: Tree = {}
        if self.stochastic:
            variance = {
                k: v.detach().clone().requires_grad_(True) for k, v in message["variance"].items()
            }
            stats = ClassStatistics(self.num_classes, self.dim)
            eps_stream = generator(self.ctx.seed, "fedcr", task.round, task.client_id)
        plan, lr = self.client_plan(task), self.local_lr(task)
        window = self.statistics_steps(len(plan), data.num_train)
        total = 0.0
        with (
            model.random_stream(self.ctx.seed, task.round, task.client_id),
            head_input(head) as store,
        ):
            for step, idx in enumerate(plan):
                flat_grad.zero_()
                xb, yb = data.x_train[idx], data.y_train[idx]
                with torch.enable_grad():
                    out = lean.module(xb)
                    if self.stochastic:
                        h = store["h"]
                        loss, s2 = self.local_objective(h, yb, head, variance, message, eps_stream)
                    else:
                        loss = model.loss_from_output(out, yb)
                    loss.backward()
                with torch.no_grad():
                    flat.sub_(flat_grad, alpha=lr)
                    for v in variance.values():
                        assert v.grad is not None
                        v.sub_(v.grad, alpha=lr)
                        v.grad = None
                    if self.stochastic and step in window:
                        stats.add(h.detach(), s2.detach(), yb)
                total += float(loss.detach())
        new_params, new_buffers = lean.params(), lean.buffers_copy()
        upload: Message = self.split.shared(new_params, new_buffers)
        if self.stochastic:
            upload["variance"] = {k: v.detach() for k, v in variance.items()}
            upload["classes"] = stats.upload(flat.dtype)
        new_state = self.personal_state(state, new_params, new_buffers, len(plan))
        weight = self.ctx.objective_weight(task.client_id, cfg.weighting)
        return ClientResult(upload, weight, total / max(1, len(plan)), state=new_state)
