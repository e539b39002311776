"""FedPer (Arivazhagan et al., 2019, arXiv:1912.00818): federated learning with personalization
layers: decoupled models phi_k = [psi, omega_k] (FedCR, Zhang et al., ICML 2023, with beta = 0
and deterministic features is FedPer; :mod:`fedloom.algorithms.fedcr`).

The model is split by its own declaration (``FedModel.head_modules``, see
:mod:`fedloom.models.base`): the head (final classifier, the paper's personalization layers) and
the body (every other parameter: the base layers, a feature extractor).

- shared: the body's parameters (and the body's buffers, e.g. BatchNorm statistics). The server
  keeps them, sends them, and averages the uploads with the engine's aggregation rule;
- kept: each client's head (persistent client state, initialized from the initial model's
  head), never uploaded: the upload, hence the communication bytes, holds only the body.

One round::

    client k: w_k <- [w_B, w_k^P]                     # local_start: server body, own head
              local SGD on the whole network          # the shared local solver (vectorized)
              upload w_k,B, keep w_k^P                # local_finish
    server:   w_B <- sum_k p_k w_k,B / sum_k p_k      # aggregate (body only)

with p_k = n_k / n (``weighting: samples``, the paper's FedAvg-style weights, the default) or
1/K (``uniform``: the plain mean over reporting clients, as in FedCR).

There is no global model (``Capabilities.has_global_model``): the body alone cannot classify, and an
average of personal heads trained on different label sets is no principled head. Client k
deploys [w_B, w_k^P]. A client that never trained (a held-out new client, ``eval.new_clients``,
or one never sampled) deploys the body with the initial head; with ``finetune_steps`` > 0 it
first trains that head for ``finetune_steps`` SGD steps on its own training data, the body
frozen (minibatches from the stream (seed, round, client, 'finetune'), step ``finetune_lr``,
default ``train.lr``): the personalization-layer training a new FedPer client does. The sharing
pattern itself is :mod:`fedloom.algorithms.partial`, shared with FedBN.
"""

from __future__ import annotations

from pydantic import Field

from fedloom.algorithms.deployment import LocalPartDeployment
from fedloom.algorithms.meta import adapt
from fedloom.algorithms.partial import HeadBodySplit, HeadBodySplitConfig
from fedloom.core.protocol import ClientTask, State
from fedloom.core.pytree import Tree


class FedPerConfig(HeadBodySplitConfig):
    finetune_steps: int = Field(
        default=0, ge=0, description="head-only SGD steps of a never-trained client before use"
    )
    finetune_lr: float | None = Field(default=None, gt=0, description="default: train.lr")


class InitialHead(LocalPartDeployment):
    """A new client starts from the body with the initial head, untuned: the cold-start
    evaluation fine-tunes the head itself, step by step."""

    algorithm: FedPer

    def new_client_model(self, server: State, task: ClientTask) -> tuple[Tree, Tree]:
        return self.algorithm.initial_client_model(server)


class FedPer(HeadBodySplit):
    name = "fedper"
    summary = "FedPer: shared body averaged by the server, personal heads stay on clients"
    Config = FedPerConfig
    Deployment = InitialHead

    def fresh_client_model(
        self, params: Tree, buffers: Tree, task: ClientTask
    ) -> tuple[Tree, Tree]:
        """The body with the initial head, fine-tuned on the client's data when
        ``finetune_steps`` > 0."""
        if self.config.finetune_steps > 0:
            params = self.finetune_head(params, buffers, task)
        return params, buffers

    def finetune_head(self, params: Tree, buffers: Tree, task: ClientTask) -> Tree:
        """``finetune_steps`` SGD steps on the head only (body and buffers unchanged)."""
        cfg, head = self.config, self.split.local_params
        lr = cfg.finetune_lr or self.ctx.lr
        tuned, _ = adapt(self.ctx, params, buffers, task, cfg.finetune_steps, lr, "finetune", head)
        return {**params, **{k: tuned[k] for k in head}}
