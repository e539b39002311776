"""FedGH (Yi, Wang, Liu, Yu, ACM MM 2023, "FedGH: Heterogeneous Federated Learning with
Generalized Global Header", arXiv:2303.13137, Algorithm 1): the clients keep their feature
extractors (bodies) and share one generalized global header (the head, the final linear
layer), which the server trains on the clients' class-averaged representations.

The split is LG-FedAvg's (:class:`fedloom.algorithms.partial.HeadBodySplit` with the body
local, the model's ``FedModel.head_modules``); what travels up is no model but class
prototypes (FedProto's, :func:`fedloom.algorithms.fedproto.prototype_upload`). One round::

    client k:  w <- [own body phi_k, global header H]       # the header replaces its own
               local SGD on CE(f(x; w), y), the whole model, on the engine's plan
               keep phi_k; upload (j, r_k^j) for the classes j it holds, with
               r_k^j = 1/|D_kj| sum_{x in D_kj} phi_k(x)     # after training, eval mode
    server:    H <- SGD on 1/|B| sum_{(r, j) in B} CE(H(r), j)
               over the round's pairs (r_k^j, j), ``server_epochs`` passes of shuffled
               minibatches of ``server_batch_size`` at step ``server_lr``

The server's minibatches come from the stream (seed, 'fedgh/header', round). Defaults: one
pass a round in ``train.batch_size`` minibatches (as the public PFLlib implementation trains
the header), at ``train.lr`` unless ``server_lr`` is set (PFLlib's ``server_learning_rate``).

Deployed model: [phi_k, H]; a client that never trained gets the initial body with H (the
cold-start evaluation fine-tunes the body, ``adaptation_keys``). Bytes: down the header,
up the prototypes, class ids and counts. The homogeneous models of fedloom stand in for the
paper's heterogeneous bodies: only their representation dimension must match the header's.

The upload is computed from the client's raw data outside DP-SGD's steps, so sample-level DP
is refused (``supports_sample_dp``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedproto import linear_head, prototype_upload
from fedloom.algorithms.partial import HeadBodySplit
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.solvers import ClientProgram
from fedloom.solvers.local import LocalSolution


class FedGHConfig(AlgorithmConfig):
    server_lr: float | None = Field(
        default=None, gt=0, description="SGD step of the header's training (default: train.lr)"
    )
    server_epochs: int = Field(
        default=1, ge=0, description="passes over the round's representations (PFLlib: 1)"
    )
    server_batch_size: int | None = Field(
        default=None, ge=1, description="header minibatch size (default: train.batch_size)"
    )


class FedGH(HeadBodySplit):
    name = "fedgh"
    summary = "FedGH: local bodies, a global header trained by the server on class prototypes"
    Config = FedGHConfig
    capabilities = HeadBodySplit.capabilities.but(
        classification_only="class-averaged representations",
        supports_sample_dp=False,  # the prototypes are computed from raw data
    )
    personal_head: ClassVar[bool] = False  # the body stays on the client, the header travels

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head_name, self.dim, self.num_classes = linear_head(ctx.model, self.name)
        self.header = ctx.model.module.get_submodule(self.head_name)

    def client_weight(self, task: ClientTask) -> float:
        return float(task.data.num_train)

    # -- server ---------------------------------------------------------------------------
    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        if not results:
            return server
        reps = torch.cat([r.upload["protos"]["mean"] for r in results])
        labels = torch.cat([r.upload["protos"]["ids"] for r in results])
        header = self.train_header(server["params"], reps, labels, results[0].round)
        return {**server, "params": header}

    def train_header(
        self, header: Tree, reps: torch.Tensor, labels: torch.Tensor, round: int
    ) -> Tree:
        """The header after ``server_epochs`` passes of plain SGD on the mean cross-entropy of
        shuffled minibatches of the (representation, label) pairs."""
        cfg, ctx = self.config, self.ctx
        lr = cfg.server_lr if cfg.server_lr is not None else ctx.lr
        n = int(labels.shape[0])
        size = cfg.server_batch_size or ctx.batch_size or n
        gen = generator(ctx.seed, "fedgh/header", round)
        prefix = len(self.head_name) + 1
        params = {k: v.detach() for k, v in header.items()}
        for _ in range(cfg.server_epochs):
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, size):
                idx = order[start : start + size]
                leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
                with torch.enable_grad():
                    local = {k[prefix:]: v for k, v in leaves.items()}
                    out = functional_call(self.header, local, (reps[idx],))
                    loss = F.cross_entropy(out, labels[idx])
                    grads = torch.autograd.grad(loss, list(leaves.values()))
                params = {
                    k: (v - lr * g).detach()
                    for (k, v), g in zip(params.items(), grads, strict=True)
                }
        return params

    # -- client ---------------------------------------------------------------------------
    def make_program(self) -> ClientProgram:
        """FedAvg's local SGD of [own body, global header], uploading prototypes."""
        return PlainSGDProgram(self, start=self.local_start, finish=self.local_finish)

    def local_finish(
        self, message: Message, state: State | None, task: ClientTask, solved: LocalSolution
    ) -> ClientResult:
        """Keep the trained body, upload its class-averaged representations."""
        assert state is not None
        protos = prototype_upload(
            self.ctx.model,
            self.head_name,
            solved.params,
            solved.buffers,
            task,
            self.num_classes,
            self.dim,
        )
        new_state = self.personal_state(state, solved.params, solved.buffers, solved.steps)
        return ClientResult(
            {"protos": protos}, self.client_weight(task), solved.loss, state=new_state
        )
