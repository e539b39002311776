"""FedProto (Tan et al., AAAI 2022, "FedProto: Federated Prototype Learning across Heterogeneous
Clients", arXiv:2105.00243, Algorithm 1): a regularizer in function (representation) space
rather than parameter space.

No model parameters travel. Every client keeps its whole model (client state, initially the
common initial model); what is shared are class prototypes, the mean representation h(x) (the
head's input, :func:`fedloom.solvers.objective_sgd.single_head`) of each class. One round::

    server sends C_bar_j for the classes j that have a global prototype
    client k:  SGD from its own model on, per minibatch B,
                 L = CE(f(x), y) + lam * 1/(|B| D) sum_{n in B} ||h(x_n) - C_bar_{y_n}||^2
               (no term for a sample whose class has no global prototype yet)
               C_k^j = 1/|D_kj| sum_{x in D_kj} h(x)     # after training, eval mode, no grad,
               upload (j, C_k^j, |D_kj|) for the classes j it holds     # on all its train data
    server:    C_bar_j = sum_k |D_kj| C_k^j / sum_k |D_kj|   over the clients reporting j
               (``weighting: samples``, the paper's eq. (7) weights; ``uniform``: the plain
               1/K mean over them); a class nobody reported keeps last round's prototype

The penalty is the mean squared error of the paper's code (``nn.MSELoss``, averaged over the
batch and the D feature dimensions, samples without a prototype counting as 0), so ``lam`` is
the paper's lambda (its code's ``ld``, 1 by default).

A contrastive variant (fedloom's option, not in the paper),
sum ||f(x) - c_y||^2 - sum_{j != y} ||f(x) - c_j||^2,
whose second term is unbounded below (push h(x) to infinity). It is offered in a safe hinge
form with weight ``repel`` (default 0: the paper's FedProto), with d_j = ||h(x) - c_j||^2 / D::

    + repel * 1/|B| sum_n sum_{j != y_n, c_j known} max(0, margin + d_{y_n} - d_j)

a triplet loss that is >= 0 and vanishes once every other prototype is ``margin`` farther than
the own one.

Deployed model: the client's own model (classification by its own head); there is no global
model. A client that never trained (a held-out new client) starts from the initial model, which
the cold-start evaluation then fine-tunes (the default ``new_client_model``). Bytes: uploads
are the held classes' ids, prototypes and counts; downloads the known global prototypes and
their ids; both much smaller than the model.

The local step is a client program (:class:`FedProtoProgram`, algorithms/objective.py) that the
sequential and the vmap backends both run; the prototype table is the round's shared input, the
MSE and the hinge average over the real samples of a (padded) minibatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedloom.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.objective import Forward, ObjectiveProgram, Shared
from fedloom.algorithms.sgd_program import own_model
from fedloom.algorithms.weights import Weighting, weighting_field
from fedloom.core.functional import FunctionalModel, evaluation_mode
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone
from fedloom.solvers.local import LocalSolution
from fedloom.solvers.objective_sgd import single_head
from fedloom.solvers.program import Batch, Carry, ClientProgram, weighted_mean


class FedProtoConfig(AlgorithmConfig):
    lam: float = Field(
        default=1.0, ge=0.0, description="weight of the prototype MSE term (paper: lambda = 1)"
    )
    weighting: Weighting = weighting_field(
        "samples", "prototype averaging weights (paper eq. 7: class counts)"
    )
    repel: float = Field(
        default=0.0, ge=0.0, description="weight of the hinge term pushing other prototypes away"
    )
    margin: float = Field(
        default=1.0, ge=0.0, description="hinge margin of the repel term (per-dimension sq. dist.)"
    )


def linear_head(model: FunctionalModel, algorithm: str) -> tuple[str, int, int]:
    """(name, representation dimension, classes) of the model's head, one ``nn.Linear``
    (:func:`fedloom.solvers.objective_sgd.single_head`: a clear error otherwise)."""
    head = single_head(model, algorithm)
    linear = model.module.get_submodule(head)
    assert isinstance(linear, nn.Linear)
    return head, linear.in_features, linear.out_features


@torch.no_grad()
def class_moments(
    model: FunctionalModel,
    head: str,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    dim: int,
    batch_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(means, squares, counts): the mean head input h(x) of each class over (x, y) in
    evaluation mode, shape (num_classes, dim), the mean of ||h(x)||^2 of each class, shape
    (num_classes,) (zero for absent classes, both in float64), and the class counts
    (int64)."""
    sums = torch.zeros(num_classes, dim, dtype=torch.float64)
    squares = torch.zeros(num_classes, dtype=torch.float64)
    counts = torch.bincount(y, minlength=num_classes)
    with evaluation_mode(model.module):
        for start in range(0, int(x.shape[0]), batch_size):
            _, h = model.forward_with_features(params, buffers, x[start : start + batch_size], head)
            labels, h = y[start : start + batch_size], h.to(torch.float64)
            sums.index_add_(0, labels, h)
            squares.index_add_(0, labels, (h**2).sum(dim=1))
    per_class = counts.clamp_min(1).to(torch.float64)
    return sums / per_class[:, None], squares / per_class, counts


