"""Models by name: ``logreg``, ``mlp`` (the FedAvg paper's 2NN), ``cnn``, ``cnn_bn``,
``cnn4`` (PFLlib's CNN), ``resnet18`` (the CIFAR variant), ``char_lstm`` (docs/models.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from fedloom.models.base import FedModel
from fedloom.models.char_lstm import CharLSTM
from fedloom.models.cnn import CNN, CNNBatchNorm
from fedloom.models.cnn4 import CNN4
from fedloom.models.resnet import ResNet18, ResNetOptions
from fedloom.models.simple import MLP, LogisticRegression
from fedloom.models.spec import ModelSpec, NoOptions
from fedloom.registry import Registry

MODELS: Registry[ModelSpec] = Registry("model", "model.name")
MODELS.add("logreg", ModelSpec(LogisticRegression))
MODELS.add("mlp", ModelSpec(MLP))
MODELS.add("cnn", ModelSpec(CNN))
MODELS.add("cnn_bn", ModelSpec(CNNBatchNorm))
MODELS.add("cnn4", ModelSpec(CNN4))
MODELS.add("resnet18", ModelSpec(ResNet18, ResNetOptions))
MODELS.add("char_lstm", ModelSpec(CharLSTM))


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_outputs: int,
    options: Mapping[str, Any] | None = None,
) -> FedModel:
    """Build a registered model for inputs of ``input_shape`` and ``num_outputs`` outputs,
    with its ``options`` (the ``model`` section's keys besides ``name``; default: none)."""
    from fedloom.errors import ConfigError

    spec = MODELS.get(name)
    try:
        resolved = spec.resolved(dict(options or {}))
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"model.{key}: {msg} (model {name})") from None
    try:
        return spec.build(tuple(input_shape), num_outputs, **resolved)
    except ValueError as err:
        raise ConfigError(f"model.name: {name} does not fit this data: {err}") from None


__all__ = [
    "CNN",
    "CNN4",
    "MLP",
    "MODELS",
    "CNNBatchNorm",
    "CharLSTM",
    "FedModel",
    "LogisticRegression",
    "ModelSpec",
    "NoOptions",
    "ResNet18",
    "build_model",
]
