"""Closed forms for the linear least-squares ('quadratic') clients, in augmented [w, b]
coordinates, used as oracles by the algorithm tests."""

from __future__ import annotations

import torch

import fedloom
from fedloom.config import DataConfig
from fedloom.data import FederatedData, load_dataset


def quadratic_data(num_clients: int = 5, seed: int = 0, **options) -> FederatedData:
    cfg = DataConfig(name="quadratic", num_clients=num_clients, options=options)
    return load_dataset(cfg, seed)


def as_vector(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """logreg params (linear.weight (1, d), linear.bias (1,)) -> augmented (d+1,) float64."""
    return torch.cat(
        [params["linear.weight"].reshape(-1), params["linear.bias"].reshape(-1)]
    ).double()


def optimum_vector(opt: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([opt["w"].reshape(-1), opt["b"].reshape(-1)]).double()


def weights(data: FederatedData) -> torch.Tensor:
    n = torch.tensor(data.train_sizes(), dtype=torch.float64)
    return n / n.sum()


def max_curvature(data: FederatedData) -> float:
    return max(float(torch.linalg.eigvalsh(h.double()).max()) for h in data.extras["hessians"])


def fedavg_fixed_point(data: FederatedData, lr: float, steps: int, mu: float = 0.0) -> torch.Tensor:
    """Fixed point of full-batch FedAvg/FedProx with ``steps`` local GD steps on quadratics.

    Local GD on F_k + mu/2||w - w_t||^2 maps w_t to w_k* + M_k (w_t - w_k*) with
    M_k = (I - lr H_k - lr mu I)^S + lr mu sum_{s<S} (I - lr H_k - lr mu I)^s (the proximal pull
    toward w_t); averaging with p_k and solving w = sum_k p_k [w_k* + M_k (w - w_k*)] gives
    (I - sum_k p_k M_k) w = sum_k p_k (I - M_k) w_k*.
    """
    p = weights(data)
    dim = data.extras["hessians"][0].shape[0]
    eye = torch.eye(dim, dtype=torch.float64)
    lhs = torch.zeros(dim, dim, dtype=torch.float64)
    rhs = torch.zeros(dim, dtype=torch.float64)
    for pk, h, opt in zip(p, data.extras["hessians"], data.extras["local_optima"], strict=True):
        step = eye - lr * h.double() - lr * mu * eye
        power, geometric = eye.clone(), torch.zeros_like(eye)
        for _ in range(steps):
            geometric += power
            power = power @ step
        m = power + lr * mu * geometric
        lhs += pk * (eye - m)
        rhs += pk * (eye - m) @ optimum_vector(opt)
    return torch.linalg.solve(lhs, rhs)


def run(data: FederatedData, algorithm: dict, rounds: int, lr: float, **train) -> fedloom.RunResult:
    config = {
        "seed": 0,
        "model": {"name": "logreg"},
        "algorithm": algorithm,
        "train": {"rounds": rounds, "lr": lr, "batch_size": None, **train},
        "eval": {"every": rounds},
        "executor": {"kind": "sequential"},  # bitwise comparisons between runs
    }
    return fedloom.run(config, data=data, write=False, progress=False)
