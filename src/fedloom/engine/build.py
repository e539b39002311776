"""What a horizontal run is built from, one small builder each: the clients' data as they train
on it (hidden features, validation split; data/missing.py, data/validation.py), the mechanisms
(engine/mechanisms.py), the algorithm, the training clients, the round pipeline and its
schedule (engine/pipeline.py, engine/asynchrony.py), and the callbacks in their order
(engine/callbacks.py). ``Engine`` (engine/loop.py) is these parts plus the round loop; its
callbacks see them as a read-only :class:`~fedloom.engine.context.RunContext`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedloom.algorithms import ALGORITHMS, Algorithm, AlgorithmContext, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.config import RunConfig, check_client_counts
from fedloom.core import pytree
from fedloom.core.files import one_line
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.data.augment import Augmenter
from fedloom.data.federated import FederatedData
from fedloom.data.missing import hide_features
from fedloom.data.validation import hold_out_validation
from fedloom.data.validation import pooled as pooled_validation
from fedloom.engine.asynchrony import make_schedule
from fedloom.engine.callbacks import (
    AttackReport,
    ColdStart,
    Evaluation,
    HealthMonitor,
    PrivacyAccounting,
    SecureAggregationLog,
)
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.contribution import IncentiveLedger
from fedloom.engine.executor import Executor
from fedloom.engine.factory import make_executor
from fedloom.engine.mechanisms import Mechanisms
from fedloom.engine.pipeline import RoundPipeline, Schedule
from fedloom.engine.rundir import RunDir
from fedloom.engine.sampling import TrainingClients
from fedloom.engine.serving import ServingCopies
from fedloom.errors import ConfigError
from fedloom.models.base import FedModel
from fedloom.peft import build_peft_algorithm
from fedloom.solvers.local import PlanMaker


@dataclass
class Held:
    """The data after the validation split, and the split (None when not held out)."""

    data: FederatedData
    validation: list[ClientData] | None
    pool: ClientData | None


@dataclass(eq=False)
class EngineParts:
    """Everything one run's round loop works with, built by :func:`build_parts`."""

    config: RunConfig
    data: FederatedData
    """The clients' data as they train on it (the malicious clients' poisoned, if any)."""
    model: FunctionalModel
    executor: Executor
    algorithm: Algorithm
    mechanisms: Mechanisms
    train_ids: list[int]
    new_ids: list[int]
    validation: list[ClientData] | None
    """Each client's validation set (eval.validation_fraction; data/validation.py)."""
    validation_pool: ClientData | None
    """All training clients' validation sets as one: the server's held-out set."""
    training: TrainingClients
    evaluation: Evaluation
    pipeline: RoundPipeline
    schedule: Schedule
    """Synchronous rounds, or asynchronous aggregation (engine/asynchrony.py)."""
    callbacks: list[Callback]

    def view(self, run_dir: RunDir | None) -> RunContext:
        """The read-only view the callbacks get."""
        return RunContext(
            config=self.config,
            data=self.data,
            model=self.model,
            algorithm=self.algorithm,
            executor=self.executor,
            run_dir=run_dir,
            train_ids=tuple(self.train_ids),
            new_ids=tuple(self.new_ids),
            training=self.training,
            validation=tuple(self.validation) if self.validation is not None else None,
            validation_pool=self.validation_pool,
            mechanisms=self.mechanisms,
            evaluation=self.evaluation,
        )


def check_model_fits(module: nn.Module, data: FederatedData, name: str, user: bool = False) -> None:
    """ConfigError when ``module`` cannot take one of the data's inputs (a character model on
    images, a CNN on flat vectors): found before training, not as a crash in round 1. A
    ``user`` module (the Python API's ``model=``) is named by its class, and on a
    classification task its output width must be the class count (docs/inputs.md)."""
    client = next((c for c in data.clients if c.num_train), None)
    if client is None:
        return
    label = (
        f"model ({type(module).__name__}, the module you gave)" if user else f"model.name: {name}"
    )
    sample = f"one sample of shape {list(client.x_train.shape[1:])}, {client.x_train.dtype}"
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(client.x_train[:1])
    except (RuntimeError, ValueError, IndexError, TypeError) as err:
        verb, fix = (
            ("cannot take", "; give a module that takes them") if user else ("does not fit", "")
        )
        raise ConfigError(
            f"{label} {verb} {data.name}'s inputs ({sample}): {one_line(err)[:200]}{fix}"
        ) from None
    finally:
        module.train(training)
    if not isinstance(out, torch.Tensor) or out.shape[0] != 1:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{label} gives {got} for one sample of {data.name}")
    if user and data.task == "classification" and out.shape[-1] != data.num_outputs:
        raise ConfigError(
            f"{label} gives {out.shape[-1]} outputs per sample but {data.name} has "
            f"{data.num_outputs} classes; make its last layer {data.num_outputs} wide"
        )


