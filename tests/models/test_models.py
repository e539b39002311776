"""Model shapes and the body/head and normalization declarations later algorithms rely on."""

from __future__ import annotations

import pytest
import torch

from fedloom.errors import ConfigError
from fedloom.models import MODELS, build_model

CASES = {
    "logreg": ((1, 28, 28), 10, torch.rand(4, 1, 28, 28), ["linear.weight", "linear.bias"]),
    "mlp": ((1, 28, 28), 10, torch.rand(4, 1, 28, 28), ["fc3.weight", "fc3.bias"]),
    "cnn": ((1, 28, 28), 62, torch.rand(4, 1, 28, 28), ["fc2.weight", "fc2.bias"]),
    "cnn_bn": ((1, 8, 8), 10, torch.rand(4, 1, 8, 8), ["fc2.weight", "fc2.bias"]),
    "char_lstm": ((80,), 80, torch.randint(0, 80, (4, 80)), ["out.weight", "out.bias"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_shape_and_head_body_split(name):
    shape, outputs, x, head = CASES[name]
    model = build_model(name, shape, outputs)
    assert model(x).shape == (4, outputs)
    params = [n for n, _ in model.named_parameters()]
    assert model.head_keys() == head
    assert sorted(model.body_keys() + model.head_keys()) == sorted(params)
    assert not set(model.body_keys()) & set(model.head_keys())


def test_registry_lists_all_models():
    assert MODELS.names() == sorted(CASES)


def test_fedavg_paper_architectures():
    mlp = build_model("mlp", (1, 28, 28), 10)
    assert [p.shape for p in mlp.parameters()][::2] == [(200, 784), (200, 200), (10, 200)]
    # FedAvg CNN on 28x28: 1,663,370 parameters (5x5x32, 5x5x64, 3136x512, 512x10)
    cnn = build_model("cnn", (1, 28, 28), 10)
    assert sum(p.numel() for p in cnn.parameters()) == 1_663_370
    lstm = build_model("char_lstm", (80,), 80)
    assert (
        lstm.embed.embedding_dim == 8 and lstm.lstm.hidden_size == 256 and lstm.lstm.num_layers == 2
    )


def test_normalization_layers_are_declared():
    bn = build_model("cnn_bn", (1, 28, 28), 10)
    keys = bn.norm_keys()
    assert "bn1.weight" in keys and "bn1.running_mean" in keys and "bn2.num_batches_tracked" in keys
    assert build_model("cnn", (1, 28, 28), 10).norm_keys() == []


def test_model_that_does_not_fit_the_data_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.name"):
        build_model("cnn", (60,), 10)
    with pytest.raises(ConfigError, match=r"(?i)did you mean"):
        build_model("mpl", (60,), 10)
