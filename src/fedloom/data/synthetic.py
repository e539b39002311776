"""FedProx's Synthetic(alpha, beta) devices (natural partition only).

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, Section 5.1. For
device k: u_k ~ N(0, alpha), B_k ~ N(0, beta) (second argument a standard deviation, as in the
paper's generator), v_k ~ N(B_k, 1) per feature, W_k (60x10) and b_k ~ N(u_k, 1),
x ~ N(v_k, diag((j+1)^-1.2)), y = argmax(softmax(x W_k + b_k)). Device sizes are
int(LogNormal(4, 2)) + 50. The IID variant shares one W, b ~ N(0, 1) and uses v_k = 0.
FedProx holds out 10% per device; here ``data.test_fraction`` decides (0.1 reproduces it).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedloom.core.rng import numpy_rng
from fedloom.core.settings import FrozenModel
from fedloom.data.federated import ClientData, FederatedData
from fedloom.data.natural import add_natural_dataset, from_users
from fedloom.data.pool import num_test
from fedloom.data.spec import DataRequest

DIM = 60
CLASSES = 10
DEFAULT_CLIENTS = 30


class SyntheticOptions(FrozenModel):
    """``data.synthetic`` options."""

    alpha: float = Field(1.0, ge=0, allow_inf_nan=False)
    beta: float = Field(1.0, ge=0, allow_inf_nan=False)
    iid: bool = False


def feature_variances() -> np.ndarray:
    """The diagonal of the feature covariance: (j+1)^-1.2 for j = 0..59."""
    return np.arange(1, DIM + 1, dtype=np.float64) ** -1.2


def build(req: DataRequest) -> FederatedData:
    opt = req.options
    assert isinstance(opt, SyntheticOptions)
    n_dev = req.num_clients or DEFAULT_CLIENTS
    rng = numpy_rng(req.seed, "synthetic/devices")
    sizes = rng.lognormal(4, 2, n_dev).astype(np.int64) + 50
    u = rng.normal(0, opt.alpha, n_dev)
    big_b = rng.normal(0, opt.beta, n_dev)
    shared = numpy_rng(req.seed, "synthetic/shared_model")
    w_shared, b_shared = shared.normal(0, 1, (DIM, CLASSES)), shared.normal(0, 1, CLASSES)
    std = np.sqrt(feature_variances())
    users: dict[str, ClientData] = {}
    v_all, w_all, b_all = [], [], []
    for k in range(n_dev):
        dev = numpy_rng(req.seed, "synthetic/device", client=k)
        if opt.iid:
            v, w, b = np.zeros(DIM), w_shared, b_shared
        else:
            v = dev.normal(big_b[k], 1, DIM)
            w = dev.normal(u[k], 1, (DIM, CLASSES))
            b = dev.normal(u[k], 1, CLASSES)
        x = v + dev.standard_normal((int(sizes[k]), DIM)) * std
        y = np.argmax(x @ w + b, axis=1)
        cut = len(x) - num_test(len(x), req.test_fraction)
        xt = torch.from_numpy(x.astype(np.float32))
        yt = torch.from_numpy(y.astype(np.int64))
        users[f"device_{k}"] = ClientData(xt[:cut], yt[:cut], xt[cut:], yt[cut:])
        v_all.append(v)
        w_all.append(w)
        b_all.append(b)
    return from_users(
        "synthetic",
        users,
        input_shape=(DIM,),
        num_classes=CLASSES,
        extras={
            "alpha": opt.alpha,
            "beta": opt.beta,
            "iid": opt.iid,
            "sizes": sizes.tolist(),
            "u": torch.from_numpy(u),
            "B": torch.from_numpy(big_b),
            "v": torch.from_numpy(np.stack(v_all)),
            "W": torch.from_numpy(np.stack(w_all)),
            "b": torch.from_numpy(np.stack(b_all)),
            "feature_variances": torch.from_numpy(feature_variances()),
        },
    )


add_natural_dataset(
    "synthetic", build, default_num_clients=DEFAULT_CLIENTS, options=SyntheticOptions
)
