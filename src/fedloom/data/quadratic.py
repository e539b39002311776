"""Heterogeneous least-squares clients with closed-form optima, for oracle tests.

Client k: theta_k ~ N(theta_0, h^2 I), b_k ~ N(b_0, h^2), features x ~ N(0, diag(s_k)) with
per-client scales s_k (log-uniform in [1/4, 4]; all ones when ``feature_skew`` is off),
targets y = x theta_k + b_k + N(0, noise^2). With differing Hessians, local steps drift away
from the global optimum: the client-drift setting of Karimireddy et al., "SCAFFOLD", ICML 2020.

Extras (float64, computed on each client's TRAIN split, for y_hat = x @ w + b and
F_k = mean squared error, no 1/2 factor): ``local_optima``, ``global_optimum`` (minimiser of
sum_k n_k/n F_k = pooled least squares) and ``hessians`` (H_k = 2/n_k X_aug^T X_aug in [w, b]).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedloom.core.rng import numpy_rng
from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.pool import num_test
from fedloom.data.spec import DATASETS, NATURAL, DataRequest, DatasetSpec
from fedloom.errors import ConfigError

DEFAULT_CLIENTS = 10
SCALE_RANGE = (0.25, 4.0)


class QuadraticOptions(BaseModel):
    """``data.quadratic`` options."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dim: int = Field(5, ge=1)
    samples: int | list[int] = 50
    heterogeneity: float = Field(1.0, ge=0, allow_inf_nan=False)
    noise: float = Field(0.1, ge=0, allow_inf_nan=False)
    feature_skew: bool = True

    @field_validator("samples")
    @classmethod
    def _at_least_two(cls, value: int | list[int]) -> int | list[int]:
        sizes = value if isinstance(value, list) else [value]
        if not sizes or min(sizes) < 2:
            raise ValueError(f"must be >= 2 (one integer, or one per client), got {value!r}")
        return value


def _client_sizes(opt: QuadraticOptions, num_clients: int | None) -> list[int]:
    if isinstance(opt.samples, int):
        return [opt.samples] * (num_clients or DEFAULT_CLIENTS)
    if num_clients is not None and num_clients != len(opt.samples):
        raise ConfigError(
            f"data.quadratic.samples: {len(opt.samples)} per-client sizes but "
            f"data.num_clients is {num_clients}"
        )
    return list(opt.samples)


def _augment(x: np.ndarray) -> np.ndarray:
    return np.hstack([x, np.ones((len(x), 1))])


def _solve(xs: list[np.ndarray], ys: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Least-squares minimiser (w, b) of the pooled mean squared error."""
    xa = _augment(np.concatenate(xs))
    sol = np.linalg.solve(xa.T @ xa, xa.T @ np.concatenate(ys))
    return {
        "w": torch.from_numpy(sol[:-1].copy()),
        "b": torch.tensor(float(sol[-1]), dtype=torch.float64),
    }


def build(req: DataRequest) -> FederatedData:
    opt = req.options
    assert isinstance(opt, QuadraticOptions)
    sizes = _client_sizes(opt, req.num_clients)
    n_clients = len(sizes)
    for n in sizes:
        n_train = n - num_test(n, req.test_fraction)
        if n_train < opt.dim + 1:
            raise ConfigError(
                f"data.quadratic.samples: each client needs at least dim+1 = {opt.dim + 1} "
                f"training samples for a unique optimum, got {n_train} (samples={n}, "
                f"test_fraction={req.test_fraction})"
            )
    center = numpy_rng(req.seed, "quadratic/center")
    theta0, b0 = center.normal(0, 1, opt.dim), float(center.normal(0, 1))
    clients: list[ClientData] = []
    train_x, train_y, local, hessians, thetas = [], [], [], [], []
    for k, n in enumerate(sizes):
        n_train = n - num_test(n, req.test_fraction)
        rng = numpy_rng(req.seed, "quadratic/client", client=k)
        theta = theta0 + opt.heterogeneity * rng.standard_normal(opt.dim)
        bias = b0 + opt.heterogeneity * float(rng.standard_normal())
        lo, hi = (math.log(s) for s in SCALE_RANGE)
        scales = np.exp(rng.uniform(lo, hi, opt.dim)) if opt.feature_skew else np.ones(opt.dim)
        x = rng.standard_normal((n, opt.dim)) * np.sqrt(scales)
        y = x @ theta + bias + opt.noise * rng.standard_normal(n)
        x32, y32 = x.astype(np.float32), y.astype(np.float32)
        # Closed forms use exactly the float32 values the model sees, in float64.
        xtr, ytr = x32[:n_train].astype(np.float64), y32[:n_train].astype(np.float64)
        train_x.append(xtr)
        train_y.append(ytr)
        local.append(_solve([xtr], [ytr]))
        xa = _augment(xtr)
        hessians.append(torch.from_numpy(2.0 / n_train * xa.T @ xa))
        thetas.append({"w": torch.from_numpy(theta), "b": torch.tensor(bias, dtype=torch.float64)})
        xt, yt = torch.from_numpy(x32), torch.from_numpy(y32)
        clients.append(ClientData(xt[:n_train], yt[:n_train], xt[n_train:], yt[n_train:]))
    return FederatedData(
        name="quadratic",
        clients=clients,
        task="regression",
        input_shape=(opt.dim,),
        num_outputs=1,
        client_names=[f"client_{k}" for k in range(n_clients)],
        extras={
            "local_optima": local,
            "global_optimum": _solve(train_x, train_y),
            "hessians": hessians,
            "true_params": thetas,
        },
    )


DATASETS.add(
    "quadratic",
    DatasetSpec(
        name="quadratic",
        build=build,
        partitions=NATURAL,
        default_partition="natural",
        default_num_clients=None,  # DEFAULT_CLIENTS, or len(samples) when it is a list
        options=QuadraticOptions,
    ),
)
