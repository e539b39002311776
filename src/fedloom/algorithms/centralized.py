"""Centralized training on the pooled data of all clients: the upper reference of every
algorithm card's baselines. One round is the configured local budget (epochs or steps) of SGD
over the union of the clients' training sets; nothing is communicated."""

from __future__ import annotations

from fedloom.algorithms.fedavg import FedAvg


class Centralized(FedAvg):
    """FedAvg's update with a single participant holding all data (aggregation is identity)."""

    name = "centralized"
    summary = "Centralized SGD on the pooled training data (upper reference)"
    capabilities = FedAvg.capabilities.but(communicates=False, pooled=True)
