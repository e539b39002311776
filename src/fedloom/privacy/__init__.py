"""Differential privacy (docs/privacy.md): client-level DP-FedAvg, sample-level DP-SGD,
distributed DP with the distributed discrete Gaussian, and their accounting.

Accounting goes through Opacus only (``accounting``); the mechanism that clips and noises the
clients' updates is ``client_dp``; DP-SGD's settings and per-client accounting ``sample_dp``
(its steps run in the clients, solvers/dpsgd.py); the distributed discrete Gaussian
``distributed_dp`` (its encoding ``ddg_codec``, sampler ``discrete_gaussian``, rotation
``rotation`` and accounting ``ddg_accounting``).
"""

from fedloom.privacy.accounting import epsilon, noise_multiplier_for
from fedloom.privacy.client_dp import ClientLevelDP
from fedloom.privacy.distributed_dp import DistributedDP
from fedloom.privacy.sample_dp import SampleLevelDP

__all__ = ["ClientLevelDP", "DistributedDP", "SampleLevelDP", "epsilon", "noise_multiplier_for"]
