"""L2SGD+, loopless local SGD with variance reduction (Hanzely & Richtarik 2020, "Federated
Learning of a Mixture of Global and Local Models", arXiv:2002.05516, Algorithm 2). The
labels (1) (the mixed-model problem) and (2) (the coin) are those of algorithms/l2sgd.py.

L2SGD+ solves the same problem (1) as L2SGD, over the K training clients' models x_k with
x_bar their mean, f_k = (1/m) sum_j f_kj a finite sum, with the same coin (2) but SAGA-style
control variates for both parts of the gradient: a table J_k of the latest gradient of every
component f_kj and Psi_k = lam (x_k - x_bar) at the latest communication. Its estimator is
unbiased and, unlike L2SGD's, vanishes at the solution, so the iterates converge to the
solution of (1) exactly (linearly, for strongly convex f_k), not to a noise ball around it.
Algorithm 2, with J_k^0 = 0 and Psi_k^0 = 0, one iteration::

    'no communication' (probability 1 - p): every client k, j ~ uniform{1..m}:
        g_k = (grad f_kj(x_k) - J_kj) / (K (1-p)) + mean_l J_kl / K + Psi_k / K
        x_k <- x_k - eta g_k;   J_kj <- grad f_kj(x_k)  (at the x_k before the step)
    'communicate' (probability p):
        g_k = lam / (K p) (x_k - x_bar) - (1/p - 1) Psi_k / K + mean_l J_kl / K
        x_k <- x_k - eta g_k;   Psi_k <- lam (x_k - x_bar)  (the x_k before the step)

One fedloom round is one communication, as for L2SGD: the coin's N 'no communication' flips
(``local_step_count``, shared by all clients), each a local step, and the upload of the change
of x_k; the communication step needs x_bar, so a client takes it at the start of its next round
(``local_start``). eta is ``train.lr``; ``local_steps`` / ``local_epochs`` are not used.

Components: client k's training samples are split once into m_k = ceil(n_k / B) blocks of
nearly equal size (B = ``train.batch_size``; a fixed permutation from the stream (seed,
'l2sgd_plus/blocks', client)), f_kj = (m_k |B_j| / n_k) times the mean loss on block j, so that
f_k = (1/m_k) sum_j f_kj is the client's mean loss exactly. ``batch_size: 1`` is the paper's
one sample per component, ``batch_size: null`` one component (the full gradient). Each local
step's j is drawn from the stream (seed, 'l2sgd_plus/components', round, client), and its
minibatch is block j.

Client state: x_k, J_k (a table of max_k m_k model-sized rows: the clients' tables stack on the
vectorized backend; rows past m_k stay 0) and Psi_k; memory is (m + 2) models per client.
x_k, J_k and Psi_k never travel; the upload is the change of x_k, as for L2SGD.

Deployment, theta_bar, partial participation (absent clients stay frozen; the solution of (1)
stays the fixed point: at it every g_k is 0 whoever takes part) and stragglers are L2SGD's.
"""

from __future__ import annotations

from typing import Any

import torch

from fedloom.algorithms.l2sgd import L2SGD, L2SGDConfig
from fedloom.algorithms.sgd_program import StepProgram
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, clone, sub
from fedloom.core.rng import generator
from fedloom.solvers import BATCHES, Batch, Carry, ClientProgram, ClientRun, Ops, Plan


