"""The run configuration (README.md, "A config"): pydantic models, strict keys, errors that
name the key.

Each section is defined beside the code it configures: the mechanisms' sections in their
packages (``privacy/config.py``, ``secure/config.py``, ``attacks/config.py``,
``robust/config.py``, ``compression/config.py``, ``peft/config.py``,
``incentives/config.py``), the run's own in ``run_config/``. This module composes them into
``RunConfig``, declares the rules between sections (``RULES``, checked once, when the config
is parsed), and loads YAML; a section is imported from its own package.

Every section forbids unknown keys. Algorithm-specific keys sit beside ``algorithm.name`` and
are validated by that algorithm's own config class when the run config is parsed (the parsed
``algorithm`` is that class's instance, defaults filled in; the engine builds the algorithm from
it without parsing again); dataset-specific keys sit under a key named after the dataset
(``data: {name: synthetic, synthetic: {alpha: 1.0}}``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from fedloom.algorithms import ALGORITHMS, AlgorithmConfig, parse_algorithm_config
from fedloom.attacks.config import AttackConfig
from fedloom.compression.config import CompressionConfig
from fedloom.core.files import one_line
from fedloom.core.settings import Seed, StrictModel
from fedloom.core.validation import check_int64, check_plain_tree, format_validation_error
from fedloom.core.yaml_text import DuplicateKeyError, dump_yaml_text, load_yaml_text
from fedloom.data.partition import PARTITIONS
from fedloom.errors import ConfigError, clipped
from fedloom.incentives.config import EXACT_SHAPLEY_MAX, ContributionConfig, IncentiveConfig
from fedloom.models import MODELS
from fedloom.peft.config import PEFT_MODELS, PeftConfig
from fedloom.privacy.config import PrivacyConfig
from fedloom.robust.config import AggregatorConfig
from fedloom.run_config.asynchrony import AsynchronyConfig
from fedloom.run_config.data import DataConfig, ModelConfig
from fedloom.run_config.executor import ExecutorConfig, StateConfig
from fedloom.run_config.monitor import MonitorConfig, TrackingConfig
from fedloom.run_config.rules import Algorithm, AnyOf, Check, Rule, check_rules, equals, used
from fedloom.run_config.serving import ServingConfig
from fedloom.run_config.train import CheckpointConfig, EvalConfig, TrainConfig
from fedloom.secure.config import SecureAggregationConfig


class RunConfig(StrictModel):
    """A horizontal run: the sections, composed. Each section checks its own keys; the rules
    between sections (``RULES``) are checked once, after all sections are parsed."""

    seed: Seed = 0
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: SerializeAsAny[AlgorithmConfig] = Field(
        default_factory=lambda: parse_algorithm_config({"name": "fedavg"})
    )
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    secure_aggregation: SecureAggregationConfig = Field(default_factory=SecureAggregationConfig)
    attack: AttackConfig = Field(default_factory=AttackConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    asynchrony: AsynchronyConfig = Field(default_factory=AsynchronyConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    peft: PeftConfig | None = None
    contribution: ContributionConfig = Field(default_factory=ContributionConfig)
    incentive: IncentiveConfig = Field(default_factory=IncentiveConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_parsed(cls, value: Any) -> Any:
        """The named algorithm's own Config, once. Its errors (ConfigError, naming
        ``algorithm.KEY``) pass through pydantic unchanged."""
        if isinstance(value, AlgorithmConfig):
            return value
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("algorithm.name is required (see `fedloom algorithms`)")
        return parse_algorithm_config(value)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> RunConfig:
        """The rules between sections (``RULES``), here and nowhere else."""
        check_rules(self, RULES)
        return self

    def clients_per_round_nominal(self) -> int | None:
        """train.clients_per_round, else every training client (when the count is known)."""
        if self.train.clients_per_round is not None:
            return self.train.clients_per_round
        if self.data.num_clients is not None:
            return self.data.num_clients - self.eval.new_clients
        return None

    def validation_fraction(self) -> float:
        """The validation split the run holds out: ``eval.validation_fraction``, or more when
        another part of the config needs a validation set of its own size."""
        fractions = [self.eval.validation_fraction]
        if self.contribution.kind != "none":
            fractions.append(self.contribution.validation_fraction)
        return max(fractions)

    def byzantine_f(self, n: int) -> int:
        """aggregator.f, else the attack's expected malicious clients among n (1 without)."""
        if self.aggregator.f is not None:
            return self.aggregator.f
        if self.attack.kind != "none":
            return math.ceil(self.attack.fraction * n)
        return 1

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return dump_yaml_text(self.to_dict(), sort_keys=False)


