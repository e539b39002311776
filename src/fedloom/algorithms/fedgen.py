"""FedGen (Zhu, Hong, Zhou, ICML 2021, "Data-Free Knowledge Distillation for Heterogeneous
Federated Learning", arXiv:2105.10056, Algorithm 1): label distribution shift
handled by feature-generation alignment (the server trains a generator
G(z | c) of per-class features and sends it to the clients, whose classifier heads then see
the classes they lack).

Besides the global model w = (body, head) the server keeps a conditional generator
G_v(z, y) -> R^d in the head's input space (d = ``head.in_features``; the model's head must be
one ``nn.Linear``), and every client's label counts. One round::

    server -> client k: w^t, G_v, p_hat(y)                  # G_v, p_hat: once G has trained
    client k: SGD from w^t along the round's plan on
        L_k(w; B) = CE(f(x_B; w), y_B)
                  + alpha_gen * 1/|B| sum_i CE(head_w(G_v(z_i, y^_i)), y^_i)   # G_v frozen
                  + latent_beta * KL(softmax(head_w(G_v(z'_i, y_i))) || softmax(f(x_i; w)))
        with y^_i ~ p_hat, z_i, z'_i ~ N(0, I); upload w_k and its label counts n_{k,y}
    server:   w^{t+1} <- sum_k p_k w_k / sum_k p_k            # FedAvg
              alpha_{k,y} = n_{k,y} / sum_{j in P_t} n_{j,y}   # P_t: the round's reporters
              p_t(y) = sum_{k in P_t} n_{k,y} / sum_{k in P_t} n_k  # the reporters' labels
              repeat generator_steps times, y ~ p_t, z ~ N(0, I):
                  J(v) = 1/B sum_i sum_k alpha_{k,y_i} CE(head_k(G_v(z_i, y_i)), y_i)
                         + diversity * exp(-mean_{i,j} ||z_i - z_j||^2_mean |G_i - G_j|_mean)
                  v <- Adam(v, grad J, generator_lr)

Choices, and where they come from:

- Generator: [z (``noise_dim``), one_hot(y)] -> Linear(``generator_hidden``) -> ReLU ->
  Linear(d): the official code's (zhuangdizhu/FedGen ``Generator``: 256 hidden units and
  noise_dim 32 for MNIST) without its BatchNorm layer, so the client evaluates exactly the
  function the server trained (the code switches the client's copy to eval-mode BatchNorm
  statistics). Its tensors live in the server state and travel in the message (the download
  bytes count them and the C floats of p_hat); it is evaluated with plain ``F.linear``, frozen on
  the client (no gradient reaches it). It starts as ``nn.Linear``'s default initialization,
  U(+-1/sqrt(fan_in)), from the stream (seed, 'fedgen-init'). The code draws z from
  ``torch.rand`` (U[0, 1), although its comment says Gaussian); the paper's z ~ N(0, I) here.
- Server objective: the official code's ``train_generator`` (``ensemble_alpha`` 1,
  ``ensemble_beta`` 0: no adversarial student term): the label-share weighted sum of each reporting
  client's cross-entropy, the teachers being the heads of this round's uploads (the code's
  ``selected_users`` after local training). The paper's server objective puts the heads' ensemble
  inside one cross-entropy; the code's sum of per-head cross-entropies weighted by alpha_{k,y} is
  what its experiments ran, and is kept here. The diversity term is the code's
  ``DiversityLoss('l1')`` (Mao et al. 2019's mode-seeking regularizer, ``ensemble_eta`` 1). Labels
  are drawn from p_t, the label distribution of the round's reporters (the paper's y ~ p_hat(y)
  restricted to the labels the teachers hold; the code draws uniformly over the labels some
  reporter holds). Adam's moments and step count persist across rounds in the server state (the
  code keeps one optimizer); no weight decay or learning-rate decay (the code has 1e-2 and 0.98 per
  round). Noise and labels come from the stream (seed, 'fedgen', round, -1).
- Client objective: the paper's local objective is the real-data loss plus the cross-entropy of
  the head on generated features, y^ ~ p_hat, weighted here by ``alpha_gen`` (default 1, as
  PFLlib's ``clientgen``; the code's ``generative_alpha`` is 10 for MNIST, decayed 0.98 per
  round; we keep it constant). p_hat is the
  label distribution of every client that has reported so far (the server's count table). The
  generated batch has the size of the real minibatch, so the code's ``gen_ratio`` is 1. The KD term
  is not in the paper's local objective; the official code adds it (``generative_beta``, 10 for
  MNIST): the KL from the head's prediction on generated features of the real labels (detached) to
  the model's prediction on x. It is ``latent_beta``, default 0 (the paper's objective). Draws come
  from the stream (seed, 'fedgen', round, client).
- Warm-up: no generator term until the generator has trained once (the code's
  ``regularization = glob_iter > 0``): round 1 is FedAvg and the message carries no generator.
- Counts: n_{k,y} over the client's whole training set (the paper's p_hat from the clients'
  label counts; the code counts the labels of the batches it drew, starting at 1). Uploaded as
  C int64 (counted in the upload bytes).
- p_k: n_k / n (``weighting: samples``, the code's and FedAvg's, default) or 1/K.
- The local step is a client program (:class:`FedGenProgram`, algorithms/objective.py) that the
  sequential and the vmap backends both run. A client's draws (y^, z, z' of every local step,
  in the order above, step by step) are taken from its stream in the program's ``init``, outside
  the vmapped step, into its carry. With alpha_gen = latent_beta = 0 the
  client update is FedAvg's bit for bit (the generator still trains on the server; a test
  checks it cannot touch the model). ``generator_steps: 0`` never trains the generator, so the
  clients never use it: FedAvg plus the count upload. New clients: the global model,
  fine-tuned with plain cross-entropy (the default cold start).

Measured (tests/algorithms/test_fedgen.py, Fashion-MNIST, 20 clients, 2NN, 20 rounds):
global accuracy 0.722 against FedAvg's 0.622 on 2-label shards (alpha_gen 10: 0.755), 0.717
against 0.679 on Dirichlet(0.1) (alpha_gen 10: 0.743). The generator and p_hat add 0.25 MB to
each client's 0.80 MB download (the 2NN, 200 features).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext, aggregate_models
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.objective import Forward, ObjectiveProgram, Shared, model_result
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.solvers.local import LocalSolution
from fedloom.solvers.objective_sgd import single_head
from fedloom.solvers.program import BATCHES, Batch, Carry, ClientProgram, Ops, Plan

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class FedGenConfig(AlgorithmConfig):
    alpha_gen: float = Field(
        default=1.0, ge=0.0, description="weight of the CE on generated features (code: 10)"
    )
    latent_beta: float = Field(
        default=0.0,
        ge=0.0,
        description="weight of the official code's KD to generated features of the real labels",
    )
    noise_dim: int = Field(default=32, ge=1, description="dimension of the generator's noise z")
    generator_hidden: int = Field(default=256, ge=1, description="generator hidden units")
    generator_steps: int = Field(
        default=50, ge=0, description="server Adam steps on the generator per round (code: 50)"
    )
    generator_lr: float = Field(
        default=3e-4, gt=0.0, description="the generator's Adam step size (code: 3e-4)"
    )
    generator_batch: int = Field(
        default=32, ge=2, description="(z, y) draws per generator step (code: 32)"
    )
    diversity: float = Field(
        default=1.0, ge=0.0, description="weight of the generator's diversity loss (code: 1)"
    )
    weighting: Weighting = weighting_field("samples", "model averaging weights")


# -- the generator, as pure functions of its tensors ----------------------------------------
def init_generator(
    noise_dim: int, num_classes: int, hidden: int, dim: int, gen: torch.Generator
) -> Tree:
    """``nn.Linear``'s default initialization, U(+-1/sqrt(fan_in)), of both layers."""

    def uniform(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound

    fan_in = noise_dim + num_classes
    return {
        "hidden.weight": uniform((hidden, fan_in), fan_in),
        "hidden.bias": uniform((hidden,), fan_in),
        "out.weight": uniform((dim, hidden), hidden),
        "out.bias": uniform((dim,), hidden),
    }


def generate(params: Tree, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """G(z, y): features of shape (batch, d) for noise ``z`` and labels ``y``."""
    num_classes = params["hidden.weight"].shape[1] - z.shape[1]
    one_hot = y[:, None] == torch.arange(num_classes, device=y.device)  # F.one_hot: not vmap
    inputs = torch.cat([z, one_hot.to(z.dtype)], dim=1)
    hidden = F.relu(F.linear(inputs, params["hidden.weight"], params["hidden.bias"]))
    return F.linear(hidden, params["out.weight"], params["out.bias"])


@dataclass
class Teachers:
    """The round's reporting heads and label shares: weight (K, C, d), bias (K, C), alpha
    (K, C) with alpha[k, y] = n_{k,y} / sum_j n_{j,y}, and the labels' distribution (C,)."""

    weight: torch.Tensor
    bias: torch.Tensor
    alpha: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def from_counts(
        cls, weight: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor
    ) -> Teachers:
        counts = counts.to(torch.float64)
        per_label = counts.sum(dim=0)
        alpha = (counts / per_label.clamp_min(1.0)).to(weight.dtype)
        return cls(weight, bias, alpha, per_label / per_label.sum())


def ensemble_loss(features: torch.Tensor, y: torch.Tensor, teachers: Teachers) -> torch.Tensor:
    """1/B sum_i sum_k alpha_{k,y_i} CE(head_k(features_i), y_i)."""
    logits = torch.einsum("bd,kcd->kbc", features, teachers.weight) + teachers.bias[:, None]
    k, b, c = logits.shape
    ce = F.cross_entropy(logits.reshape(k * b, c), y.repeat(k), reduction="none").view(k, b)
    return (teachers.alpha[:, y] * ce).sum(dim=0).mean()


def diversity_loss(z: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The code's ``DiversityLoss('l1')``: exp(-mean_{i,j} d2(z_i, z_j) d1(G_i, G_j)), with d2
    the mean squared and d1 the mean absolute difference: small when distinct noise gives
    distinct features."""
    noise = ((z[:, None] - z[None]) ** 2).mean(dim=-1)
    feats = (features[:, None] - features[None]).abs().mean(dim=-1)
    return torch.exp(-(noise * feats).mean())


def train_generator(
    params: Tree,
    adam: State,
    teachers: Teachers,
    config: FedGenConfig,
    stream: torch.Generator,
) -> tuple[Tree, State, float]:
    """``config.generator_steps`` Adam steps on the generator's objective J (ensemble loss plus
    diversity); returns the new tensors, Adam state and J's mean over the steps."""
    v = {k: t.detach().clone().requires_grad_(True) for k, t in params.items()}
    m1 = {k: t.clone() for k, t in adam["m"].items()}
    m2 = {k: t.clone() for k, t in adam["v"].items()}
    step = int(adam["step"])
    (b1, b2), lr = ADAM_BETAS, config.generator_lr
    total = 0.0
    for _ in range(config.generator_steps):
        y = torch.multinomial(teachers.labels, config.generator_batch, True, generator=stream)
        z = torch.randn(config.generator_batch, config.noise_dim, generator=stream)
        with torch.enable_grad():
            features = generate(v, z, y)
            loss = ensemble_loss(features, y, teachers)
            if config.diversity > 0:
                loss = loss + config.diversity * diversity_loss(z, features)
            grads = torch.autograd.grad(loss, list(v.values()))
        step += 1
        with torch.no_grad():
            for (key, p), g in zip(v.items(), grads, strict=True):
                m1[key].mul_(b1).add_(g, alpha=1 - b1)
                m2[key].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (m2[key] / (1 - b2**step)).sqrt_().add_(ADAM_EPS)
                p.addcdiv_(m1[key], denom, value=-lr / (1 - b1**step))
        total += float(loss.detach())
    new = {k: t.detach() for k, t in v.items()}
    mean = total / max(1, config.generator_steps)
    return new, {"m": m1, "v": m2, "step": torch.tensor(step)}, mean


class FedGen(Algorithm):
    name = "fedgen"
    summary = "FedGen: a server-trained feature generator regularizes the clients' heads"
    Config = FedGenConfig
    capabilities = Capabilities(
        classification_only="a generator of features by class",
    )

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head_name = single_head(ctx.model, "fedgen")
        head = ctx.model.module.get_submodule(self.head_name)
        self.dim, self.num_classes = head.in_features, head.out_features

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        cfg = self.config
        gen = init_generator(
            cfg.noise_dim,
            self.num_classes,
            cfg.generator_hidden,
            self.dim,
            generator(self.ctx.seed, "fedgen-init"),
        )
        return {
            "params": params,
            "buffers": buffers,
            "generator": gen,
            "adam": {
                "m": {k: torch.zeros_like(t) for k, t in gen.items()},
                "v": {k: torch.zeros_like(t) for k, t in gen.items()},
                "step": torch.tensor(0),
            },
            "label_counts": torch.zeros(self.ctx.num_clients, self.num_classes, dtype=torch.int64),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        message: Message = {"params": server["params"], "buffers": server["buffers"]}
        if int(server["adam"]["step"]) > 0:  # warm-up: no generator before it has trained
            counts = server["label_counts"].sum(dim=0).to(torch.float32)
            message["generator"] = server["generator"]
            message["label_prior"] = {"p": counts / counts.sum()}
        return message

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        new = {**server, **aggregate_models(self.ctx, results)}
        counts = torch.stack([r.upload["labels"]["counts"] for r in results])
        table = server["label_counts"].clone()
        table[[r.client_id for r in results]] = counts
        new["label_counts"] = table
        if int(counts.sum()) == 0:  # no labelled sample reported: nothing to teach the generator
            return new
        w, b = f"{self.head_name}.weight", f"{self.head_name}.bias"
        teachers = Teachers.from_counts(
            torch.stack([r.upload["params"][w] for r in results]),
            torch.stack([r.upload["params"][b] for r in results]),
            counts,
        )
        stream = generator(self.ctx.seed, "fedgen", results[0].round)
        new["generator"], new["adam"], _ = train_generator(
            server["generator"], server["adam"], teachers, self.config, stream
        )
        return new

    # -- client ---------------------------------------------------------------------------
    def make_program(self) -> ClientProgram:
        return FedGenProgram(self)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        result = model_result(task, solved, self.config.weighting)
        counts = torch.bincount(task.data.y_train, minlength=self.num_classes)
        result.upload["labels"] = {"counts": counts}
        return result


NOISE = "fedgen/noise"
"""The carry's key of a client's draws for its local steps."""


def at_step(table: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Row ``step`` (a 0-d index tensor, one per client under vmap) of ``table``."""
    return table.index_select(0, step.view(1)).squeeze(0)


class FedGenProgram(ObjectiveProgram):
    """The client's objective L_k with the frozen generator of the message (from round 2 on).

    Its draws for step s sit in row s of tables in the carry, with a step counter; rows are
    zero-padded to the round's longest and widest plan (the vmap backend stacks the carries of
    a chunk, so they must have one shape), which does not change the values: every step's
    draws take exactly its minibatch size from the stream, whatever the padding."""

    def __init__(self, algorithm: FedGen) -> None:
        super().__init__(algorithm, finish=algorithm.local_finish)
        self.config: FedGenConfig = algorithm.config
        head = algorithm.head_name
        self.head_keys = (f"{head}.weight", f"{head}.bias")
        self.extent = (-1, 0, 0)
        """(round, steps, width): the longest and the widest plan of the round so far (the
        backends make every client's plans before any client's carry)."""

    def regularized(self, message: Message) -> bool:
        cfg = self.config
        return "generator" in message and (cfg.alpha_gen > 0 or cfg.latent_beta > 0)

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        plans = super().plans(message, state, task)
        self.extent = (task.round, *self._extent(task.round, plans[BATCHES].batches))
        return plans

    def _extent(self, round: int, plan: list[torch.Tensor]) -> tuple[int, int]:
        seen, steps, width = self.extent
        if seen != round:
            steps = width = 0
        return max(steps, len(plan)), max([width, *(b.shape[0] for b in plan)])

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        carry = super().init(message, state, task)
        if self.regularized(message):
            carry[NOISE] = self.draws(message["label_prior"]["p"], task)
        return carry

    def draws(self, prior: torch.Tensor, task: ClientTask) -> dict[str, torch.Tensor]:
        """Per local step s with a minibatch of n samples, from the stream (seed, 'fedgen',
        round, client): y^ ~ p_hat and z (n each, alpha_gen > 0), then z' (latent_beta > 0)."""
        cfg = self.config
        plan = self.algorithm.client_plan(task)
        steps, width = self._extent(task.round, plan)
        stream = generator(self.seed, "fedgen", task.round, task.client_id)
        labels = torch.zeros(steps, width, dtype=torch.long)
        z = torch.zeros(steps, width, cfg.noise_dim)
        z_latent = torch.zeros(steps, width, cfg.noise_dim)
        for s, idx in enumerate(plan):
            n = idx.shape[0]
            if cfg.alpha_gen > 0:
                labels[s, :n] = torch.multinomial(prior, n, True, generator=stream)
                z[s, :n] = torch.randn(n, cfg.noise_dim, generator=stream)
            if cfg.latent_beta > 0:
                z_latent[s, :n] = torch.randn(n, cfg.noise_dim, generator=stream)
        noise = {"step": torch.zeros((), dtype=torch.long)}
        if cfg.alpha_gen > 0:
            noise.update(labels=labels, z=z)
        if cfg.latent_beta > 0:
            noise["z_latent"] = z_latent
        return noise

    def apply_head(self, params: Tree, features: torch.Tensor) -> torch.Tensor:
        """The model's (linear) head applied to ``features``."""
        weight, bias = self.head_keys
        return F.linear(features, params[weight], params[bias])

    def objective(self, fwd: Forward, batch: Batch, carry: Carry, shared: Shared) -> torch.Tensor:
        params, out = fwd.params, fwd.out
        cfg, noise = self.config, carry[NOISE]
        gen = shared["message"]["generator"]
        n = batch.y.shape[0]  # the minibatch, padded under vmap: its draws are the first n
        loss = self.data_loss(out, batch)
        if cfg.alpha_gen > 0:
            y_hat = at_step(noise["labels"], noise["step"])[:n]
            z = at_step(noise["z"], noise["step"])[:n]
            logits = self.apply_head(params, generate(gen, z, y_hat))
            ce = F.cross_entropy(logits, y_hat, reduction="none")
            loss = loss + cfg.alpha_gen * batch.mean(ce)
        if cfg.latent_beta > 0:
            z = at_step(noise["z_latent"], noise["step"])[:n]
            target = F.softmax(self.apply_head(params, generate(gen, z, batch.y)), dim=-1).detach()
            kl = F.kl_div(F.log_softmax(out, dim=-1), target, reduction="none").sum(dim=-1)
            loss = loss + cfg.latent_beta * batch.mean(kl)
        return loss

    def at_step(self, carry: Carry, step: int) -> Carry:
        if NOISE not in carry:
            return carry
        return {**carry, NOISE: {**carry[NOISE], "step": torch.tensor(step)}}

    takes_optimizer = True  # the objective program's step, and a step counter

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        new, metrics = super().step(ops, carry, batches, shared)
        if NOISE in carry:
            new[NOISE] = {**carry[NOISE], "step": carry[NOISE]["step"] + 1}
        return new, metrics
