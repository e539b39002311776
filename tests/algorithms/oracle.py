"""Closed forms for the linear least-squares ('quadratic') clients, in augmented [w, b]
coordinates, used as oracles by the algorithm tests."""

from __future__ import annotations

import torch

import fedloom
from fedloom.data import FederatedData, load_dataset
from fedloom.run_config.data import DataConfig


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


def weighted_optimum(data: FederatedData, p: torch.Tensor) -> torch.Tensor:
    """argmin sum_k p_k F_k: solves sum_k p_k H_k (w - w_k*) = 0."""
    hs = [h.double() for h in data.extras["hessians"]]
    opts = [optimum_vector(o) for o in data.extras["local_optima"]]
    lhs = sum(pk * h for pk, h in zip(p, hs, strict=True))
    rhs = sum(pk * h @ o for pk, h, o in zip(p, hs, opts, strict=True))
    return torch.linalg.solve(lhs, rhs)


def local_gd_map(h: torch.Tensor, lr: float, steps: int, mu: float = 0.0) -> torch.Tensor:
    """M with w_end - w* = M (w_t - w*) after ``steps`` local GD steps on F + mu/2||w - w_t||^2.

    M = (I - lr H - lr mu I)^S + lr mu sum_{s<S} (I - lr H - lr mu I)^s (the proximal pull
    toward w_t)."""
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    step = eye - lr * h.double() - lr * mu * eye
    power, geometric = eye.clone(), torch.zeros_like(eye)
    for _ in range(steps):
        geometric += power
        power = power @ step
    return power + lr * mu * geometric


def fedavg_fixed_point(
    data: FederatedData,
    lr: float,
    steps: int | list[int],
    mu: float = 0.0,
    scales: list[float] | None = None,
) -> torch.Tensor:
    """Fixed point of full-batch FedAvg/FedProx with ``steps`` local GD steps (one number, or
    one per client) on quadratics; with ``scales`` s_k, of the server step that weights client
    k's update by p_k s_k instead (FedNova: s_k = 1 / ||a_k||_1).

    Client k maps w_t to w_k* + M_k (w_t - w_k*); the fixed point solves
    sum_k p_k s_k (I - M_k) (w - w_k*) = 0.
    """
    p = weights(data)
    per_client = steps if isinstance(steps, list) else [steps] * len(p)
    s = scales or [1.0] * len(p)
    dim = data.extras["hessians"][0].shape[0]
    eye = torch.eye(dim, dtype=torch.float64)
    lhs = torch.zeros(dim, dim, dtype=torch.float64)
    rhs = torch.zeros(dim, dtype=torch.float64)
    for pk, sk, tau, h, opt in zip(
        p, s, per_client, data.extras["hessians"], data.extras["local_optima"], strict=True
    ):
        m = local_gd_map(h, lr, tau, mu)
        lhs += pk * sk * (eye - m)
        rhs += pk * sk * (eye - m) @ optimum_vector(opt)
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


# -- pFedMac (tests/algorithms/test_pfedmac.py) --------------------------------------------------


