"""Gradients and steps for client programs: reverse-mode autograd one client at a time, or
torch.func under vmap. An update asks ``ops.loss_grad(model, params, buffers, batch)`` (the
data gradient), ``ops.value_and_grad(f, params, ...)`` and ``ops.descend(params, grads, lr)``
and never knows which.

Under sample-level DP (docs/privacy.md) an update gets :class:`PrivateOps` instead, from
:func:`private_update`: its data gradient is DP-SGD's (Abadi et al., CCS 2016, Algorithm 1;
solvers/dpsgd.py) and every other way to a gradient of the data is closed, so a client step is
private or refused, never silently neither."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.func import grad_and_value

from fedloom.errors import ConfigError
from fedloom.solvers.dpsgd import DPSGD, private_grad
from fedloom.solvers.program import Batch, Carry, Draw, Update, weighted_mean
from fedloom.solvers.steps import descend

if TYPE_CHECKING:
    from fedloom.core.functional import FunctionalModel

Tree = dict[str, torch.Tensor]


class Steps:
    """The SGD step both kinds of ops share: ``steps.descend`` out of place; with ``in_place``
    (only the vmap backend's choice, see FuncOps) written into ``params``. One client's carry
    may share tensors with the round's message (FedAvg starts from the global model), so the
    sequential ops never write in place."""

    in_place = False

    def value_and_grad(
        self, f: Callable[..., torch.Tensor], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor]:
        raise NotImplementedError

    def loss_grad(
        self, model: FunctionalModel, params: Tree, buffers: Tree, batch: Batch
    ) -> tuple[Tree, torch.Tensor]:
        """The data gradient: gradient of the model's mean loss on the batch's real samples,
        and the loss (``steps.loss_grad``)."""
        return self.value_and_grad(model.weighted_loss, params, buffers, batch.x, batch.y, batch.w)

    def descend(
        self,
        params: Tree,
        grads: Tree,
        lr: float | torch.Tensor,
        anchor: Tree | None = None,
        mu: float = 0.0,
    ) -> Tree:
        """params - lr (grads + mu (params - anchor)), see ``steps.descend``."""
        if not self.in_place:
            return descend(params, grads, lr, anchor, mu)
        for k, g in grads.items():
            p = params[k]
            if anchor is not None and mu:  # as steps.descend; lerp_ has no vmap batching rule
                p.mul_(1.0 - lr * mu).add_(anchor[k], alpha=lr * mu)
            if isinstance(lr, torch.Tensor):
                p.sub_(lr * g)
            else:
                p.add_(g, alpha=-lr)
        return params


class AutogradOps(Steps):
    """One client: ``torch.autograd.grad`` on fresh leaves. Cheaper per call than torch.func
    for small models (benchmarks/README.md, Design measurements). Inside an outer
    differentiation (inputs already require grad, as in
    Per-FedAvg's second-order variants) the graph is kept so the outer call can go through."""

    def value_and_grad(
        self, f: Callable[..., torch.Tensor], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor]:
        nested = torch.is_grad_enabled() and any(v.requires_grad for v in params.values())
        leaves = (
            params if nested else {k: v.detach().requires_grad_(True) for k, v in params.items()}
        )
        with torch.enable_grad():
            value = f(leaves, *args)
            grads = torch.autograd.grad(value, list(leaves.values()), create_graph=nested)
        if not nested:
            value = value.detach()
        return dict(zip(leaves, grads, strict=True)), value

    def value_and_grad_aux(
        self, f: Callable[..., tuple[torch.Tensor, Any]], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor, Any]:
        """As ``value_and_grad`` for ``f`` returning (scalar, aux): (grads, scalar, aux), aux
        out of the graph."""
        held: list[Any] = []

        def value(p: Tree, *a: Any) -> torch.Tensor:
            v, aux = f(p, *a)
            held.append(aux)
            return v

        grads, v = self.value_and_grad(value, params, *args)
        return grads, v, _detached(held[0])


class FuncOps(Steps):
    """Many clients under ``vmap``: ``torch.func.grad_and_value`` (composable with vmap and
    with itself). With ``in_place`` (the vmap backend's choice when it owns the stacked carry
    and every client of the call takes the step, so nothing has to be masked), ``descend``
    writes into ``params``: W3's 31 MB update without a fresh block each step
    (benchmarks/README.md, Design measurements)."""

    def __init__(self, in_place: bool = False) -> None:
        self.in_place = in_place

    def value_and_grad(
        self, f: Callable[..., torch.Tensor], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor]:
        return grad_and_value(f)(params, *args)

    def value_and_grad_aux(
        self, f: Callable[..., tuple[torch.Tensor, Any]], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor, Any]:
        grads, (value, aux) = grad_and_value(f, has_aux=True)(params, *args)
        return grads, value, aux


def _detached(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


AUTOGRAD = AutogradOps()
FUNC = FuncOps()
FUNC_IN_PLACE = FuncOps(in_place=True)


# -- sample-level DP: the only data gradient is the private one ------------------------------

DP_BATCH = "dp_batch"
"""Carry key of a private client's expected Poisson batch size q n (``DPSGD.expected_batch``):
the divisor of its noised gradient sum, a (clients,) tensor under vmap."""


class PrivacyRefused(ConfigError):
    """A client step that would not be private under ``privacy.kind: sample_dp``: it took a
    gradient of its data some other way than DP-SGD's, or not as often as the accountant
    counts."""


class SealedBatch:
    """The minibatch as a step sees it under sample-level DP: its padding weights ``w`` and
    ``mean``, but no samples. ``x`` and ``y`` raise :class:`PrivacyRefused`: the data reach
    the step only through ``PrivateOps.loss_grad``, which opens the batch it was handed."""

    draws = None  # the step's noise belongs to PrivateOps

    def __init__(self, batch: Batch, refuse: Callable[[str], PrivacyRefused]) -> None:
        self._batch = batch
        self._refuse = refuse
        self.w = batch.w

    @property
    def x(self) -> torch.Tensor:
        raise self._refuse("reads its minibatch's samples (batch.x) itself")

    @property
    def y(self) -> torch.Tensor:
        raise self._refuse("reads its minibatch's targets (batch.y) itself")

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        return weighted_mean(per_sample, self.w)


class PrivateOps:
    """The ops of one private client step (one call of the update, for one client on the
    sequential backend, for a whole chunk under the vmap backend's ``vmap``).

    ``loss_grad`` is DP-SGD's noised mean of clipped per-sample gradients (``private_grad``)
    on the step's own minibatch, and it counts its calls: a step may take ``calls`` of them
    (the program's ``private_grads``), each noised with multiplier sigma sqrt(calls), so
    that together they are one Gaussian mechanism of multiplier sigma on the step's Poisson
    minibatch (k adaptive Gaussian releases of sensitivity C and noise sigma sqrt(k) C
    compose to one of noise sigma C: Dong, Roth & Su, JRSS-B 2022, "Gaussian Differential
    Privacy", Corollary 3.3), which is what the accountant counts for the step. A call beyond
    ``calls`` raises before it returns anything. ``value_and_grad`` and
    ``value_and_grad_aux`` raise: they have no private version. ``descend`` is the base
    ops'."""

    def __init__(
        self,
        base: Any,
        dp: DPSGD,
        batch: Batch,
        expected_batch: float | torch.Tensor,
        calls: int,
        refuse: Callable[[str], PrivacyRefused],
    ) -> None:
        self._base = base  # underscored, as SealedBatch._batch: not for the step
        self.in_place = base.in_place
        self.descend = base.descend  # the backend's own step: no data enters it
        self.dp = dp if calls == 1 else noisier(dp, calls)
        self._batch = batch
        self.sealed = SealedBatch(batch, refuse)
        self.expected_batch = expected_batch
        self.calls = calls
        self.taken = 0
        self.refuse = refuse

    def loss_grad(
        self, model: FunctionalModel, params: Tree, buffers: Tree, batch: Any
    ) -> tuple[Tree, torch.Tensor]:
        """DP-SGD's private gradient of the model's loss on the step's minibatch (``batch``
        must be the sealed minibatch the step was handed), and the mean loss."""
        if batch is not self.sealed:
            raise self.refuse("takes a data gradient on a minibatch it was not handed")
        self.taken += 1
        if self.taken > self.calls:
            raise self.refuse(
                f"takes more than the {self.calls} private gradient(s) a step its program "
                "declares (private_grads), which the noise and the accountant count"
            )
        real = self._batch
        draws = None
        if real.draws is not None:
            draws = {k: d[self.taken - 1] for k, d in real.draws.items()}
        noisy = Batch(real.x, real.y, real.w, draws)
        return private_grad(model, params, buffers, noisy, self.dp, self.expected_batch)

    def value_and_grad(self, f: Callable[..., torch.Tensor], params: Tree, *args: Any) -> Any:
        raise self.refuse("takes a gradient through ops.value_and_grad, which is not private")

    def value_and_grad_aux(self, f: Callable[..., Any], params: Tree, *args: Any) -> Any:
        raise self.refuse("takes a gradient through ops.value_and_grad_aux, which is not private")


def noisier(dp: DPSGD, calls: int) -> DPSGD:
    """DP-SGD's settings for one of ``calls`` private gradients of a step: noise multiplier
    sigma sqrt(calls) (PrivateOps)."""
    return dataclasses.replace(dp, noise_multiplier=dp.noise_multiplier * math.sqrt(calls))


def repeated_draw(draw: Draw, times: int) -> Draw:
    """``times`` draws of ``draw`` stacked along a new leading dimension (one per private
    gradient of a step); one draw's numbers are the same as ``draw``'s."""

    def drawn(gen: torch.Generator) -> dict[str, torch.Tensor]:
        each = [draw(gen) for _ in range(times)]
        return {k: torch.stack([d[k] for d in each]) for k in each[0]}

    return drawn


def private_update(
    name: str,
    plans: tuple[str, ...],
    fn: Callable[..., tuple[Carry, dict]],
    dp: DPSGD,
    shapes: Sequence[tuple[str, torch.Size]],
    calls: int,
    owner: str,
) -> Update:
    """The update ``fn`` made private: each call hands it :class:`PrivateOps` (over the
    backend's own ops) and its minibatch sealed (:class:`SealedBatch`), draws the noise of
    its ``calls`` private gradients from the client's stream, and refuses (raises
    :class:`PrivacyRefused`, naming ``owner``) a step that took no or fewer private gradients
    than ``calls`` or any other gradient of its data. The carry holds the client's q n under
    ``DP_BATCH``. No ``stacked`` form: the vmap backend vmaps the guarded ``fn``.

    Fail closed by construction, not a sandbox: this closes fedloom's own ways to a data
    gradient (``ops``, ``steps.loss_grad``, ``SGDProgram.data_grad``, the minibatch itself);
    Python code that reaches around them on purpose (data kept from ``init``) is not seen."""
    if calls < 1:
        raise ConfigError(f"{owner}: a private step takes at least one private gradient")

    def refuse(why: str) -> PrivacyRefused:
        return PrivacyRefused(
            f"privacy.kind: sample_dp: {owner}'s client step {why}. Under sample_dp a step's "
            f"only data gradient is DP-SGD's, through loss_grad / ops.loss_grad / "
            f"SGDProgram.data_grad on the minibatch it is handed, {calls} time(s) a step "
            "(docs/privacy.md); declare capabilities.supports_sample_dp = False otherwise"
        )

    def guarded(
        ops: Any, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        lead, *rest = batches
        private = PrivateOps(ops, dp, lead, carry[DP_BATCH], calls, refuse)
        sealed = (private.sealed, *(SealedBatch(b, refuse) for b in rest))
        new, metrics = fn(private, carry, cast(tuple[Batch, ...], sealed), shared)
        if private.taken < calls:
            raise refuse(f"took {private.taken} private gradient(s), not the {calls} declared")
        if DP_BATCH not in new:
            new = {**new, DP_BATCH: carry[DP_BATCH]}
        return new, metrics

    draw = repeated_draw(dp.noise_draw(shapes), calls)
    return Update(name, plans, guarded, draw)
