"""Models by name: ``logreg``, ``mlp`` (the FedAvg paper's 2NN), ``cnn``, ``cnn_bn``,
``cnn4`` (PFLlib's CNN), ``char_lstm``."""

from __future__ import annotations

from collections.abc import Callable

from fedloom.models.base import FedModel
from fedloom.models.char_lstm import CharLSTM
from fedloom.models.cnn import CNN, CNNBatchNorm
from fedloom.models.cnn4 import CNN4
from fedloom.models.simple import MLP, LogisticRegression
from fedloom.registry import Registry

ModelBuilder = Callable[[tuple[int, ...], int], FedModel]

MODELS: Registry[ModelBuilder] = Registry("model", "model.name")
MODELS.add("logreg", LogisticRegression)
MODELS.add("mlp", MLP)
MODELS.add("cnn", CNN)
MODELS.add("cnn_bn", CNNBatchNorm)
MODELS.add("cnn4", CNN4)
MODELS.add("char_lstm", CharLSTM)


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int) -> FedModel:
    """Build a registered model for inputs of ``input_shape`` and ``num_outputs`` outputs."""
    from fedloom.errors import ConfigError

    builder = MODELS.get(name)
    try:
        return builder(tuple(input_shape), num_outputs)
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
    "build_model",
]
