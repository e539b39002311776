"""The stacked step of a ReLU chain (flatten, Linear, ReLU, ..., Linear: the built-in ``logreg``
and ``mlp``) with its backward pass written out, without autograd.

For C clients' stacked weights W_l (C, out, in) and minibatches X (C, B, ...) the forward pass
is H_0 = flatten(X), Z_l = H_{l-1} W_l^T + b_l, H_l = relu(Z_l) (no ReLU after the last layer);
the loss of client c is its weighted mean loss sum_i w_ci l_ci / max(1, sum_i w_ci) (as
``FunctionalModel.weighted_loss``). Going back (Rumelhart, Hinton & Williams, 1986)::

    G_L = d loss / d Z_L     cross-entropy: (softmax(Z_L) - onehot(y)) w / sum(w)
                             squared error: 2 (Z_L - y) / m  w / sum(w)
    G_l = (G_{l+1} W_{l+1}) * [H_l > 0]
    dW_l = G_l^T H_{l-1},   db_l = sum_i G_l

so a step's gradient is the factors (G_l, H_{l-1}) of ``core/stacked.py``'s ``StackedGrad``,
written into the weights by one batched product each. Against asking autograd for G_l (the
generic stacked path) this saves the graph's bookkeeping: 0.83 ms against 1.04 ms for a step of
5 clients of the FedAvg 2NN at B = 10 on one core (benchmarks/stacked_step.py; numbers in
benchmarks/README.md, "Stacked steps"). The tests hold it to the generic path's gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tree = dict[str, torch.Tensor]
Layer = tuple[str, nn.Linear]
"""(the key prefix of a layer's parameters, the layer)."""


def relu_chain(module: nn.Module) -> list[Layer] | None:
    """The layers of ``module``'s declared ReLU chain (``FedModel.relu_chain``), in order, or
    None when it declares none or the declaration cannot be trusted: every parameter must
    belong to the named ``nn.Linear`` layers, and the class that declares the chain must be
    the one whose ``forward`` runs (a subclass with a forward of its own does not inherit it),
    and the module must hold no dropout layer."""
    names: tuple[str, ...] = getattr(module, "relu_chain", ())
    if not names:
        return None
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules()):
        return None  # the chain's forward has no dropout: autograd's path draws the masks
    mro = type(module).__mro__
    declares = next(c for c in mro if "relu_chain" in c.__dict__)
    runs = next(c for c in mro if "forward" in c.__dict__)
    if declares is not runs:
        return None
    layers = [(name, module.get_submodule(name)) for name in names]
    if not all(isinstance(layer, nn.Linear) for _, layer in layers):
        return None
    owned = sum(1 for _, layer in layers for _ in layer.parameters())
    if owned != sum(1 for _ in module.parameters()):
        return None
    return layers  # type: ignore[return-value]


def chain_forward(layers: list[Layer], params: Tree, x: torch.Tensor) -> list[torch.Tensor]:
    """[H_0, H_1, ..., H_{L-1}, Z_L]: each layer's input, then the output (C, B, out)."""
    hs = [x.reshape(x.shape[0], x.shape[1], -1)]
    for i, (name, layer) in enumerate(layers):
        weight = params[f"{name}.weight"].transpose(1, 2)
        bias = params.get(f"{name}.bias") if layer.bias is not None else None
        z = (
            torch.bmm(hs[-1], weight)
            if bias is None
            else torch.baddbmm(bias.unsqueeze(1), hs[-1], weight)
        )
        hs.append(z.relu_() if i < len(layers) - 1 else z)
    return hs


def output_gradient(
    out: torch.Tensor, y: torch.Tensor, w: torch.Tensor, task: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(G_L, losses): the gradient of the C clients' weighted mean losses at the output
    ``out`` (C, B, K), and the losses (C,), for ``FunctionalModel.per_sample_loss`` of
    ``task``."""
    share = w / w.sum(1, keepdim=True).clamp_min(1.0)  # (C, B): w_i / max(1, sum w)
    if task == "classification":
        logp = F.log_softmax(out, dim=-1)
        per = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        grad = logp.exp_()
        grad.scatter_add_(-1, y.unsqueeze(-1), torch.full_like(per, -1.0).unsqueeze(-1))
    else:
        err = (out.squeeze(-1) if y.dim() == 2 else out) - y
        dims = err.shape[2:].numel()
        per = (err**2).reshape(*err.shape[:2], -1).mean(-1)
        grad = (err * (2.0 / dims)).reshape(out.shape)
    grad.mul_(share.view(*share.shape, *([1] * (grad.dim() - 2))))
    return grad, (per * share).sum(1)


def chain_gradients(
    layers: list[Layer], params: Tree, hs: list[torch.Tensor], grad: torch.Tensor
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], Tree]:
    """The weight factors (G_l, H_{l-1}) and bias gradients from the output gradient, back
    through the chain (the module doc)."""
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    dense: Tree = {}
    for i in range(len(layers) - 1, -1, -1):
        name, layer = layers[i]
        factors[f"{name}.weight"] = (grad, hs[i])
        if layer.bias is not None:
            dense[f"{name}.bias"] = grad.sum(1)
        if i > 0:
            grad = torch.bmm(grad, params[f"{name}.weight"]).mul_(hs[i] > 0)
    return factors, dense
