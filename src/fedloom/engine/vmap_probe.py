"""Whether the vmap backend can run a model, asked once before training: one vmapped gradient of
the model's loss over two clients on two samples of the run's data, in training mode. A model
it cannot run (data-dependent control flow, ``.item()``, an operator without a batching rule)
is refused by the vectorized executor naming the layer that failed, and auto leaves the
vectorized candidates out (docs/executors.md, "What runs where")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.func import grad_and_value, vmap

from fedloom.core.client_dropout import Call, ChunkDropout, has_dropout
from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError


class NotVmappable(ConfigError):
    """The vectorized executor cannot run this model (the message names the layer)."""


def check_vmappable(model: FunctionalModel, x: torch.Tensor, y: torch.Tensor) -> None:
    """Raise :class:`NotVmappable` when the vmap backend cannot differentiate ``model``'s loss
    on a minibatch like ``x``, ``y`` (at least one sample) for two clients at once."""
    module = model.module
    xs = _two_clients(x[:2])
    ys = _two_clients(y[:2])
    w = torch.ones(ys.shape[:2])
    params = {k: _two_clients(v.detach()) for k, v in module.named_parameters()}
    buffers = {k: _two_clients(v.detach()) for k, v in module.named_buffers()}
    width = int(xs.shape[1])
    step = vmap(grad_and_value(model.weighted_loss), in_dims=(0, 0, 0, 0, 0))
    with _entered_layers(module) as entered, _client_masks(module, width):
        module.train()
        try:
            step(params, buffers, xs, ys, w)
        except Exception as err:  # any failure under vmap: name where it happened
            layer = entered[-1] if entered else "<root>"
            kind = type(module.get_submodule(layer)).__name__ if entered else type(module).__name__
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise NotVmappable(
                f"executor.kind: the vectorized executor cannot run layer {layer} ({kind}) of "
                f"this model under torch.func.vmap ({reason}); the fastest executor that runs "
                "it is the sequential one in worker processes: executor: {kind: sequential, "
                "workers: <cores>} (or kind: ray) (docs/executors.md)"
            ) from err


def _two_clients(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0).expand(2, *t.shape).clone()


@contextlib.contextmanager
def _entered_layers(module: nn.Module) -> Iterator[list[str]]:
    """Inside the block, the list is the stack of submodules whose forward is running
    (outermost first): after a failure its last entry is the innermost layer that failed;
    empty, the model's own ``forward`` code failed."""
    entered: list[str] = []

    def enter(name: str) -> Callable[[nn.Module, tuple], None]:
        return lambda _module, _args: entered.append(name)

    def leave(_module: nn.Module, _args: tuple, _out: object) -> None:
        entered.pop()

    handles = []
    for name, m in module.named_modules():
        if name:
            handles.append(m.register_forward_pre_hook(enter(name)))
            handles.append(m.register_forward_hook(leave))
    try:
        yield entered
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _client_masks(module: nn.Module, width: int) -> Iterator[None]:
    """Dropout layers draw per-client masks as in a chunk (core/client_dropout.py)."""
    if not has_dropout(module):
        yield
        return
    source = ChunkDropout(0, 0, [0, 1])
    with source.swapped(module), source.call(Call([0, 1], [True, True], [[width, width]], width)):
        yield