# -- the rules between sections ------------------------------------------------------------
AVERAGES_MODELS = Algorithm(has=("averages_client_models", "communicates"))
"""The server step averages the clients' uploaded models (the FedAvg family)."""
ASYNCHRONOUS = Algorithm(has=("averages_client_models", "communicates"), lacks=("pooled",))
"""A stale model can be folded into the server step (asynchrony.kind fedasync, fedbuff)."""
GLOBAL_MODEL = Algorithm(has=("has_global_model", "communicates"), lacks=("pooled",))
"""A global model built from the round's uploads (contribution valuation)."""

PRETRAINED = equals("model.name", *PEFT_MODELS)
CLIENT_DP = equals("privacy.kind", "client_dp")
SECURE = used("secure_aggregation.kind")
PER_ROUND = used("train.clients_per_round", None)
NOMINAL = Check(lambda c: c.clients_per_round_nominal() is not None)


def asynchronous_algorithms() -> list[str]:
    """Algorithms that asynchrony.kind fedasync and fedbuff apply to: those whose server step
    is a function of the average of the uploaded models (``averages_client_models``)."""
    return ASYNCHRONOUS.supported()


def client_count_error(config: RunConfig, num_clients: int) -> str | None:
    """What is wrong with ``eval.new_clients`` and ``train.clients_per_round`` for
    ``num_clients`` clients, or None."""
    new, per_round = config.eval.new_clients, config.train.clients_per_round
    if new >= num_clients:
        return f"eval.new_clients: {new} leaves no client to train (there are {num_clients})"
    if per_round is not None and per_round > num_clients - new:
        return (
            f"train.clients_per_round: {per_round} is more than the {num_clients - new} "
            f"training clients (data.num_clients={num_clients}, eval.new_clients={new})"
        )
    return None


def check_client_counts(config: RunConfig, num_clients: int) -> None:
    """``eval.new_clients`` and ``train.clients_per_round`` against the number of clients: when
    the config is parsed if it states ``data.num_clients`` (a rule of ``RULES``), else when the
    engine is handed data of its own (Python API)."""
    error = client_count_error(config, num_clients)
    if error is not None:
        raise ConfigError(error)


def _stated_counts_error(config: RunConfig) -> str | None:
    assert config.data.num_clients is not None
    return client_count_error(config, config.data.num_clients)


def _count_noise(config: RunConfig) -> float:
    """privacy.adaptive_clip.count_noise, else clients_per_round / 20 (Andrew et al.)."""
    adaptive, per_round = config.privacy.adaptive_clip, config.train.clients_per_round
    assert adaptive is not None and per_round is not None
    return adaptive.count_noise if adaptive.count_noise is not None else per_round / 20.0


def _count_noise_error(config: RunConfig) -> str:
    return (
        f"privacy.adaptive_clip.count_noise: {_count_noise(config):g} (null: "
        f"clients_per_round / 20) is too small for noise_multiplier "
        f"{config.privacy.noise_multiplier:g}: it must exceed noise_multiplier / 2 "
        "(Andrew et al. 2021, Theorem 1)"
    )


def _byzantine_need(config: RunConfig) -> int:
    """Clients a round that Krum (n > 2f + 2) or Bulyan (n >= 4f + 3) needs."""
    n = config.clients_per_round_nominal()
    assert n is not None
    f = config.byzantine_f(n)
    return 4 * f + 3 if config.aggregator.kind == "bulyan" else 2 * f + 3


def _byzantine_error(config: RunConfig) -> str:
    n = config.clients_per_round_nominal()
    assert n is not None
    kind = config.aggregator.kind
    rule = "n >= 4f + 3" if kind == "bulyan" else "n > 2f + 2"
    return (
        f"aggregator.kind {kind} with f={config.byzantine_f(n)} needs at least "
        f"{_byzantine_need(config)} clients a round ({rule}); train.clients_per_round gives {n}"
    )


def _secure_group(config: RunConfig) -> int:
    """The clients a SecAgg threshold counts: a round's (SecAgg+: a client's neighbours)."""
    n = config.clients_per_round_nominal()
    assert n is not None
    neighbours = config.secure_aggregation.neighbours
    return min(n, neighbours) if neighbours is not None else n


