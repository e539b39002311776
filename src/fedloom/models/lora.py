"""LoRA (Hu et al., ICLR 2022, eq. 3): h = W0 x + b + s B A x on a frozen linear layer.

Two halves, so that only the factors are the federated model's parameters:

- :class:`LoRAFactors`, a submodule of the PEFT model: ``lora_A`` (r x in, peft's "input
  side", Kaiming-uniform as peft initializes it) and ``lora_B`` (out x r, zeros), and for the
  exact aggregations (FLoRA, FedEx-LoRA) a ``residual`` buffer (out x in) that the server
  folds into the frozen weight and sends down;
- :class:`LoRALinear`, which replaces the target ``nn.Linear`` inside the frozen backbone and
  holds placeholders of the same names; the PEFT model calls the backbone through
  ``torch.func.functional_call`` with the factors substituted, so batched (vmapped) factors
  of many clients meet one unbatched W0.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def lora_scale(r: int, alpha: float) -> float:
    """s = alpha / r (LoRA's scaling, peft's default ``lora_alpha / r``)."""
    return float(alpha) / float(r)


class LoRAFactors(nn.Module):
    """The trainable factors of one target layer (and its server-owned residual, if any)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int,
        train_a: bool = True,
        residual: bool = False,
    ) -> None:
        super().__init__()
        self.r = r
        self.train_a = train_a
        a = torch.empty(r, in_features)
        if train_a:
            self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))
        if residual:
            self.register_buffer("residual", torch.zeros(out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """peft's LoRA init: A Kaiming-uniform (a = sqrt(5)), B = 0, so B A = 0 at the start."""
        if self.train_a:
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)


class LoRALinear(nn.Module):
    """``base`` (frozen W0, b) plus s B A (+ the residual R): y = x (W0 + R)^T + b + s (x A^T) B^T.

    ``lora_A``/``lora_B``/``residual`` are placeholder buffers; the PEFT model substitutes
    its own tensors for them on every call. FFA-LoRA's frozen A (``fixed_a``) stays here as a
    constant shared by every client (Sun et al., ICLR 2024, sec. 3)."""

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        scale: float,
        fixed_a: torch.Tensor | None = None,
        residual: bool = False,
    ) -> None:
        super().__init__()
        self.base = base
        self.scale = scale
        out_f, in_f = base.weight.shape
        self.register_buffer("lora_A", torch.zeros(r, in_f) if fixed_a is None else fixed_a)
        self.register_buffer("lora_B", torch.zeros(out_f, r))
        self.has_residual = residual
        if residual:
            self.register_buffer("residual", torch.zeros(out_f, in_f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.has_residual:
            y = y + x @ self.residual.T
        return y + self.scale * ((x @ self.lora_A.T) @ self.lora_B.T)


def merged_weight(
    w0: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """W0 (+ R) + s B A: the dense weight of a client's deployed model (merged for inference)."""
    w = w0 + scale * (b @ a)
    return w if residual is None else w + residual
