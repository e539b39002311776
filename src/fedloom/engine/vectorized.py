"""The vectorized executor: a round's clients trained C at a time as one tensor program.

The executor places the data (every client's training samples concatenated once into an
:class:`~fedloom.solvers.vmap.Arena`), sizes the chunks C to the memory budget and evaluates
models stacked; the local steps themselves are the algorithm's client program run by the vmap
backend (solvers/vmap.py): each update of a step is one ``vmap`` call over the chunk (or one
stacked call, core/stacked.py). Dropout masks are drawn per client from the streams the
sequential executor draws them from (core/client_dropout.py, docs/executors.md).
"""

from __future__ import annotations

import torch
from torch import nn

from fedloom.algorithms.base import Algorithm
from fedloom.algorithms.client import client_program
from fedloom.core.client_dropout import refused_dropout
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.evaluation import evaluate_stacked
from fedloom.engine.executor import States
from fedloom.engine.memory import (
    activation_bytes_per_sample,
    choose_chunk_size,
    client_footprint,
    keep_large_blocks_in_heap,
    tree_bytes,
)
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.vmap_probe import check_vmappable
from fedloom.errors import ConfigError
from fedloom.run_config.executor import parse_bytes
from fedloom.solvers.vmap import Arena, ChunkRunner, plan_steps, to_device


class VectorizedExecutor:
    name = "vectorized"
    batches_clients = True

    def __init__(
        self,
        model: FunctionalModel,
        chunk_size: int | None = None,
        memory_budget: str | int | None = None,
        device: str = "cpu",
    ) -> None:
        refused = refused_dropout(model.module)
        if refused:
            raise ConfigError(
                f"executor.kind: the vectorized executor cannot run the dropout layers "
                f"{', '.join(refused)}: it draws each client's masks only for nn.Dropout and "
                "nn.Dropout1d/2d/3d (docs/executors.md); use executor.kind: sequential (or "
                "ray, or workers: N)"
            )
        self.model = model
        self.requested_chunk = chunk_size
        self.budget = parse_bytes(memory_budget)
        self.device = torch.device(device)
        self.has_norm = bool(getattr(model.module, "norm_modules", ())) or any(
            isinstance(m, nn.modules.batchnorm._NormBase) for m in model.module.modules()
        )
        """Batch statistics (declared norm layers, or any BatchNorm/InstanceNorm of a user's
        module): clients are grouped by exact batch size instead of padded."""
        self._param_bytes = sum(p.numel() * p.element_size() for p in model.module.parameters())
        self._act_bytes: int | None = None
        self.last_chunk_size: int | None = None
        self._arena: Arena | None = None
        self._heap_tuned = keep_large_blocks_in_heap()

    def prepare(self, clients: dict[int, ClientData]) -> None:
        """Concatenate every client's training data once into one arena, so that a step's
        minibatches for a whole chunk are a single gather. Refuses a model vmap cannot run,
        naming the layer (engine/vmap_probe.py), before any training."""
        # two samples where a client has them (batch normalization needs more than one)
        sample = max(clients.values(), key=lambda d: min(d.num_train, 2), default=None)
        if sample is not None and sample.num_train == 0:
            sample = None
        if sample is not None:
            check_vmappable(self.model, sample.x_train[:2], sample.y_train[:2])
        self._arena = Arena(clients, self.device)

    def close(self) -> None:
        pass

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        """Deployment fine-tuning stacked, every client at once."""
        return algorithm.deployment.deployed_models(server, states, tasks, batched=True)

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        if self._act_bytes is None:
            self._act_bytes = activation_bytes_per_sample(self.model.module, datas[0].x_test[0])
        footprint = 2 * self._param_bytes + 2 * self._act_bytes * batch_size
        size = choose_chunk_size(
            footprint, self._param_bytes, self.budget, len(models), None, self._heap_tuned
        )
        return evaluate_stacked(self.model, models, datas, batch_size, size, self.device)

    # -- chunking -------------------------------------------------------------------------
    def chunk_size(
        self, tasks: list[ClientTask], max_batch: int, carry_bytes: int | None = None
    ) -> int:
        """Clients per chunk for ``tasks``; ``carry_bytes``: one client's carry, measured."""
        if self._act_bytes is None:
            self._act_bytes = activation_bytes_per_sample(
                self.model.module, tasks[0].data.x_train[0]
            )
        footprint = client_footprint(self._param_bytes, self._act_bytes, max_batch, carry_bytes)
        return choose_chunk_size(
            footprint,
            self._param_bytes,
            self.budget,
            len(tasks),
            self.requested_chunk,
            self._heap_tuned,
        )

    # -- the round ------------------------------------------------------------------------
    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        if not tasks:
            return []
        program = client_program(algorithm)
        plans = [program.plans(message, s, t) for s, t in zip(states, tasks, strict=True)]
        # shape[0], not len(): Tensor.__len__ is a Python-level call, paid once per minibatch
        # (benchmarks/README.md, Design measurements)
        max_batch = max(
            (b.shape[0] for p in plans for plan in p.values() for b in plan.batches), default=1
        )
        widest = max(len(u.plans) for u in program.updates)  # minibatches live in one update
        carry_bytes = tree_bytes(program.init(message, states[0], tasks[0]))  # one client's
        carry_bytes += program.step_bytes(max_batch)
        size = self.chunk_size(tasks, max_batch * widest, carry_bytes)
        self.last_chunk_size = size
        # Most local steps first: chunks hold clients of similar budgets (little padding), and
        # inside a chunk the clients still training at step s are always a prefix.
        steps = [plan_steps(p) for p in plans]
        order = sorted(range(len(tasks)), key=lambda i: -steps[i])
        arena = (
            self._arena
            if self._arena is not None and self._arena.holds(tasks)
            else Arena({t.client_id: t.data for t in tasks}, self.device)
        )
        runner = ChunkRunner(program, arena, self.device, self.has_norm)
        shared_cpu = program.shared(message, tasks[0])
        shared = to_device(shared_cpu, self.device)
        results: list[ClientResult | None] = [None] * len(tasks)
        for lo in range(0, len(order), size):
            idx = order[lo : lo + size]
            runs = runner.run(
                message,
                [tasks[i] for i in idx],
                [states[i] for i in idx],
                [plans[i] for i in idx],
                shared,
                shared_cpu,
            )
            for i, run in zip(idx, runs, strict=True):
                results[i] = program.finish(message, states[i], tasks[i], run).stamped(tasks[i])
        return results  # type: ignore[return-value]
