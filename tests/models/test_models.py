"""Model shapes and the body/head and normalization declarations later algorithms rely on."""

from __future__ import annotations

import math

import pytest
import torch

from fedloom.core.functional import FunctionalModel
from fedloom.core.stacked import stackable
from fedloom.errors import ConfigError
from fedloom.models import MODELS, build_model

CASES = {
    "logreg": ((1, 28, 28), 10, torch.rand(4, 1, 28, 28), ["linear.weight", "linear.bias"]),
    "mlp": ((1, 28, 28), 10, torch.rand(4, 1, 28, 28), ["fc3.weight", "fc3.bias"]),
    "cnn": ((1, 28, 28), 62, torch.rand(4, 1, 28, 28), ["fc2.weight", "fc2.bias"]),
    "cnn_bn": ((1, 8, 8), 10, torch.rand(4, 1, 8, 8), ["fc2.weight", "fc2.bias"]),
    "cnn4": ((3, 32, 32), 10, torch.rand(4, 3, 32, 32), ["fc.weight", "fc.bias"]),
    "resnet18": ((3, 8, 8), 10, torch.rand(4, 3, 8, 8), ["linear.weight", "linear.bias"]),
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


def test_cnn4_is_pfllibs_cnn():
    """PFLlib's FedAvgCNN: 5x5 convolutions without padding, FC 512, the last FC as head."""
    cifar = build_model("cnn4", (3, 32, 32), 10)
    assert sum(p.numel() for p in cifar.parameters()) == 878_538
    fmnist = build_model("cnn4", (1, 28, 28), 10)
    assert sum(p.numel() for p in fmnist.parameters()) == 582_026
    shapes = {n: tuple(p.shape) for n, p in fmnist.named_parameters()}
    assert shapes == {
        "conv1.0.weight": (32, 1, 5, 5),
        "conv1.0.bias": (32,),
        "conv2.0.weight": (64, 32, 5, 5),
        "conv2.0.bias": (64,),
        "fc1.0.weight": (512, 1024),  # 64 x 4 x 4: each unpadded conv trims 4 pixels
        "fc1.0.bias": (512,),
        "fc.weight": (10, 512),
        "fc.bias": (10,),
    }
    assert fmnist.head_keys() == ["fc.weight", "fc.bias"] and fmnist.norm_keys() == []
    assert stackable(fmnist)  # runs the vectorized executor's stacked path
    x = torch.rand(2, 1, 28, 28)
    manual = torch.max_pool2d(torch.relu(fmnist.conv1[0](x)), 2)
    manual = torch.max_pool2d(torch.relu(fmnist.conv2[0](manual)), 2)
    manual = fmnist.fc(torch.relu(fmnist.fc1[0](manual.flatten(1))))
    assert torch.allclose(fmnist(x), manual)
    with pytest.raises(ConfigError, match="16x16"):
        build_model("cnn4", (1, 15, 15), 10)


def test_cnn4_init_is_pytorchs_default_from_the_run_seed():
    """Deterministic from the run seed (the 'init' stream), and PyTorch's default ranges:
    kaiming_uniform(a=sqrt(5)) bounds weights by 1/sqrt(fan_in), as the biases."""
    model = FunctionalModel(build_model("cnn4", (1, 28, 28), 10), "classification")
    a, _ = model.initial_state(3)
    b, _ = model.initial_state(3)
    c, _ = model.initial_state(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc1.0.weight"], c["fc1.0.weight"])
    for key, fan_in in [("conv1.0", 25), ("conv2.0", 32 * 25), ("fc1.0", 1024), ("fc", 512)]:
        bound = 1 / math.sqrt(fan_in)
        for part in ("weight", "bias"):
            values = a[f"{key}.{part}"]
            assert float(values.abs().max()) <= bound
            assert float(values.abs().max()) > 0.9 * bound  # uniform over the whole range


def test_resnet18_is_the_cifar_variant():
    """3x3 stride-1 stem, no max pooling, stages of 64..512 channels at strides 1, 2, 2, 2:
    11,173,962 parameters on CIFAR-10 with BatchNorm (as pytorch-cifar's ResNet18)."""
    model = build_model("resnet18", (3, 32, 32), 10)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    assert tuple(model.conv1.weight.shape) == (64, 3, 3, 3) and model.conv1.stride == (1, 1)
    sides = {}
    for name in ("layer1", "layer2", "layer3", "layer4"):
        model.get_submodule(name).register_forward_hook(
            lambda m, i, o, name=name: sides.__setitem__(name, tuple(o.shape[1:]))
        )
    model.eval()
    model(torch.rand(1, 3, 32, 32))
    assert sides == {
        "layer1": (64, 32, 32),
        "layer2": (128, 16, 16),
        "layer3": (256, 8, 8),
        "layer4": (512, 4, 4),
    }
    bns = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 20 and model.norm_modules == tuple(bns)  # FedBN keeps them all local
    assert "layer2.0.shortcut.1.running_var" in model.norm_keys()
    assert not model.samplewise and model.head_keys() == ["linear.weight", "linear.bias"]


def test_resnet18_norm_options():
    group = build_model("resnet18", (3, 32, 32), 10, {"norm": "group"})
    norms = [m for m in group.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == 20 and {m.num_groups for m in norms} == {2}
    assert sum(p.numel() for p in group.parameters()) == 11_173_962  # same affine parameters
    assert group.samplewise and group.norm_modules == () and not stackable(group)
    none = build_model("resnet18", (3, 32, 32), 10, {"norm": "none"})
    # 2 x 4800 normalized channels fewer; only convolutions and the FC: runs stacked
    assert sum(p.numel() for p in none.parameters()) == 11_173_962 - 2 * 4800
    assert stackable(none)
    small = build_model("resnet18", (1, 8, 8), 5, {"norm": "group", "width": 8, "groups": 4})
    assert small.linear.in_features == 64 and small.bn1.num_groups == 4
    with pytest.raises(ConfigError, match=r"model\.groups: applies only with norm: group"):
        build_model("resnet18", (3, 8, 8), 10, {"groups": 4})
    with pytest.raises(ConfigError, match=r"model\.groups: must divide width"):
        build_model("resnet18", (3, 8, 8), 10, {"norm": "group", "groups": 3})
