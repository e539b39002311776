"""Three defences of personalized models against membership inference (docs/audit.md, "The
three defences and their honesty labels"), each as something the audit can measure, with an
honest label of what it guarantees.

1. Noisy proximal regularizer ("DP regularization"): the personal objective
   f_k(phi) + mu/2 ||phi - w + xi||^2 with xi ~ N(0, sigma^2 I). Drawn afresh at each step,
   xi only adds the gradient noise mu xi to Ditto's step (9); nothing bounds the data
   gradient's norm and no accountant runs, so it carries no epsilon: labelled *heuristic*.
   (Calibrated objective perturbation, Chaudhuri, Monteleoni & Sarwate, JMLR 2011, needs a
   convex, smooth, regularized loss, one fixed draw and the exact minimizer; a neural network
   trained by SGD meets none of these, so it is not offered.) It needs the personal training
   loop, which belongs to the algorithm: here it is the training routine of the defence study
   (:func:`personalize`), Ditto's (9) solved from the global model w.
2. Distillation through public data: the client releases phi~_k, trained only on public data
   (a disjoint slice of never-seen samples) labelled by phi_k's soft outputs; phi~_k never
   sees a training sample. No formal guarantee (phi_k's answers on public data still depend on
   its training set): labelled *empirical*.
3. Output noise: the model answers with its probability vector plus Gaussian noise. With the
   probabilities as the output (any two lie within L2 distance sqrt(2), so the sensitivity is
   bounded whatever the training set) and sigma calibrated by the analytic Gaussian mechanism
   (Balle & Wang, ICML 2018, Theorem 8), each answer is (epsilon, delta)-DP; the noise is
   pinned per query (a function of the query's bytes), so repeating a query returns the same
   answer instead of averaging the noise away; distinct queries compose. Noise of a given
   sigma on raw logits (unbounded) is *uncalibrated*: no epsilon is stated.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from fedloom.audit.outputs import Outputs, model_logits
from fedloom.audit.training import Model, train_sgd
from fedloom.core.functional import FunctionalModel, GradCorrection
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator

PROBABILITY_SENSITIVITY = math.sqrt(2.0)
"""L2 distance bound between two probability vectors: ||p - q||^2 <= ||p - q||_1 max|p - q|."""


# -- 1. noisy proximal regularizer ------------------------------------------------------------
def noisy_prox(
    anchor: Tree, mu: float, sigma: float, gen: torch.Generator, fresh: bool = True
) -> GradCorrection:
    """Gradient of mu/2 ||phi - w + xi||^2 at phi: mu (phi - w + xi), xi ~ N(0, sigma^2 I)
    drawn afresh at every call (step) with ``fresh``, else once (the objective-perturbation
    form: a random linear term mu <phi, xi> in the objective). sigma 0 is Ditto's proximal
    term (9)."""
    once = None if fresh else _normal(anchor, sigma, gen)

    def correction(params: Tree) -> Tree:
        xi = once if once is not None else _normal(anchor, sigma, gen)
        return {k: mu * (p - anchor[k] + xi[k]) for k, p in params.items()}

    return correction


def _normal(like: Tree, sigma: float, gen: torch.Generator) -> Tree:
    return {k: sigma * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in like.items()}


def personalize(
    model: FunctionalModel,
    global_model: Model,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int | None,
    mu: float,
    sigma: float,
    gen: torch.Generator,
    fresh: bool = True,
) -> Model:
    """A personal model phi_k from w: SGD on f_k(phi) + mu/2 ||phi - w + xi||^2 (xi fresh each
    step, or one draw; sigma 0: Ditto's objective (9) with w fixed)."""
    correction = noisy_prox(global_model[0], mu, sigma, gen, fresh) if mu else None
    return train_sgd(model, global_model, x, y, epochs, lr, batch_size, gen, correction)


# -- 2. distillation through public data ------------------------------------------------------
def distill(
    model: FunctionalModel,
    teacher: Model,
    start: Model,
    public_x: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int | None,
    gen: torch.Generator,
    temperature: float = 1.0,
) -> Model:
    """phi~ trained from ``start`` only on ``public_x`` against the teacher's soft labels
    softmax(phi(x) / T) (cross-entropy with soft targets: the KL divergence up to a constant;
    Hinton et al. 2015)."""
    soft = (model_logits(model, *teacher, public_x) / temperature).softmax(1).to(torch.float32)
    return train_sgd(model, start, public_x, soft, epochs, lr, batch_size, gen)


# -- 3. output noise --------------------------------------------------------------------------
def _std_normal_cdf(t: float) -> float:
    return 0.5 * math.erfc(-t / math.sqrt(2.0))


def gaussian_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """The smallest delta for which N(0, sigma^2 I) noise on a query of L2 ``sensitivity`` is
    (epsilon, delta)-DP (Balle & Wang 2018, Theorem 8):
    Phi(D/(2s) - e s/D) - exp(e) Phi(-D/(2s) - e s/D)."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    return _std_normal_cdf(a - b) - math.exp(epsilon) * _std_normal_cdf(-a - b)


def gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """The smallest sigma that makes the Gaussian mechanism (epsilon, delta)-DP (the analytic
    calibration, Balle & Wang 2018, Algorithm 1, by bisection; valid for every epsilon > 0,
    unlike the classic sqrt(2 ln(1.25/delta)) D / epsilon, which needs epsilon < 1)."""
    if not (0 < epsilon <= 100 and 0 < delta < 1):
        raise ValueError(f"need 0 < epsilon <= 100 and 0 < delta < 1, got {epsilon}, {delta}")
    lo, hi = 1e-6 * sensitivity, sensitivity
    while gaussian_delta(hi, sensitivity, epsilon) > delta:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mid, sensitivity, epsilon) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class OutputNoise:
    """Gaussian noise on a model's answers, pinned per query.

    ``on``: 'probabilities' (softmax output, sensitivity sqrt(2)) or 'logits' (unbounded).
    ``epsilon``/``delta`` are set only by :meth:`calibrated`."""

    sigma: float
    on: str = "probabilities"
    epsilon: float | None = None
    delta: float | None = None
    seed: int = 0

    @classmethod
    def calibrated(cls, epsilon: float, delta: float, seed: int = 0) -> OutputNoise:
        """Noise on the probability vector that makes each answer (epsilon, delta)-DP."""
        sigma = gaussian_sigma(PROBABILITY_SENSITIVITY, epsilon, delta)
        return cls(sigma, "probabilities", epsilon, delta, seed)

    @property
    def label(self) -> str:
        if self.epsilon is None:
            return "uncalibrated (no epsilon)"
        return f"(epsilon={self.epsilon:g}, delta={self.delta:g}) per query"

    def noise(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """One noise row per query, a function of the query's bytes and the seed (pinned)."""
        rows = []
        for row in x:
            digest = hashlib.blake2b(row.contiguous().numpy().tobytes(), digest_size=8).hexdigest()
            gen = generator(self.seed, f"audit/output_noise/{digest}")
            rows.append(torch.randn(width, generator=gen, dtype=torch.float64))
        return self.sigma * torch.stack(rows)

    def release(self, model: FunctionalModel, trained: Model, x: torch.Tensor) -> Outputs:
        """What a client answering through this defence returns for queries ``x``."""
        logits = model_logits(model, trained[0], trained[1], x)
        if self.on == "logits":
            return Outputs(logits + self.noise(x, logits.shape[1]), "logits")
        probs = logits.softmax(1)
        return Outputs(probs + self.noise(x, probs.shape[1]), "probabilities")
