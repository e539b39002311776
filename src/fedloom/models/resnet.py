"""``resnet18``: the CIFAR variant of ResNet-18 (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016, Section 4.2), as in kuangliu's pytorch-cifar: a 3x3 stem convolution
of stride 1 and no max pooling (32x32 images are too small for ImageNet's 7x7 stride-2 stem),
four stages of two BasicBlocks (widths 64, 128, 256, 512; strides 1, 2, 2, 2; a 1x1
projection shortcut where the shape changes), global average pooling and one FC layer.
11,173,962 parameters on CIFAR-10 with batch normalization (docs/models.md).

Options (``model: {name: resnet18, norm: ..., width: ..., groups: ...}``):

- ``norm``: ``batch`` (the architecture's own; declared in ``norm_modules``, so FedBN keeps
  every BatchNorm local, and not sample-wise: the vectorized executor groups clients by batch
  size), ``group`` (GroupNorm, Wu & He, ECCV 2018: per-sample statistics, which Hsieh et al.,
  "The Non-IID Data Quagmire of Decentralized Machine Learning", ICML 2020, recommend under
  non-IID data) or ``none`` (the same network without normalization layers).
- ``groups``: GroupNorm's groups per layer, with ``norm: group`` only; default 2, the choice
  of Hsieh et al. (2020) that Reddi et al. ("Adaptive Federated Optimization", ICLR 2021)
  use for ResNet-18 on CIFAR-10. Must divide ``width``.
- ``width``: the first stage's channels (default 64); the stages have width x 1, 2, 4, 8.
  Smaller widths make small, fast networks of the same shape (tests).

Parameter names follow pytorch-cifar's (``conv1``, ``bn1``, ``layer1.0.conv1``, ...,
``layer2.0.shortcut.0``, ``linear``); the head is the final FC layer ``linear``. Weights
start from PyTorch's default initialization drawn from the run's ``init`` stream
(core/functional.py ``initial_state``), as pytorch-cifar's do.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator
from torch import nn

from fedloom.core.settings import FrozenModel
from fedloom.models.base import FedModel

DEFAULT_GROUPS = 2
STAGES = ((1, 1), (2, 2), (4, 2), (8, 2))
"""(width multiple, stride of the first block) of each stage; every stage has two blocks."""
BLOCKS_PER_STAGE = 2

Norm = Literal["batch", "group", "none"]


class ResNetOptions(FrozenModel):
    """``resnet18``'s options (see the module doc)."""

    norm: Norm = "batch"
    width: int = Field(default=64, ge=1)
    groups: int | None = Field(default=None, ge=1, validate_default=True)

    @field_validator("groups")
    @classmethod
    def _groups_with_group_norm(cls, value: int | None, info: ValidationInfo) -> int | None:
        norm, width = info.data.get("norm"), info.data.get("width")
        if norm != "group":
            if value is not None:
                raise ValueError(f"applies only with norm: group (got norm: {norm})")
            return None
        groups = DEFAULT_GROUPS if value is None else value
        if width is not None and width % groups:
            raise ValueError(f"must divide width ({width}); got {groups}")
        return groups


def _norm(norm: Norm, channels: int, groups: int | None) -> nn.Module:
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "group":
        assert groups is not None
        return nn.GroupNorm(groups, channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with normalization, added to the (projected) input, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Norm, groups: int | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, cout, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(norm, cout, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return torch.relu(h + self.shortcut(x))


class ResNet18(FedModel):
    head_modules = ("linear",)

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_outputs: int,
        norm: Norm = "batch",
        width: int = 64,
        groups: int | None = None,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(
                f"resnet18 needs image inputs (channels, height, width), got {input_shape}"
            )
        if norm == "group" and groups is None:
            groups = DEFAULT_GROUPS
        self.conv1 = nn.Conv2d(input_shape[0], width, 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, width, groups)
        cin = width
        for i, (multiple, stride) in enumerate(STAGES, start=1):
            cout = width * multiple
            blocks = [
                BasicBlock(cin if b == 0 else cout, cout, stride if b == 0 else 1, norm, groups)
                for b in range(BLOCKS_PER_STAGE)
            ]
            self.add_module(f"layer{i}", nn.Sequential(*blocks))
            cin = cout
        self.linear = nn.Linear(cin, num_outputs)
        # per instance: the declarations follow the norm option
        self.samplewise = norm != "batch"  # type: ignore[misc]
        self.norm_modules = tuple(  # type: ignore[misc]
            name for name, m in self.named_modules() if isinstance(m, nn.BatchNorm2d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
        return self.linear(h.mean(dim=(2, 3)))  # global average pooling
