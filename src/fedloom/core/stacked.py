"""A sample-wise model run for C clients at once, without ``vmap``: stacked weights, one merged
batch, and SGD steps written straight into the stacked weights.

The vmap backend (solvers/vmap.py) runs any client program on any module, but a batched step
under ``torch.func`` pays a fixed cost per call (its transforms wrap every tensor of the
forward and backward passes). At the minibatch sizes most FL papers use (B = 10 in the FedAvg
paper) that cost dominates: ten clients' 2NN step is a few milliseconds of kernel work. This
module runs such steps directly (docs/executors.md; numbers in benchmarks/README.md,
"Stacked steps"):

- **Stacked weights.** Each parameter holds C clients' copies along a new leading dimension.
- **One merged batch.** The C clients' minibatches are one batch of C*B samples, client c's
  rows at c*B .. (c+1)*B. Element-wise operations, pooling and flattening in the model's own
  ``forward`` treat every sample alone, so they run unchanged (max-pooling on a channels-last
  copy, the same bits: core/pooling.py); only the layers that hold
  parameters are swapped, for the duration of a call, for stacked versions: ``nn.Linear`` as
  one batched product per layer (``torch.baddbmm``), ``nn.Conv2d`` as one grouped
  convolution of C groups, or, for a layer with few input channels (an image model's first
  layer), as C separate convolutions on views of the merged batch joined by one ``cat``
  (:data:`SEPARATE_CONV_MAX_IN_CHANNELS`).
- **Gradients as outer products.** A linear layer's weight gradient is G^T H (G: the gradient
  at its output, H: its input). Autograd is asked for the gradients at the linear layers'
  outputs only (a zero tensor is added to an output that nothing upstream of it makes
  differentiable, the first layer's, to have something to ask at): it never forms the C
  weight gradients. A step then writes ``W <- W - lr G^T H`` into W with one ``baddbmm_``,
  reading and writing the largest tensors once. Convolution weights (small next to the linear
  layers of the built-in CNN) get ordinary autograd gradients.

The loss is the sum over clients of each client's weighted mean loss, so the gradient with
respect to client c's weights is client c's own gradient: the clients never interact.

A model qualifies when its forward pass is sample-wise (no operation mixes samples of a
batch: declared by ``FedModel.samplewise``, or a plain ``nn.Sequential`` of layers known to
treat samples alone, :func:`declares_samplewise`) and every parameter belongs to an
``nn.Linear`` or an ungrouped, zero-padded ``nn.Conv2d`` (the built-in ``logreg``, ``mlp`` and
``cnn``); other models (batch normalization, recurrent layers, transformers) take the vmap
path. Dropout layers (``nn.Dropout``, ``Dropout1d/2d/3d``) run stacked with each client's own
masks while a chunk swaps them (core/client_dropout.py, docs/executors.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fedloom.core.client_dropout import DROPOUT_LAYERS
from fedloom.core.pooling import fast_max_pools, max_pools
from fedloom.core.skinny import stacked_linear
from fedloom.core.stacked_chain import chain_forward, chain_gradients, output_gradient, relu_chain

Tree = dict[str, torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(output, targets) -> per-sample loss, shape (samples,)."""


SAMPLEWISE_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Hardtanh,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Identity,
    *DROPOUT_LAYERS,
)
"""Layers whose output for a sample depends on that sample alone (with their default,
batched inputs)."""


def declares_samplewise(module: nn.Module) -> bool:
    """Whether ``module``'s forward pass treats every sample alone: it declares
    ``samplewise`` (``FedModel.samplewise``), or it is a plain ``nn.Sequential`` (nested ones
    included) of ``SAMPLEWISE_LAYERS``, softmaxes over a dimension other than the batch's,
    and flattenings that keep the batch dimension. A subclass of ``nn.Sequential`` with a
    ``forward`` of its own does not count."""
    if getattr(module, "samplewise", False):
        return True
    if type(module) is nn.Sequential:
        return all(declares_samplewise(m) for m in module)
    if type(module) in SAMPLEWISE_LAYERS:
        return True
    if type(module) in (nn.Softmax, nn.LogSoftmax):
        dim = module.dim  # type: ignore[attr-defined]
        return dim is not None and dim != 0
    if type(module) is nn.Flatten:
        return module.start_dim != 0  # type: ignore[attr-defined]
    if type(module) is nn.Unflatten:
        return module.dim != 0  # type: ignore[attr-defined]
    return False


