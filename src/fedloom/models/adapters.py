"""Houlsby adapters (Houlsby et al., ICML 2019, sec. 2.1, fig. 2): a bottleneck after the
attention output projection and after the feed-forward output projection of every layer,

    h <- h + W_up sigma(W_down h + b_down) + b_up,     W_down: d -> m, W_up: m -> d,

inserted before the residual connection and layer norm. W_up starts at zero, so every adapter
starts as the identity (some write the two names the other way round; this is the
paper's form). FedAdapter (Cai et al., MobiCom 2022) federates exactly these parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Adapter(nn.Module):
    """The trainable bottleneck of one insertion point (a submodule of the PEFT model). Plain
    parameters, no child modules: the engine's initialization resets every submodule, and
    a child ``nn.Linear`` would undo the zero up-projection."""

    def __init__(self, d: int, m: int) -> None:
        super().__init__()
        self.down_weight = nn.Parameter(torch.empty(m, d))
        self.down_bias = nn.Parameter(torch.empty(m))
        self.up_weight = nn.Parameter(torch.empty(d, m))
        self.up_bias = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W_down as nn.Linear initializes it (Kaiming-uniform, a = sqrt(5)), W_up and b_up
        zero: the identity map."""
        nn.init.kaiming_uniform_(self.down_weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.down_weight.shape[1])
        nn.init.uniform_(self.down_bias, -bound, bound)
        nn.init.zeros_(self.up_weight)
        nn.init.zeros_(self.up_bias)


class AdapterLinear(nn.Module):
    """The frozen projection ``base`` followed by an adapter whose weights are placeholders
    (``down_weight``, ``down_bias``, ``up_weight``, ``up_bias``) that the PEFT model substitutes
    on every call."""

    def __init__(self, base: nn.Linear, m: int) -> None:
        super().__init__()
        self.base = base
        d = base.weight.shape[0]
        self.register_buffer("down_weight", torch.zeros(m, d))
        self.register_buffer("down_bias", torch.zeros(m))
        self.register_buffer("up_weight", torch.zeros(d, m))
        self.register_buffer("up_bias", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)
        z = F.gelu(F.linear(h, self.down_weight, self.down_bias))
        return h + F.linear(z, self.up_weight, self.up_bias)