def pfedmac_client_map(
    h: torch.Tensor,
    opt: torch.Tensor,
    lam: float,
    lr: float,
    inner_lr: float,
    inner_steps: int,
    local_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, c) with theta_k = A theta^t + c after pFedMac's full-batch ClientUpdate on the
    quadratic F_k(x) = (x - opt)^T H (x - opt) / 2 + const (gradient H (x - opt)).

    The joint state z = [theta_k; omega] starts at [theta^t; theta^t]; one inner step is
    omega <- omega - inner_lr (H (omega - opt) - lam theta_k), one local step is ``inner_steps``
    inner steps then theta_k <- (1 - lr lam) theta_k + lr lam omega. Composed as affine maps in
    homogeneous coordinates (float64)."""
    dim = h.shape[0]
    h = h.double()
    eye = torch.eye(dim, dtype=torch.float64)
    size = 2 * dim + 1

    def affine(block: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        out = torch.eye(size, dtype=torch.float64)
        out[: 2 * dim, : 2 * dim] = block
        out[: 2 * dim, -1] = shift
        return out

    zero = torch.zeros(dim, dim, dtype=torch.float64)
    inner = affine(
        torch.cat(
            [torch.cat([eye, zero], 1), torch.cat([inner_lr * lam * eye, eye - inner_lr * h], 1)]
        ),
        torch.cat([torch.zeros(dim, dtype=torch.float64), inner_lr * h @ opt.double()]),
    )
    step = lr * lam
    outer = affine(
        torch.cat([torch.cat([(1 - step) * eye, step * eye], 1), torch.cat([zero, eye], 1)]),
        torch.zeros(2 * dim, dtype=torch.float64),
    )
    local = outer @ torch.linalg.matrix_power(inner, inner_steps)
    total = torch.linalg.matrix_power(local, local_steps)
    start = torch.cat([eye, eye, torch.zeros(1, dim, dtype=torch.float64)])  # theta -> [t; t; 0]
    a = total[:dim] @ start
    c = total[:dim, -1]
    return a, c


def pfedmac_fixed_point(
    data: FederatedData, lam: float, lr: float, inner_lr: float, inner_steps: int, local_steps: int
) -> torch.Tensor:
    """Fixed point of full-participation pFedMac (any beta, uniform weights):
    theta = mean_k (A_k theta + c_k), i.e. sum_k (I - A_k) theta = sum_k c_k."""
    dim = data.extras["hessians"][0].shape[0]
    lhs = torch.zeros(dim, dim, dtype=torch.float64)
    rhs = torch.zeros(dim, dtype=torch.float64)
    for h, opt in zip(data.extras["hessians"], data.extras["local_optima"], strict=True):
        a, c = pfedmac_client_map(
            h, optimum_vector(opt), lam, lr, inner_lr, inner_steps, local_steps
        )
        lhs += torch.eye(dim, dtype=torch.float64) - a
        rhs += c
    return torch.linalg.solve(lhs, rhs)


def pfedmac_stationary_point(data: FederatedData, lam: float) -> torch.Tensor:
    """Stationary point of problem (17), F(theta) = 1/K sum_k F_k(theta), on quadratics: the
    inner argmin is omega_k*(theta) = x_k* + lam H_k^{-1} theta, grad F_k(theta) =
    lam (theta - omega_k*(theta)), so sum_k (I - lam H_k^{-1}) theta = sum_k x_k*."""
    dim = data.extras["hessians"][0].shape[0]
    eye = torch.eye(dim, dtype=torch.float64)
    hs = [h.double() for h in data.extras["hessians"]]
    lhs = sum(eye - lam * torch.linalg.inv(h) for h in hs)
    rhs = sum(optimum_vector(o) for o in data.extras["local_optima"])
    return torch.linalg.solve(lhs, rhs)


# -- Ditto and APFL (Li et al. 2021; Deng et al. 2020; labels of algorithms/ditto.py, apfl.py) -
def ditto_personal_optima(
    data: FederatedData, theta: torch.Tensor, mu: float
) -> list[torch.Tensor]:
    """argmin_w F_k(w) + mu/2 ||w - theta||^2 for each client: (H_k + mu I) w = H_k w_k* + mu
    theta (the local optima w_k* when mu = 0)."""
    out = []
    for h, opt in zip(data.extras["hessians"], data.extras["local_optima"], strict=True):
        h = h.double()
        eye = torch.eye(h.shape[0], dtype=torch.float64)
        out.append(torch.linalg.solve(h + mu * eye, h @ optimum_vector(opt) + mu * theta))
    return out


def apfl_personal_fixed_point(
    h: torch.Tensor, opt: torch.Tensor, theta: torch.Tensor, alpha: float, lr: float, steps: int
) -> torch.Tensor:
    """omega_k at the start of a round once full-batch APFL with a fixed alpha has converged
    (the server model at theta). Within the round theta_s = w* + (I - lr H)^s (theta - w*) and
    omega_{s+1} = omega_s - lr H (alpha omega_s + (1 - alpha) theta_s - w*) = M omega_s + c_s
    with M = I - lr alpha H and c_s = lr H (w* - (1 - alpha) theta_s); the fixed point solves
    (I - M^S) omega_0 = sum_s M^(S-1-s) c_s."""
    h = h.double()
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    m = eye - lr * alpha * h
    acc, theta_s = torch.zeros_like(opt), theta.clone()
    for _ in range(steps):
        acc = m @ acc + lr * h @ (opt - (1 - alpha) * theta_s)
        theta_s = theta_s - lr * h @ (theta_s - opt)
    return torch.linalg.solve(eye - torch.linalg.matrix_power(m, steps), acc)


# -- L2SGD and pFedMe (Hanzely & Richtarik 2020; Dinh et al. 2020; test_l2sgd.py, test_pfedme.py)
def l2sgd_mixed_solution(
    data: FederatedData, lam: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(theta_bar, [theta_k]) minimizing (1), 1/K sum_k F_k(theta_k) + lam/(2K) sum_k
    ||theta_k - theta_bar||^2, theta_bar the mean: the stationarity in the theta_k alone,
    (1/K) H_k (theta_k - w_k*) + (lam/K) (theta_k - 1/K sum_j theta_j) = 0 for all k, as one
    block linear system (the 1/K factors kept as they are in (1))."""
    hs = [h.double() for h in data.extras["hessians"]]
    opts = [optimum_vector(o) for o in data.extras["local_optima"]]
    k, d = len(hs), hs[0].shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    lhs = torch.zeros(k * d, k * d, dtype=torch.float64)
    rhs = torch.zeros(k * d, dtype=torch.float64)
    for i, (h, opt) in enumerate(zip(hs, opts, strict=True)):
        rows = slice(i * d, (i + 1) * d)
        for j in range(k):
            lhs[rows, j * d : (j + 1) * d] = -lam / k**2 * eye
        lhs[rows, rows] += (h + lam * eye) / k
        rhs[rows] = h @ opt / k
    thetas = list(torch.linalg.solve(lhs, rhs).split(d))
    return sum(thetas) / k, thetas