def _secure_group_name(config: RunConfig) -> str:
    if config.secure_aggregation.neighbours is not None:
        return "neighbours of a client (secure_aggregation.neighbours, at most the round's)"
    return "clients a round (train.clients_per_round)"


RULES: tuple[Rule, ...] = (
    # serving: the best model is selected on the validation split, never on the test sets
    Rule(
        when=equals("serving.keep_best", True),
        requires=Check(lambda c: c.validation_fraction() > 0),
        message="serving.keep_best: the best model is chosen on a validation split: set "
        "eval.validation_fraction (e.g. 0.1)",
    ),
    # peft: a peft section goes with a frozen pretrained model and vice versa (docs/peft.md)
    Rule(
        when=PRETRAINED,
        requires=used("peft", None),
        message="model.name: {model.name} is a frozen pretrained model: add a peft section "
        "(peft: {{kind: lora | adapter | prompt, ...}})",
    ),
    Rule(
        when=used("peft", None),
        requires=PRETRAINED,
        message=f"peft: needs a pretrained model (model.name: {' | '.join(PEFT_MODELS)}), "
        "got {model.name}",
    ),
    Rule(
        when=PRETRAINED,
        excludes=equals("model.freeze", False),
        message="model.freeze: false is not supported: the backbone stays frozen and only the "
        "peft parameters and the head train",
    ),
    # the client counts, when the config states data.num_clients
    Rule(
        when=used("data.num_clients", None),
        requires=Check(lambda c: _stated_counts_error(c) is None),
        message=lambda c: str(_stated_counts_error(c)),
    ),
    # privacy: sample_dp needs clients that run DP-SGD's steps (``supports_sample_dp``);
    # client_dp a server step that averages models and a sampling rate
    Rule(
        when=equals("privacy.kind", "sample_dp"),
        requires=Algorithm(has=("supports_sample_dp",)),
        message="privacy.kind: sample_dp needs an algorithm whose clients run plain local SGD "
        "steps (DP-SGD replaces their gradient); {algorithm.name} has local work of its own. "
        "Supported: {supported}",
    ),
    Rule(
        when=CLIENT_DP,
        requires=AVERAGES_MODELS,
        message="privacy.kind: client_dp needs an algorithm whose server averages the clients' "
        "models (fedavg, fedprox, fedopt's family, ...); {algorithm.name} does not",
    ),
    Rule(
        when=CLIENT_DP,
        requires=PER_ROUND,
        message="privacy.kind: client_dp samples clients each round: set "
        "train.clients_per_round (the sampling rate is clients_per_round / clients)",
    ),
    Rule(  # with target_epsilon, the noise multiplier is known only when the run starts
        when=(
            CLIENT_DP,
            PER_ROUND,
            used("privacy.adaptive_clip", None),
            used("privacy.noise_multiplier", None, 0.0),
        ),
        requires=Check(lambda c: 2.0 * _count_noise(c) > c.privacy.noise_multiplier),
        message=_count_noise_error,
    ),
    # distributed DP: the clients' noised integers are summed by SecAgg / SecAgg+ only
    Rule(
        when=equals("privacy.kind", "distributed_dp"),
        requires=equals("secure_aggregation.kind", "secagg", "secagg_plus"),
        message="privacy.kind: distributed_dp sums the clients' noised integer vectors with "
        "secure aggregation: set secure_aggregation.kind to secagg or secagg_plus (got "
        "{secure_aggregation.kind})",
    ),
    # secure aggregation sums the clients' model updates: the server step must average models
    Rule(
        when=SECURE,
        requires=AVERAGES_MODELS,
        message="secure_aggregation.kind: {secure_aggregation.kind} needs an algorithm whose "
        "server averages the clients' models (fedavg, fedprox, fedopt's family, ...); "
        "{algorithm.name} does not",
    ),
    # robust rules read every update in the clear; Krum and Bulyan need enough clients
    Rule(
        when=used("aggregator.kind", "mean"),
        excludes=(SECURE, CLIENT_DP),
        message="aggregator.kind {aggregator.kind} needs each client's update in the clear: "
        "it does not combine with {clash}",
    ),
    Rule(
        when=(equals("aggregator.kind", "krum", "multi_krum", "bulyan"), NOMINAL),
        requires=Check(lambda c: c.clients_per_round_nominal() >= _byzantine_need(c)),
        message=_byzantine_error,
    ),
    Rule(
        when=(used("aggregator.m", None), NOMINAL),
        requires=Check(lambda c: c.aggregator.m <= c.clients_per_round_nominal()),
        message="aggregator.m: multi_krum averages m of the round's updates; {aggregator.m} "
        "is more than the {n} clients a round (train.clients_per_round): every round would be "
        "skipped. Use at most {n}, or null (n - f)",
    ),
    # secure aggregation: the survivors a round needs cannot exceed the clients it has
    Rule(
        when=(used("secure_aggregation.threshold", None), NOMINAL),
        requires=Check(lambda c: c.secure_aggregation.threshold <= _secure_group(c)),
        message=lambda c: (
            f"secure_aggregation.threshold: {c.secure_aggregation.threshold} is more than the "
            f"{_secure_group(c)} {_secure_group_name(c)}: every round would abort. Use at "
            "most that, or null (a strict majority)"
        ),
    ),
    # asynchrony folds stale models into the server step; the round-synchronous protocols
    # (DP accounting, secure aggregation, robust rules, dropout, stragglers) do not apply
    Rule(
        when=used("asynchrony.kind"),
        requires=ASYNCHRONOUS,
        message="asynchrony.kind: {asynchrony.kind} needs an algorithm whose server step "
        "averages the clients' models (a stale model can be folded into it); "
        "{algorithm.name}'s is not. Supported: {supported}",
    ),
    Rule(
        when=used("asynchrony.kind"),
        excludes=(
            used("privacy.kind"),
            SECURE,
            used("aggregator.kind", "mean"),
            used("train.dropout", 0.0),
            used("train.stragglers", 0.0),
        ),
        message="asynchrony.kind: {asynchrony.kind} does not combine with {clash}: these are "
        "round-synchronous (slow clients are modelled by asynchrony.speeds)",
    ),
    # compression encodes uploads the server reads one by one (docs/compression.md, Limits)
    Rule(
        when=AnyOf((used("compression.kind"), used("compression.download"))),
        requires=Algorithm(has=("communicates",)),
        message="compression: {algorithm.name} sends nothing to compress",
    ),
    Rule(
        when=used("compression.kind"),
        excludes=(SECURE, CLIENT_DP),
        message="compression.kind: {compression.kind} does not combine with {clash} (see "
        "docs/compression.md, Limits)",
    ),
    # contribution values each upload in the clear by the global model it builds; fli and
    # shapley pay by contribution (docs/incentives.md)
    Rule(
        when=equals("incentive.kind", "fli", "shapley"),
        requires=used("contribution.kind"),
        message="incentive.kind: {incentive.kind} pays by contribution: set contribution.kind "
        "(exact, loo, tmc or gtg), or choose incentive.kind equal, samples or cost",
    ),
    Rule(
        when=AnyOf((used("contribution.kind"), used("incentive.kind"))),
        excludes=used("asynchrony.kind"),
        message="contribution and incentive value and pay the clients of synchronous rounds; "
        "set asynchrony.kind: none",
    ),
    Rule(
        when=used("incentive.kind"),
        requires=Algorithm(lacks=("pooled",)),
        message="incentive.kind: {incentive.kind} pays the clients of a round; "
        "{algorithm.name} trains one pooled virtual client",
    ),
    Rule(
        when=used("contribution.kind"),
        requires=GLOBAL_MODEL,
        message="contribution.kind: {contribution.kind} values clients by the global model "
        "their uploads build; {algorithm.name} has no global model built from uploads",
    ),
    Rule(
        when=used("contribution.kind"),
        excludes=(SECURE, CLIENT_DP),
        message="contribution.kind: {contribution.kind} builds a model from every coalition of "
        "a round's uploads: it needs them in the clear (not secure_aggregation) and unreleased "
        "(client_dp's accountant does not count the coalition models); got {clash}",
    ),
    Rule(
        when=(equals("contribution.kind", "exact"), NOMINAL),
        requires=Check(lambda c: c.clients_per_round_nominal() <= EXACT_SHAPLEY_MAX),
        message="contribution.kind: exact evaluates 2^n coalitions a round; {n} clients a "
        f"round is more than {EXACT_SHAPLEY_MAX}: use gtg or tmc",
    ),
)
"""Every rule between sections, in the order they are checked: the first one a config
breaks is its error (run_config/rules.py says how a rule reads)."""


