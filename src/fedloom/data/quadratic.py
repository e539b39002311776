"""Heterogeneous least-squares clients with closed-form optima, for oracle tests.

Client k: theta_k ~ N(theta_0, h^2 I), b_k ~ N(b_0, h^2), features x ~ N(0, diag(s_k)) with
per-client scales s_k (log-uniform in [1/4, 4]; all ones when ``feature_skew`` is off),
targets y = x theta_k + b_k + N(0, noise^2). With differing Hessians, local steps drift away
from the global optimum: the client-drift setting of Karimireddy et al., "SCAFFOLD", ICML 2020.

Extras (float64, computed on each client's TRAIN split, for y_hat = x @ w + b and
F_k = mean squared error, no 1/2 factor): ``local_optima``, ``global_optimum`` (minimiser of
sum_k n_k/n F_k = pooled least squares) and ``hessians`` (H_k = 2/n_k X_aug^T X_aug in [w, b]);
also ``true_params`` (theta_k, b_k). Per client: ``local_optima[k]`` and ``true_params[k]`` are
``{"w", "b"}`` (a :class:`ParamRows` sequence), ``hessians[k]`` a row of one (K, d+1, d+1)
tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch
from pydantic import Field, field_validator

from fedloom.core.rng import numpy_rng
from fedloom.core.settings import FrozenModel
from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.natural import add_natural_dataset
from fedloom.data.pool import num_test
from fedloom.data.spec import DataRequest
from fedloom.errors import ConfigError

DEFAULT_CLIENTS = 10
SCALE_RANGE = (0.25, 4.0)


class QuadraticOptions(FrozenModel):
    """``data.quadratic`` options."""

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
    """Least-squares minimiser (w, b) of the pooled mean squared error, in float64 (float32
    samples are widened exactly)."""
    xa = _augment(np.concatenate(xs))
    sol = np.linalg.solve(xa.T @ xa, xa.T @ np.concatenate(ys))
    return {
        "w": torch.from_numpy(sol[:-1].copy()),
        "b": torch.tensor(float(sol[-1]), dtype=torch.float64),
    }


ALIGN = 16
"""Each client's samples start at a multiple of this many float32 values (64 bytes) in the one
buffer all clients share, as a fresh allocation of their own would."""


class ParamRows(Sequence[dict[str, torch.Tensor]]):
    """One ``{"w", "b"}`` per client, read as rows of two stacked tables (a list of 100,000
    small dicts of tensors would take about 150 MB; docs/population.md)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        self.w, self.b = w, b

    def __len__(self) -> int:
        return int(self.w.shape[0])

    @overload
    def __getitem__(self, k: int) -> dict[str, torch.Tensor]: ...

    @overload
    def __getitem__(self, k: slice) -> list[dict[str, torch.Tensor]]: ...

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(len(self))[k]]
        return {"w": self.w[k], "b": self.b[k]}


CHUNK = 4096
"""Clients whose closed forms are computed in one batched call (the same values as one client
at a time: numpy's batched matmul and solve call the same BLAS and LAPACK routines per
matrix)."""


