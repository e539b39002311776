"""FedPAC (Xu, Tong, Huang, ICLR 2023, "Personalized Federated Learning with Feature Alignment
and Classifier Collaboration", arXiv:2306.11867, Section 4, eq. 4-12, Algorithm 1): a shared
feature extractor (the body) aligned to global class centroids, and per-client classifiers
(heads) combined across clients with weights from a quadratic program.

FedRep's split and phases (:mod:`fedloom.algorithms.fedrep`: the model's
``FedModel.head_modules``; the head first, the body frozen, then the body, the head frozen),
with FedProto's centroids (:mod:`fedloom.algorithms.fedproto`) as the body's regularizer. One
round (Algorithm 1)::

    client k:  theta <- theta^t (the server's body),  phi <- phi_k (its personalized head)
               V_k, H_k <- feature statistics of theta^t on D_k                 # eq. 11-12
               repeat tau_h times:  phi <- phi - lr grad_phi CE(phi(f_theta(x)), y)   # eq. 4
               repeat tau_theta times:                                          # eq. 5-6
                   theta <- theta - lr grad_theta [CE(phi(f_theta(x)), y)
                                                   + lamda MSE(f_theta(x), c_y)]
               c_k^j <- mean of f_theta(x) over D_kj, after training, eval mode  # eq. 7
               upload theta, phi, (j, c_k^j, |D_kj|), V_k, H_k
    server:    theta^{t+1} <- sum_k n_k theta_k / sum_k n_k                     # the body
               c_j <- sum_k |D_kj| c_k^j / sum_k |D_kj|                         # eq. 8
               for every client i of the round, over the round's clients j:      # eq. 10
                   alpha_i <- argmin_{alpha in simplex} alpha^T (diag(V) + G_i) alpha,
                   G_i[j, l] = <H_i - H_j, H_i - H_l>  (Frobenius)
                   phi_i <- sum_j alpha_ij phi_j                                # its new head

The statistics (eq. 11-12, as the authors' code estimates them, on the round's received body
in eval mode): with p_c = n_kc / n_k, mu_c the class mean of the features and
E_c ||z||^2 their mean squared norm,

    H_k = [p_c mu_c]_c  (a C x d matrix),
    V_k = 1/n_k sum_c (p_c E_c ||z||^2 - p_c^2 ||mu_c||^2).

alpha^T G_i alpha = ||H_i - sum_j alpha_j H_j||^2 on the simplex (the bias term) and
sum_j alpha_j^2 V_j the variance term: the QP is convex (diag(V) >= 0, G_i a Gram matrix) and
solved exactly by :func:`fedloom.algorithms.simplex_qp.simplex_qp` (the authors use cvxpy and
then zero weights below 1e-3; the exact solver needs no threshold).

- tau_h: ``head_steps`` SGD steps or ``head_epochs`` epochs (default 1: the authors' one
  epoch for the classifier); tau_theta: the round's local steps (the engine's plan).
- ``lamda``: the alignment weight (paper and PFLlib: 1). The alignment term is FedProto's
  MSE, averaged over the batch and the d feature dimensions, 0 for a class with no centroid.
- ``weighting``: the body's averaging weights (default ``samples``, the authors' n_k).

The server keeps every training client's personalized head (a table, initially the initial
head): the combination of round t is the head client i starts from in its next round and
deploys. Bytes: down the body, the known centroids and the client's own head; up the body,
the head, the held classes' centroids and counts, and V_k, H_k. There is no global model; a
client that never trained deploys the body with its table head (the initial one) or, for a
held-out new client, the initial head, which the cold-start evaluation fine-tunes
(``adaptation_keys``, as FedPer's). Sample-level DP is refused: the uploads are computed from
raw data outside DP-SGD's steps, and so is FedRep's phased training.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field
from torch.func import vmap

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedproto import (
    aggregate_prototypes,
    class_moments,
    linear_head,
    prototype_loss,
    prototype_table,
    prototype_upload,
)
from fedloom.algorithms.fedrep import FedRep, FedRepConfig, FedRepProgram
from fedloom.algorithms.simplex_qp import simplex_qp
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.algorithms.wire import Wire
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.core.stacked import FeaturePenalty
from fedloom.solvers import Batch, Carry, ClientProgram, Ops
from fedloom.solvers.adamw import MOMENTS
from fedloom.solvers.local import LocalSolution
from fedloom.solvers.stacked_sgd import stacked_update

HEAD_EPOCHS = 1
"""tau_h when neither ``head_steps`` nor ``head_epochs`` is set: the authors' one epoch."""