DEFAULT_EXPERIMENT: dict[str, Any] = {
    "seed": 0,
    "data": {"name": "digits", "num_clients": 30, "partition": {"kind": "dirichlet", "alpha": 0.3}},
    "model": {"name": "cnn"},
    "algorithm": {"name": "fedavg_ft", "finetune_steps": 10},
    "train": {
        "rounds": 100,
        "clients_per_round": 10,
        "local_epochs": 2,
        "batch_size": 16,
        "lr": 0.05,
    },
    "eval": {"every": 5},
    "checkpoint": {"every": 20},
}
"""``fedloom run`` without a file: scikit-learn's bundled digits, no download."""


def parse_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a raw mapping into a RunConfig; raise ConfigError naming the key on failure."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    if "kind" in raw:  # the run family (fedloom.api.run_kind): this parser's is horizontal
        if raw["kind"] != "horizontal":
            raise ConfigError(
                f"kind: {clipped(repr(raw['kind']))} is not a horizontal run's config"
            )
        raw = {k: v for k, v in raw.items() if k != "kind"}
    check_int64(raw)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RunConfig)) from None


EMPTY_CONFIG = "empty config: give a file with keys, or no file for the default experiment"
"""The error for a config file without keys (``fedloom run`` without a file runs
``DEFAULT_EXPERIMENT``)."""