@dataclass
class _Tables:
    """The clients' samples in one buffer each (float32, as the model sees them), each client's
    block at ``at_x``/``at_y``, and their closed forms as stacked float64 tables."""

    x: np.ndarray
    y: np.ndarray
    at_x: list[int]
    at_y: list[int]
    hessians: np.ndarray
    local: np.ndarray
    true: np.ndarray

    @classmethod
    def empty(cls, sizes: list[int], dim: int) -> _Tables:
        at_x = list(itertools.accumulate((_aligned(n * dim) for n in sizes), initial=0))
        at_y = list(itertools.accumulate((_aligned(n) for n in sizes), initial=0))
        k = len(sizes)
        return cls(  # the sample buffers from torch: 64-byte aligned, as numpy's are not
            torch.zeros(at_x[-1]).numpy(),
            torch.zeros(at_y[-1]).numpy(),
            at_x,
            at_y,
            np.zeros((k, dim + 1, dim + 1)),
            np.zeros((k, dim + 1)),
            np.zeros((k, dim + 1)),
        )

    def samples(self, k: int, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """Client k's first ``n`` samples (x, y), views into the buffers."""
        x = self.x[self.at_x[k] : self.at_x[k] + n * dim].reshape(n, dim)
        return x, self.y[self.at_y[k] : self.at_y[k] + n]

    def fill_closed_forms(self, clients: list[int], n_train: int, dim: int) -> None:
        """Hessians and local optima of ``clients`` (each with ``n_train`` training samples),
        from exactly the float32 values the model sees, in float64."""
        pairs = [self.samples(k, n_train, dim) for k in clients]
        x = np.stack([p[0] for p in pairs]).astype(np.float64)
        y = np.stack([p[1] for p in pairs]).astype(np.float64)[..., None]
        xa = np.concatenate([x, np.ones((*x.shape[:2], 1))], axis=2)  # _augment, batched
        xt = xa.transpose(0, 2, 1)
        self.hessians[clients] = 2.0 / n_train * xt @ xa
        self.local[clients] = np.linalg.solve(xt @ xa, xt @ y)[..., 0]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _client(
    req: DataRequest, opt: QuadraticOptions, k: int, n: int, center: tuple[np.ndarray, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Client k's samples (float32 x, y) and its true (theta, bias), from its own stream."""
    theta0, b0 = center
    rng = numpy_rng(req.seed, "quadratic/client", client=k)
    theta = theta0 + opt.heterogeneity * rng.standard_normal(opt.dim)
    bias = b0 + opt.heterogeneity * float(rng.standard_normal())
    lo, hi = (math.log(s) for s in SCALE_RANGE)
    scales = np.exp(rng.uniform(lo, hi, opt.dim)) if opt.feature_skew else np.ones(opt.dim)
    x = rng.standard_normal((n, opt.dim)) * np.sqrt(scales)
    y = x @ theta + bias + opt.noise * rng.standard_normal(n)
    return x.astype(np.float32), y.astype(np.float32), theta, bias


def _check_sizes(opt: QuadraticOptions, sizes: list[int], test_fraction: float) -> None:
    for n in sizes:
        n_train = n - num_test(n, test_fraction)
        if n_train < opt.dim + 1:
            raise ConfigError(
                f"data.quadratic.samples: each client needs at least dim+1 = {opt.dim + 1} "
                f"training samples for a unique optimum, got {n_train} (samples={n}, "
                f"test_fraction={test_fraction})"
            )


def build(req: DataRequest) -> FederatedData:
    """Every client's samples as views into one buffer (no per-client arrays: 100,000 clients
    fit in a few hundred MB, docs/population.md); the closed forms in stacked tables, computed
    for up to CHUNK clients of one training size at a time."""
    opt = req.options
    assert isinstance(opt, QuadraticOptions)
    sizes = _client_sizes(opt, req.num_clients)
    _check_sizes(opt, sizes, req.test_fraction)
    trains = [n - num_test(n, req.test_fraction) for n in sizes]
    rng = numpy_rng(req.seed, "quadratic/center")
    center = rng.normal(0, 1, opt.dim), float(rng.normal(0, 1))
    tables = _Tables.empty(sizes, opt.dim)
    xs, ys = torch.from_numpy(tables.x), torch.from_numpy(tables.y)
    clients: list[ClientData] = []
    for k, (n, n_train) in enumerate(zip(sizes, trains, strict=True)):
        x32, y32, theta, bias = _client(req, opt, k, n, center)
        x, y = tables.samples(k, n, opt.dim)
        x[:], y[:] = x32, y32
        tables.true[k] = np.append(theta, bias)
        at_x, at_y = tables.at_x[k], tables.at_y[k]
        xt = xs[at_x : at_x + n * opt.dim].view(n, opt.dim)
        yt = ys[at_y : at_y + n]
        clients.append(ClientData(xt[:n_train], yt[:n_train], xt[n_train:], yt[n_train:]))
    by_size: dict[int, list[int]] = {}
    for k, n_train in enumerate(trains):
        by_size.setdefault(n_train, []).append(k)
    for n_train, members in by_size.items():
        for start in range(0, len(members), CHUNK):
            tables.fill_closed_forms(members[start : start + CHUNK], n_train, opt.dim)
    train = [tables.samples(k, n_train, opt.dim) for k, n_train in enumerate(trains)]
    local, true = torch.from_numpy(tables.local), torch.from_numpy(tables.true)
    return FederatedData(
        name="quadratic",
        clients=clients,
        task="regression",
        input_shape=(opt.dim,),
        num_outputs=1,
        client_names=[f"client_{k}" for k in range(len(sizes))],
        extras={
            "local_optima": ParamRows(local[:, :-1], local[:, -1]),
            "global_optimum": _solve([x for x, _ in train], [y for _, y in train]),
            "hessians": torch.from_numpy(tables.hessians),
            "true_params": ParamRows(true[:, :-1], true[:, -1]),
        },
    )


# default_num_clients None: DEFAULT_CLIENTS, or len(samples) when it is a list
add_natural_dataset("quadratic", build, options=QuadraticOptions)
