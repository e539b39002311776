"""Algorithms by name. One module per algorithm: ``fedloom/algorithms/<name>.py``."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from fedloom.algorithms.apfl import APFL
from fedloom.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    AlgorithmContext,
    ClientResult,
    ClientTask,
)
from fedloom.algorithms.centralized import Centralized
from fedloom.algorithms.ditto import Ditto
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.fedavg_ft import FedAvgFT
from fedloom.algorithms.fedbn import FedBN
from fedloom.algorithms.fedcr import FedCR
from fedloom.algorithms.feddyn import FedDyn
from fedloom.algorithms.fedgen import FedGen
from fedloom.algorithms.fedlc import FedLC
from fedloom.algorithms.fednova import FedNova
from fedloom.algorithms.fedntd import FedNTD
from fedloom.algorithms.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from fedloom.algorithms.fedper import FedPer
from fedloom.algorithms.fedproto import FedProto
from fedloom.algorithms.fedprox import FedProx
from fedloom.algorithms.fedrep import FedRep
from fedloom.algorithms.fedsgd import FedSGD
from fedloom.algorithms.fpfc import FPFC
from fedloom.algorithms.l2sgd import L2SGD
from fedloom.algorithms.lgfedavg import LGFedAvg
from fedloom.algorithms.local import LocalOnly
from fedloom.algorithms.perfedavg import PerFedAvg
from fedloom.algorithms.pfedhn import PFedHN
from fedloom.algorithms.pfedmac import PFedMac
from fedloom.algorithms.pfedme import PFedMe
from fedloom.algorithms.reptile import Reptile
from fedloom.algorithms.scaffold import Scaffold
from fedloom.errors import ConfigError
from fedloom.registry import Registry

ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "algorithm.name")
for _cls in (
    FedSGD,
    FedAvg,
    FedProx,
    LocalOnly,
    FedAvgFT,
    Centralized,
    Scaffold,
    FedNova,
    FedDyn,
    FedBN,
    FedAvgM,
    FedAdagrad,
    FedYogi,
    FedAdam,
    FedPer,
    FedCR,
    L2SGD,
    PFedMe,
    Ditto,
    APFL,
    PFedMac,
    FPFC,
    FedRep,
    LGFedAvg,
    FedProto,
    FedNTD,
    PFedHN,
    PerFedAvg,
    Reptile,
    FedLC,
    FedGen,
):
    ALGORITHMS.add(_cls.name, _cls)


def parse_algorithm_config(raw: dict[str, Any]) -> AlgorithmConfig:
    """Validate ``algorithm:`` keys with the named algorithm's Config; errors name the key."""
    from fedloom.config import format_validation_error

    cls = ALGORITHMS.get(str(raw.get("name")))
    try:
        return cls.Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, cls.Config, prefix="algorithm.")) from None


def build_algorithm(raw: dict[str, Any], ctx: AlgorithmContext) -> Algorithm:
    config = parse_algorithm_config(raw)
    return ALGORITHMS.get(config.name)(config, ctx)


def describe(cls: type[Algorithm]) -> str:
    """One line: name, summary and hyperparameters with defaults."""
    fields = [f"{k}={f.default!r}" for k, f in cls.Config.model_fields.items() if k != "name"]
    params = f" [{', '.join(fields)}]" if fields else ""
    return f"{cls.name:<12} {cls.summary}{params}"


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmContext",
    "ClientResult",
    "ClientTask",
    "build_algorithm",
    "describe",
    "parse_algorithm_config",
]