def load_yaml(path: str | Path, empty: str = EMPTY_CONFIG) -> dict[str, Any]:
    """The YAML file at ``path`` (``core/yaml_text.py``: a duplicate key is an error); a file
    that holds nothing (no text, only comments, ``null``) is the ConfigError ``empty``."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give the YAML file itself")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = load_yaml_text(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a YAML config (not UTF-8 text)") from None
    except DuplicateKeyError as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {clipped(one_line(err), 300)}") from None
    if raw is None:  # no text, only comments, or `null`
        raise ConfigError(f"{path}: {empty}")
    check_plain_tree(raw, str(path))
    return raw


_SWITCHES: dict[tuple[str, ...], str] = {
    ("algorithm",): "name",
    ("data",): "name",
    ("data", "partition"): "kind",
    ("model",): "name",
}
"""Sections whose keys belong to one choice (the algorithm, the dataset, the partition kind, the
model): a
``--set`` naming another choice keeps every key written for the old one (each must be a key of
the new choice) and replaces only the embedded defaults' keys."""


_CHOICES = {
    ("algorithm",): "algorithm",
    ("data",): "dataset",
    ("data", "partition"): "partition",
    ("model",): "model",
}
"""What each switch of ``_SWITCHES`` chooses, as messages name it."""


def _foreign_keys(section: tuple[str, ...], keys: dict[str, Any], old: Any) -> list[str]:
    """The keys of ``section`` that the choice it now holds does not have. An algorithm's or a
    partition's keys are its Config's fields (a choice that does not exist is the parser's
    error); every dataset has the data section's keys, and only the old dataset's options (the
    mapping under its name) are not the new one's; a model's keys are the section's own and its
    options (models/spec.py)."""
    name = keys.get(_SWITCHES[section])
    if section == ("data",):
        return [k for k in keys if k == old and k != name]
    if section == ("model",):
        spec = MODELS.get(name) if isinstance(name, str) and name in MODELS else None
        options = spec.options.model_fields if spec is not None else {}
        return [k for k in keys if k not in ModelConfig.model_fields and k not in options]
    registry = ALGORITHMS if section == ("algorithm",) else PARTITIONS
    if not isinstance(name, str) or name not in registry:
        return []
    entry = registry.get(name)
    fields = entry.Config.model_fields if section == ("algorithm",) else entry.model_fields
    return [k for k in keys if k not in fields]


def _check_switched(
    raw: dict[str, Any],
    section: tuple[str, ...],
    old: Any,
    set_paths: set[tuple[str, ...]],
    written_in: str,
) -> None:
    """Every key left in a switched ``section`` is one of its new choice's, else ConfigError
    naming the key, the choice and where the key was written."""
    keys = _find_section(raw, section)
    foreign = _foreign_keys(section, keys, old) if keys is not None else []  # None: set null
    if foreign:
        path = (*section, foreign[0])
        by_set = any(p[: len(path)] == path for p in set_paths)
        raise ConfigError(
            f"{'.'.join(path)}: not a key of {_CHOICES[section]} "
            f"'{keys.get(_SWITCHES[section])}' (written in {'--set' if by_set else written_in}): "
            "remove it there"
        )


