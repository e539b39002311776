"""A mixture of M copies of one classifier: the model FedEM trains and deploys
(algorithms/fedem.py; Marfoq et al., NeurIPS 2021, arXiv:2108.10252, Section 3)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from fedloom.models.base import FedModel

COMPONENTS = "components"
LOG_PI = "log_pi"
"""The buffer of the mixture weights, log pi (a client's own in its deployed model)."""


class MixtureModel(FedModel):
    """M components of ``base``'s architecture (``components.<m>.<key>``) and the mixture
    weights ``log_pi``: the output is the log of the pi-mixture of the components' class
    probabilities, log sum_m pi_m softmax(f_m(x)), so cross-entropy on it is the mixture's
    negative log-likelihood and its argmax the mixture's prediction. ``components=True``
    returns the components' logits instead, shape (M, batch, classes).

    The components are initialized in order by ``FunctionalModel.initial_state``: component
    0 as ``base`` alone would be, the others by the next draws of the same stream. The base's
    head and normalization layers are declared for every component (the vmap backend does
    not pad the minibatches of a model with normalization layers)."""

    def __init__(self, base: FedModel, m: int) -> None:
        super().__init__()
        self.components = nn.ModuleList(copy.deepcopy(base) for _ in range(m))
        self.register_buffer(LOG_PI, torch.full((m,), -math.log(m)))
        self.head_modules = tuple(
            f"{COMPONENTS}.{i}.{n}" for i in range(m) for n in base.head_modules
        )
        self.norm_modules = tuple(
            f"{COMPONENTS}.{i}.{n}" for i in range(m) for n in base.norm_modules
        )

    def forward(self, x: torch.Tensor, components: bool = False) -> torch.Tensor:
        logits = torch.stack([component(x) for component in self.components])
        if components:
            return logits
        log_p = F.log_softmax(logits, dim=-1) + getattr(self, LOG_PI)[:, None, None]
        return torch.logsumexp(log_p, dim=0)


def component_key(key: str, m: int) -> str:
    """The key of component ``m``'s copy of the base model's ``key``."""
    return f"{COMPONENTS}.{m}.{key}"
