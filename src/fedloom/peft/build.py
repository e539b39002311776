"""From the ``peft`` config to the model and the algorithm (the engine's and the API's only
entry into the package)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedloom.algorithms import (
    Algorithm,
    AlgorithmConfig,
    AlgorithmContext,
    build_algorithm,
    parse_algorithm_config,
)
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.models import build_model
from fedloom.models.base import FedModel
from fedloom.models.transformer import (
    PeftSpec,
    PeftTransformer,
    Streams,
    build_peft_transformer,
)
from fedloom.peft.algorithm import PeftFedAvg, PeftFedPer, PeftFedRep
from fedloom.peft.config import PeftConfig
from fedloom.peft.personal import PeftAPFL, PeftDitto, PeftPFedMe
from fedloom.peft.sharing import Pruning, StrategySharing

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


def build_run_model(config: RunConfig, input_shape: tuple[int, ...], num_outputs: int) -> FedModel:
    """The model a run of ``config`` trains: the PEFT transformer when it has a ``peft``
    section, else ``model.name`` from the model registry (what ``fedloom.run`` builds, for
    the tools that rebuild a finished run's models: ``fedloom audit``)."""
    if config.peft is not None:
        return build_peft_model(config, num_outputs)
    return build_model(config.model.name, input_shape, num_outputs, config.model.options)


def needs_peft_server(cfg: PeftConfig) -> bool:
    """Whether the strategy needs PEFT's own pieces (personal keys, ranks, residuals, the
    spherical prompt mean)."""
    if cfg.head == "personal" or cfg.rank_by_size or cfg.prune_strength > 0:
        return True
    if cfg.kind == "lora":
        return cfg.share not in PLAIN_SHARES
    if cfg.kind == "prompt":
        return cfg.personal_prompt_length > 0 or (
            cfg.prompt_length > 0 and cfg.aggregation == "spherical"
        )
    return False


ALGORITHMS: dict[str, type] = {
    "fedavg": PeftFedAvg,
    "fedper": PeftFedPer,
    "fedrep": PeftFedRep,
    "ditto": PeftDitto,
    "apfl": PeftAPFL,
    "pfedme": PeftPFedMe,
}
"""The algorithms that take a strategy with personal state (docs/peft.md, "Algorithms")."""
PRUNING = ("fedavg", "fedper", "ditto")
"""Those whose local steps take the self-pruning penalty (FedAvg's SGD program: FedPer's
and Ditto's global update are it; FedRep's phases, APFL's and pFedMe's steps are their own)."""


def make_sharing(config: RunConfig, ctx: AlgorithmContext) -> StrategySharing:
    """The strategy of the ``peft`` section on the run's model."""
    cfg = config.peft
    assert cfg is not None
    model = ctx.model
    return StrategySharing(
        model.module.spec,
        list(model.param_keys),
        list(model.buffer_keys),
        head=cfg.head,
        scale=float(getattr(model.module, "scale", 1.0)),
        seed=ctx.seed,
        population=ctx.population,
        num_clients=ctx.num_clients,
        rank_by_size=cfg.rank_by_size,
        aggregation=cfg.aggregation,
        pruning=Pruning(cfg.prune_strength, cfg.prune_decay),
    )


def build_peft_algorithm(config: RunConfig, ctx: AlgorithmContext) -> Algorithm | None:
    """The algorithm for a PEFT run, or None when the named algorithm runs as it is."""
    cfg = config.peft
    name = config.algorithm.name
    if cfg is None or name in NO_SERVER or not needs_peft_server(cfg):
        return None
    if not isinstance(ctx.model.module, PeftTransformer):
        raise ConfigError("peft: the model must be a PEFT model (model.name: minilm | tiny_bert)")
    if name not in ALGORITHMS:
        raise ConfigError(
            f"peft: {_what(cfg)} keeps state on each client or takes its own server step, "
            f"which algorithm.name: {name} has no place for; use one of "
            f"{', '.join(ALGORITHMS)}, or peft.share: both or ffa (lora), adapters, or "
            "prompts with aggregation: mean and no personal prompt (docs/peft.md)"
        )
    sharing = make_sharing(config, ctx)
    _check(config, name, sharing)
    algorithm = config.algorithm
    if not isinstance(algorithm, AlgorithmConfig):
        algorithm = parse_algorithm_config(algorithm)
    return ALGORITHMS[name](algorithm, ctx, sharing)


def _check(config: RunConfig, name: str, sharing: StrategySharing) -> None:
    """The combinations a strategy refuses (docs/peft.md, "Algorithms")."""
    cfg = config.peft
    assert cfg is not None
    options = config.algorithm.model_dump()
    if cfg.prune_strength > 0 and name not in PRUNING:
        raise ConfigError(
            f"peft.prune_strength: the self-pruning penalty enters FedAvg's local SGD "
            f"({', '.join(PRUNING)}); {name}'s local steps are its own"
        )
    inner = options.get("global_algorithm", {}).get("name", "fedavg")
    if name == "ditto" and inner != "fedavg":
        raise ConfigError(
            f"algorithm.global_algorithm: with peft: {_what(cfg)} Ditto's global algorithm is "
            f"FedAvg with the strategy; got {inner}"
        )
    if name == "apfl" and options.get("final_averaging"):
        raise ConfigError(
            f"algorithm.final_averaging: APFL's iterate averages of theta are not defined with "
            f"peft: {_what(cfg)} (kept keys, ranks, residuals); set it to false"
        )
    if name == "pfedme" and options.get("beta", 1.0) != 1.0 and sharing.exact:
        raise ConfigError(
            f"algorithm.beta: pFedMe's extrapolation (7) needs a mean; peft: {_what(cfg)} "
            "takes its own server step; set beta: 1"
        )
    if sharing.exact and (
        config.privacy.kind == "client_dp" or config.secure_aggregation.kind != "none"
    ):
        raise ConfigError(
            f"peft: {_what(cfg)} computes with each client's upload (products, norms, "
            "directions), which client-level DP and secure aggregation hide; use share a, b, "
            "both or ffa, or aggregation: mean"
        )


def _what(cfg: PeftConfig) -> str:
    if cfg.rank_by_size or cfg.prune_strength > 0:
        return "HetLoRA (rank_by_size, prune_strength)"
    if cfg.head == "personal":
        return "head: personal"
    if cfg.kind == "lora":
        return f"share: {cfg.share}"
    return "a personal prompt or the spherical prompt mean"


def make_algorithm(config: RunConfig, ctx: AlgorithmContext) -> Algorithm:
    """``build_peft_algorithm`` or, failing that, the named algorithm."""
    return build_peft_algorithm(config, ctx) or build_algorithm(config.algorithm, ctx)