def build_parts(
    config: RunConfig,
    data: FederatedData,
    module: FedModel,
    callbacks: list[Callback] | None = None,
) -> EngineParts:
    """The parts of a run of ``module`` on ``data`` under ``config``; ``callbacks`` run after
    the built-in evaluation, monitoring and privacy accounting and before the run shell's
    metrics row and checkpoint (engine/shell.py)."""
    check_model_fits(module, data, config.model.name)
    module = ALGORITHMS.get(config.algorithm.name).model_for(module, config.algorithm)
    model = FunctionalModel(module, data.task)
    executor = make_executor(config.executor, model)
    if config.data.num_clients != data.num_clients:  # else checked when parsed
        check_client_counts(config, data.num_clients)
    data = hide_features(data, config.data.missing, config.seed)  # data.missing: zeroed
    new = config.eval.new_clients
    train_ids = list(range(data.num_clients - new))
    held = hold_out(config, data, train_ids)
    incentives = IncentiveLedger.build(config)
    extra = [incentives.valuation] if incentives is not None else []
    mechanisms = Mechanisms(config, held.data, module, train_ids, extra)
    algorithm = make_algorithm(config, model, held.data, mechanisms, train_ids)
    training = TrainingClients.view(
        mechanisms.data,
        train_ids,
        config.train.clients_per_round,
        algorithm.capabilities.pooled,
        poisson=mechanisms.poisson_clients,
    )
    evaluation = Evaluation()
    schedule, clock = make_schedule(config, list(training.data))
    pipeline = RoundPipeline(config, algorithm, mechanisms, executor, training)
    own = [*([incentives.payments] if incentives is not None else []), *clock]
    return EngineParts(
        config=config,
        data=mechanisms.data,
        model=model,
        executor=executor,
        algorithm=algorithm,
        mechanisms=mechanisms,
        train_ids=train_ids,
        new_ids=list(range(data.num_clients - new, data.num_clients)),
        validation=held.validation,
        validation_pool=held.pool,
        training=training,
        evaluation=evaluation,
        pipeline=pipeline,
        schedule=schedule,
        callbacks=default_callbacks(config, mechanisms, evaluation, [*(callbacks or []), *own]),
    )


def hold_out(config: RunConfig, data: FederatedData, train_ids: list[int]) -> Held:
    """Each client's validation split (``eval.validation_fraction``), when there is one."""
    fraction = config.validation_fraction()
    if fraction <= 0:
        return Held(data, None, None)
    data, validation = hold_out_validation(data, fraction, config.seed, train_ids)
    return Held(data, validation, pooled_validation(validation[: len(train_ids)]))


def make_algorithm(
    config: RunConfig,
    model: FunctionalModel,
    data: FederatedData,
    mechanisms: Mechanisms,
    train_ids: list[int],
) -> Algorithm:
    """The configured algorithm (a PEFT strategy with its own server step, docs/peft.md, else
    the named one) with the mechanisms' aggregation rule and sample-level DP."""
    train, sample_dp = config.train, mechanisms.sample_dp
    ctx = AlgorithmContext(
        model=model,
        seed=config.seed,
        num_clients=data.num_clients,
        lr=train.lr,
        batch_size=train.batch_size,
        aggregate=mechanisms.aggregator(pytree.weighted_average),
        make_plan=PlanMaker(
            config.seed,
            train.batch_size,
            poisson=sample_dp is not None,
            augment=Augmenter.of(data.augment, config.seed, data.input_shape),
        ),
        rounds=train.rounds,
        population={c: data.clients[c].num_train for c in train_ids},
        sample_dp=sample_dp.dpsgd if sample_dp is not None else None,
        optimizer=train.optimizer.adamw(),
    )
    algorithm = build_peft_algorithm(config, ctx) or build_algorithm(config.algorithm, ctx)
    program = client_program(algorithm)
    if sample_dp is not None and getattr(program, "private", None) is None:
        raise ConfigError(  # declared, but its program has a step of its own
            f"privacy.kind: sample_dp: {algorithm.name}'s client program does not take DP-SGD steps"
        )
    return algorithm


def default_callbacks(
    config: RunConfig,
    mechanisms: Mechanisms,
    evaluation: Evaluation,
    extra: list[Callback],
) -> list[Callback]:
    """The callbacks in their order: evaluation, monitoring, privacy accounting, secure
    aggregation's counters, the attack report and the serving copies; then ``extra`` (the
    caller's, incentive payments, the clock); then the cold-start curve. The run shell's
    metrics row and checkpoint come after all of them (engine/loop.py)."""
    return [
        evaluation,
        *([HealthMonitor()] if config.monitor.enabled else []),
        PrivacyAccounting(mechanisms.all),
        *([SecureAggregationLog(mechanisms.secure)] if mechanisms.secure is not None else []),
        *([AttackReport(mechanisms)] if mechanisms.malicious else []),
        *([ServingCopies(config.serving)] if config.serving.enabled else []),
        *extra,
        ColdStart(),
    ]
