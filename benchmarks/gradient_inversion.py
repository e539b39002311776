"""Gradient inversion on Fashion-MNIST (issue #15; DLG, Zhu et al. 2019; iDLG, Zhao et al. 2020;
docs/audit.md).

The DLG paper's LeNet-style network (sigmoid, uniform(-0.5, 0.5) weights) at initialization,
batch 1, images of the official test split. For each image the client's gradient is inverted
by iDLG (label read off the last bias gradient) and DLG (label optimized too), with L-BFGS,
30 outer steps; then under the gradient defences: Gaussian noise sigma in {1e-4 ... 0.1} and
top-k pruning of {20, 50, 90}% of each tensor's entries, the attacker matching every entry
(as the DLG paper) or only the surviving ones (knowing that zeros were pruned). Last, the
analytic recovery through the 2NN's first fully connected layer, with and without defences.
Prints one row per setting (PSNR mean, min and max over the images, labels recovered, seconds
per image) and, as its last line, the rows as JSON.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/gradient_inversion.py [--images 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

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
from fedloom.data.load import default_root
from fedloom.data.mnist import load_mnist_arrays
from fedloom.models import build_model

Tree = dict[str, torch.Tensor]


def defences(seed: int, i: int) -> dict[str, tuple[Callable[[Tree], Tree], bool]]:
    """name -> (what the defence does to the gradient, whether the attacker matches only the
    nonzero entries)."""
    out: dict[str, tuple[Callable[[Tree], Tree], bool]] = {"none": (lambda g: g, False)}
    for sigma in (1e-4, 1e-3, 1e-2, 0.1):
        gen = generator(seed, f"bench/noise/{sigma}", client=i)
        out[f"noise sigma={sigma:g}"] = (lambda g, s=sigma, r=gen: gradient_noise(g, s, r), False)
    for share in (0.2, 0.5, 0.9):
        prune = lambda g, p=share: topk_prune(g, p)  # noqa: E731
        out[f"top-k prune {share:.0%}"] = (prune, False)
        out[f"top-k prune {share:.0%}, support-only attacker"] = (prune, True)
    return out


def summarize(
    name: str, method: str, psnrs: list[float], labels: list[bool], secs: list[float]
) -> dict[str, Any]:
    finite = [p if np.isfinite(p) else 300.0 for p in psnrs]
    row = {
        "method": method,
        "defence": name,
        "psnr_mean": statistics.fmean(finite),
        "psnr_min": min(finite),
        "psnr_max": max(finite),
        "labels": f"{sum(labels)}/{len(labels)}",
        "seconds": statistics.fmean(secs),
    }
    print(
        f"| {method} | {name} | {row['psnr_mean']:.1f} | {row['psnr_min']:.1f} | "
        f"{row['psnr_max']:.1f} | {row['labels']} | {row['seconds']:.2f} |",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, _, x, y = load_mnist_arrays(default_root(), "fashion_mnist")
    xs = torch.from_numpy(x[: args.images].astype(np.float32) / 255.0).unsqueeze(1)
    ys = torch.from_numpy(y[: args.images].astype(np.int64))
    module = SigmoidLeNet((1, 28, 28), 10)
    dlg_init(module, generator(args.seed, "bench/lenet"))
    model = FunctionalModel(module, "classification")
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    weight, bias = last_layer_keys(model, 10)
    print("| method | defence | PSNR mean (dB) | min | max | labels | s/image |")
    print("|" + " --- |" * 7)
    rows = []
    grads = [
        batch_gradient(model, params, {}, xs[i : i + 1], ys[i : i + 1]) for i in range(len(xs))
    ]
    for method in ("iDLG", "DLG"):
        names = defences(args.seed, 0) if method == "iDLG" else {"none": None}
        for name in names:
            psnrs, labels, secs = [], [], []
            for i in range(len(xs)):
                defend, support = defences(args.seed, i)[name]
                observed = defend(grads[i])
                label = idlg_label(observed, weight, bias)
                inv = gradient_inversion(
                    model, params, {}, observed, (1, 1, 28, 28), 10,
                    generator(args.seed, f"bench/{method}", client=i),
                    labels=torch.tensor([label]) if method == "iDLG" else None,
                    support_only=support,
                )  # fmt: skip
                psnrs.append(inv.psnr(xs[i : i + 1]))
                labels.append(int(inv.label[0]) == int(ys[i]))
                secs.append(inv.seconds)
            rows.append(summarize(name, method, psnrs, labels, secs))
    mlp = FunctionalModel(build_model("mlp", (1, 28, 28), 10), "classification")
    mparams, mbuffers = mlp.initial_state(args.seed)
    layer = first_linear_layer(mlp)
    assert layer is not None
    for name in ("none", "noise sigma=0.0001", "noise sigma=0.1", "top-k prune 90%"):
        psnrs, secs = [], []
        for i in range(len(xs)):
            tick = time.perf_counter()
            observed = defences(args.seed, i)[name][0](
                batch_gradient(mlp, mparams, mbuffers, xs[i : i + 1], ys[i : i + 1])
            )
            psnrs.append(psnr(xs[i], analytic_recovery(observed, *layer).view_as(xs[i])))
            secs.append(time.perf_counter() - tick)
        rows.append(summarize(name, "analytic (2NN fc1)", psnrs, [], secs))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
