"""One batched SGD step of 10 clients of the FedAvg 2NN at B = 10, five ways (benchmarks/README.md,
"Stacked steps"): one client at a time, autograd on stacked weights with a separate update,
gradients at the layer outputs written into the weights (what core/stacked.py does), a
hand-written backward, and ``torch.func.vmap``. Interleaved, fastest of 7 x 50 steps.

Usage: ``python benchmarks/stacked_step.py [THREADS]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

C, B, LR = 10, 10, 0.1
DIMS = [784, 200, 200, 10]


def stacked_weights() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weights = [torch.randn(C, o, i) * 0.05 for i, o in pairwise(DIMS)]
    return weights, [torch.zeros(C, o) for o in DIMS[1:]]


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    x, y = torch.rand(C, B, 784), torch.randint(0, 10, (C, B))
    w_auto, b_auto = stacked_weights()
    leaves = [t.requires_grad_() for t in w_auto + b_auto]

    def autograd_weights() -> None:
        h = x
        for layer in range(3):
            h = torch.baddbmm(leaves[3 + layer].unsqueeze(1), h, leaves[layer].transpose(1, 2))
            h = h.relu() if layer < 2 else h
        loss = F.cross_entropy(h.reshape(-1, 10), y.reshape(-1), reduction="sum") / B
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            torch._foreach_add_(leaves, grads, alpha=-LR)

    w_tap, b_tap = stacked_weights()

    def output_gradients() -> None:
        h, inputs, taps = x, [], []
        for layer in range(3):
            inputs.append(h)
            tap = torch.zeros(C, B, DIMS[layer + 1], requires_grad=True)
            taps.append(tap)
            h = torch.baddbmm(b_tap[layer].unsqueeze(1), h, w_tap[layer].transpose(1, 2)) + tap
            h = h.relu() if layer < 2 else h
        loss = F.cross_entropy(h.reshape(-1, 10), y.reshape(-1), reduction="sum") / B
        grads = torch.autograd.grad(loss, taps)
        with torch.no_grad():
            for layer, g in enumerate(grads):
                w_tap[layer].baddbmm_(g.transpose(1, 2), inputs[layer], alpha=-LR)
                b_tap[layer].sub_(g.sum(1), alpha=LR)

    w_hand, b_hand = stacked_weights()

    def hand_written() -> None:
        hs, h = [x], x
        for layer in range(3):
            h = torch.baddbmm(b_hand[layer].unsqueeze(1), h, w_hand[layer].transpose(1, 2))
            h = h.relu() if layer < 2 else h
            hs.append(h)
        g = torch.softmax(h, -1)
        g.scatter_add_(-1, y.unsqueeze(-1), torch.full((C, B, 1), -1.0))
        g /= B
        for layer in (2, 1, 0):
            below = torch.bmm(g, w_hand[layer]) if layer else None
            w_hand[layer].baddbmm_(g.transpose(1, 2), hs[layer], alpha=-LR)
            b_hand[layer].add_(g.sum(1), alpha=-LR)
            if below is not None:
                g = below * (hs[layer] > 0)

    model = nn.Sequential(
        nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10)
    )
    params = list(model.parameters())

    def one_at_a_time() -> None:
        for c in range(C):
            grads = torch.autograd.grad(F.cross_entropy(model(x[c]), y[c]), params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-LR)

    stacked = {
        k: v.detach().unsqueeze(0).repeat(C, *[1] * v.dim()) for k, v in model.named_parameters()
    }

    def loss_of(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xb,)), yb)

    def one(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> tuple[dict, torch.Tensor]:
        g, loss = grad_and_value(loss_of)(p, xb, yb)
        return {k: p[k] - LR * g[k] for k in p}, loss

    vmapped = vmap(one)

    def under_vmap() -> None:
        nonlocal stacked
        stacked, _ = vmapped(stacked, x, y)

    steps: dict[str, Callable[[], None]] = {
        "one client at a time": one_at_a_time,
        "vmap": under_vmap,
        "autograd on stacked weights": autograd_weights,
        "gradients at the outputs (core/stacked.py)": output_gradients,
        "hand-written backward": hand_written,
    }
    for step in steps.values():
        for _ in range(20):
            step()
    best: dict[str, float] = {}
    for _ in range(7):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(50):
                step()
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - start) / 50 * 1e3)
    for name, ms in best.items():
        print(f"{name:<45} {ms:7.3f} ms per {C}-client step")


if __name__ == "__main__":
    main()
