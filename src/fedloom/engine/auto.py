"""``executor.kind: auto``: pick the sequential (lean) executor, the vectorized executor, or
sequential in one worker process per core, and the thread count, from the shape of the
workload, with a cost model (docs/executors.md; calibration in benchmarks/README.md, "Auto's
cost model").

The choice is a deterministic function of the config, the data, the model and the machine's
core count: nothing is timed while the run goes. A choice made from timings would differ
from one run of a config to the next on a machine shared with other work, and with it the
last bits of every number (sequential and vectorized sum in different orders; so do 1 and 2
threads), so two runs of one config and seed would not be equal. The cost model's constants
were measured once on the reference machine (2 cores) by ``benchmarks/auto_choice.py``, which
also reports, for each benchmark workload, auto's pick next to the best fixed executor.

The model, per round, for ``n`` clients of ``S`` local steps of ``U`` updates each, minibatches
of ``B`` samples, a model of ``P`` parameters and ``M`` multiply-accumulates per sample
(``F = 6 B M`` floating-point operations for a forward and backward pass)::

    sequential, T threads   n (CLIENT + S U (STEP + F / rate(T)))
    vectorized, T threads   chunks S U (VSTEP + c (F / vrate(T) + TOUCH P / bandwidth(T)))
                            + n VCLIENT
    processes, W            sequential(1) / W + n (W - 1) / W SHIP(P) + POOL
    vectorized-processes, W vectorized(1) of n / W clients + n (W - 1) / W SHIP(P) + POOL

where c is the chunk size and VSTEP the fixed cost of one batched step: small for the stacked
path (core/stacked.py), larger under ``vmap``. With W processes (engine/processes.py) this
process trains one group of clients and W - 1 forked workers the others; only theirs travel.
The choice is reported in ``choice`` (and the run summary) with every candidate's estimate in
``estimates``, and kept in checkpoints so a resumed run continues on the same executor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from fedloom.algorithms.base import Algorithm
from fedloom.algorithms.client import client_program
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.executor import States
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.processes import MultiprocessExecutor
from fedloom.engine.sequential import SequentialExecutor
from fedloom.engine.threads import SMALL_STEP_MACS, macs_per_sample, torch_threads
from fedloom.engine.vectorized import VectorizedExecutor
from fedloom.engine.vmap_probe import NotVmappable
from fedloom.errors import ConfigError
from fedloom.run_config.executor import ExecutorConfig
from fedloom.solvers.program import ClientProgram


@dataclass(frozen=True)
class CostModel:
    """Seconds and rates of the reference machine (benchmarks/README.md, "Auto's cost
    model"); see the module doc for where each enters."""

    client: float = 2.0e-4
    """Per client and round, one client at a time: plans, carry, result."""
    step: float = 3.5e-4
    """Per update, one client at a time on the lean trainer (the FedAvg family): the autograd
    engine and a dozen small kernels."""
    generic_step: float = 6.0e-4
    """The same for a program stepped through its updates (``functional_call`` per pass)."""
    rate: float = 100e9
    """Floating-point operations per second of one client's step of a linear model, one
    thread."""
    conv_rate: float = 90e9
    """The same for a model with convolutions (the one-client loop as fast as plain PyTorch
    since issue #37: the FedAvg paper's CNN at B = 10 in 3.8 s a round)."""
    thread_speedup: float = 1.6
    """A step of at least SMALL_STEP_MACS on every core against one (smaller steps do not
    speed up with threads: the sequential candidate on all cores is not considered)."""
    ship: float = 2.0e-4
    """Per client and round, worker processes: pickling and moving its work and result."""
    ship_bandwidth: float = 3.0e9
    """Bytes per second a worker process's message, state and result travel at."""
    pool: float = 8.0e-3
    """Per round, worker processes: submitting and collecting the groups."""
    stacked_step: float = 3.0e-4
    """Per batched update, the stacked path (core/stacked.py)."""
    vmap_step: float = 2.5e-3
    """Per batched update under ``vmap``."""
    vector_rate: float = 100e9
    """Floating-point operations per second of a batched linear model's step, one thread."""
    conv_vector_rate: float = 110e9
    """The same for a model with convolutions, refitted after issue #37 (first layers as
    separate per-client convolutions) to the FedAvg paper's CNN at B = 10 and the default
    experiment's CNN (benchmarks/README.md, "Auto's cost model after issue #37")."""
    bandwidth: float = 25e9
    """Bytes per second a batched step streams its clients' parameters at, one thread."""
    touch: float = 12.0
    """Bytes per parameter and client a stacked step streams (read; read and write)."""
    vmap_touch: float = 12.0
    """The same under ``vmap`` (gradients are formed, then applied)."""
    vector_client: float = 1.0e-4
    """Per client and round, vectorized: stacking, result, finish."""
    thread_scaling: float = 1.5
    """Batched work on every core against one, for a batched step of at least
    ``big_step_flops`` of a model without convolutions (W1, W3: 2 threads were fastest)."""
    small_thread_scaling: float = 0.8
    """The same below it, and for convolutions: a stacked round of the FedAvg paper's setting
    (10 clients, about 0.12 GFLOP a step) took 0.156 s at 2 threads against 0.117 s at 1, the
    default experiment's CNN 0.160 against 0.133 s."""
    big_step_flops: float = 3e8
    """Floating-point operations of one batched step above which threads pay."""
    big_conv_step_flops: float = 3e9
    """The same for a model with convolutions: the FedAvg paper's CNN at B = 10 (10 clients,
    7.4 GFLOP a step) ran 1.5x faster at 2 threads, the default experiment's CNN (0.8 GFLOP)
    1.4x slower (benchmarks/README.md, "Auto's cost model after issue #37")."""
    conv_client_step: float = 5.0e-4
    """Per client and update of a stacked step of a model with convolutions: a first layer of
    at most 3 input channels runs as one convolution per client (core/stacked.py), and each
    layer's per-client views cost Python time."""


COSTS = CostModel()


@dataclass(frozen=True)
class Shape:
    """What the cost model reads of a round: clients, mean local steps, gradient passes per
    step (``updates``: ``ClientProgram.passes_per_step``), mean minibatch size, parameters,
    forward multiply-accumulates per sample, whether the model has convolutions and whether the
    vectorized backend runs it stacked (without ``vmap``)."""

    clients: int
    steps: float
    updates: float
    batch: float
    params: int
    macs: int
    conv: bool
    stacked: bool
    lean: bool = True
    """The sequential backend runs the program on its fused one-client trainer."""

    @property
    def flops(self) -> float:
        """Floating-point operations of one gradient pass of one client (forward and backward)."""
        return 6.0 * self.batch * self.macs


def estimate(kind: str, threads: int, shape: Shape, chunk: int, costs: CostModel = COSTS) -> float:
    """Estimated seconds of one round of ``shape`` on candidate ``kind`` (``sequential``,
    ``vectorized``, ``processes=W`` or ``vectorized-processes=W``) at ``threads`` intra-op
    threads."""
    updates = shape.clients * shape.steps * shape.updates
    if "processes=" in kind:
        inner, workers_text = kind.split("processes=")
        workers = int(workers_text)
        # the message and a state in, the upload and a new state out, float32
        shipped = shape.clients * (workers - 1) / workers
        ship = shipped * (costs.ship + 4 * 4 * shape.params / costs.ship_bandwidth)
        if inner == "vectorized-":
            group = replace(shape, clients=math.ceil(shape.clients / workers))
            work = estimate("vectorized", 1, group, min(chunk, group.clients), costs)
        else:
            work = estimate("sequential", 1, shape, chunk, costs) / workers
        return work + ship + costs.pool
    speedup = 1.0 if threads == 1 else costs.thread_speedup
    if kind == "sequential":
        rate = (costs.conv_rate if shape.conv else costs.rate) * speedup
        per_update = (costs.step if shape.lean else costs.generic_step) + shape.flops / rate
        return shape.clients * costs.client + updates * per_update
    threshold = costs.big_conv_step_flops if shape.conv else costs.big_step_flops
    big = chunk * shape.flops >= threshold
    scaling = 1.0 if threads == 1 else costs.thread_scaling if big else costs.small_thread_scaling
    rate = (costs.conv_vector_rate if shape.conv else costs.vector_rate) * scaling
    fixed = costs.stacked_step if shape.stacked else costs.vmap_step
    touch = costs.touch if shape.stacked else costs.vmap_touch
    per_client = shape.flops / rate + touch * shape.params / (costs.bandwidth * scaling)
    if shape.conv and shape.stacked:
        per_client += costs.conv_client_step
    chunks = math.ceil(shape.clients / max(1, chunk))
    batched_updates = chunks * shape.steps * shape.updates
    return batched_updates * fixed + updates * per_client + shape.clients * costs.vector_client


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


class AutoExecutor:
    name = "auto"

    def __init__(self, model: FunctionalModel, config: ExecutorConfig) -> None:
        self.model = model
        self.config = config
        self.sequential = SequentialExecutor(model)
        self.vectorized: VectorizedExecutor | None = None
        try:
            self.vectorized = VectorizedExecutor(
                model, config.chunk_size, config.memory_budget, config.device
            )
        except ConfigError:
            if config.device == "cuda":
                raise
            # a model the vectorized executor cannot reproduce (AlphaDropout; nn.Dropout and
            # Dropout1d/2d/3d it runs with the sequential executor's masks): the others only
        self.cores = usable_cores()
        self.pools: dict[str, MultiprocessExecutor] = {}
        """Worker-process candidates by kind ('processes=N': sequential inside,
        'vectorized-processes=N'); their workers are forked only if chosen."""
        if self.cores > 1 and config.device == "cpu":
            workers = config.workers or self.cores
            kinds = ["processes"] + (["vectorized-processes"] if self.vectorized else [])
            self.pools = {f"{k}={workers}": self._new_pool(k, workers) for k in kinds}
        self._clients: dict[int, ClientData] = {}
        self.choice: str | None = None
        """'<kind>/threads=T', kind one of sequential, vectorized, processes=N and
        vectorized-processes=N."""
        self.estimates: dict[str, float] = {}
        """Each candidate's estimated seconds per round (the cost model's, not measured)."""
        self._macs: int | None = None

    def _new_pool(self, kind: str, workers: int) -> MultiprocessExecutor:
        """A worker-process candidate: 'processes' (sequential inside) or
        'vectorized-processes' (sharing the in-process vectorized executor)."""
        inner = (
            self.vectorized if kind == "vectorized-processes" else SequentialExecutor(self.model)
        )
        return MultiprocessExecutor(inner, workers, 1)

    def prepare(self, clients: dict[int, ClientData]) -> None:
        self._clients = dict(clients)
        if self.vectorized is not None:
            try:
                self.vectorized.prepare(clients)
            except NotVmappable:
                if self.config.device == "cuda":
                    raise
                # a model vmap cannot run (engine/vmap_probe.py): the other candidates only
                self.vectorized = None
                self.pools = {k: p for k, p in self.pools.items() if not k.startswith("vectorized")}
        for pool in self.pools.values():
            self._prepare_pool(pool)

    def _prepare_pool(self, pool: MultiprocessExecutor) -> None:
        if pool.inner is self.vectorized:  # prepared in prepare()
            pool.remember(self._clients)
        else:
            pool.prepare(self._clients)

    def close(self) -> None:
        for executor in (self.vectorized, *self.pools.values()):
            if executor is not None:
                executor.close()

    def _executor(self, kind: str) -> Any:
        if kind == "sequential":
            return self.sequential
        if kind == "vectorized":
            assert self.vectorized is not None
            return self.vectorized
        if kind not in self.pools:  # a stored choice of another core count (resume)
            name, workers = kind.split("=")
            self.pools[kind] = self._new_pool(name, int(workers))
            self._prepare_pool(self.pools[kind])
        return self.pools[kind]

    @property
    def batches_clients(self) -> bool:
        return (self.choice or "").startswith("vectorized")

    def _chosen(self) -> Any:
        """The chosen executor (the sequential one before the first round)."""
        return self._executor(self.choice.split("/")[0]) if self.choice else self.sequential

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        return self._chosen().evaluate(models, datas, batch_size)

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        kind, threads = (self.choice or "sequential/threads=1").split("/threads=")
        with torch_threads(int(threads)):
            return self._executor(kind).deployed_models(algorithm, server, states, tasks)

    def _candidates(self, shape: Shape) -> list[tuple[str, int]]:
        """One thread and every core for the vectorized executor; one thread for the
        sequential one, and every core where a step is large enough to gain from them
        (engine/threads.py, SMALL_STEP_MACS); one 1-thread worker process per core.
        ``executor.threads`` pins the in-process candidates' count."""
        pinned = self.config.threads
        threads = sorted({pinned or 1, pinned or self.cores})
        candidates = []
        if self.config.device != "cuda":
            big = shape.batch * shape.macs >= SMALL_STEP_MACS
            candidates = [("sequential", t) for t in threads if t == threads[0] or big]
        if self.vectorized is not None:
            candidates += [("vectorized", t) for t in threads]
        candidates += [(kind, 1) for kind in self.pools]
        return candidates

    def shape(self, algorithm: Algorithm, message: Message, tasks: list[ClientTask]) -> Shape:
        """The round's :class:`Shape`, from its work orders (deterministic: the plans come
        from the run's seed)."""
        module = self.model.module
        plans = [algorithm.client_plan(t) for t in tasks]
        sizes = [b.shape[0] for p in plans for b in p]
        if self._macs is None:
            self._macs = max(1, macs_per_sample(module, tasks[0].data.x_train[0]))
        program = client_program(algorithm)
        return Shape(
            clients=len(tasks),
            steps=sum(len(p) for p in plans) / len(plans),
            updates=max(1.0, program.passes_per_step()),
            batch=sum(sizes) / max(1, len(sizes)),
            params=sum(p.numel() for p in module.parameters() if p.requires_grad),
            macs=self._macs,
            conv=any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules()),
            stacked=all(u.stacked is not None for u in program.updates),
            # fully on the fused trainer (Ditto's personal steps are not)
            lean=type(program).run_lean is not ClientProgram.run_lean and len(program.updates) == 1,
        )

    def choose(self, algorithm: Algorithm, message: Message, tasks: list[ClientTask]) -> str:
        """The candidate of least estimated cost for this round's shape."""
        shape = self.shape(algorithm, message, tasks)
        chunk = shape.clients
        if self.vectorized is not None:
            widest = max((b.shape[0] for t in tasks for b in algorithm.client_plan(t)), default=1)
            chunk = min(shape.clients, self.vectorized.chunk_size(tasks, widest))
        self.estimates = {
            f"{kind}/threads={threads}": estimate(kind, threads, shape, chunk)
            for kind, threads in self._candidates(shape)
        }
        return min(self.estimates, key=self.estimates.__getitem__)

    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        if not tasks:
            return []
        if self.choice is None:
            self.choice = self.choose(algorithm, message, tasks)
        for kind in [k for k in self.pools if not self.choice.startswith(f"{k}/")]:
            self.pools.pop(kind).close()  # not chosen: its workers are never started
        kind, threads = self.choice.split("/threads=")
        with torch_threads(int(threads)):
            return self._executor(kind).run_round(algorithm, message, tasks, states)
