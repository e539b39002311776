"""FedRoD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning for
Image Classification", arXiv:2107.00778, Section 4, Eq. (4)-(6)): one model with two heads,
a generic one for the federation and a personal one per client.

The model is split at its declared head (``FedModel.head_modules``, one ``nn.Linear``): the
body f_theta (the representation z = f_theta(x), the head's input) and the generic head h_psi
(G-head) are shared and averaged by the server; each client k keeps a personal head h_phi_k
(P-head, an ``nn.Linear`` of the same shape). One round, per minibatch B of the local SGD::

    z = f_theta(x),  g = h_psi(z)                                  # generic logits
    theta, psi <- theta, psi - lr grad L_BSM(g, y; n_k)             # Eq. (4)-(5)
    phi_k      <- phi_k - lr grad CE(g.detach() + h_phi_k(z.detach()), y)   # Eq. (6)
    L_BSM(g, y; n_k) = CE(g + log n_k, y),   n_k = client k's class counts

then the client uploads (theta, psi), weighted n_k, keeps phi_k, and the server averages
(FedAvg, ``aggregate_models``). Both updates of a step read the minibatch's one forward pass at
the step's start, as the authors' and PFLlib's code (``clientrod.py``) do; the detaches keep
the two objectives apart, so one gradient of their sum is both steps.

- ``balanced_loss``: ``bsm`` (the balanced softmax of Ren et al., NeurIPS 2020, the paper's
  choice) or ``ce`` (plain cross-entropy: the generic model is then FedAvg's). The balanced
  softmax adds log n_{k,c} to the logit of class c; a class the client has no sample of gets
  -1e4 there (exp of it is 0 in float32, as the log 0 = -inf of the public code, without an
  infinity in the padded samples of the vmap backend).
- The P-head starts as the G-head the client first receives: the initial one in the first
  round (PFLlib's ``copy.deepcopy(model.predictor)`` at the start); a client first sampled
  later starts from the G-head of then.
- Deployed (personalized) model: [theta, psi + phi_k], i.e. the logits h_psi(z) + h_phi_k(z)
  (the paper's personalized prediction; both heads are linear in z, so their sum is one linear
  head with weights W_psi + W_phi and biases b_psi + b_phi). Global model: [theta, psi], the
  generic model, which also serves new clients (cold start: the default fine-tuning).
- Communication: FedAvg's (the model each way); the P-head never leaves the client.

Refused: sample-level DP (the step's objectives are its own), ``train.optimizer: adamw`` (the
two heads' steps are SGD's).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedloom.algorithms.base import AlgorithmConfig, AlgorithmContext
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.sgd_program import SGDProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone, select
from fedloom.solvers import Batch, Carry, ClientProgram, ClientRun, Ops
from fedloom.solvers.objective_sgd import single_head

ABSENT = -1e4
"""log n_c of a class the client has no sample of: exp(-1e4) is exactly 0 in float32."""

PERSONAL = "personal/"
"""Prefix of the P-head's entries in the tree one step differentiates."""


class FedRoDConfig(AlgorithmConfig):
    balanced_loss: Literal["bsm", "ce"] = Field(
        default="bsm", description="loss of the generic head: balanced softmax (paper) or CE"
    )


def log_class_counts(y: torch.Tensor, classes: int) -> torch.Tensor:
    """log n_c per class of the labels ``y`` (``ABSENT`` for a class without samples)."""
    counts = torch.bincount(y, minlength=classes).to(torch.float32)
    return torch.where(counts > 0, counts.clamp_min(1).log(), torch.full_like(counts, ABSENT))


def balanced_softmax_loss(
    logits: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor, w: torch.Tensor | None = None
) -> torch.Tensor:
    """CE(logits + log n, y) averaged over the batch (``w``: the sample weights of a padded
    batch, None: all real): the balanced softmax of Ren et al. (2020), FedRoD's Eq. (5)."""
    per = F.cross_entropy(logits + log_counts.to(logits.dtype), y, reduction="none")
    if w is None:
        return per.mean()
    return (per * w).sum() / w.sum().clamp_min(1.0)


