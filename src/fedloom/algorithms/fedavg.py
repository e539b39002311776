"""FedAvg (McMahan et al., AISTATS 2017, arXiv:1602.05629, Algorithm 1).

One round, line by line::

    Ct <- sample max(rho*K, 1) clients            # engine (train.clients_per_round)
    wk <- local_train(w, Dk, S, M, eta)            # make_program: local SGD from w
    upload wk                                      # upload_model: the upload is the local model
    alpha_k <- nk / sum_{j in Ct} nj               # ClientResult.weight = n_k
    w <- weighted_average({wk}, {alpha_k})         # aggregate
"""

from __future__ import annotations

from fedloom.algorithms.base import Algorithm, aggregate_models
from fedloom.algorithms.capabilities import Capabilities
from fedloom.core.protocol import ClientResult, State


class FedAvg(Algorithm):
    name = "fedavg"
    summary = "FedAvg: local SGD, sample-size weighted model averaging (McMahan et al., 2017)"
    capabilities = Capabilities(
        averages_client_models=True,
        supports_sample_dp=True,
    )

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        return aggregate_models(self.ctx, results)