def class_prototypes(
    model: FunctionalModel,
    head: str,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    dim: int,
    batch_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(means, counts): the mean head input h(x) of each class over (x, y) in evaluation mode,
    shape (num_classes, dim) (zero rows for absent classes), and the class counts (int64)."""
    means, _, counts = class_moments(
        model, head, params, buffers, x, y, num_classes, dim, batch_size
    )
    return means.to(next(iter(params.values())).dtype), counts


def prototype_upload(
    model: FunctionalModel,
    head: str,
    params: Tree,
    buffers: Tree,
    task: ClientTask,
    num_classes: int,
    dim: int,
) -> Tree:
    """What a client uploads of its class prototypes (FedProto, FedPAC, FedGH): the ids of the
    classes it holds, their mean head input over its training data and their counts."""
    data = task.data
    means, counts = class_prototypes(
        model, head, params, buffers, data.x_train, data.y_train, num_classes, dim
    )
    ids = torch.nonzero(counts).flatten()
    return {"ids": ids, "mean": means[ids], "count": counts[ids]}


def prototype_table(sent: Tree, num_classes: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, known) on a client: the broadcast prototypes (``sent``: their class ids and
    means) as a (num_classes, dim) table, zero where a class has none, and the mask of the
    classes that have one."""
    table = torch.zeros(num_classes, dim, dtype=sent["mean"].dtype)
    table[sent["ids"]] = sent["mean"]
    known = torch.zeros(num_classes, dtype=torch.bool)
    known[sent["ids"]] = True
    return table, known


def aggregate_prototypes(
    ctx: AlgorithmContext,
    table: torch.Tensor,
    known: torch.Tensor,
    results: list[ClientResult],
    weighting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, known) after a round: each class's prototype is the ``ctx.aggregate`` of the
    uploads (``results[i].upload['protos']``) that hold it, weighted by class counts
    (``weighting: samples``, FedProto's eq. 7) or 1 (``uniform``); a class nobody reported
    keeps its row of ``table``."""
    table, known = table.clone(), known.clone()
    for c in range(table.shape[0]):
        means, weights = [], []
        for r in results:
            up = r.upload["protos"]
            rows = torch.nonzero(up["ids"] == c).flatten()
            if rows.numel():
                means.append({"mean": up["mean"][rows[0]]})
                count = float(up["count"][rows[0]])
                weights.append(count if weighting == "samples" else 1.0)
        if means:
            table[c] = ctx.aggregate(means, weights)["mean"]
            known[c] = True
    return table, known


def prototype_loss(
    h: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    known: torch.Tensor,
    repel: float = 0.0,
    margin: float = 1.0,
    w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pull, push) of a minibatch: the MSE of h to its class's global prototype (0 for samples
    whose class has none) and the hinge repel term (see the module doc; 0 if ``repel`` = 0),
    averaged over the real samples (``w``: the sample weights of a padded batch, None: all)."""
    has = known[y].to(h.dtype)
    diff = (h - table[y]) * has[:, None]
    pull = weighted_mean((diff**2).mean(dim=-1), w)
    push = h.new_zeros(())
    if repel > 0:
        d = ((h[:, None, :] - table[None]) ** 2).mean(-1)  # (B, C) per-dimension sq. dist.
        own = d.gather(1, y[:, None])
        classes = torch.arange(table.shape[0], device=y.device)
        others = known[None, :] & (classes[None, :] != y[:, None])
        hinge = F.relu(margin + own - d) * others.to(h.dtype) * has[:, None]
        push = weighted_mean(hinge.sum(1), w)
    return pull, push


class FedProto(Algorithm):
    name = "fedproto"
    summary = "FedProto: local models regularized to global class prototypes, only those shared"
    Config = FedProtoConfig
    capabilities = Capabilities(
        classification_only="class prototypes",
        has_global_model=False,
    )

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head, self.dim, self.num_classes = linear_head(ctx.model, self.name)

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        """The initial model (each client's starting point, never sent) and the prototype
        table with the mask of the classes that have a global prototype."""
        return {
            "initial": {"params": clone(params), "buffers": clone(buffers)},
            "protos": torch.zeros(
                self.num_classes, self.dim, dtype=next(iter(params.values())).dtype
            ),
            "known": torch.zeros(self.num_classes, dtype=torch.bool),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        ids = torch.nonzero(server["known"]).flatten()
        return {"protos": {"ids": ids, "mean": server["protos"][ids]}}

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        table, known = aggregate_prototypes(
            self.ctx, server["protos"], server["known"], results, self.config.weighting
        )
        return {**server, "protos": table, "known": known}

    # -- client ---------------------------------------------------------------------------
    def init_client_state(self, server: State, client_id: int) -> State:
        initial = server["initial"]
        return {"params": clone(initial["params"]), "buffers": clone(initial["buffers"])}

    def make_program(self) -> ClientProgram:
        return FedProtoProgram(self)  # each client trains its own model (nothing of it is shared)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """Upload the held classes' prototypes of the trained model, keep the model."""
        protos = prototype_upload(
            self.ctx.model,
            self.head,
            solved.params,
            solved.buffers,
            task,
            self.num_classes,
            self.dim,
        )
        new_state = {"params": solved.params, "buffers": solved.buffers}
        return ClientResult(
            {"protos": protos}, float(task.data.num_train), solved.loss, state=new_state
        )

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state if state is not None else self.init_client_state(server, task.client_id)
        return state["params"], state["buffers"]


class FedProtoProgram(ObjectiveProgram):
    """L = CE(f(x), y) + lam MSE(h(x), C_bar_y) + repel hinge, with the round's prototype table
    (and the mask of the classes that have one) shared by every client."""

    def __init__(self, algorithm: FedProto) -> None:
        super().__init__(
            algorithm, head=algorithm.head, start=own_model, finish=algorithm.local_finish
        )
        self.config: FedProtoConfig = algorithm.config
        self.num_classes, self.dim = algorithm.num_classes, algorithm.dim

    def regularized(self, message: Message) -> bool:
        cfg = self.config
        return message["protos"]["ids"].numel() > 0 and (cfg.lam > 0 or cfg.repel > 0)

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        table, known = prototype_table(message["protos"], self.num_classes, self.dim)
        return {**super().shared(message, task), "protos": table, "known": known}

    def objective(self, fwd: Forward, batch: Batch, carry: Carry, shared: Shared) -> torch.Tensor:
        out, h = fwd.out, fwd.h
        cfg = self.config
        assert h is not None
        pull, push = prototype_loss(
            h, batch.y, shared["protos"], shared["known"], cfg.repel, cfg.margin, batch.w
        )
        return self.data_loss(out, batch) + cfg.lam * pull + cfg.repel * push