def block_count(num_train: int, batch_size: int | None) -> int:
    """m_k: the client's components, blocks of ``batch_size`` samples (one without)."""
    if batch_size is None or num_train == 0:
        return 1
    return -(-num_train // batch_size)


def component_blocks(seed: int, client: int, num_train: int, blocks: int) -> list[torch.Tensor]:
    """The client's fixed split of its samples into ``blocks`` blocks of nearly equal size."""
    order = torch.randperm(num_train, generator=generator(seed, "l2sgd_plus/blocks", -1, client))
    return list(torch.tensor_split(order, blocks))


def component_order(seed: int, round: int, client: int, blocks: int, steps: int) -> torch.Tensor:
    """The component j of each of the round's local steps, uniform over the client's blocks."""
    gen = generator(seed, "l2sgd_plus/components", round, client)
    return torch.randint(blocks, (steps,), generator=gen)


class L2SGDPlusConfig(L2SGDConfig):
    pass


class L2SGDPlus(L2SGD):
    name = "l2sgd_plus"
    summary = (
        "L2SGD+: L2SGD with control variates, exact on the mixed problem (Hanzely & Richtarik)"
    )
    Config = L2SGDPlusConfig

    def table_rows(self) -> int:
        """Rows of every client's table J: the most components a training client has."""
        sizes = self.ctx.population.values() or [0]
        return max(block_count(n, self.ctx.batch_size) for n in sizes)

    def init_client_state(self, server: State, client_id: int) -> State:
        rows = self.table_rows()
        params = server["init"]
        return {
            "params": clone(params),
            "buffers": clone(server["buffers"]),
            "table": {k: torch.zeros(rows, *v.shape, dtype=v.dtype) for k, v in params.items()},
            "psi": {k: torch.zeros_like(v) for k, v in params.items()},
        }

    def client_plan(self, task: ClientTask) -> list[torch.Tensor]:
        blocks = block_count(task.data.num_train, self.ctx.batch_size)
        split = component_blocks(self.ctx.seed, task.client_id, task.data.num_train, blocks)
        order = self.components(task, blocks)
        return [split[j] for j in order[: self.round_steps(task)].tolist()]

    def components(self, task: ClientTask, blocks: int) -> torch.Tensor:
        """j of each of the round's coin N steps (a straggler takes the first ones): every
        client's table of them has the length N, so the tables stack."""
        return component_order(
            self.ctx.seed, task.round, task.client_id, blocks, self.coin(task.round)
        )

    def make_program(self) -> ClientProgram:
        return L2SGDPlusProgram(self)


class L2SGDPlusProgram(StepProgram):
    """Algorithm 2's client side: the communication step in ``init`` (one client, plain
    tensors), the local steps in ``step`` (pure, vmapped over clients), the new x_k, J_k and
    Psi_k in ``finish``."""

    def __init__(self, algorithm: L2SGDPlus) -> None:
        super().__init__(algorithm)
        self.l2sgd = algorithm

    def plans(self, message: Message, state: State | None, task: ClientTask) -> dict[str, Plan]:
        return {BATCHES: Plan(self.l2sgd.client_plan(task))}

    def init(self, message: Message, state: State | None, task: ClientTask) -> Carry:
        assert state is not None
        algorithm, config = self.l2sgd, self.l2sgd.config
        num_clients, lam, p = algorithm.num_clients, config.lam, config.p
        n = task.data.num_train
        blocks = block_count(n, algorithm.ctx.batch_size)
        x, table, psi = state["params"], state["table"], state["psi"]
        gap = sub(x, message["params"])  # x_k - x_bar
        eta = task.lr
        params = {
            k: x[k]
            - eta
            * (
                lam / (num_clients * p) * gap[k]
                - (1.0 / p - 1.0) / num_clients * psi[k]
                + table[k].sum(0) / (blocks * num_clients)
            )
            for k in x
        }
        sizes = [
            int(b.shape[0]) for b in component_blocks(algorithm.ctx.seed, task.client_id, n, blocks)
        ]
        scale = torch.zeros(next(iter(table.values())).shape[0])
        scale[:blocks] = torch.tensor([blocks * s / max(n, 1) for s in sizes])
        order = algorithm.components(task, blocks)
        return {
            "params": params,
            "buffers": clone(state["buffers"]),
            "table": table,
            "psi": {k: lam * g for k, g in gap.items()},
            "order": order,
            "step": torch.zeros((), dtype=torch.long),
            "scale": scale,
            "blocks": torch.tensor(float(blocks)),
        }

    def shared(self, message: Message, task: ClientTask) -> dict[str, Any]:
        return {"lr": task.lr}

    def step(
        self, ops: Ops, carry: Carry, batches: tuple[Batch, ...], shared: dict[str, Any]
    ) -> tuple[Carry, dict]:
        (batch,) = batches
        num_clients, p = self.l2sgd.num_clients, self.l2sgd.config.p
        order, table, psi = carry["order"], carry["table"], carry["psi"]
        at_step = torch.arange(order.shape[0]) == carry["step"]
        j = (order * at_step).sum()
        rows = next(iter(table.values())).shape[0]
        row = torch.arange(rows) == j
        weight = (carry["scale"] * row).sum()  # m_k |B_j| / n_k
        grads, loss = ops.loss_grad(self.model, carry["params"], carry["buffers"], batch)
        estimate: Tree = {}
        new_table: Tree = {}
        for k, g in grads.items():
            g = weight * g  # grad f_kj(x_k)
            mask = row.view(rows, *([1] * g.ndim))
            old = (table[k] * mask).sum(0)  # J_kj
            mean = table[k].sum(0) / carry["blocks"]
            estimate[k] = (g - old) / (num_clients * (1.0 - p)) + (mean + psi[k]) / num_clients
            new_table[k] = torch.where(mask, g.unsqueeze(0), table[k])
        new = dict(carry)
        new["params"] = ops.descend(carry["params"], estimate, shared["lr"])
        new["table"] = new_table
        new["step"] = carry["step"] + 1
        return new, {"loss": loss}

    def finish(
        self, message: Message, state: State | None, task: ClientTask, run: ClientRun
    ) -> ClientResult:
        assert state is not None
        carry = run.carry
        params, buffers = carry["params"], carry["buffers"]
        upload = {"delta": sub(params, state["params"]), "buffers": buffers}
        new_state = {
            "params": params,
            "buffers": buffers,
            "table": carry["table"],
            "psi": carry["psi"],
        }
        return ClientResult(upload, 1.0, run.metric(self.STEP), state=new_state)
