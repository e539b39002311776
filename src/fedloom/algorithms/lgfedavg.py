"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally,
Act Globally: Federated Learning with Local and Global Representations", NeurIPS 2019 FL
workshop, arXiv:2001.01523, Algorithm 1): the split phi_k = [psi_k, omega],
local representations psi_k, one global head omega.

FedPer's split read the other way round (the model's ``FedModel.head_modules``):

- kept: the body (every parameter and buffer outside the head: the local representation, e.g.
  BatchNorm statistics too). Persistent client state, initialized from the initial model's
  body, never uploaded;
- shared: the head (the paper's global model on top of the local representations). The server
  keeps it, sends it and averages the uploads with the engine's aggregation rule; the upload,
  hence the communication bytes, holds only the head.

One round::

    client k: w_k <- [psi_k, omega]                    # local_start: own body, server head
              local SGD on the whole network           # the shared local solver (vectorized)
              upload omega_k, keep psi_k               # local_finish
    server:   omega <- sum_k p_k omega_k / sum_k p_k   # aggregate (head only)

with p_k = n_k / n (``weighting: samples``, FedAvg's weights, the default) or 1/K
(``uniform``: the authors' code, ``main_lg.py``, divides the sum by the number of clients; equal
on their equal-size shards).

There is no global model (the head alone cannot classify). Client k deploys [psi_k, omega]; a
client that never trained (a held-out new client, ``eval.new_clients``) deploys the initial body
with the global head, and the cold-start evaluation fine-tunes its body, the head fixed
(``adaptation_keys``: the local part), i.e. it learns its own local representation for the
global head. The sharing pattern is :mod:`fedloom.algorithms.partial`, shared with FedPer and
FedBN.

Where the authors' code differs: it starts from a FedAvg-trained model (``--load_fed``) and can
share more than the last layer (``--num_layers_keep``, 3 of the MNIST MLP's layers); here
training starts from the initial model and the shared part is the model's declared head. It
also keeps each client's best model over rounds by test accuracy, which is not done here.
Note that LG-FedAvg is sometimes summarized as shared low-level features with personal
high-level semantics; that is FedPer's and FedRep's split; the paper's LG-FedAvg is the reverse,
implemented here.
"""

from __future__ import annotations

from fedloom.algorithms.partial import HeadBodySplit


class LGFedAvg(HeadBodySplit):
    name = "lgfedavg"
    summary = "LG-FedAvg: local bodies (representations) stay on clients, the head is averaged"
    personal_head = False
