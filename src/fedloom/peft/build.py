"""From the ``peft`` config to the model and the algorithm (the engine's and the API's only
entry into the package)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedloom.algorithms import Algorithm, AlgorithmContext, build_algorithm
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.models.transformer import (
    PeftSpec,
    PeftTransformer,
    Streams,
    build_peft_transformer,
)
from fedloom.peft.algorithm import PeftFedAvg
from fedloom.peft.config import PeftConfig

if TYPE_CHECKING:
    from fedloom.config import RunConfig

PLAIN_SHARES = ("both", "ffa")
"""Strategies under which every trainable key is shared and the server averages: any
algorithm then runs over the PEFT parameters unchanged."""
NO_SERVER = ("local", "centralized")


def peft_spec(cfg: PeftConfig) -> PeftSpec:
    return PeftSpec(
        kind=cfg.kind,
        r=cfg.r,
        alpha=cfg.alpha,
        targets=tuple(cfg.targets),
        share=cfg.share,
        residual=cfg.kind == "lora" and cfg.share in ("flora", "fedex"),
        bottleneck=cfg.bottleneck,
        prompt_length=cfg.prompt_length,
        personal_prompt_length=cfg.personal_prompt_length,
    )


def streams(seed: int) -> Streams:
    """The model's random streams: purpose -> generator(seed, purpose) (core/rng.py)."""

    def stream(purpose: str) -> torch.Generator:
        return generator(seed, purpose)

    return stream


def build_peft_model(config: RunConfig, num_outputs: int) -> PeftTransformer:
    """``model.name`` (minilm | tiny_bert) with the ``peft`` layers, seeded by the run seed."""
    assert config.peft is not None
    return build_peft_transformer(
        config.model.name, num_outputs, peft_spec(config.peft), streams(config.seed)
    )


def needs_peft_server(cfg: PeftConfig) -> bool:
    """Whether the strategy needs PEFT's own server step (personal keys, ranks, residuals,
    the spherical prompt mean)."""
    if cfg.head == "personal" or cfg.rank_by_size:
        return True
    if cfg.kind == "lora":
        return cfg.share not in PLAIN_SHARES
    if cfg.kind == "prompt":
        return cfg.personal_prompt_length > 0 or (
            cfg.prompt_length > 0 and cfg.aggregation == "spherical"
        )
    return False


def build_peft_algorithm(config: RunConfig, ctx: AlgorithmContext) -> Algorithm | None:
    """The algorithm for a PEFT run, or None when the named algorithm runs as it is."""
    cfg = config.peft
    name = config.algorithm.name
    if cfg is None or name in NO_SERVER or not needs_peft_server(cfg):
        return None
    if not isinstance(ctx.model.module, PeftTransformer):
        raise ConfigError("peft: the model must be a PEFT model (model.name: minilm | tiny_bert)")
    if name != "fedavg":
        raise ConfigError(
            f"peft: {_what(cfg)} needs PEFT's own server step, which runs with algorithm.name: "
            f"fedavg; {name} personalizes in its own way: use it with peft.share: both or ffa "
            "(lora), adapters, or prompts with aggregation: mean and no personal prompt"
        )
    exact = (
        cfg.rank_by_size
        or (cfg.kind == "lora" and cfg.share in ("flora", "fedex"))
        or (cfg.kind == "prompt" and cfg.aggregation == "spherical")
    )
    if exact and (config.privacy.kind == "client_dp" or config.secure_aggregation.kind != "none"):
        raise ConfigError(
            f"peft: {_what(cfg)} computes with each client's upload (products, norms, "
            "directions), which client-level DP and secure aggregation hide; use share a, b, "
            "both or ffa, or aggregation: mean"
        )
    return PeftFedAvg(
        config.algorithm, ctx, ctx.model.module.spec, cfg.head, cfg.rank_by_size, cfg.aggregation
    )


def _what(cfg: PeftConfig) -> str:
    if cfg.rank_by_size:
        return "rank_by_size (HetLoRA)"
    if cfg.head == "personal":
        return "head: personal"
    if cfg.kind == "lora":
        return f"share: {cfg.share}"
    return "a personal prompt or the spherical prompt mean"


def make_algorithm(config: RunConfig, ctx: AlgorithmContext) -> Algorithm:
    """``build_peft_algorithm`` or, failing that, the named algorithm."""
    return build_peft_algorithm(config, ctx) or build_algorithm(config.algorithm, ctx)
