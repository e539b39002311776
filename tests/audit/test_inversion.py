"""Gradient inversion (DLG, Zhu et al. 2019; iDLG, Zhao et al. 2020; docs/audit.md): DLG/iDLG
on the sigmoid LeNet recover a Fashion-MNIST image from its gradient (PSNR >= 30 dB) unless
the gradient is noised (sigma 0.1) or 90% pruned (<= 15 dB); the analytic first-layer
recovery is exact (>= 100 dB)."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedloom.audit.images import png_bytes, png_data_uri
from fedloom.audit.inversion import (
    analytic_recovery,
    batch_gradient,
    first_linear_layer,
    gradient_inversion,
    gradient_noise,
    idlg_label,
    last_layer_keys,
    topk_prune,
)
from fedloom.audit.lenet import SigmoidLeNet, dlg_init
from fedloom.audit.metrics import psnr
from fedloom.core.functional import FunctionalModel
from fedloom.core.rng import generator
from fedloom.data.mnist import load_mnist_arrays
from fedloom.models import build_model

IMAGES = (0, 1, 2)


@pytest.fixture(scope="module")
def images(data_root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, x, y = load_mnist_arrays(data_root, "fashion_mnist")
    xs = torch.from_numpy(x[: len(IMAGES)].astype(np.float32) / 255.0).unsqueeze(1)
    return xs, torch.from_numpy(y[: len(IMAGES)].astype(np.int64))


@pytest.fixture(scope="module")
def lenet() -> tuple[FunctionalModel, dict[str, torch.Tensor]]:
    module = SigmoidLeNet((1, 28, 28), 10)
    dlg_init(module, generator(0, "audit/test/lenet"))
    model = FunctionalModel(module, "classification")
    return model, {k: v.detach().clone() for k, v in module.named_parameters()}


def _attack(model, params, observed, i, labels=None) -> float:  # type: ignore[no-untyped-def]
    gen = generator(0, "audit/test/dlg", client=i)
    return gradient_inversion(model, params, {}, observed, (1, 1, 28, 28), 10, gen, labels)


@pytest.mark.parametrize("i", IMAGES)
def test_idlg_recovers_label_and_image(lenet, images, i: int) -> None:  # type: ignore[no-untyped-def]
    model, params = lenet
    x, y = images[0][i : i + 1], images[1][i : i + 1]
    grads = batch_gradient(model, params, {}, x, y)
    label = idlg_label(grads, *last_layer_keys(model, 10))
    assert label == int(y)  # iDLG's label rule (Zhao et al. 2020)
    inv = _attack(model, params, grads, i, torch.tensor([label]))
    assert inv.psnr(x) >= 30.0


def test_dlg_recovers_soft_label_and_image(lenet, images) -> None:  # type: ignore[no-untyped-def]
    model, params = lenet
    x, y = images[0][:1], images[1][:1]
    inv = _attack(model, params, batch_gradient(model, params, {}, x, y), 0)
    assert int(inv.label[0]) == int(y) and inv.psnr(x) >= 30.0


@pytest.mark.parametrize(
    "defend",
    [
        pytest.param(lambda g: gradient_noise(g, 0.1, generator(0, "noise")), id="noise-0.1"),
        pytest.param(lambda g: topk_prune(g, 0.9), id="prune-90%"),
    ],
)
@pytest.mark.parametrize("i", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_gradient_defences_defeat_idlg(lenet, images, defend, i: int) -> None:  # type: ignore[no-untyped-def]
    model, params = lenet
    x, y = images[0][i : i + 1], images[1][i : i + 1]
    observed = defend(batch_gradient(model, params, {}, x, y))
    assert _attack(model, params, observed, i, y).psnr(x) <= 15.0  # even given the true label


def test_analytic_first_layer_recovery(images) -> None:  # type: ignore[no-untyped-def]
    module = build_model("mlp", (1, 28, 28), 10)
    model = FunctionalModel(module, "classification")
    params, buffers = model.initial_state(0)
    layer = first_linear_layer(model)
    assert layer == ("fc1.weight", "fc1.bias")
    for i in IMAGES:
        x, y = images[0][i : i + 1], images[1][i : i + 1]
        grads = batch_gradient(model, params, buffers, x, y)
        assert psnr(x, analytic_recovery(grads, *layer).view_as(x)) >= 100.0
    assert first_linear_layer(FunctionalModel(SigmoidLeNet((1, 28, 28), 10), "x")) is None


def test_topk_prune_keeps_the_largest_entries() -> None:
    g = {"a": torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 1.0, 0.3, -0.4, 2.0])}
    pruned = topk_prune(g, 0.7)["a"]
    assert torch.equal(pruned, torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, 2.0]))


def test_png_round_trip() -> None:
    img = torch.linspace(0, 1, 12).view(1, 3, 4)
    data = png_bytes(img)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    rows = zlib.decompress(idat)
    assert len(rows) == 3 * (1 + 4) and rows[0] == 0  # filter byte 0, then 4 grey pixels
    assert rows[1] == 0 and rows[-1] == 255
    assert png_data_uri(img).startswith("data:image/png;base64,")
