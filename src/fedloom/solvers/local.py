"""The local solver every client-side algorithm shares: minibatch SGD over a batch plan, and
its one fast one-client loop (:func:`local_sgd`), which the FedAvg family's fused path, the
objective programs, fine-tuning and the cold-start adaptation all call.

The plan (which samples each step uses) comes from the stream (seed, round, client, 'batches'):
each epoch is one permutation of the client's samples sliced into contiguous batches, so the
same plan is reproduced on every executor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from fedloom.core.functional import FunctionalModel, GradCorrection, head_input
from fedloom.core.lean import LeanModule, backward
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.data.augment import Augmentation, Augmenter, draw_augmentation
from fedloom.solvers.adamw import AdamW, Moments, fused_adamw_


def steps_per_epoch(n: int, batch_size: int | None) -> int:
    """Minibatches in one pass over ``n`` samples (1 for full batch)."""
    return 1 if batch_size is None else max(1, math.ceil(n / batch_size))


def batch_plan(
    n: int, batch_size: int | None, num_steps: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """Index tensors for ``num_steps`` minibatches: epochs of permutations cut into batches.

    ``batch_size`` None (or >= n) means full batch: every step uses all ``n`` samples in order.
    """
    if n == 0:
        return []
    if batch_size is None or batch_size >= n:
        full = torch.arange(n)
        return [full] * num_steps
    # the same views as ``perm.split(batch_size)``, but split_with_sizes is a direct ATen
    # call: Tensor.split's Python wrapper costs more than the randperm, once per client and
    # round (benchmarks/README.md, Design measurements)
    sizes = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    plan: list[torch.Tensor] = []
    while len(plan) < num_steps:
        plan.extend(torch.randperm(n, generator=gen).split_with_sizes(sizes))
    return plan[:num_steps]


def poisson_plan(
    n: int, batch_size: int | None, num_steps: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """Index tensors for ``num_steps`` Poisson minibatches: at each step every one of the ``n``
    samples is taken independently with probability q = min(1, batch_size / n) (DP-SGD's
    sampling, what its accountant assumes; Opacus's ``poisson_sampling``). A step may take no
    sample (an empty tensor)."""
    if n == 0:
        return []
    q = 1.0 if batch_size is None else min(1.0, batch_size / n)
    draws = torch.rand(num_steps, n, generator=gen) < q
    return [row.nonzero().flatten() for row in draws]


@dataclass(frozen=True)
class PlanMaker:
    """Makes a client's minibatch plan from the stream (seed, round, client, purpose).

    A small picklable object (not a closure over the engine) so that algorithms can be sent to
    Ray workers and still make the same plans there. With ``poisson`` (sample-level DP) the
    engine's round plan (purpose ``batches``) is Poisson-sampled (``poisson_plan``). With
    ``augment`` (the dataset's train-time augmentation, data/augment.py) every plan it makes
    is trained on augmented samples, drawn by ``augmentation``."""

    seed: int
    batch_size: int | None
    poisson: bool = False
    augment: Augmenter | None = None

    def __call__(
        self, data: ClientData, num_steps: int, purpose: str, round: int, client_id: int
    ) -> list[torch.Tensor]:
        gen = generator(self.seed, purpose, round, client_id)
        if self.poisson and purpose == "batches":
            return poisson_plan(data.num_train, self.batch_size, num_steps, gen)
        return batch_plan(data.num_train, self.batch_size, num_steps, gen)

    def augmentation(
        self, plan: list[torch.Tensor], purpose: str, round: int, client_id: int
    ) -> Augmentation | None:
        """The augmentation of a plan this maker made for ``purpose`` (None without one)."""
        return draw_augmentation(self.augment, plan, purpose, round, client_id)


GATHER_BYTES = 8 << 20
"""Consecutive steps' minibatches are gathered together up to about this many bytes."""


def minibatches(
    x: torch.Tensor,
    y: torch.Tensor,
    plan: list[torch.Tensor],
    augment: Augmentation | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's minibatch ``(x[idx], y[idx])`` along ``plan``, gathered with one indexing
    call per group of consecutive steps (up to GATHER_BYTES) and handed out as contiguous
    slices: an epoch's reordering is one copy, not one gather per step, which matters for
    small minibatches (benchmarks/README.md, Design measurements). With ``augment`` (the
    plan's draws, data/augment.py) each group's inputs are augmented in one batched call."""
    row_bytes = max(1, x[:1].numel() * x.element_size())
    i = 0
    while i < len(plan):
        j, rows = i + 1, plan[i].shape[0]
        while j < len(plan) and (rows + plan[j].shape[0]) * row_bytes <= GATHER_BYTES:
            rows += plan[j].shape[0]
            j += 1
        idx = plan[i] if j - i == 1 else torch.cat(plan[i:j])
        xs = x[idx] if augment is None else augment.step(x[idx], i)  # the group's draws
        if j - i == 1:
            yield xs, y[idx]
        else:
            sizes = [b.shape[0] for b in plan[i:j]]
            # split_with_sizes: all the views in one call, not one slicing call per view
            yield from zip(xs.split_with_sizes(sizes), y[idx].split_with_sizes(sizes), strict=True)
        i = j


@dataclass
class LocalSolution:
    """What the local solver returns for one client."""

    params: Tree
    buffers: Tree
    loss: float
    """Mean minibatch loss over the steps taken."""
    start: Tree
    """The parameters local SGD started from."""
    lr: float
    steps: int
    velocity: Tree | None = None
    """Heavy-ball momentum buffer at the end (None when the solver ran without momentum)."""
    moments: Moments | None = None
    """AdamW's moments at the end (solvers/adamw.py; None when the solver ran SGD)."""


@dataclass
class LeanBatch:
    """One local step's minibatch, as a minibatch objective of :func:`local_sgd` sees it: the
    step, the model's output and features, the lean trainer (not solvers/program.py's ``Batch``,
    which a client program's update sees)."""

    step: int
    x: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor
    """The model's output (logits for classification)."""
    features: torch.Tensor | None
    """The head's input h(x) (the representation), when the solver was given ``head``."""
    lean: LeanModule
    """The trainer's module (e.g. to apply the head to other features: FedGen)."""


BatchObjective = Callable[[LeanBatch], torch.Tensor]
StepCallback = Callable[[int, LeanModule], None]
"""Called after each step with the number of steps done and the trainer (for snapshots)."""


def local_sgd(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    plan: list[torch.Tensor],
    lr: float,
    correction: GradCorrection | None = None,
    momentum: float = 0.0,
    velocity: Tree | None = None,
    *,
    objective: BatchObjective | None = None,
    trainable: Collection[str] | None = None,
    head: str | None = None,
    on_step: StepCallback | None = None,
    adamw: AdamW | None = None,
    moments: Moments | None = None,
    augment: Augmentation | None = None,
) -> LocalSolution:
    """The one fast one-client SGD loop: steps w <- w - lr (grad L(w; batch) + correction(w))
    along ``plan``, L the model's loss or ``objective``.

    - ``objective``: the minibatch objective (``LeanBatch``: the step, the minibatch, the model's
      output, the head's input when ``head`` names the head module); default the model's loss;
    - ``correction``: an extra gradient term at w (FedProx's proximal pull, SCAFFOLD's control
      variates), added after the backward pass;
    - ``momentum`` rho > 0: heavy-ball steps as ``torch.optim.SGD`` (no dampening),
      v <- rho v + g, w <- w - lr v, from ``velocity`` (default zero);
    - ``trainable``: only these parameters move (default: all; FedPer's head, the cold-start
      adaptation's keys);
    - ``adamw``: AdamW steps (solvers/adamw.py) on the same gradient instead of SGD's, from
      ``moments`` (default zero), which the solution returns; not with ``momentum``;
    - ``augment``: the plan's train-time augmentation (``PlanMaker.augmentation``);
    - ``on_step(done, lean)`` after each step (snapshots).

    The inputs are not modified; buffers (BatchNorm statistics) evolve in training mode. Runs
    on the model's lean trainer (flat buffers, one fused update per step); the math is the
    same as the client programs' steps, which both backends run (algorithms/base.py,
    ``SGDProgram``).
    """
    lean = model.lean()
    lean.load(params, buffers)
    frozen = [] if trainable is None else [k for k in lean.keys if k not in set(trainable)]
    rule = _StepRule(lean, lr, correction, frozen, momentum, velocity, adamw, moments)
    hooked = head_input(lean.module.get_submodule(head)) if head else contextlib.nullcontext({})
    total = 0.0
    # one grad-mode switch for the loop, not two context managers a step: the updates below
    # touch only the flat buffers, which autograd does not track (the parameters are views)
    with hooked as store, torch.enable_grad():
        for step, (xb, yb) in enumerate(minibatches(x, y, plan, augment)):
            lean.flat_grad.zero_()
            out = lean.module(xb)
            if objective is None:
                loss = model.loss_from_output(out, yb)
            else:
                loss = objective(LeanBatch(step, xb, yb, out, store.get("h"), lean))
            backward(loss)
            rule.step(step)
            total += loss.item()
            if on_step is not None:
                with torch.no_grad():  # snapshots copy the views
                    on_step(step + 1, lean)
    return LocalSolution(
        lean.params(),
        lean.buffers_copy(),
        total / max(1, len(plan)),
        params,
        lr,
        len(plan),
        rule.velocity_tree(),
        rule.moments_tree(len(plan)),
    )


class _StepRule:
    """:func:`local_sgd`'s update after each backward pass, on the lean trainer's flat buffers:
    the gradient plus ``correction``'s term, zero on the ``frozen`` parameters, then a plain
    SGD step, a heavy-ball one (``torch.optim.SGD``'s, no dampening) from ``velocity``, or an
    AdamW one (solvers/adamw.py) from ``moments``."""

    def __init__(
        self,
        lean: LeanModule,
        lr: float,
        correction: GradCorrection | None,
        frozen: list[str],
        momentum: float,
        velocity: Tree | None,
        adamw: AdamW | None,
        moments: Moments | None,
    ) -> None:
        if adamw is not None and momentum:
            raise ValueError(
                "AdamW steps take no heavy-ball momentum (its first moment replaces it)"
            )
        self.lean, self.lr, self.correction, self.frozen = lean, lr, correction, frozen
        self.momentum, self.adamw = momentum, adamw
        self.grads = lean.grad_view()
        self.moments = _flat_moments(lean, moments) if adamw is not None else None
        self.step0 = int(moments["step"]) if adamw is not None and moments is not None else 0
        # decoupled weight decay would move frozen parameters: they are put back after each step
        self.keep = {k: lean.views[k].detach().clone() for k in frozen} if adamw is not None else {}
        self.velocity: torch.Tensor | None = None
        if momentum:
            self.velocity = torch.zeros_like(lean.flat)
            if velocity is not None:
                lean.flatten_into(velocity, self.velocity)

    def step(self, step: int) -> None:
        """Local step ``step`` (from 0) on the gradient the backward pass left."""
        if self.correction is not None:  # a function of the views: no graph for it
            with torch.no_grad():
                extra = self.correction(self.lean.views)
            if extra is not None:
                for k, g in self.grads.items():
                    g.add_(extra[k])
        for k in self.frozen:
            self.grads[k].zero_()
        flat, flat_grad = self.lean.flat, self.lean.flat_grad
        if self.moments is not None:
            assert self.adamw is not None
            m, v = self.moments
            fused_adamw_(
                [flat], [flat_grad], [m], [v], [self.step0 + step + 1], self.lr, self.adamw
            )
            for k, value in self.keep.items():
                self.lean.views[k].data.copy_(value)
        elif self.velocity is not None:
            self.velocity.mul_(self.momentum).add_(flat_grad)
            flat.sub_(self.velocity, alpha=self.lr)
        else:
            flat.sub_(flat_grad, alpha=self.lr)

    def velocity_tree(self) -> Tree | None:
        """The heavy-ball velocity at the end (None without momentum)."""
        return self.lean.unflatten(self.velocity) if self.velocity is not None else None

    def moments_tree(self, steps: int) -> Moments | None:
        """AdamW's moments after ``steps`` more steps (None without AdamW)."""
        if self.moments is None:
            return None
        return _moments_tree(self.lean, self.moments, self.step0 + steps)


def _flat_moments(lean: LeanModule, moments: Moments | None) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's (m, v) as flat buffers laid out like the trainer's parameters (zero, or from
    ``moments``)."""
    m, v = torch.zeros_like(lean.flat), torch.zeros_like(lean.flat)
    if moments is not None:
        lean.flatten_into(moments["m"], m)
        lean.flatten_into(moments["v"], v)
    return m, v


def _moments_tree(lean: LeanModule, flat: tuple[torch.Tensor, torch.Tensor], steps: int) -> Moments:
    """The flat (m, v) after ``steps`` steps in all as the moments tree of solvers/adamw.py."""
    m, v = flat
    step = torch.tensor(float(steps), dtype=torch.float64)
    return {"m": lean.unflatten(m), "v": lean.unflatten(v), "step": step}
