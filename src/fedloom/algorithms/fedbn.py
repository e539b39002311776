"""FedBN (Li et al., ICLR 2021, arXiv:2102.07623, Algorithm 1): federated
learning on non-IID features via local batch normalization, each client keeping its own BN
state under feature shift.

What is shared and what is kept (the model's ``norm_keys()`` tell them apart):

- shared: every parameter outside the normalization layers (and any buffer outside them). The
  server keeps them, sends them, and averages the uploads by sample size with the engine's
  aggregation rule, exactly as FedAvg does;
- kept: each client's normalization parameters (BatchNorm weight and bias) and running
  statistics (running_mean, running_var, num_batches_tracked). They are persistent client
  state, initialized from the server's initial model, never uploaded (the upload, hence the
  communication bytes, holds only the shared part) and never aggregated.

One round (the paper's Algorithm 1)::

    client k: local SGD from (shared w, own BN_k)     # local_start + the engine's local SGD
              upload the non-BN part, keep new BN_k   # local_finish
    server:   w <- sum_k n_k w_k / sum_k n_k           # aggregate (non-BN only)

There is no single global model (``Capabilities.has_global_model``): client k deploys the shared
parameters with its own BN state. A client that never trained (a held-out new client,
``eval.new_clients``, or one never sampled) has no BN history; it deploys the shared parameters
with the initial BN affine parameters and running statistics calibrated on its own training
data (a new client needs its BN statistics calibrated first), see
:mod:`fedloom.solvers.norm_calibration`. The sharing pattern itself is
:mod:`fedloom.algorithms.partial`, shared with FedPer and FedCR.
"""

from __future__ import annotations

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.partial import PartialSharing
from fedloom.core.protocol import ClientTask
from fedloom.core.pytree import Tree
from fedloom.errors import ConfigError
from fedloom.solvers.norm_calibration import calibrate_norm_stats


class FedBN(PartialSharing):
    name = "fedbn"
    summary = "FedBN: FedAvg on non-BN parameters, BN parameters and statistics stay local"
    capabilities = PartialSharing.capabilities.but(
        supports_sample_dp=False,  # its point is BatchNorm, whose batch statistics mix samples
    )

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        module = ctx.model.module
        norm_keys = getattr(module, "norm_keys", None)
        self.norm = set(norm_keys()) if callable(norm_keys) else set()
        if not self.norm:
            raise ConfigError(
                f"algorithm.name: fedbn needs a model with normalization layers (declared by "
                f"FedModel.norm_modules), and {type(module).__name__} has none; use e.g. "
                "model.name: cnn_bn"
            )
        super().__init__(config, ctx)
        self.norm_layers = list(getattr(module, "norm_modules", ()))

    def local_keys(self) -> set[str]:
        return self.norm

    def fresh_client_model(
        self, params: Tree, buffers: Tree, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """Shared parameters, initial BN affine parameters, and BN running statistics
        calibrated on the client's own training data."""
        buffers = calibrate_norm_stats(
            self.ctx.model.module,
            params,
            buffers,
            task.data.x_train,
            self.ctx.batch_size,
            self.norm_layers,
        )
        return params, buffers
