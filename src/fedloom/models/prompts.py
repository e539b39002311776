"""Prompt tuning (Lester et al., EMNLP 2021; FedPrompt, Zhao et al. 2022; PromptFL, Guo et al.
2022): L trainable vectors prepended to the word embeddings of the frozen model. The global
prompt P_g is federated, the personal prompt P_k stays on client k; the input is
[P_g; P_k; embed(tokens)] with the attention mask extended by ones (BERT adds its position
embeddings itself)."""

from __future__ import annotations

import torch
from torch import nn


class Prompts(nn.Module):
    """``shared`` (L_g x d) and ``personal`` (L_p x d) prompt tokens; absent when L is 0."""

    def __init__(self, d: int, shared_length: int, personal_length: int, std: float) -> None:
        super().__init__()
        self.std = std
        if shared_length:
            self.shared = nn.Parameter(torch.empty(shared_length, d))
        if personal_length:
            self.personal = nn.Parameter(torch.empty(personal_length, d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, std^2) with std the word embeddings' standard deviation (their scale)."""
        for p in self.parameters(recurse=False):
            nn.init.normal_(p, std=self.std)

    def tokens(self) -> list[torch.Tensor]:
        return [
            p
            for p in (getattr(self, "shared", None), getattr(self, "personal", None))
            if p is not None
        ]
