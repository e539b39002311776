"""Max-pooling on a channels-last copy of its input: the values and gradients of
``F.max_pool2d`` bit for bit, faster on the CPU.

torch 2.13's CPU max-pooling kernel is about 8x slower on the default (NCHW) layout than on
channels-last (NHWC): ``simple_cnn``'s (250, 64, 28, 28) activation took 52-59 ms forward at
1 thread, against 6-7 ms channels-last. Handing channels-last tensors on to the rest of a
model does not pay (its flatten sends the gradient back in the default layout, and the mixed
layouts cost more than pooling saves: benchmarks/README.md, "Channels-last activations in
stacked convolutions"). So only the pooling changes layout, inside one autograd function:

- forward: copy the input channels-last, pool it there with indices, and return the output in
  the default layout. The indices are positions within each (sample, channel) plane, the same
  whatever the layout, and both kernels scan a window in the same order and keep its first
  maximum, so the output and the indices equal the default kernel's, ties included;
- backward: the default layout's own backward with those indices (fast already).

Forward and backward together took 54-65 ms against 82 ms on that activation, and a round of
pfl-research's CIFAR-10 setting 0.94-0.98x the time (benchmarks/README.md, "Max-pooling
through channels-last"). It runs where fedloom calls a model's ``forward`` itself outside
``torch.func``'s transforms (which cannot query a channels-last layout): the stacked path
(core/stacked.py) and the one-client trainer (core/lean.py) swap the forward of every
``nn.MaxPool2d`` for it (:func:`fast_max_pools`, :func:`install_fast_max_pools`); elsewhere
``nn.MaxPool2d`` runs ``F.max_pool2d`` as usual, with the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair


class _ChannelsLastMaxPool(torch.autograd.Function):
    """(x, kernel, stride, padding, dilation, ceil_mode) -> (output, indices), as
    ``aten.max_pool2d_with_indices``; see the module doc."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        nhwc = x.contiguous(memory_format=torch.channels_last)
        out, indices = torch.ops.aten.max_pool2d_with_indices(nhwc, *args)
        out, indices = out.contiguous(), indices.contiguous()
        ctx.save_for_backward(x, indices)
        ctx.args = args
        ctx.mark_non_differentiable(indices)
        return out, indices

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _indices: Any) -> tuple[Any, ...]:
        x, indices = ctx.saved_tensors
        dx = torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *ctx.args, indices)
        return (dx, *(None for _ in ctx.args))


def max_pool2d(
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> torch.Tensor:
    """``F.max_pool2d(x, ...)`` (its values and gradients, bit for bit), through channels-last
    for a batched (4-d) CPU input outside ``torch.func``'s transforms; ``F.max_pool2d`` itself
    otherwise."""
    if (
        x.dim() != 4
        or x.device.type != "cpu"
        or torch._C._functorch.peek_interpreter_stack() is not None
    ):
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)
    kernel = _pair(kernel_size)
    strides = _pair(stride) if stride is not None and stride != [] else kernel
    args = (list(kernel), list(strides), list(_pair(padding)), list(_pair(dilation)), ceil_mode)
    return _ChannelsLastMaxPool.apply(x, *args)[0]


def _pooling(layer: nn.MaxPool2d) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return max_pool2d(
            x, layer.kernel_size, layer.stride, layer.padding, layer.dilation, layer.ceil_mode
        )

    return forward


def max_pools(module: nn.Module) -> list[nn.MaxPool2d]:
    """The ``nn.MaxPool2d`` layers of ``module`` that return no indices."""
    return [m for m in module.modules() if type(m) is nn.MaxPool2d and not m.return_indices]


def install_fast_max_pools(module: nn.Module) -> None:
    """Swap the forward of every :func:`max_pools` layer of ``module`` for :func:`max_pool2d`,
    for good: for a private copy that only fedloom runs (core/lean.py)."""
    for layer in max_pools(module):
        layer.forward = _pooling(layer)  # type: ignore[method-assign]


@contextmanager
def fast_max_pools(layers: list[nn.MaxPool2d]) -> Iterator[None]:
    """The forward of each of ``layers`` (:func:`max_pools`) swapped for :func:`max_pool2d`
    for the duration of the block."""
    for layer in layers:
        layer.forward = _pooling(layer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward
