"""Differential privacy (docs/privacy.md): client-level DP-FedAvg and its accounting.

Accounting goes through Opacus only (``accounting``); the mechanism that clips and noises the
clients' updates is ``client_dp``.
"""

from fedloom.privacy.accounting import epsilon, noise_multiplier_for
from fedloom.privacy.client_dp import ClientLevelDP

__all__ = ["ClientLevelDP", "epsilon", "noise_multiplier_for"]
