"""The ``peft`` section of a run config (docs/peft.md) and the models it applies to."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedloom.core.settings import StrictModel
from fedloom.errors import ConfigError

PEFT_MODELS = ("minilm", "tiny_bert")


LORA_TARGETS = ("query", "key", "value", "attention_output", "intermediate", "output")


class PeftConfig(StrictModel):
    """Parameter-efficient fine-tuning of a frozen pretrained transformer (docs/peft.md)."""

    kind: Literal["lora", "adapter", "prompt"] = "lora"
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0.0)
    targets: list[str] = Field(default_factory=lambda: ["query", "value"], min_length=1)
    share: Literal["a", "b", "both", "ffa", "flora", "fedex"] = "a"
    """lora: which factors the server aggregates (a: FedSA-LoRA, b personal; b: A personal;
    both: FedIT; ffa: A frozen, B shared; flora: stacking; fedex: residual)."""
    rank_by_size: bool = False
    """HetLoRA with fedloom's size rule (docs/peft.md) r_k = floor(r log(n_k + 1) /
    log(n_max + 1)) (share both)."""
    prune_strength: float = Field(default=0.0, ge=0.0)
    """HetLoRA's rank self-pruning (Cho et al. 2024, sec. 3.2): lambda of the penalty on the
    norm of the rank's tail B[:, t:r_k] A[t:r_k] (0: off; share both)."""
    prune_decay: float = Field(default=0.9, gt=0.0, lt=1.0)
    """gamma: the tail starts at t = max(1, floor(gamma r_k)), a pruned client keeps t ranks."""
    head: Literal["shared", "personal"] = "shared"
    bottleneck: int = Field(default=16, ge=1)
    prompt_length: int = Field(default=8, ge=0)
    personal_prompt_length: int = Field(default=0, ge=0)
    aggregation: Literal["spherical", "mean"] = "spherical"
    """prompt: the server's rule for the shared prompt (spherical mean or weighted mean)."""

    @model_validator(mode="after")
    def _combinations(self) -> PeftConfig:
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ConfigError(
                f"peft.targets: unknown {', '.join(bad)}; allowed: {', '.join(LORA_TARGETS)}"
            )
        if self.rank_by_size and (self.kind != "lora" or self.share != "both"):
            raise ConfigError(
                "peft.rank_by_size: HetLoRA's ranks need kind: lora and share: both "
                f"(got kind: {self.kind}, share: {self.share})"
            )
        if self.prune_strength > 0 and (self.kind != "lora" or self.share != "both"):
            raise ConfigError(
                "peft.prune_strength: HetLoRA's rank self-pruning needs kind: lora and share: "
                f"both (got kind: {self.kind}, share: {self.share})"
            )
        if self.kind == "prompt" and self.prompt_length + self.personal_prompt_length == 0:
            raise ConfigError("peft.prompt_length: prompt tuning needs at least one prompt token")
        return self
