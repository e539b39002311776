"""Differential privacy (docs/privacy.md): client-level DP-FedAvg, sample-level DP-SGD and
their accounting.

Accounting goes through Opacus only (``accounting``); the mechanism that clips and noises the
clients' updates is ``client_dp``; DP-SGD's settings and per-client accounting ``sample_dp``
(its steps run in the clients, solvers/dpsgd.py).
"""

from fedloom.privacy.accounting import epsilon, noise_multiplier_for
from fedloom.privacy.client_dp import ClientLevelDP
from fedloom.privacy.sample_dp import SampleLevelDP

__all__ = ["ClientLevelDP", "SampleLevelDP", "epsilon", "noise_multiplier_for"]