def pfedme_mixed_solution(
    data: FederatedData, lam: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(theta, [theta_k]) minimizing (3), sum_k F_k(theta_k) + lam/2 ||theta_k - theta||^2:
    H_k (theta_k - w_k*) + lam (theta_k - theta) = 0 for every k and
    sum_k lam (theta - theta_k) = 0, as one block linear system in (theta_1..theta_K, theta)."""
    hs = [h.double() for h in data.extras["hessians"]]
    opts = [optimum_vector(o) for o in data.extras["local_optima"]]
    k, d = len(hs), hs[0].shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    lhs = torch.zeros((k + 1) * d, (k + 1) * d, dtype=torch.float64)
    rhs = torch.zeros((k + 1) * d, dtype=torch.float64)
    last = slice(k * d, (k + 1) * d)
    for i, (h, opt) in enumerate(zip(hs, opts, strict=True)):
        rows = slice(i * d, (i + 1) * d)
        lhs[rows, rows] = h + lam * eye
        lhs[rows, last] = -lam * eye
        rhs[rows] = h @ opt
        lhs[last, rows] = -lam * eye
    lhs[last, last] = k * lam * eye
    if lam == 0:  # theta is free: any point solves (3); take the mean of the theta_k
        lhs[last, :] = torch.cat([-eye] * k + [k * eye], dim=1)
    solution = torch.linalg.solve(lhs, rhs).split(d)
    return solution[-1], list(solution[:-1])
