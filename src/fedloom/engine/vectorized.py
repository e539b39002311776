"""The vectorized executor: a round's clients trained C at a time as one tensor program.

Each chunk's parameters are stacked along a leading client dimension and one local-SGD step
of all C clients is a single ``vmap(grad(...))`` call (torch.func). Clients with fewer or
smaller minibatches are padded: padded samples get weight 0 in the loss and a client without a
step at position s gets an update multiplied by 0, so every client follows exactly the
sequential executor's trajectory (up to float summation order). Models with normalization
layers are grouped by batch size at each step instead of padded, since padding would change
batch statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad_and_value, vmap

from fedloom.algorithms.base import Algorithm, ClientResult, ClientTask, Message, State
from fedloom.data.federated import ClientData
from fedloom.engine.functional import FunctionalModel
from fedloom.engine.local import LocalSolution
from fedloom.engine.memory import (
    activation_bytes_per_sample,
    choose_chunk_size,
    client_footprint,
    parse_bytes,
)
from fedloom.engine.pytree import Tree


def stack(trees: list[Tree]) -> Tree:
    return {k: torch.stack([t[k] for t in trees]) for k in trees[0]}


def unstack(tree: Tree, n: int) -> list[Tree]:
    return [{k: v[i] for k, v in tree.items()} for i in range(n)]


def stack_states(states: list[State | None]) -> Any:
    """Stack per-client states (nested dicts of tensors) along a new leading dimension."""
    if all(s is None for s in states):
        return None
    first = states[0]
    if isinstance(first, dict):
        return {k: stack_states([s[k] for s in states]) for k in first}  # type: ignore[index]
    return torch.stack(states)  # type: ignore[arg-type]


class VectorizedExecutor:
    name = "vectorized"

    def __init__(
        self,
        model: FunctionalModel,
        chunk_size: int | None = None,
        memory_budget: str | int | None = None,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.requested_chunk = chunk_size
        self.budget = parse_bytes(memory_budget)
        self.device = torch.device(device)
        self.has_norm = bool(getattr(model.module, "norm_modules", ()))
        self._param_bytes = sum(p.numel() * p.element_size() for p in model.module.parameters())
        self._act_bytes: int | None = None
        self.last_chunk_size: int | None = None

    def prepare(self, clients: list[ClientData]) -> None:
        pass

    def close(self) -> None:
        pass

    # -- chunking -------------------------------------------------------------------------
    def chunk_size(self, tasks: list[ClientTask], max_batch: int) -> int:
        if self._act_bytes is None:
            self._act_bytes = activation_bytes_per_sample(
                self.model.module, tasks[0].data.x_train[0]
            )
        footprint = client_footprint(self._param_bytes, self._act_bytes, max_batch)
        return choose_chunk_size(
            footprint, self._param_bytes, self.budget, len(tasks), self.requested_chunk
        )

    # -- the round ------------------------------------------------------------------------
    def run_round(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> list[ClientResult]:
        if not tasks:
            return []
        plans = [algorithm.client_plan(t) for t in tasks]
        max_batch = max((len(b) for plan in plans for b in plan), default=1)
        size = self.chunk_size(tasks, max_batch)
        self.last_chunk_size = size
        results: list[ClientResult] = []
        for lo in range(0, len(tasks), size):
            idx = range(lo, min(lo + size, len(tasks)))
            solved = self.solve_chunk(
                algorithm,
                message,
                [tasks[i] for i in idx],
                [states[i] for i in idx],
                [plans[i] for i in idx],
            )
            results += [
                algorithm.local_finish(message, states[i], tasks[i], s)
                for i, s in zip(idx, solved, strict=True)
            ]
        return results

    def solve_chunk(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
        plans: list[list[torch.Tensor]],
    ) -> list[LocalSolution]:
        dev = self.device
        starts = [algorithm.local_start(message, s, t) for s, t in zip(states, tasks, strict=True)]
        params = {k: v.to(dev) for k, v in stack([p for p, _ in starts]).items()}
        buffers = (
            {k: v.to(dev) for k, v in stack([b for _, b in starts]).items()} if starts[0][1] else {}
        )
        stacked_state = stack_states(states) if algorithm.has_correction() else None
        step = self._step_fn(algorithm, message)
        num = len(tasks)
        lr = tasks[0].lr
        steps = [len(p) for p in plans]
        loss_sum = torch.zeros(num)
        xs = [t.data.x_train for t in tasks]
        ys = [t.data.y_train for t in tasks]
        for s in range(max(steps)):
            active = [c for c in range(num) if s < steps[c]]
            groups = self._groups(active, [plans[c][s] for c in active] if active else [], num)
            for members, batch in groups:
                xb, yb, wb, on = self._gather(xs, ys, plans, s, members, batch, steps)
                sub = members if len(members) < num else None
                p_in = params if sub is None else {k: v[sub] for k, v in params.items()}
                b_in = buffers if sub is None else {k: v[sub] for k, v in buffers.items()}
                st_in = stacked_state if sub is None else _index_state(stacked_state, sub)
                new_p, losses = step(
                    p_in, b_in, xb.to(dev), yb.to(dev), wb.to(dev), on.to(dev), lr, st_in
                )
                if sub is None:
                    params = new_p
                else:
                    index = torch.tensor(sub, device=dev)
                    params = {k: v.index_copy(0, index, new_p[k]) for k, v in params.items()}
                    for k, v in buffers.items():
                        v.index_copy_(0, index, b_in[k])
                loss_sum[torch.tensor(members)] += losses.detach().cpu()
        cpu_params = {k: v.cpu() for k, v in params.items()}
        cpu_buffers = {k: v.cpu() for k, v in buffers.items()}
        return [
            LocalSolution(p, b, float(loss_sum[c]) / max(1, steps[c]), starts[c][0], lr, steps[c])
            for c, (p, b) in enumerate(
                zip(
                    unstack(cpu_params, num),
                    unstack(cpu_buffers, num) if buffers else [{}] * num,
                    strict=True,
                )
            )
        ]

    def _groups(
        self, active: list[int], batches: list[torch.Tensor], num: int
    ) -> list[tuple[list[int], int]]:
        """Which clients take step s together, and the padded batch size.

        Without normalization layers all clients go together (inactive ones masked); with
        them, clients are grouped by their exact batch size (no padding, no masking)."""
        if not active:
            return []
        if not self.has_norm:
            return [(list(range(num)), max(len(b) for b in batches))]
        by_size: dict[int, list[int]] = {}
        for c, b in zip(active, batches, strict=True):
            by_size.setdefault(len(b), []).append(c)
        return [(members, size) for size, members in sorted(by_size.items())]

    @staticmethod
    def _gather(
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        plans: list[list[torch.Tensor]],
        s: int,
        members: list[int],
        batch: int,
        steps: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded (C, batch, ...) inputs, targets, sample weights and the active mask."""
        ref_x, ref_y = xs[members[0]], ys[members[0]]
        xb = ref_x.new_zeros((len(members), batch, *ref_x.shape[1:]))
        yb = ref_y.new_zeros((len(members), batch, *ref_y.shape[1:]))
        wb = torch.zeros(len(members), batch)
        on = torch.zeros(len(members))
        for row, c in enumerate(members):
            if s >= steps[c]:
                continue
            idx = plans[c][s]
            xb[row, : len(idx)] = xs[c][idx]
            yb[row, : len(idx)] = ys[c][idx]
            wb[row, : len(idx)] = 1.0
            on[row] = 1.0
        return xb, yb, wb, on

    def _step_fn(self, algorithm: Algorithm, message: Message) -> Callable[..., Any]:
        model = self.model
        with_correction = algorithm.has_correction()

        def one_client(params, buffers, xb, yb, wb, on, lr, state):
            grads, loss = grad_and_value(model.weighted_loss)(params, buffers, xb, yb, wb)
            if with_correction:
                extra = algorithm.local_correction(params, message, state)
                if extra is not None:
                    grads = {k: g + extra[k] for k, g in grads.items()}
            return {k: p - (lr * on) * grads[k] for k, p in params.items()}, loss * on

        per_client = vmap(one_client, in_dims=(0, 0, 0, 0, 0, 0, None, 0))
        shared_state = vmap(one_client, in_dims=(0, 0, 0, 0, 0, 0, None, None))

        def step(params, buffers, xb, yb, wb, on, lr, state):
            model.module.train()
            batched = shared_state if state is None else per_client
            with torch.no_grad():
                return batched(params, buffers, xb, yb, wb, on, lr, state)

        return step


def _index_state(state: Any, rows: list[int]) -> Any:
    if state is None:
        return None
    if isinstance(state, dict):
        return {k: _index_state(v, rows) for k, v in state.items()}
    return state[rows]