def stackable(module: nn.Module) -> bool:
    """Whether ``module`` can run stacked (see the module doc): its forward pass is
    sample-wise (:func:`declares_samplewise`), it has no normalization layers and no dropout
    layers other than ``DROPOUT_LAYERS``, and every parameter belongs to an ``nn.Linear`` or
    an ungrouped, zero-padded ``nn.Conv2d``."""
    if not declares_samplewise(module):
        return False
    owners = 0
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            return False
        if isinstance(m, nn.modules.dropout._DropoutNd) and type(m) not in DROPOUT_LAYERS:
            return False
        if isinstance(m, nn.Linear | nn.Conv2d):
            if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or m.groups != 1):
                return False
            owners += sum(1 for _ in m.parameters(recurse=False))
        elif any(True for _ in m.parameters(recurse=False)):
            return False
    return owners == sum(1 for _ in module.parameters())


@dataclass(frozen=True)
class FeaturePenalty:
    """An extra term of each client's loss on the input of one linear layer (the features
    that layer reads), added to its weighted mean loss: FedPAC's alignment of the features
    to class centroids (algorithms/fedpac.py)."""

    layer: str
    """The linear layer's module name (e.g. ``fc3``)."""
    loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(features (C, B, d), targets (C, B, ...), sample weights (C, B)) -> the C terms."""


@dataclass
class Taps:
    """What a stacked forward pass recorded for the gradient: each linear layer's input H
    (C, n, in) and the zero tap added to its output (C, n, out); and, for ``watch`` (a linear
    layer's name prefix, e.g. ``fc3.``), its input still in the graph (``features``)."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    taps: dict[str, torch.Tensor] = field(default_factory=dict)
    watch: str | None = None
    features: torch.Tensor | None = None


@dataclass
class StackedGrad:
    """The C clients' gradients of one step: linear weights as factors (G, H) whose product
    G^T H is the gradient, and biases as G summed over samples (``dense``)."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: Tree

    def names(self) -> list[str]:
        """The parameter keys that have a gradient."""
        return [*self.factors, *self.dense]

    def materialize(self, key: str) -> torch.Tensor:
        """gradient[key] as a (C, ...) tensor (G^T H formed for a linear weight)."""
        if key in self.factors:
            g, h = self.factors[key]
            return torch.bmm(g.transpose(1, 2), h)
        return self.dense[key]

    def add_to(self, key: str, target: torch.Tensor, alpha: float) -> None:
        """target += alpha * gradient[key], in place (no gradient tensor is formed for linear
        weights)."""
        if key in self.factors:
            g, h = self.factors[key]
            target.baddbmm_(g.transpose(1, 2), h, alpha=alpha)
        else:
            target.add_(self.dense[key], alpha=alpha)


class StackedModel:
    """Runs ``module`` (which must be :func:`stackable`) for C clients at once."""

    def __init__(self, module: nn.Module) -> None:
        if not stackable(module):
            raise ValueError(f"{type(module).__name__} cannot run stacked (core/stacked.py)")
        self.module = module
        self.layers: dict[str, nn.Module] = {
            name: m for name, m in module.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)
        }
        self.conv_keys = [
            (f"{name}." if name else "") + key
            for name, m in self.layers.items()
            if isinstance(m, nn.Conv2d)
            for key, _ in m.named_parameters(recurse=False)
        ]
        """Convolution parameters: ordinary (dense) autograd gradients."""
        self.chain = relu_chain(module)
        """The layers of a declared ReLU chain, whose backward runs by hand
        (core/stacked_chain.py); None: autograd's."""
        self.pools = max_pools(module)
        """Max-pooling layers, run on a channels-last copy while bound (core/pooling.py)."""

    @contextmanager
    def bound(self, params: Tree, clients: int, taps: Taps | None = None) -> Iterator[None]:
        """Inside the block, calling ``module`` on a merged batch of ``clients`` equal
        minibatches runs each client's rows with its own stacked ``params`` (with ``taps``:
        recording what :meth:`value_and_grad` needs)."""
        for name, layer in self.layers.items():
            prefix = _prefix(name)
            weight = params[prefix + "weight"]
            bias = params.get(prefix + "bias") if layer.bias is not None else None
            if isinstance(layer, nn.Linear):
                layer.forward = _stacked_linear(weight, bias, clients, prefix, taps)
            else:
                layer.forward = _stacked_conv(layer, weight, bias, clients)  # type: ignore[arg-type]
        try:
            with fast_max_pools(self.pools):  # core/pooling.py: the same bits, faster
                yield
        finally:
            for layer in self.layers.values():
                del layer.forward  # back to the class's forward

    def forward(self, params: Tree, x: torch.Tensor) -> torch.Tensor:
        """The C clients' outputs on their minibatches ``x`` (C, B, ...), merged: (C*B, ...)."""
        clients = x.shape[0]
        with self.bound(params, clients):
            return self.module(x.reshape(-1, *x.shape[2:]))

    def value_and_grad(
        self,
        params: Tree,
        x: torch.Tensor,
        y: torch.Tensor,
        w: torch.Tensor,
        loss: Loss,
        trainable: set[str] | None = None,
        task: str | None = None,
        penalty: FeaturePenalty | None = None,
    ) -> tuple[StackedGrad, torch.Tensor]:
        """Each client's gradient of its weighted mean loss sum_i w_i l_i / sum_i w_i on its
        minibatch (x, y, w: (C, B, ...)), plus its ``penalty`` term if given, and the C
        losses. ``trainable``: the keys to differentiate (default: all). ``task``: ``loss`` is
        the model's own per-sample loss of that task (``FunctionalModel.per_sample_loss``), so
        that a ReLU chain can run its backward by hand (core/stacked_chain.py) when there is
        no penalty."""
        if self.chain is not None and task is not None and penalty is None:
            factors, dense, losses = self.by_hand(params, x, y, w, task)
            if trainable is not None:
                factors = {k: v for k, v in factors.items() if k in trainable}
                dense = {k: v for k, v in dense.items() if k in trainable}
            return StackedGrad(factors, dense), losses
        clients, width = x.shape[0], x.shape[1]
        taps = Taps(watch=None if penalty is None else _prefix(penalty.layer))
        leaves = {
            k: params[k].detach().requires_grad_(True)
            for k in self.conv_keys
            if trainable is None or k in trainable
        }
        with torch.enable_grad(), self.bound({**params, **leaves}, clients, taps):
            out = self.module(x.reshape(-1, *x.shape[2:]))
            per = loss(out, y.reshape(-1, *y.shape[2:])).view(clients, width)
            losses = (per * w).sum(1) / w.sum(1).clamp_min(1.0)
            if penalty is not None:
                assert taps.features is not None, f"no linear layer {penalty.layer!r} ran"
                losses = losses + penalty.loss(taps.features, y, w)
            wanted = {
                name: tap
                for name, tap in taps.taps.items()
                if trainable is None or {f"{name}weight", f"{name}bias"} & trainable
            }
            inputs = [*wanted.values(), *leaves.values()]
            grads = torch.autograd.grad(losses.sum(), inputs) if inputs else ()
        dense: Tree = dict(zip(leaves, grads[len(wanted) :], strict=True))
        factors = _linear_gradients(
            params, taps, dict(zip(wanted, grads, strict=False)), dense, trainable
        )
        return StackedGrad(factors, dense), losses.detach()

    def by_hand(
        self, params: Tree, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, task: str
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], Tree, torch.Tensor]:
        """The gradient of a declared ReLU chain with its backward run by hand
        (core/stacked_chain.py): (weight factors, dense gradients, losses)."""
        assert self.chain is not None
        with torch.no_grad():
            hs = chain_forward(self.chain, params, x)
            grad, losses = output_gradient(hs[-1], y, w, task)
            factors, dense = chain_gradients(self.chain, params, hs, grad)
        return factors, dense, losses