def default_experiment(dataset: str | None, rl_envs: tuple[str, ...] = ()) -> dict[str, Any]:
    """What ``fedloom run`` without a config file starts from: ``DEFAULT_EXPERIMENT``; for
    another ``dataset`` (``--set data.name=X``) only its algorithm and schedule (its CNN is for
    digits' images), and for an RL environment (``rl_envs``) nothing (the RL defaults)."""
    if dataset is None or dataset == DEFAULT_EXPERIMENT["data"]["name"]:
        return DEFAULT_EXPERIMENT
    if dataset in rl_envs:
        return {}
    return {k: v for k, v in DEFAULT_EXPERIMENT.items() if k != "model"}


def from_default(err: Exception, overrides: list[str]) -> Exception:
    """``err`` saying that its key came from the built-in default experiment when no
    ``--set`` named it (a run without a config file)."""
    key = str(err).split(":", 1)[0].strip()
    named = {item.split("=", 1)[0].strip() for item in overrides}
    if not isinstance(err, ConfigError) or " " in key or key in named:
        return err
    return ConfigError(
        f"{err} ({key} is the built-in default experiment's, used without a config file: "
        "set it with --set, or start from a config file such as examples/mnist.yaml)"
    )


_ALTERNATIVES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("train", "local_epochs"): ("train", "local_steps"),
    ("train", "local_steps"): ("train", "local_epochs"),
}
"""Keys that exclude each other: a ``--set`` of one replaces the file's other."""


def _parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {clipped(repr(item))}: expected key.path=value")
    path, text = item.split("=", 1)
    keys = tuple(k for k in path.strip().split(".") if k)
    if not keys:
        raise ConfigError(f"--set {clipped(repr(item))}: empty key")
    shown = f"--set {clipped(repr(item))}"
    try:
        value = load_yaml_text(text)
        check_plain_tree(value, shown)
        return keys, value
    except DuplicateKeyError as err:
        raise ConfigError(f"{shown}: {err}") from None
    except yaml.YAMLError as err:
        msg = f"{shown}: the value is not a YAML scalar or list: {clipped(one_line(err), 300)}"
        raise ConfigError(msg) from None


def _find_section(raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The mapping at ``keys``, or None if a part of the path is absent."""
    node: Any = raw
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _section(raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The mapping at ``keys``, creating absent (or null) sections on the way."""
    node = raw
    for i, key in enumerate(keys):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(keys[: i + 1])}: '{key}' is not a section")
        node = child
    return node


def apply_overrides(
    raw: dict[str, Any], overrides: list[str], written_in: str | None = "the config"
) -> dict[str, Any]:
    """Apply ``--set key.path=value`` overrides (values parsed as YAML scalars/lists) to
    ``raw``: the keys written ``written_in`` (a file's name), or None when ``raw`` is the
    embedded default experiment (``DEFAULT_EXPERIMENT``), whose keys nobody wrote.

    Nothing written is dropped: ``--set algorithm.name=X`` (or ``data.name``,
    ``data.partition.kind``) naming another choice keeps the section's written keys, and each
    must be a key of X (else ConfigError naming the key, X and where it was written); of the
    defaults, that section starts afresh (the old choice's keys would not apply to X) before
    the other ``--set`` keys land in it. Setting one of ``train.local_epochs`` /
    ``train.local_steps`` removes the file's other (both set by ``--set`` stays an error)."""
    raw = yaml.safe_load(yaml.safe_dump(raw))  # deep copy of plain data
    parsed = [_parse_override(item) for item in overrides]
    switched: list[tuple[tuple[str, ...], Any]] = []
    for keys, value in parsed:
        if keys[:-1] in _SWITCHES and keys[-1] == _SWITCHES[keys[:-1]]:
            section = _find_section(raw, keys[:-1])
            old = None if section is None else section.get(keys[-1])
            if old != value:
                switched.append((keys[:-1], old))
                if written_in is None:
                    _section(raw, keys[:-2])[keys[-2]] = {keys[-1]: value}
    set_paths = {keys for keys, _ in parsed}
    for keys, value in parsed:
        other = _ALTERNATIVES.get(keys)
        if other is not None and value is not None and other not in set_paths:
            section = _find_section(raw, other[:-1])
            if section is not None:
                section.pop(other[-1], None)
        _section(raw, keys[:-1])[keys[-1]] = value
    for section_keys, old in switched:
        _check_switched(raw, section_keys, old, set_paths, written_in or "the default experiment")
    return raw


def resolve_config(config: Any) -> RunConfig:
    """Accept a RunConfig, a mapping, or a YAML path."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, str | Path):
        return parse_config(load_yaml(config))
    if config is None:
        return parse_config(DEFAULT_EXPERIMENT)
    return parse_config(config)
