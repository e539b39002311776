"""A model seen as pure functions of a parameter tree (torch.func), so that one client's update
can later be vmapped over many clients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedloom.core.lean import LeanModule
from fedloom.core.pytree import Tree
from fedloom.core.rng import seed_for
from fedloom.core.stacked import StackedModel, stackable

if TYPE_CHECKING:
    from fedloom.models.base import FedModel


class FunctionalModel:
    """Wraps a template ``FedModel`` and a task; never mutates the template's weights.

    ``params`` are the trainable tensors, ``buffers`` the rest of the state (BatchNorm's
    running statistics). The loss is cross-entropy for classification and the mean squared
    error (mean over samples, no 1/2 factor) for regression, as README.md ("Python API") fixes.
    """

    def __init__(self, module: FedModel, task: str) -> None:
        self.module = module
        self.task = task
        self.param_keys = [n for n, _ in module.named_parameters()]
        self._lean: LeanModule | None = None
        self._stacked: StackedModel | None = None
        self.has_dropout = any(
            isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in module.modules()
        )
        self.buffer_keys = [n for n, _ in module.named_buffers()]

    def random_stream(
        self, seed: int, round: int, client: int
    ) -> contextlib.AbstractContextManager:
        """Dropout masks from the stream (seed, round, client, 'dropout') instead of torch's
        global generator, so every executor and a resumed run draw the same masks."""
        if not self.has_dropout:
            return contextlib.nullcontext()
        return _seeded_global_rng(seed_for(seed, "dropout", round, client))

    def lean(self) -> LeanModule:
        """The private flat-buffer copy used by the sequential local solver (made once)."""
        if self._lean is None:
            self._lean = LeanModule(self.module)
        return self._lean

    def stacked(self) -> StackedModel | None:
        """The model run for many clients at once without ``vmap`` (core/stacked.py), or
        None when it cannot run so (not sample-wise, or layers other than linear and
        convolution hold parameters)."""
        if self._stacked is None and stackable(self.module):
            self._stacked = StackedModel(self.module)
        return self._stacked

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_lean": None, "_stacked": None}

    def initial_state(self, seed: int) -> tuple[Tree, Tree]:
        """Fresh (params, buffers) from the stream (seed, 'init'): the same for every executor."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(seed, "init"))
            for m in self.module.modules():
                if m is not self.module and hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        params = {k: v.detach().clone() for k, v in self.module.named_parameters()}
        buffers = {k: v.detach().clone() for k, v in self.module.named_buffers()}
        return params, buffers

    def forward(self, params: Tree, buffers: Tree, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, (params, buffers), (x,))

    def forward_with_features(
        self, params: Tree, buffers: Tree, x: torch.Tensor, head: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, h): the model's output on ``x`` and the input h(x) of its submodule
        ``head`` (the representation a linear head classifies). Pure like ``forward``: a
        forward pre-hook captures h during the functional call, which works under ``vmap`` and
        ``torch.func.grad`` (the captured tensor belongs to the same transform level)."""
        with head_input(self.module.get_submodule(head)) as store:
            out = functional_call(self.module, (params, buffers), (x,))
        return out, store["h"]

    def loss_from_output(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "classification":
            return F.cross_entropy(out, y)
        return F.mse_loss(out.squeeze(-1) if y.ndim == 1 else out, y)

    def per_sample_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each sample's loss, shape (batch,): its mean is ``loss_from_output``."""
        if self.task == "classification":
            return F.cross_entropy(out, y, reduction="none")
        err = (out.squeeze(-1) if y.ndim == 1 else out) - y
        return (err**2).reshape(err.shape[0], -1).mean(dim=1)

    def weighted_loss(
        self, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """sum_i w_i l_i / sum_i w_i: the mean loss over the real (w = 1) samples of a padded
        batch; 0 for an all-padding batch. Pure, for ``vmap``."""
        per = self.per_sample_loss(self.forward(params, buffers, x), y)
        return (per * w).sum() / w.sum().clamp_min(1.0)

    def loss(self, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_from_output(self.forward(params, buffers, x), y)

    def grad_and_loss(
        self, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[Tree, torch.Tensor]:
        """Gradient of the mean loss on (x, y) with respect to ``params``, and the loss.

        In training mode BatchNorm updates ``buffers`` in place (the caller owns them).
        ``loss`` itself is pure, so the vectorized executor differentiates it with
        ``torch.func.grad`` under ``vmap``; one client at a time, reverse-mode autograd on
        fresh leaves is cheaper per call (benchmarks/README.md, Design measurements), which
        dominates small models' local steps.
        """
        self.module.train()
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with torch.enable_grad():
            loss = self.loss(leaves, buffers, x, y)
            grads = torch.autograd.grad(loss, list(leaves.values()))
        return dict(zip(leaves, grads, strict=True)), loss.detach()

    def full_gradient(
        self, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor, chunk: int = 1024
    ) -> Tree:
        """Gradient of the mean loss over all of (x, y) at ``params``, in chunks of ``chunk``
        samples (so memory stays bounded); ``buffers`` are not modified."""
        n = int(x.shape[0])
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        for start in range(0, n, chunk):
            xb, yb = x[start : start + chunk], y[start : start + chunk]
            grads, _ = self.grad_and_loss(
                params, {k: b.clone() for k, b in buffers.items()}, xb, yb
            )
            for k, g in grads.items():
                total[k].add_(g, alpha=int(xb.shape[0]) / n)
        return total

    @torch.no_grad()
    def evaluate(
        self, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
    ) -> tuple[float, float, int]:
        """(summed loss, number correct, n) on (x, y) in evaluation mode."""
        self.module.eval()
        loss_sum, correct, n = 0.0, 0.0, int(x.shape[0])
        for start in range(0, n, batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            out = self.forward(params, buffers, xb)
            loss_sum += float(self.loss_from_output(out, yb)) * int(xb.shape[0])
            if self.task == "classification":
                correct += float((out.argmax(-1) == yb).sum())
        self.module.train()
        return loss_sum, correct, n


@contextlib.contextmanager
def evaluation_mode(module: torch.nn.Module) -> Iterator[None]:
    """Inside the block ``module`` is in evaluation mode (no dropout, BatchNorm on its running
    statistics), in training mode after it."""
    module.eval()
    try:
        yield
    finally:
        module.train()


@contextlib.contextmanager
def head_input(head: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, ``store['h']`` is the input of ``head``'s latest forward call."""
    store: dict[str, torch.Tensor] = {}

    def hook(module: torch.nn.Module, args: tuple) -> None:
        store["h"] = args[0]

    handle = head.register_forward_pre_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


GradCorrection = Callable[[Tree], Tree | None]
"""A term added to the data gradient at every local step (FedProx's mu(w - w_t), SCAFFOLD's
c - c_k, FedDyn's linear and proximal terms)."""


@contextlib.contextmanager
def _seeded_global_rng(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