class FedPACConfig(FedRepConfig):
    weighting: Weighting = weighting_field("samples", "body averaging weights (paper: n_k)")
    head_epochs: int | None = Field(
        default=None,
        ge=0,
        description=f"head-only epochs per round, before the body (default {HEAD_EPOCHS})",
    )
    lamda: float = Field(
        default=1.0, ge=0.0, description="weight of the feature-alignment MSE (paper: 1)"
    )


@torch.no_grad()
def feature_statistics(
    model: FunctionalModel,
    head: str,
    params: Tree,
    buffers: Tree,
    task: ClientTask,
    num_classes: int,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(V_k, H_k) of the client's training data (see the module doc), in float64."""
    data = task.data
    means, squares, counts = class_moments(
        model, head, params, buffers, data.x_train, data.y_train, num_classes, dim
    )
    n = counts.sum().to(torch.float64)
    p = counts.to(torch.float64) / n
    v = (p * squares - p**2 * (means**2).sum(dim=1)).sum() / n
    return v, p[:, None] * means


def combination_weights(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The (R, R) matrix whose row i is client i's optimal combination alpha_i (eq. 10) of
    the R clients with variances ``v`` (R,) and statistics ``h`` (R, C, d)."""
    flat = h.reshape(h.shape[0], -1).to(torch.float64)
    rows = []
    for i in range(flat.shape[0]):
        diff = flat[i] - flat
        rows.append(simplex_qp(torch.diag(v.to(torch.float64)) + diff @ diff.T))
    return torch.stack(rows)


class FedPAC(FedRep):
    name = "fedpac"
    summary = "FedPAC: body aligned to global centroids, heads combined by per-client QP weights"
    Config = FedPACConfig
    capabilities = FedRep.capabilities.but(
        classification_only="class centroids and feature statistics",
    )
    wire = Wire(rows={"heads": 1})
    default_head_epochs: ClassVar[int] = HEAD_EPOCHS

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head_name, self.dim, self.num_classes = linear_head(ctx.model, self.name)
        self.m = len(ctx.population) if ctx.population else ctx.num_clients
        assert sorted(ctx.population or range(self.m)) == list(range(self.m)), (
            "fedpac indexes the training clients 0 .. m-1"
        )

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        """FedPer's state, the centroid table with its mask of known classes, and every
        training client's personalized head (initially the initial head)."""
        dtype = next(iter(params.values())).dtype
        heads = {
            k: params[k].unsqueeze(0).repeat(self.m, *[1] * params[k].ndim)
            for k in self.split.local_params
        }
        return {
            **super().init_server_state(params, buffers),
            "protos": torch.zeros(self.num_classes, self.dim, dtype=dtype),
            "known": torch.zeros(self.num_classes, dtype=torch.bool),
            "heads": heads,
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        ids = torch.nonzero(server["known"]).flatten()
        return {
            **super().server_message(server, round),
            "protos": {"ids": ids, "mean": server["protos"][ids]},
            "heads": server["heads"],
        }

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        if not results:
            return server
        table, known = aggregate_prototypes(
            self.ctx, server["protos"], server["known"], results, "samples"
        )
        return {
            **server,
            **super().aggregate(server, results),
            "protos": table,
            "known": known,
            "heads": self.combine_heads(server["heads"], results),
        }

    def combine_heads(self, heads: Tree, results: list[ClientResult]) -> Tree:
        """The head table with each of the round's clients' rows set to its combination
        sum_j alpha_ij phi_j of the round's uploaded heads (eq. 10)."""
        v = torch.stack([r.upload["stats"]["v"] for r in results])
        h = torch.stack([r.upload["stats"]["h"] for r in results])
        alpha = combination_weights(v, h)
        ids = torch.tensor([r.client_id for r in results])
        table = {}
        for key, rows in heads.items():
            uploaded = torch.stack([r.upload["head"][key] for r in results]).to(torch.float64)
            combined = torch.tensordot(alpha, uploaded, dims=1).to(rows.dtype)
            table[key] = rows.index_copy(0, ids, combined)
        return table

    # -- client ---------------------------------------------------------------------------
    def own_head(self, heads: Tree, client_id: int) -> Tree:
        """Client ``client_id``'s row of the head table."""
        return {k: v[client_id] for k, v in heads.items()}

    def local_start(
        self, message: Message, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """[theta^t, phi_k]: the server's body with the client's personalized head."""
        assert state is not None
        head = self.own_head(message["heads"], task.client_id)
        return (
            self.split.merge(message["params"], head),
            self.split.merge(message["buffers"], state["buffers"], params=False),
        )

    def make_program(self) -> ClientProgram:
        return FedPACProgram(self)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """Upload the body, the trained head, the centroids of the trained body and the
        statistics of the received one; keep the head and the step count."""
        result = super().local_finish(message, state, task, solved)
        model, args = self.ctx.model, (task, self.num_classes, self.dim)
        start_params, start_buffers = self.local_start(message, state, task)
        v, h = feature_statistics(model, self.head_name, start_params, start_buffers, *args)
        dtype = next(iter(solved.params.values())).dtype
        result.upload = {
            **result.upload,
            "head": {k: solved.params[k] for k in self.split.local_params},
            "protos": prototype_upload(model, self.head_name, solved.params, solved.buffers, *args),
            "stats": {"v": v.to(dtype), "h": h.to(dtype)},
        }
        return result

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """[theta, phi_k] with the client's head from the table; FedPer's deployment for a
        client outside it (a held-out new client) or that never trained."""
        cid = task.client_id
        state = state if state is not None else self.init_client_state(server, cid)
        if cid >= self.m or int(state["steps"]) == 0:
            return super().deployed_model(server, state, task)
        params = self.split.merge(server["params"], self.own_head(server["heads"], cid))
        buffers = self.split.merge(server["buffers"], state["buffers"], params=False)
        return params, buffers


class FedPACProgram(FedRepProgram):
    """FedRep's two phases, the body's on CE + lamda MSE(f(x), c_y) with the round's centroid
    table shared by every client (plain FedRep body steps while no centroid is known or
    lamda = 0)."""

    def __init__(self, algorithm: FedPAC) -> None:
        super().__init__(algorithm)
        self.head_name = algorithm.head_name
        self.num_classes, self.dim = algorithm.num_classes, algorithm.dim
        self.lamda = algorithm.config.lamda

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        sent = message["protos"]
        table, known = prototype_table(sent, self.num_classes, self.dim)
        aligned = self.lamda > 0 and sent["ids"].numel() > 0
        return {
            **super().shared(message, task),
            "protos": table,
            "known": known,
            "aligned": aligned,
        }

    def body_step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """theta <- theta - lr grad_theta [CE + lamda MSE(f_theta(x), c_y)], the head frozen."""
        if not shared["aligned"]:
            return super().body_step(ops, carry, batches, shared)
        (batch,) = batches
        params = carry["params"]
        fixed = {k: v for k, v in params.items() if k not in self.body_keys}

        # the buffers go in as an argument: BatchNorm's forward updates them in place
        def loss(body: Tree, buffers: Tree) -> torch.Tensor:
            out, h = self.model.forward_with_features(
                {**fixed, **body}, buffers, batch.x, self.head_name
            )
            pull, _ = prototype_loss(h, batch.y, shared["protos"], shared["known"], w=batch.w)
            return batch.mean(self.model.per_sample_loss(out, batch.y)) + self.lamda * pull

        body = {k: params[k] for k in self.body_keys}
        grads, value = ops.value_and_grad(loss, body, carry["buffers"])
        return self.phase_descend("body", ops, carry, grads, shared["lr"]), {"loss": value}

    def stacked_body_step(
        self, carry: Carry, batches: tuple[Batch, ...], shared: dict
    ) -> tuple[Carry, dict]:
        """``body_step`` for a whole chunk on a stackable model (core/stacked.py), in place:
        the alignment term on the head's input features of each client's minibatch."""
        if not shared["aligned"]:
            return super().stacked_body_step(carry, batches, shared)
        table, known, lamda = shared["protos"], shared["known"], self.lamda

        def one_client(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return lamda * prototype_loss(h, y, table, known, w=w)[0]

        penalty = FeaturePenalty(self.head_name, vmap(one_client))
        lr, moments = float(shared["lr"]), carry.get(f"{MOMENTS}/body")
        return stacked_update(
            self.model, carry, batches[0], lr, self.body_keys, self.optimizer, moments, penalty
        )