def _prefix(name: str) -> str:
    """A layer's parameter-key prefix: ``fc3`` -> ``fc3.``, the root module -> ``''``."""
    return f"{name}." if name else ""


def _linear_gradients(
    params: Tree,
    taps: Taps,
    output_grads: dict[str, torch.Tensor],
    dense: Tree,
    trainable: set[str] | None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear layer's weight gradient as the pair (output gradient, input), and its bias
    gradient (the output gradient summed over the samples) added to ``dense``."""
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, g in output_grads.items():
        if trainable is None or f"{name}weight" in trainable:
            factors[f"{name}weight"] = (g, taps.inputs[name])
        if f"{name}bias" in params and (trainable is None or f"{name}bias" in trainable):
            dense[f"{name}bias"] = g.sum(1)
    return factors


def _stacked_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, clients: int, name: str, taps: Taps | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(clients, -1, x.shape[-1])  # client c's samples are rows c*n .. (c+1)*n
        out = stacked_linear(rows, weight, bias)  # core/skinny.py: oneDNN for large weights
        if taps is not None:
            if taps.watch == name:
                taps.features = rows
            taps.inputs[name] = rows.detach()
            if out.requires_grad:  # autograd can stop at this output itself
                taps.taps[name] = out
            else:  # nothing upstream needs a gradient: add a zero leaf to stop at
                tap = torch.zeros_like(out, requires_grad=True)
                taps.taps[name] = tap
                out = out + tap
        return out.reshape(*x.shape[:-1], weight.shape[1])

    return forward


SEPARATE_CONV_MAX_IN_CHANNELS = 3
"""A convolution with at most this many input channels (an image model's first layer: 1 or 3)
runs as C separate convolutions, one per client, instead of one grouped convolution
(:func:`_stacked_conv`; benchmarks/README.md, "Convolution steps"). Tests set it to force
either form: 0 always groups, a large value always separates."""


def _stacked_conv(
    layer: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor | None, clients: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A convolution of C clients on the merged batch, in one of two forms chosen per layer by
    its number of input channels only (not by the thread count or the machine, so that one
    configuration always runs the same form and gives the same bits run to run):

    - **C separate convolutions** when ``layer.in_channels <= SEPARATE_CONV_MAX_IN_CHANNELS``:
      client c's rows ``x[c*n:(c+1)*n]`` (a view of the merged batch, no copy) with its own
      ``weight[c]`` and ``bias[c]``, the outputs joined by one ``torch.cat``. With 1 or 3 input
      channels a grouped convolution runs at 11-28 % of the machine's convolution peak. The
      separate form took 0.49-0.67x the grouped form's time (forward and gradients), and a
      whole 10-client step 0.88-0.95x (0.95-1.00x on ``cnn``), at 1 thread
      (benchmarks/README.md, "Separate first-layer convolutions").
    - **One grouped convolution of C groups** otherwise: the batch regrouped to
      (n, C*cin, H, W), client c's channels as group c (measured faster than a batched
      product over unfolded patches at 28x28, and within 10 % of it at 8x8: "Stacked steps").
      On the 5x5 32->64-channel layers measured it is as fast as the separate form or faster.
    """
    args = (layer.stride, layer.padding, layer.dilation)
    if layer.in_channels <= SEPARATE_CONV_MAX_IN_CHANNELS:

        def separate(x: torch.Tensor) -> torch.Tensor:
            weights = weight.unbind(0)  # one backward node stacks the C weight gradients
            biases = bias.unbind(0) if bias is not None else (None,) * clients
            # client c's samples: rows c*n .. (c+1)*n, views of the merged batch
            rows = x.view(clients, x.shape[0] // clients, *x.shape[1:]).unbind(0)
            return torch.cat(
                [
                    F.conv2d(r, wc, bc, *args)
                    for r, wc, bc in zip(rows, weights, biases, strict=True)
                ]
            )

        return separate

    def grouped(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] // clients
        # (C*n, cin, H, W) -> (n, C*cin, H, W): client c's channels are group c
        regrouped = x.view(clients, n, *x.shape[1:]).transpose(0, 1).reshape(n, -1, *x.shape[2:])
        out = F.conv2d(
            regrouped,
            weight.reshape(-1, *weight.shape[2:]),
            bias.reshape(-1) if bias is not None else None,
            *args,
            clients,
        )
        out = out.view(n, clients, -1, *out.shape[2:]).transpose(0, 1)
        return out.reshape(clients * n, *out.shape[2:])

    return grouped
