"""The products of a stacked linear layer when each client's minibatch is a few rows against a
large weight: oneDNN's matrix product one client at a time instead of one batched MKL call.

A stacked step (core/stacked.py) multiplies client c's B rows by its own weight W_c: the
forward H_c W_c^T and the input gradient G_c W_c. At B = 10 these are skinny products (ten rows
against, for ``simple_cnn``'s 12544 -> 128 layer, a 6.4 MB weight), and torch's batched MKL
call ran them at 41-45 GFLOP/s at 1 thread, moving the weights at about 8 GB/s where the core
reads memory at about 40 GB/s. oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, what
torch's own compiler emits for CPU linear layers) ran the same products at 69-87 GFLOP/s, one
call per client (benchmarks/README.md, "Skinny products through oneDNN"). On a small weight
the per-call cost loses (200 x 200: 38 against 70 GFLOP/s), so only weights of at least
:data:`MIN_WEIGHT` elements go this way, a rule that depends on the layer's shape alone (a
configuration always takes the same kernels, and the same bits, run to run).

oneDNN sums in another order than MKL: the outputs agree to float rounding (3e-6 on
``simple_cnn``'s layer, outputs of size 1), within the executors' 1e-4 equivalence.
"""

from __future__ import annotations

from typing import Any

import torch

MIN_WEIGHT = 1_000_000
"""Weights of at least this many elements a client (``simple_cnn``'s 12544 x 128, the FedAvg
CNN's 3136 x 512) take oneDNN's per-client products. The FedAvg 2NN's 784 x 200 gained only
9 % there (benchmarks/README.md, "Skinny products through oneDNN") and stays batched; tests
lower it to cover both forms."""


def _onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear operator (CPU builds with MKL-DNN)."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        probe = op(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(probe.shape == (2, 4) and torch.backends.mkldnn.is_available())


ONEDNN = _onednn_available()


def takes_onednn(weight: torch.Tensor) -> bool:
    """Whether a stacked weight (C, out, in) runs its products through oneDNN."""
    return (
        ONEDNN
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight[0].numel() >= MIN_WEIGHT
        and torch._C._functorch.peek_interpreter_stack() is None
    )


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _batched(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One batched MKL product, differentiable in every argument."""
    if bias is None:
        return torch.bmm(rows, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), rows, weight.transpose(1, 2))


def rows_times_weights(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(C, n, in) x (C, out, in) -> (C, n, out): each client's rows H_c W_c^T (+ b_c), through
    oneDNN when :func:`takes_onednn` (no autograd graph then), else one batched product."""
    if not takes_onednn(weight):
        return _batched(rows, weight, bias)
    biases = bias.unbind(0) if bias is not None else (None,) * weight.shape[0]
    return torch.stack(
        [_linear(r, w, b) for r, w, b in zip(rows.unbind(0), weight.unbind(0), biases, strict=True)]
    )


def grads_times_weights(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(C, n, out) x (C, out, in) -> (C, n, in): each client's G_c W_c, the gradient at a linear
    layer's input, through oneDNN when :func:`takes_onednn`, else one batched product."""
    if not takes_onednn(weight):
        return torch.bmm(grad, weight)
    return torch.stack(
        [_linear(g, w.t(), None) for g, w in zip(grad.unbind(0), weight.unbind(0), strict=True)]
    )


class _StackedLinear(torch.autograd.Function):
    """rows -> rows_times_weights(rows, weight, bias), differentiable in ``rows`` only (the
    stacked path forms weight gradients from the output gradient and the input itself)."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return rows_times_weights(rows, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return grads_times_weights(grad, weight), None, None


def stacked_linear(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The stacked path's linear layer: H_c W_c^T + b_c for every client, differentiable in
    ``rows``, through oneDNN's per-client products for a large weight (:func:`takes_onednn`)
    that needs no gradient of its own; torch's batched product otherwise."""
    own_grad = weight.requires_grad or (bias is not None and bias.requires_grad)
    if own_grad or not takes_onednn(weight):
        return _batched(rows, weight, bias)
    return _StackedLinear.apply(rows, weight, bias)
