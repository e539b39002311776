"""The lean one-client-at-a-time trainer behind the sequential executor.

One private copy of the model (made once, not per client) whose parameters are views into a
single flat buffer, with gradients accumulated into a second flat buffer: loading a client's
starting point is one copy, each SGD step is forward, backward and one fused
``flat -= lr * flat_grad``. No deepcopy, optimizer or DataLoader per client; cheaper per
step than ``functional_call`` + autograd for small models (benchmarks/README.md, Design
measurements).

With ``channels_last=True`` convolution weights are kept channels-last (NHWC) inside the
flat buffer: oneDNN's convolutions run faster on that layout (same section; not for models
with batch normalization, see ``_channels_last_keys``). Off by default: with torch 2.13's CPU
kernels, channels-last convolution weights of ``resnet18`` at ``width: 8`` on 64x64 inputs
(batch 32) corrupted the heap in the backward pass (``free(): invalid next size``, a crash of
the process; reproduced with plain torch, the weights set channels-last on the module), and the
default layout never did.
Trees going in and out keep PyTorch's default layout; only the flat buffer's order of a
convolution weight's elements differs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedloom.core.pooling import install_fast_max_pools
from fedloom.core.pytree import Tree

try:  # torch's own entry to the C++ autograd engine, behind Tensor.backward
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - a torch without it: the public path
    _engine_run_backward = None

_ONES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` for a scalar loss, without the public wrapper's argument handling.

    ``Tensor.backward`` normalizes its arguments and builds a ``ones_like(loss)`` seed on
    every call before it reaches the engine, a visible share of a small model's step
    (benchmarks/README.md, Design measurements). Here the seed is cached and the engine
    entry that ``torch.autograd.backward`` itself ends in is called directly; same
    gradients."""
    if _engine_run_backward is None or loss.dim() != 0:
        loss.backward()
        return
    key = (loss.dtype, loss.device)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = torch.ones((), dtype=loss.dtype, device=loss.device)
    _engine_run_backward(
        (loss,), (one,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _channels_last_keys(module: nn.Module) -> set[str]:
    """Names of the 4-d convolution weights (``conv.weight``) to keep channels-last; none for
    models with batch normalization, whose statistics over small batches amplify the layout's
    different float summation order past the executors' 1e-4 equivalence (measured 3.3e-4
    after three rounds of ``cnn_bn`` on digits, batch 121)."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return set()
    return {
        f"{name}.weight" if name else "weight"
        for name, m in module.named_modules()
        if isinstance(m, nn.Conv2d)
    }


class LeanModule:
    def __init__(self, template: nn.Module, channels_last: bool = False) -> None:
        self.module = copy.deepcopy(template)
        self.module.train()
        install_fast_max_pools(self.module)  # core/pooling.py: the same bits, faster
        named = list(self.module.named_parameters())
        self.keys = [k for k, _ in named]
        self.channels_last = _channels_last_keys(self.module) if channels_last else set()
        self.flat = torch.cat([self._flat_order(k, p.detach()) for k, p in named]).contiguous()
        self.flat_grad = torch.zeros_like(self.flat)
        self.views: Tree = {}
        offset = 0
        for key, p in named:
            n = p.numel()
            p.data = self._view(key, self.flat[offset : offset + n], p.shape)
            p.grad = self._view(key, self.flat_grad[offset : offset + n], p.shape)
            self.views[key] = p
            offset += n
        self.buffers = dict(self.module.named_buffers())

    def _flat_order(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (default layout) as the 1-d run of elements its slot of the flat buffer holds."""
        if key in self.channels_last:
            return t.permute(0, 2, 3, 1).reshape(-1)
        return t.reshape(-1)

    def _view(self, key: str, run: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """A parameter-shaped view of a 1-d slot of a flat buffer."""
        if key in self.channels_last:
            out, inp, kh, kw = shape
            return run.view(out, kh, kw, inp).permute(0, 3, 1, 2)
        return run.view(shape)

    def flatten_into(self, tree: Tree, out: torch.Tensor) -> None:
        """Write a parameter-shaped tree into a flat buffer laid out like ``flat``."""
        torch.cat([self._flat_order(k, tree[k]) for k in self.keys], out=out)

    def load(self, params: Tree, buffers: Tree) -> None:
        with torch.no_grad():
            self.flatten_into(params, self.flat)
            for k, b in self.buffers.items():
                b.copy_(buffers[k])

    def grad_view(self) -> Tree:
        return {k: p.grad for k, p in self.views.items()}  # type: ignore[misc]

    def params(self) -> Tree:
        """Detached copies of the current parameters (one copy of the flat buffer)."""
        return self.unflatten(self.flat)

    def unflatten(self, flat: torch.Tensor) -> Tree:
        """A copy of a flat parameter-shaped vector as a tree keyed like the parameters, in
        the default layout."""
        flat = flat.clone()
        out, offset = {}, 0
        for k, p in self.views.items():
            view = self._view(k, flat[offset : offset + p.numel()], p.shape)
            out[k] = view.contiguous() if k in self.channels_last else view
            offset += p.numel()
        return out

    def buffers_copy(self) -> Tree:
        return {k: b.clone() for k, b in self.buffers.items()}
