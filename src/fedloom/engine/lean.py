"""The lean one-client-at-a-time trainer behind the sequential executor.

One private copy of the model (made once, not per client) whose parameters are views into a
single flat buffer, with gradients accumulated into a second flat buffer: loading a client's
starting point is one copy, each SGD step is forward, backward and one fused
``flat -= lr * flat_grad``. No deepcopy, optimizer or DataLoader per client; measured 3x
fewer microseconds per step than ``functional_call`` + autograd for small models.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedloom.engine.pytree import Tree


class LeanModule:
    def __init__(self, template: nn.Module) -> None:
        self.module = copy.deepcopy(template)
        self.module.train()
        named = list(self.module.named_parameters())
        self.keys = [k for k, _ in named]
        self.flat = torch.cat([p.detach().reshape(-1) for _, p in named]).contiguous()
        self.flat_grad = torch.zeros_like(self.flat)
        self.views: Tree = {}
        offset = 0
        for key, p in named:
            n = p.numel()
            p.data = self.flat[offset : offset + n].view_as(p)
            p.grad = self.flat_grad[offset : offset + n].view_as(p)
            self.views[key] = p
            offset += n
        self.buffers = dict(self.module.named_buffers())

    def load(self, params: Tree, buffers: Tree) -> None:
        with torch.no_grad():
            torch.cat([params[k].reshape(-1) for k in self.keys], out=self.flat)
            for k, b in self.buffers.items():
                b.copy_(buffers[k])

    def grad_view(self) -> Tree:
        return {k: p.grad for k, p in self.views.items()}  # type: ignore[misc]

    def params(self) -> Tree:
        """Detached copies of the current parameters (one copy of the flat buffer)."""
        return self.unflatten(self.flat)

    def unflatten(self, flat: torch.Tensor) -> Tree:
        """A copy of a flat parameter-shaped vector as a tree keyed like the parameters."""
        flat = flat.clone()
        out, offset = {}, 0
        for k, p in self.views.items():
            out[k] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return out

    def buffers_copy(self) -> Tree:
        return {k: b.clone() for k, b in self.buffers.items()}