class FedRoD(FedAvg):
    name = "fedrod"
    summary = "FedRoD: generic head by balanced softmax, averaged; personal head added per client"
    Config = FedRoDConfig
    capabilities = FedAvg.capabilities.but(
        classification_only="class counts",
        supports_sample_dp=False,  # the heads' objectives are its own
    )

    def __init__(self, config: AlgorithmConfig, ctx: AlgorithmContext) -> None:
        super().__init__(config, ctx)
        self.head = single_head(ctx.model, self.name)
        linear = ctx.model.module.get_submodule(self.head)
        assert isinstance(linear, nn.Linear)
        self.num_classes = linear.out_features
        self.weight, self.bias = f"{self.head}.weight", f"{self.head}.bias"
        self.head_keys = [k for k in (self.weight, self.bias) if k in ctx.model.param_keys]

    def init_client_state(self, server: State, client_id: int) -> State:
        """phi_k before the client's first round: the G-head it first receives (the initial
        one for the clients of the first round, as PFLlib's copy of the initial head)."""
        return {"params": clone(select(server["params"], self.head_keys))}

    def make_program(self) -> ClientProgram:
        return FedRoDProgram(self)

    def personalized(self, params: Tree, personal: Tree) -> Tree:
        """[theta, psi + phi]: the model whose logits are h_psi(z) + h_phi(z)."""
        return {k: v + personal[k] if k in personal else v for k, v in params.items()}

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        state = state if state is not None else self.init_client_state(server, task.client_id)
        return self.personalized(server["params"], state["params"]), server["buffers"]


class FedRoDProgram(SGDProgram):
    """Eq. (4)-(6) as one step: the gradient of L_BSM (or CE) + CE(g.detach() + h_phi(z.detach()))
    with respect to (theta, psi) and phi together."""

    takes_optimizer = False  # the P-head's steps are SGD's

    def __init__(self, algorithm: FedRoD) -> None:
        super().__init__(algorithm)
        self.rod = algorithm
        self.balanced = algorithm.config.balanced_loss == "bsm"

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        carry = super().init(message, state, task)
        assert state is not None
        carry["personal"] = clone(state["params"])  # stepped in place under vmap
        if self.balanced:
            carry["log_counts"] = log_class_counts(task.data.y_train, self.rod.num_classes)
        return carry

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        rod, personal = self.rod, carry["personal"]
        leaves = {**carry["params"], **{PERSONAL + k: v for k, v in personal.items()}}

        def loss(p: Tree, buffers: Tree) -> tuple[torch.Tensor, torch.Tensor]:
            model = {k: v for k, v in p.items() if not k.startswith(PERSONAL)}
            g, z = self.model.forward_with_features(model, buffers, batch.x, rod.head)
            if self.balanced:
                generic = balanced_softmax_loss(g, batch.y, carry["log_counts"], batch.w)
            else:
                generic = batch.mean(self.model.per_sample_loss(g, batch.y))
            bias = p.get(PERSONAL + rod.bias)
            logits = g.detach() + F.linear(z.detach(), p[PERSONAL + rod.weight], bias)
            personal_loss = batch.mean(F.cross_entropy(logits, batch.y, reduction="none"))
            return generic + personal_loss, generic

        grads, _, generic = ops.value_and_grad_aux(loss, leaves, carry["buffers"])
        lr = shared["lr"]
        model_grads = {k: grads[k] for k in carry["params"]}
        personal_grads = {k: grads[PERSONAL + k] for k in personal}
        new = {**carry, "params": ops.descend(carry["params"], model_grads, lr)}
        new["personal"] = ops.descend(personal, personal_grads, lr)
        return new, {"loss": generic}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        result = super().finish(message, state, task, run)
        result.state = {"params": run.carry["personal"]}
        return result
