"""Gradient inversion: what one client's single-batch gradient gives away.

- DLG (Zhu, Liu & Han, "Deep Leakage from Gradients", NeurIPS 2019, Algorithm 1): optimize a
  dummy input x' and a dummy soft label y' = softmax(v') so that the gradient they produce at
  the same model matches the observed one, ||grad L(x', y') - grad L(x, y)||^2 (squared L2
  over all parameters), with L-BFGS.
- iDLG (Zhao, Mopuri & Bilen, "iDLG: Improved Deep Leakage from Gradients", 2020, section 3):
  for softmax cross-entropy and a batch of one, dL/db_i = p_i - y_i of the last layer's bias is
  negative only at the true class, so the label is read off the gradient and only x' is
  optimized. (Without a bias: the last weight's rows, dL/dW_i = (p_i - y_i) h with h >= 0
  after ReLU/sigmoid, give the same sign.)
- Analytic recovery through a first fully connected layer with bias, z = W1 x + b1: for one
  sample dL/dW1[j, :] = (dL/dz_j) x and dL/db1[j] = dL/dz_j, so x = dL/dW1[j, :] / dL/db1[j]
  for any unit j with dL/db1[j] != 0 (Phong et al. 2018; Geiping et al. 2020, section 3).

Defences against it (DLG paper, section 5): Gaussian noise on the gradient and top-k pruning
(``gradient_noise``, ``topk_prune``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedloom.audit.metrics import psnr
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree


def batch_gradient(
    model: FunctionalModel, params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor
) -> Tree:
    """The gradient a client computes on one minibatch (mean cross-entropy), detached."""
    grads, _ = model.grad_and_loss(params, {k: b.clone() for k, b in buffers.items()}, x, y)
    return {k: g.detach() for k, g in grads.items()}


# -- defences ---------------------------------------------------------------------------------
def gradient_noise(grads: Tree, sigma: float, gen: torch.Generator) -> Tree:
    """grad + N(0, sigma^2 I) on every entry (DLG paper, Figure 7: variance >= 1e-2 defeats it;
    a heuristic defence, no epsilon: nothing bounds the gradient's norm)."""
    return {
        k: g + sigma * torch.randn(g.shape, generator=gen, dtype=g.dtype) for k, g in grads.items()
    }


def topk_prune(grads: Tree, pruned: float) -> Tree:
    """Each tensor with its ``pruned`` fraction of smallest-magnitude entries set to zero (DLG
    paper, Figure 8: gradient pruning, as in Deep Gradient Compression)."""
    if not 0.0 <= pruned < 1.0:
        raise ValueError(f"pruned must be in [0, 1), got {pruned}")
    out = {}
    for k, g in grads.items():
        keep = max(1, math.ceil(round((1.0 - pruned) * g.numel(), 6)))  # 0.3 * 10 is 3
        flat = g.flatten()
        mask = torch.zeros_like(flat, dtype=torch.bool)
        mask[flat.abs().topk(keep).indices] = True
        out[k] = torch.where(mask, flat, torch.zeros_like(flat)).view_as(g)
    return out


# -- label recovery ---------------------------------------------------------------------------
def last_layer_keys(model: FunctionalModel, num_classes: int) -> tuple[str, str | None]:
    """(weight, bias or None) of the layer that produces the logits: the model's declared head
    (``FedModel.head_modules``) if it has one, else the last 2-D parameter with
    ``num_classes`` rows."""
    heads = getattr(model.module, "head_modules", ()) or ()
    keys = model.param_keys
    for head in heads:
        w, b = f"{head}.weight", f"{head}.bias"
        if w in keys:
            return w, b if b in keys else None
    shapes = dict(model.module.named_parameters())
    for k in reversed(keys):
        if shapes[k].ndim == 2 and shapes[k].shape[0] == num_classes:
            bias = k.removesuffix("weight") + "bias"
            return k, bias if bias in keys else None
    raise ValueError("no last layer with one output per class found")


def idlg_label(grads: Tree, weight: str, bias: str | None) -> int:
    """iDLG: the true class of a one-sample gradient, the only negative entry of the last
    layer's bias gradient (else of its weight gradient's row sums)."""
    signal = grads[bias] if bias is not None else grads[weight].sum(dim=1)
    return int(signal.argmin())


# -- DLG / iDLG -------------------------------------------------------------------------------
@dataclass
class Inversion:
    """A reconstruction and how it was obtained."""

    x: torch.Tensor
    label: torch.Tensor
    """Recovered labels: class indices (iDLG) or the argmax of the dummy soft label (DLG)."""
    matching_loss: float
    seconds: float
    history: list[float] = field(default_factory=list)

    def psnr(self, x: torch.Tensor, data_range: float = 1.0) -> float:
        return psnr(x, self.x, data_range)


def _soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def gradient_inversion(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    observed: Tree,
    shape: tuple[int, ...],
    num_classes: int,
    gen: torch.Generator,
    labels: torch.Tensor | None = None,
    outer_steps: int = 30,
    inner_steps: int = 20,
    support_only: bool = False,
) -> Inversion:
    """DLG (``labels`` None: the soft label is optimized too) or iDLG (``labels`` given, e.g.
    by :func:`idlg_label`): L-BFGS (lr 1, as the DLG code) on the dummy input (and label),
    ``outer_steps`` calls of ``step`` of at most ``inner_steps`` iterations each, from a
    uniform [0, 1) dummy image and N(0, 1) dummy label logits drawn from ``gen``.

    ``observed``: the gradient the attacker saw (maybe defended) for a batch of ``shape[0]``
    samples with inputs of shape ``shape[1:]``. ``support_only``: match only the entries that
    are not zero in ``observed`` (an attacker who knows that a pruned gradient's zeros carry
    no information; the DLG paper matches all entries)."""
    tick = time.perf_counter()
    keys = list(observed)
    target = [observed[k].detach() for k in keys]
    masks = [(t != 0).to(t.dtype) if support_only else None for t in target]
    fixed = {k: v.detach() for k, v in params.items()}
    dummy_x = torch.rand(shape, generator=gen).requires_grad_(True)
    dummy_v = torch.randn((shape[0], num_classes), generator=gen).requires_grad_(labels is None)
    variables = [dummy_x] + ([dummy_v] if labels is None else [])
    optimizer = torch.optim.LBFGS(variables, lr=1.0, max_iter=inner_steps, history_size=100)
    model.module.eval()  # no dropout masks, no BatchNorm statistics updates while matching

    def matching_loss() -> torch.Tensor:
        leaves = {k: fixed[k].clone().requires_grad_(k in observed) for k in fixed}
        out = functional_call(model.module, (leaves, buffers), (dummy_x,))
        if labels is None:
            loss = _soft_cross_entropy(out, dummy_v.softmax(-1))
        else:
            loss = F.cross_entropy(out, labels)
        grads = torch.autograd.grad(loss, [leaves[k] for k in keys], create_graph=True)
        total = torch.zeros((), dtype=target[0].dtype)
        for g, t, m in zip(grads, target, masks, strict=True):
            total = total + (((g - t) if m is None else (g - t) * m) ** 2).sum()
        return total

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = matching_loss()
        loss.backward()
        return loss

    history: list[float] = []
    try:
        with torch.enable_grad():
            for _ in range(outer_steps):
                loss = float(optimizer.step(closure).detach())
                history.append(loss)
                if not math.isfinite(loss) or loss < 1e-14:
                    break
    finally:
        model.module.train()
    recovered = labels if labels is not None else dummy_v.detach().argmax(-1)
    return Inversion(dummy_x.detach(), recovered, history[-1], time.perf_counter() - tick, history)


# -- analytic recovery ------------------------------------------------------------------------
def first_linear_layer(model: FunctionalModel) -> tuple[str, str] | None:
    """(weight, bias) keys of the model's first layer when it is fully connected with a bias
    (the first parameters are a 2-D weight and its 1-D bias), else None."""
    params = dict(model.module.named_parameters())
    keys = model.param_keys
    if len(keys) < 2:
        return None
    w, b = keys[0], keys[1]
    if params[w].ndim == 2 and params[b].ndim == 1 and b == w.removesuffix("weight") + "bias":
        return w, b
    return None


def analytic_recovery(grads: Tree, weight: str, bias: str) -> torch.Tensor:
    """x = dL/dW1[j, :] / dL/db1[j] at the unit j with the largest |dL/db1[j]| (the best
    conditioned), for a one-sample gradient; the flattened input."""
    gb = grads[bias].to(torch.float64)
    j = int(gb.abs().argmax())
    if gb[j] == 0:
        raise ValueError("every first-layer bias gradient is zero: nothing to divide by")
    return grads[weight][j].to(torch.float64) / gb[j]
