"""The run configuration (README.md, "A config"): pydantic models, strict keys, errors that
name the key.

Every section forbids unknown keys. Algorithm-specific keys sit beside ``algorithm.name`` and
are validated by that algorithm's own config class when the run config is parsed (the parsed
``algorithm`` is that class's instance, defaults filled in; the engine builds the algorithm from
it without parsing again); dataset-specific keys sit under a key named after the dataset
(``data: {name: synthetic, synthetic: {alpha: 1.0}}``).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PositiveInt,
    SerializeAsAny,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from fedloom.algorithms import ALGORITHMS, AlgorithmConfig, parse_algorithm_config
from fedloom.core.validation import format_validation_error
from fedloom.data.missing import MissingFeatures
from fedloom.errors import ConfigError


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(StrictModel):
    name: str = "digits"
    root: str | None = None
    num_clients: int | None = Field(default=None, ge=1)
    partition: dict[str, Any] | None = None
    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    missing: MissingFeatures | None = None
    """Clients lacking input features: {kind: columns | regions, fraction, clients}
    (data/missing.py, docs/missing_features.md)."""
    max_length: int | None = Field(default=None, ge=1)
    """Text datasets (bbc_news): tokens per sample, padded or truncated (default 32)."""
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _dataset_options(cls, value: Any) -> Any:
        """Move the sub-dict keyed by the dataset's name into ``options``."""
        if isinstance(value, dict):
            value = dict(value)
            name = value.get("name", "digits")
            if isinstance(name, str) and name in value and name not in cls.model_fields:
                opts = value.pop(name)
                if opts is not None and not isinstance(opts, dict):
                    raise ValueError(f"data.{name} must be a mapping of {name}'s options")
                value["options"] = opts or {}
        return value

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        options = out.pop("options", {})
        if options:
            out[self.name] = options
        return out


class ModelConfig(StrictModel):
    name: str = "mlp"
    freeze: bool = True
    """Pretrained models (minilm, tiny_bert): the backbone stays frozen; only the ``peft``
    parameters and the head train (docs/peft.md)."""


PEFT_MODELS = ("minilm", "tiny_bert")
LORA_TARGETS = ("query", "key", "value", "attention_output", "intermediate", "output")


class PeftConfig(StrictModel):
    """Parameter-efficient fine-tuning of a frozen pretrained transformer (docs/peft.md)."""

    kind: Literal["lora", "adapter", "prompt"] = "lora"
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0.0)
    targets: list[str] = Field(default_factory=lambda: ["query", "value"], min_length=1)
    share: Literal["a", "b", "both", "ffa", "flora", "fedex"] = "a"
    """lora: which factors the server aggregates (a: FedSA-LoRA, b personal; b: A personal;
    both: FedIT; ffa: A frozen, B shared; flora: stacking; fedex: residual)."""
    rank_by_size: bool = False
    """HetLoRA with fedloom's size rule (docs/peft.md) r_k = floor(r log(n_k + 1) /
    log(n_max + 1)) (share both)."""
    head: Literal["shared", "personal"] = "shared"
    bottleneck: int = Field(default=16, ge=1)
    prompt_length: int = Field(default=8, ge=0)
    personal_prompt_length: int = Field(default=0, ge=0)
    aggregation: Literal["spherical", "mean"] = "spherical"
    """prompt: the server's rule for the shared prompt (spherical mean or weighted mean)."""

    @model_validator(mode="after")
    def _combinations(self) -> PeftConfig:
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ConfigError(
                f"peft.targets: unknown {', '.join(bad)}; allowed: {', '.join(LORA_TARGETS)}"
            )
        if self.rank_by_size and (self.kind != "lora" or self.share != "both"):
            raise ConfigError(
                "peft.rank_by_size: HetLoRA's ranks need kind: lora and share: both "
                f"(got kind: {self.kind}, share: {self.share})"
            )
        if self.kind == "prompt" and self.prompt_length + self.personal_prompt_length == 0:
            raise ConfigError("peft.prompt_length: prompt tuning needs at least one prompt token")
        return self


class WorkDistribution(StrictModel):
    """Local work (epochs or steps) that differs between clients (system heterogeneity).

    - ``uniform {low, high}``: an integer drawn uniformly from low..high (inclusive);
    - ``choice {values, probs}``: one of ``values`` (with ``probs``, else uniformly);
    - ``per_client {values}``: client i always does ``values[i]``.
    Random draws are made afresh every round (``per: round``) or once per client for the whole
    run (``per: client``), from the stream (seed, round, client, 'work').
    """

    kind: Literal["uniform", "choice", "per_client"]
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    values: list[int] | None = None
    probs: list[float] | None = None
    per: Literal["round", "client"] = "round"

    @model_validator(mode="after")
    def _complete(self) -> WorkDistribution:
        if self.kind == "uniform":
            if self.low is None or self.high is None or self.low > self.high:
                raise ValueError("kind uniform needs integers low <= high (both >= 1)")
        else:
            if not self.values or any(v < 1 for v in self.values):
                raise ValueError(f"kind {self.kind} needs values: a list of integers >= 1")
            if self.probs is not None:
                if self.kind != "choice":
                    raise ValueError("probs applies only to kind choice")
                if len(self.probs) != len(self.values) or any(q < 0 for q in self.probs):
                    raise ValueError("probs needs one non-negative number per value")
                if abs(sum(self.probs) - 1.0) > 1e-6:
                    raise ValueError(f"probs must sum to 1 (got {sum(self.probs)})")
        return self


def _work_kind(value: Any) -> str:
    return "distribution" if isinstance(value, dict | WorkDistribution) else "count"


Work = Annotated[
    Annotated[PositiveInt, Tag("count")] | Annotated[WorkDistribution, Tag("distribution")],
    Discriminator(_work_kind),
]
"""A fixed number, or a WorkDistribution mapping."""


class TrainConfig(StrictModel):
    rounds: int = Field(default=20, ge=1)
    clients_per_round: int | None = Field(default=None, ge=1)
    local_epochs: Work | None = None
    local_steps: Work | None = None
    batch_size: int | None = Field(default=32, ge=1)
    lr: float = Field(default=0.05, gt=0.0)
    stragglers: float = Field(default=0.0, ge=0.0, lt=1.0)
    straggler_mode: Literal["partial", "drop"] = "partial"
    """partial: a straggler does a uniform share 1..S of its S steps and is aggregated;
    drop: the server drops it (FedProx paper: FedAvg drops stragglers, FedProx keeps them)."""
    nonfinite: Literal["error", "drop"] = "error"
    """A client whose loss, upload or state is not finite (diverged): error: stop the run naming
    the client, the round and what to lower; drop: leave it out of that round's aggregation
    (its personalized state keeps its previous value) and count it (``dropped_nonfinite``)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of each round's sampled clients that vanish mid-round (engine/dropout.py):
    floor(dropout x sampled) of them, each at a stage drawn uniformly from secure
    aggregation's three (after advertising keys, after sharing them, after sending its masked
    input). The first two never upload; the last has uploaded and is summed. The same
    clients drop at the same stages under every ``secure_aggregation.kind``, so runs show
    what each protocol survives (docs/secure_aggregation.md)."""

    @model_validator(mode="after")
    def _one_budget(self) -> TrainConfig:
        if self.local_epochs is not None and self.local_steps is not None:
            raise ValueError(
                "set exactly one of train.local_epochs and train.local_steps, not both"
            )
        if self.local_epochs is None and self.local_steps is None:
            object.__setattr__(self, "local_epochs", 1)
        return self


class EvalConfig(StrictModel):
    every: int = Field(default=5, ge=1)
    new_clients: int = Field(default=0, ge=0)
    """Clients held out of training entirely; evaluated every round as they would be served,
    and at the end by the cold-start evaluation (accuracy vs adaptation steps)."""
    batch_size: int = Field(default=1024, ge=1)
    adaptation_steps: list[int] = Field(default=[0, 1, 5, 20], min_length=1)
    """Cold start: a new client's accuracy after each of these many fine-tuning steps."""
    adapt_lr: float | None = Field(default=None, gt=0)
    """Cold start step size (default: the algorithm's own, e.g. Per-FedAvg's alpha, else
    train.lr)."""
    validation_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of each training client's train set held out as its validation set, which no
    client trains on (data/validation.py). Metrics rows then get a ``validation`` entry:
    what hyperparameter search, keeping the best model and contribution evaluation read,
    so that the test sets stay untouched."""

    @field_validator("adaptation_steps")
    @classmethod
    def _sorted_steps(cls, steps: list[int]) -> list[int]:
        if any(s < 0 for s in steps):
            raise ValueError("adaptation steps must be >= 0")
        return sorted(set(steps))


class CheckpointConfig(StrictModel):
    every: int | None = Field(default=10, ge=1)
    keep: int = Field(default=2, ge=1)


EXACT_SHAPLEY_MAX = 12
"""contribution.kind exact: the most clients a round (2^12 coalition models)."""

DEFAULT_BUDGET = 2 * 2**30
"""executor.memory_budget when none is given: 2 GiB."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


def parse_bytes(text: str | int | None) -> int:
    """'2GB', '512MiB', '1e9' or an int -> bytes (None: the 2 GiB default)."""
    if text is None:
        return DEFAULT_BUDGET
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r}; write e.g. '512MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


class ExecutorConfig(StrictModel):
    """Where and how clients train (engine/factory.py). Every combination is checked here,
    once, when the config is parsed."""

    kind: Literal["auto", "sequential", "vectorized", "ray"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    workers: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)
    chunk_size: int | None = Field(default=None, ge=1)
    memory_budget: str | None = None
    address: str | None = None

    @field_validator("kind")
    @classmethod
    def _ray_installed(cls, kind: str) -> str:
        if kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "'ray' needs Ray, an optional extra that is not installed: "
                "pip install 'fedloom[ray]' (or choose kind: auto, sequential or vectorized)"
            )
        return kind

    @field_validator("device")
    @classmethod
    def _device_runs_it(cls, device: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if device == "cuda" and kind in ("sequential", "ray"):
            raise ValueError(
                f"'cuda' is not supported by the {kind} executor (it trains on the CPU); use "
                "device: cpu, or kind: vectorized (or auto) on a GPU"
            )
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("'cuda' was asked for but torch sees no CUDA device")
        return device

    @field_validator("workers")
    @classmethod
    def _workers_on_cpu(cls, workers: int | None, info: ValidationInfo) -> int | None:
        if workers and workers > 1 and info.data.get("device") == "cuda":
            raise ValueError("worker processes run on the CPU only")
        return workers

    @field_validator("memory_budget")
    @classmethod
    def _readable_budget(cls, value: str | None) -> str | None:
        parse_bytes(value)
        return value


class AdaptiveClipConfig(StrictModel):
    """Adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive
    Clipping", NeurIPS 2021): the bound follows the ``target_quantile`` of the clients' update
    norms, C <- C exp(-lr (b - target_quantile)), b the noised fraction of updates within C."""

    target_quantile: float = Field(default=0.5, gt=0.0, lt=1.0)
    lr: float = Field(default=0.2, gt=0.0)
    count_noise: float | None = Field(default=None, ge=0.0)
    """Std of the noise on the count of clipped updates (null: expected clients per round /
    20, the paper's choice); part of the privacy budget (docs/privacy.md)."""


class PrivacyConfig(StrictModel):
    """Differential privacy (docs/privacy.md).

    - ``client_dp``: DP-FedAvg (McMahan et al. 2018): each client's model update clipped to L2
      norm ``clip``, Gaussian noise of std ``noise_multiplier * clip`` on their sum, divided by
      the expected number of clients per round; accounted with Opacus as ``rounds`` steps of
      the subsampled Gaussian mechanism.
    - ``sample_dp``: DP-SGD inside every client (Abadi et al. 2016, Opacus's semantics):
      Poisson minibatches of expected size ``train.batch_size``, each per-sample gradient
      clipped to L2 norm ``clip``, Gaussian noise of std ``noise_multiplier * clip`` on their
      sum; each client's steps accounted with Opacus, the largest epsilon reported."""

    kind: Literal["none", "client_dp", "sample_dp"] = "none"
    noise_multiplier: float | None = Field(default=None, ge=0.0)
    target_epsilon: float | None = Field(default=None, gt=0.0)
    """Instead of ``noise_multiplier``: the smallest noise that keeps epsilon at the last round
    within this (Opacus's ``get_noise_multiplier``)."""
    clip: float = Field(default=1.0, gt=0.0)
    """client_dp: the bound S on each client's update (with ``adaptive_clip``: its first
    value); sample_dp: the bound C on each per-sample gradient."""
    adaptive_clip: AdaptiveClipConfig | None = None
    """client_dp only."""
    delta: float = Field(default=1e-5, gt=0.0, lt=1.0)
    accountant: Literal["rdp", "prv"] = "rdp"
    sampling: Literal["poisson", "fixed"] = "poisson"
    """client_dp: how the clients of a round are drawn: each training client independently
    with probability q = train.clients_per_round / clients (what the accountant assumes), or
    exactly train.clients_per_round of them (the accountant's q = m / N is then the usual
    approximation). sample_dp always draws Poisson minibatches and leaves client sampling as
    train sets it."""

    @model_validator(mode="after")
    def _complete(self) -> PrivacyConfig:
        if self.kind == "none":
            return self
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        if self.kind == "sample_dp" and self.adaptive_clip is not None:
            raise ValueError("adaptive_clip applies to kind client_dp only")
        return self


class SecureAggregationConfig(StrictModel):
    """Secure aggregation (docs/secure_aggregation.md): the server learns the weighted sum of
    the clients' model updates and nothing else. Each client sends [w_k Delta_k, w_k], w_k its
    sample count over the round's largest, every coordinate clipped to [-clip, clip].

    - ``secagg``: SecAgg (Bonawitz et al. 2017), pairwise masks between all clients;
    - ``secagg_plus``: SecAgg+ (Bell et al. 2020), masks between ``neighbours`` per client;
    - ``paillier``: Paillier encryption, slot-packed, decrypted by a key authority;
    - ``ckks``: TenSEAL's CKKS, approximate."""

    kind: Literal["none", "secagg", "secagg_plus", "paillier", "ckks"] = "none"
    clip: float = Field(default=8.0, gt=0.0)
    """Every coordinate of a client's weighted update is clipped to [-clip, clip] before it is
    encoded (SecAgg's quantization range, Paillier's fixed-point offset)."""
    bits: int = Field(default=22, ge=2, le=31)
    """secagg, secagg_plus: quantization bits b (the sum of max_clients values fits Z_2^32)."""
    max_clients: int = Field(default=1000, ge=2)
    """secagg, secagg_plus: the most clients a round may hold (max_clients (2^b - 1) < 2^32);
    paillier: sizes the packing slots."""
    threshold: int | None = Field(default=None, ge=2)
    """secagg, secagg_plus: the clients (SecAgg+: the neighbours) that must survive for the
    round to finish (null: a strict majority)."""
    neighbours: int | None = Field(default=None, ge=2)
    """secagg_plus: each client's neighbours k, even (null: the smallest even >= 3 log2 n)."""
    key_bits: int = Field(default=2048, ge=512)
    """paillier: modulus bits (1024 for tests only, 2048 about 112-bit security, 3072
    128-bit)."""
    frac_bits: int = Field(default=16, ge=1, le=52)
    """paillier: fixed-point fractional bits f (resolution 2^-f)."""
    min_contributors: int = Field(default=2, ge=1)
    """paillier, ckks: the key authority decrypts no aggregate of fewer clients."""

    @model_validator(mode="after")
    def _keys_of_kind(self) -> SecureAggregationConfig:
        own = {
            "bits": {"secagg", "secagg_plus"},
            "max_clients": {"secagg", "secagg_plus", "paillier"},
            "threshold": {"secagg", "secagg_plus"},
            "neighbours": {"secagg_plus"},
            "key_bits": {"paillier"},
            "frac_bits": {"paillier"},
            "min_contributors": {"paillier", "ckks"},
        }
        fields = type(self).model_fields
        for key, kinds in own.items():  # a value other than the default, for another kind
            if self.kind not in kinds and getattr(self, key) != fields[key].default:
                raise ValueError(
                    f"{key} applies to kind {' or '.join(sorted(kinds))}, not {self.kind}"
                )
        if self.neighbours is not None and self.neighbours % 2:
            raise ValueError(
                f"neighbours must be even (a k-regular Harary graph), got {self.neighbours}"
            )
        return self


class TriggerConfig(StrictModel):
    size: int = Field(default=3, ge=1)
    """Side of the square trigger in pixels (flat inputs: size^2 last features)."""
    value: float | None = None
    """The trigger's pixel value (null: the largest input value of the training data)."""


class AttackConfig(StrictModel):
    """Poisoning by a seeded fraction of malicious clients (docs/security.md)."""

    kind: Literal[
        "none", "label_flip", "random_labels", "backdoor", "gaussian", "scale", "sign_flip"
    ] = "none"
    fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Of all training clients, chosen once with the run's seed."""
    mode: Literal["complement", "all_to_one", "targeted"] = "complement"
    """label_flip: y -> C - 1 - y, y -> target, or source -> target."""
    source: int | None = Field(default=None, ge=0)
    """label_flip mode targeted: the class relabelled."""
    target: int = Field(default=0, ge=0)
    """label_flip (all_to_one, targeted) and backdoor: the label the attacker wants."""
    scale: float | None = Field(default=None, gt=0.0)
    """scale: the boost K (null: the clients per round); sign_flip: s >= 1 (null: 1)."""
    trigger: TriggerConfig = Field(default_factory=TriggerConfig)
    """backdoor: the pixel trigger."""
    poison_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    """backdoor: the fraction of a malicious client's samples stamped and relabelled."""

    @model_validator(mode="after")
    def _complete(self) -> AttackConfig:
        if self.kind == "label_flip" and self.mode == "targeted" and self.source is None:
            raise ValueError("label_flip mode targeted needs source (the class to relabel)")
        if self.kind == "sign_flip" and self.scale is not None and self.scale < 1:
            raise ValueError(f"sign_flip scale s must be >= 1, got {self.scale}")
        return self


class AggregatorConfig(StrictModel):
    """The server's aggregation rule (docs/security.md): FedAvg's weighted mean, or a
    Byzantine-robust rule in its place for every algorithm that aggregates."""

    kind: Literal[
        "mean",
        "median",
        "trimmed_mean",
        "krum",
        "multi_krum",
        "bulyan",
        "norm_clip",
        "feature_aware",
    ] = "mean"
    """feature_aware: the first layer's weight columns averaged over the clients that observed
    each input feature (docs/missing_features.md)."""
    f: int | None = Field(default=None, ge=0)
    """krum, multi_krum, bulyan: Byzantine clients tolerated per round (null: the attack's
    fraction of the clients per round, rounded up; 1 without an attack)."""
    beta: float = Field(default=0.1, ge=0.0, lt=0.5)
    """trimmed_mean: the fraction trimmed at each end."""
    m: int | None = Field(default=None, ge=1)
    """multi_krum: updates averaged (null: n - f)."""
    max_norm: float | None = Field(default=None, gt=0.0)
    """norm_clip: the bound M (null: the median update norm of the round)."""
    noise: float = Field(default=0.0, ge=0.0)
    """norm_clip: std of Gaussian noise added to the mean (Sun et al. 2019's weak DP)."""


class CompressionConfig(StrictModel):
    """Compression of the uploads (docs/compression.md): what each client sends is encoded,
    communication counts the encoded bytes, the server decodes."""

    kind: Literal["none", "topk", "randk", "qsgd", "fp16", "int8"] = "none"
    ratio: float = Field(default=0.01, gt=0.0, le=1.0)
    """topk, randk: the fraction of each tensor's entries sent."""
    error_feedback: bool | None = None
    """Keep what was not sent per client and add it to the next upload. null: on for the
    contractive schemes (topk, randk, int8, fp16), off for qsgd, whose variance makes the
    residual grow without bound (it cannot be turned on there)."""
    levels: int = Field(default=16, ge=1, le=2**15)
    """qsgd: quantization levels s."""
    download: Literal["none", "fp16", "int8"] = "none"
    """The broadcast model as fp16 or int8 (clients train from the decoded model)."""

    @model_validator(mode="after")
    def _feedback_applies(self) -> CompressionConfig:
        if self.kind == "qsgd" and self.error_feedback:
            raise ConfigError(
                "compression.error_feedback: true does not apply to qsgd: it is unbiased but not "
                "contractive (variance up to sqrt(d)/s times the update's), so the residual "
                "would grow every round; leave it null or false (docs/compression.md)"
            )
        return self

    def feedback(self) -> bool:
        """Whether error feedback is on (``error_feedback``, else on for all but qsgd)."""
        return self.error_feedback if self.error_feedback is not None else self.kind != "qsgd"


class StateConfig(StrictModel):
    storage: Literal["memory", "mmap"] = "memory"
    """Per-client persistent state: stacked tensors in RAM, or memory-mapped files under the
    run directory's ``state/`` (for very many clients)."""


class AlertConfig(StrictModel):
    """Thresholds of the report's and the dashboard's alert rules (docs/monitoring.md)."""

    loss_patience: int = Field(default=5, ge=2)
    """Evaluations in a row without a new lowest loss (global, else training loss)."""
    p10_min: float | None = Field(default=0.65, ge=0.0, le=1.0)
    """Personalized accuracy P10 below this (default 0.65); null: off."""
    update_norm_growth: float = Field(default=10.0, gt=1.0)
    """Median update norm above this multiple of its first value (exploding updates)."""
    update_norm_growth_client: float = Field(default=10.0, gt=1.0)
    """A client's update norm above this multiple of its own first recorded value, or not
    finite (that client diverging)."""
    client_accuracy_drop: float | None = Field(default=0.5, gt=0.0, lt=1.0)
    """A client's personalized accuracy below this fraction of its best earlier value
    (collapse: e.g. 0.95 -> 0.0 while the mean looks fine); null: off."""
    update_norm_decay: float = Field(default=1e-3, gt=0.0, lt=1.0)
    """Median update norm below this fraction of its first value (vanishing updates)."""
    zeta_jump: float = Field(default=2.0, gt=0.0)
    """Gradient dissimilarity zeta^2 rising by more than this fraction between evaluations
    (2.0: a jump of more than 200%)."""
    communication_budget_mb: float | None = Field(default=None, gt=0.0)
    """Total MB up + down the run may use; null: no budget."""
    cold_start_steps: int = Field(default=20, ge=0)
    """New clients should reach ``cold_start_target`` within this many adaptation steps."""
    cold_start_target: float = Field(default=0.9, gt=0.0, le=1.0)
    """... of the trained clients' mean personalized accuracy."""
    epsilon_max: float = Field(default=10.0, gt=0.0)
    """Privacy budget epsilon above this (when a privacy mechanism reports one)."""


class MonitorConfig(StrictModel):
    """What the engine records for training health every evaluated round
    (engine/monitoring.py)."""

    enabled: bool = True
    clients: int = Field(default=10, ge=2)
    """At most this many clients enter the cosine matrix and zeta^2 (a fixed sample)."""
    gradient_dissimilarity: bool = True
    """Compute zeta^2 (gradients of the sampled clients at the global model)."""
    gradient_samples: int | None = Field(default=256, ge=1)
    """Training samples per client (a fixed random subset) of zeta^2's gradients; null: all."""
    alerts: AlertConfig = Field(default_factory=AlertConfig)


class TrackingConfig(StrictModel):
    """Optional exporters of the per-round metrics to other tools."""

    tensorboard: bool = False
    """Scalars under <run dir>/tensorboard (needs the ``tensorboard`` package)."""
    mlflow: str | None = None
    """An MLflow tracking URI (e.g. file:./mlruns or http://127.0.0.1:5000); needs ``mlflow``."""
    experiment: str = "fedloom"
    """MLflow experiment name."""


class SpeedsConfig(StrictModel):
    """Each client's time per local step on the virtual clock (engine/clock.py): a median
    m_c fixed per client, times exp(jitter * N(0, 1)) drawn per job."""

    kind: Literal["constant", "lognormal", "stragglers", "per_client"] = "constant"
    sigma: float = Field(default=1.0, ge=0.0)
    """lognormal: m_c = exp(sigma * N(0, 1)), drawn once per client."""
    fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """stragglers: the share of clients (chosen once with the seed) that are slow."""
    slowdown: float = Field(default=10.0, ge=1.0)
    """stragglers: how many times slower a slow client's step is."""
    values: list[float] | None = None
    """per_client: m_c of client c (one positive number per client)."""
    jitter: float = Field(default=0.0, ge=0.0)
    """Spread of each job's time around the client's median (lognormal, per job)."""

    @model_validator(mode="after")
    def _complete(self) -> SpeedsConfig:
        if self.kind == "per_client" and (not self.values or min(self.values) <= 0):
            raise ValueError("kind per_client needs values: one positive time per client")
        if self.values is not None and self.kind != "per_client":
            raise ValueError(f"values applies only to kind per_client, not {self.kind}")
        return self


class AsynchronyConfig(StrictModel):
    """Asynchronous aggregation on a virtual clock (docs/asynchrony.md): FedAsync (Xie et al.
    2019) mixes each arriving model in with weight alpha * s(staleness); FedBuff (Nguyen et al.
    2022) applies the mean of every ``buffer`` arriving updates. With ``kind: none`` and
    ``speeds`` set, the synchronous rounds get the same clock (round time: the slowest client)."""

    kind: Literal["none", "fedasync", "fedbuff"] = "none"
    buffer: int = Field(default=10, ge=1)
    """fedbuff: K, the updates per server step."""
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    """s(d) of FedAsync section 5.2; fedbuff scales each update by it too."""
    a: float = Field(default=0.5, ge=0.0)
    """polynomial: s(d) = (d + 1)^-a; hinge: the slope a."""
    b: float = Field(default=4.0, ge=0.0)
    """hinge: s(d) = 1 up to staleness b."""
    alpha: float = Field(default=0.6, gt=0.0, le=1.0)
    """fedasync: the mixing weight alpha (alpha_t = alpha * s(d))."""
    server_lr: float = Field(default=1.0, gt=0.0)
    """fedbuff: eta_g, the step along the buffered mean update."""
    weighting: Literal["samples", "uniform"] = "samples"
    """fedbuff: updates weighted by the clients' samples (FedAvg's weights) or equally."""
    concurrency: int | None = Field(default=None, ge=1)
    """Clients training at once (null: train.clients_per_round, else every training client)."""
    speeds: SpeedsConfig | None = None
    """The clients' speeds (null: all equal; with kind none: no clock is kept)."""


class ContributionConfig(StrictModel):
    """Each round's clients valued by their contribution to the global model (docs/incentives.md;
    incentives/shapley.py): v(S) is the validation metric of the model the algorithm's server
    step builds from coalition S's uploads (v(empty): the model before the round).

    - ``exact``: Shapley values over all 2^n coalitions (n <= 12 clients a round);
    - ``loo``: leave-one-out, v(N) - v(N minus i);
    - ``tmc``: truncated Monte-Carlo Shapley (Ghorbani & Zou 2019);
    - ``gtg``: GTG-Shapley (Liu et al. 2022): guided, truncated, rescaled to the round's gain."""

    kind: Literal["none", "exact", "loo", "tmc", "gtg"] = "none"
    every: int = Field(default=1, ge=1)
    """Value the clients every this many rounds (rounds between reuse each client's latest)."""
    validation_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """The held-out validation split v(S) is measured on (eval.validation_fraction's split:
    the larger of the two is held out)."""
    metric: Literal["loss", "accuracy"] = "loss"
    """v(S): minus the mean validation loss, or the validation accuracy (classification).
    The loss is continuous: truncation and rankings need it (docs/incentives.md, measured)."""
    tolerance: float = Field(default=1e-3, ge=0.0)
    """tmc, gtg: a permutation's walk stops once |v(N) - v(prefix)| < tolerance; gtg: a round
    whose gain |v(N) - v(empty)| is at most this values everyone 0."""
    max_permutations: int | None = Field(default=None, ge=1)
    """tmc, gtg: the most permutations a round (null: min(2^n, max(30, n, 0.8 x 2^n)))."""


class CostConfig(StrictModel):
    """A client's reported cost for a round it takes part in (incentives/costs.py)."""

    per_sample: float = Field(default=0.001, ge=0.0)
    """Per training sample processed (local steps x batch)."""
    per_mb: float = Field(default=0.01, ge=0.0)
    """Per MB (10^6 bytes) uploaded."""
    per_client: list[float] | None = None
    """User-given: client i's cost per round (replaces per_sample and per_mb)."""

    @field_validator("per_client")
    @classmethod
    def _non_negative(cls, costs: list[float] | None) -> list[float] | None:
        if costs is not None and any(c < 0 for c in costs):
            raise ValueError("costs must be >= 0")
        return costs


class IncentiveConfig(StrictModel):
    """Per-round payments from a budget to the round's clients (docs/incentives.md): FLI (Yu et
    al. 2020) and the baselines (equal split, by sample count, Shapley-proportional, cost
    only), all computed side by side on the same budget; ``kind`` is the headline scheme."""

    kind: Literal["none", "fli", "equal", "samples", "shapley", "cost"] = "none"
    budget: float = Field(default=100.0, gt=0.0)
    """B(t): the budget paid out every round."""
    omega: float = Field(default=1.0, ge=0.0)
    """FLI's weight of contribution against the regret and waiting queues (fairness)."""
    sub_rounds: int = Field(default=20, ge=1)
    """R: each round's budget is paid in R equal parts, the queues updated after each."""
    cost: CostConfig = Field(default_factory=CostConfig)


class ServingConfig(StrictModel):
    """Deployable copies and routing (docs/serving.md; engine/serving.py, serving/,
    docs/serving.md). Absent or all off: nothing is kept."""

    keep_best: bool = False
    """Keep the global model of the round with the best validation metric (and, when clients
    deploy models of their own, each client's best one); needs eval.validation_fraction."""
    ema: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Decay of an exponential moving average of the global model, updated every round."""
    route: Literal["none", "confidence"] = "none"
    """confidence: per input, a client's personal model when its top softmax probability is
    at least ``threshold``, else the more confident of it and the global model."""
    threshold: float = Field(default=0.8, ge=0.0, le=1.0)

    @property
    def enabled(self) -> bool:
        return self.keep_best or self.ema is not None or self.route != "none"


class RunConfig(StrictModel):
    seed: int = 0
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
    def _serving_applies(self) -> RunConfig:
        """serving.keep_best selects on the validation split, never on the test sets."""
        if self.serving.keep_best and self.validation_fraction() <= 0:
            raise ConfigError(
                "serving.keep_best: the best model is chosen on a validation split: set "
                "eval.validation_fraction (e.g. 0.1)"
            )
        return self

    @model_validator(mode="after")
    def _peft_applies(self) -> RunConfig:
        """A ``peft`` section goes with a pretrained model and vice versa (docs/peft.md)."""
        pretrained = self.model.name in PEFT_MODELS
        if pretrained and self.peft is None:
            raise ConfigError(
                f"model.name: {self.model.name} is a frozen pretrained model: add a peft section "
                "(peft: {kind: lora | adapter | prompt, ...})"
            )
        if self.peft is not None and not pretrained:
            raise ConfigError(
                f"peft: needs a pretrained model (model.name: {' | '.join(PEFT_MODELS)}), "
                f"got {self.model.name}"
            )
        if pretrained and not self.model.freeze:
            raise ConfigError(
                "model.freeze: false is not supported: the backbone stays frozen and only the "
                "peft parameters and the head train"
            )
        return self

    @model_validator(mode="after")
    def _client_counts(self) -> RunConfig:
        if self.data.num_clients is not None:
            check_client_counts(self, self.data.num_clients)
        return self

    @model_validator(mode="after")
    def _privacy_applies(self) -> RunConfig:
        """client_dp needs a server step that averages client models (the FedAvg family) and
        a number of clients per round (the sampling rate); sample_dp an algorithm whose
        clients run DP-SGD's steps (``Algorithm.supports_sample_dp``)."""
        if self.privacy.kind == "sample_dp":
            algorithm = ALGORITHMS.get(self.algorithm.name)
            if not algorithm.supports_sample_dp:
                able = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).supports_sample_dp]
                raise ConfigError(
                    f"privacy.kind: sample_dp needs an algorithm whose clients run plain local "
                    f"SGD steps (DP-SGD replaces their gradient); {self.algorithm.name} has "
                    f"local work of its own. Supported: {', '.join(able)}"
                )
            return self
        if self.privacy.kind != "client_dp":
            return self
        algorithm = ALGORITHMS.get(self.algorithm.name)
        if not (algorithm.averages_client_models and algorithm.communicates):
            raise ConfigError(
                f"privacy.kind: client_dp needs an algorithm whose server averages the clients' "
                f"models (fedavg, fedprox, fedopt's family, ...); {self.algorithm.name} does not"
            )
        if self.train.clients_per_round is None:
            raise ConfigError(
                "privacy.kind: client_dp samples clients each round: set "
                "train.clients_per_round (the sampling rate is clients_per_round / clients)"
            )
        adaptive, z = self.privacy.adaptive_clip, self.privacy.noise_multiplier
        if adaptive is not None and z:  # with target_epsilon, z is known when the run starts
            count_noise = adaptive.count_noise
            if count_noise is None:
                count_noise = self.train.clients_per_round / 20.0
            if 2.0 * count_noise <= z:
                raise ConfigError(
                    f"privacy.adaptive_clip.count_noise: {count_noise:g} (null: "
                    f"clients_per_round / 20) is too small for noise_multiplier {z:g}: it must "
                    "exceed noise_multiplier / 2 (Andrew et al. 2021, Theorem 1)"
                )
        return self

    @model_validator(mode="after")
    def _secure_aggregation_applies(self) -> RunConfig:
        """Secure aggregation sums the clients' model updates: the server step must be a
        model average; and with client-level DP the sum is of the clipped updates."""
        kind = self.secure_aggregation.kind
        if kind == "none":
            return self
        algorithm = ALGORITHMS.get(self.algorithm.name)
        if not (algorithm.averages_client_models and algorithm.communicates):
            raise ConfigError(
                f"secure_aggregation.kind: {kind} needs an algorithm whose server averages the "
                f"clients' models (fedavg, fedprox, fedopt's family, ...); "
                f"{self.algorithm.name} does not"
            )
        return self

    @model_validator(mode="after")
    def _robust_aggregation_applies(self) -> RunConfig:
        """A robust rule needs every update in the clear (not secure aggregation, not
        client-level DP's own estimator) and, for Krum and Bulyan, enough clients a round."""
        kind = self.aggregator.kind
        if kind == "mean":
            return self
        if self.secure_aggregation.kind != "none" or self.privacy.kind == "client_dp":
            raise ConfigError(
                f"aggregator.kind {kind} needs each client's update in the clear: it does not "
                "combine with secure_aggregation or privacy.kind client_dp"
            )
        n = self.clients_per_round_nominal()
        if n is not None and kind in ("krum", "multi_krum", "bulyan"):
            f = self.byzantine_f(n)
            need = 4 * f + 3 if kind == "bulyan" else 2 * f + 3
            if n < need:
                rule = "n >= 4f + 3" if kind == "bulyan" else "n > 2f + 2"
                raise ConfigError(
                    f"aggregator.kind {kind} with f={f} needs at least {need} clients a round "
                    f"({rule}); train.clients_per_round gives {n}"
                )
        return self

    @model_validator(mode="after")
    def _asynchrony_applies(self) -> RunConfig:
        """Asynchronous server steps fold models trained from older global models into the
        current one: the server step must be a function of the clients' averaged models, and
        the round-synchronous protocols (DP accounting, secure aggregation, robust rules,
        dropout, per-round stragglers) do not apply."""
        kind = self.asynchrony.kind
        if kind == "none":
            return self
        able = asynchronous_algorithms()
        if self.algorithm.name not in able:
            raise ConfigError(
                f"asynchrony.kind: {kind} needs an algorithm whose server step averages the "
                f"clients' models (a stale model can be folded into it); {self.algorithm.name}'s "
                f"is not. Supported: {', '.join(able)}"
            )
        clash = [
            f"{key}: {value}"
            for key, value, off in (
                ("privacy.kind", self.privacy.kind, "none"),
                ("secure_aggregation.kind", self.secure_aggregation.kind, "none"),
                ("aggregator.kind", self.aggregator.kind, "mean"),
                ("train.dropout", self.train.dropout, 0.0),
                ("train.stragglers", self.train.stragglers, 0.0),
            )
            if value != off
        ]
        if clash:
            raise ConfigError(
                f"asynchrony.kind: {kind} does not combine with {', '.join(clash)}: these are "
                "round-synchronous (slow clients are modelled by asynchrony.speeds)"
            )
        return self

    @model_validator(mode="after")
    def _compression_applies(self) -> RunConfig:
        """Compression encodes uploads that the server reads one by one: not secure
        aggregation's masked sums, not client-level DP's clipped updates (the residual of error
        feedback, or quantization's rounding, would change their sensitivity)."""
        kind, download = self.compression.kind, self.compression.download
        if kind == "none" and download == "none":
            return self
        if not ALGORITHMS.get(self.algorithm.name).communicates:
            raise ConfigError(f"compression: {self.algorithm.name} sends nothing to compress")
        if kind != "none" and (
            self.secure_aggregation.kind != "none" or self.privacy.kind == "client_dp"
        ):
            raise ConfigError(
                f"compression.kind: {kind} does not combine with secure_aggregation or "
                "privacy.kind client_dp (see docs/compression.md, Limits)"
            )
        return self

    @model_validator(mode="after")
    def _incentives_apply(self) -> RunConfig:
        """contribution needs each client's upload in the clear and a global model to value;
        fli and shapley pay by contribution (engine/contribution.py)."""
        kind, pays = self.contribution.kind, self.incentive.kind
        if pays in ("fli", "shapley") and kind == "none":
            raise ConfigError(
                f"incentive.kind: {pays} pays by contribution: set contribution.kind (exact, "
                "loo, tmc or gtg), or choose incentive.kind equal, samples or cost"
            )
        if (kind != "none" or pays != "none") and self.asynchrony.kind != "none":
            raise ConfigError(
                "contribution and incentive value and pay the clients of synchronous rounds; "
                "set asynchrony.kind: none"
            )
        algorithm = ALGORITHMS.get(self.algorithm.name)
        if pays != "none" and algorithm.pooled:
            raise ConfigError(
                f"incentive.kind: {pays} pays the clients of a round; {self.algorithm.name} "
                "trains one pooled virtual client"
            )
        if kind == "none":
            return self
        if not algorithm.has_global_model or algorithm.pooled or not algorithm.communicates:
            raise ConfigError(
                f"contribution.kind: {kind} values clients by the global model their uploads "
                f"build; {self.algorithm.name} has no global model built from uploads"
            )
        if self.secure_aggregation.kind != "none" or self.privacy.kind == "client_dp":
            raise ConfigError(
                f"contribution.kind: {kind} builds a model from every coalition of a round's "
                "uploads: it needs them in the clear (not secure_aggregation) and unreleased "
                "(client_dp's accountant does not count the coalition models)"
            )
        n = self.clients_per_round_nominal()
        if kind == "exact" and n is not None and n > EXACT_SHAPLEY_MAX:
            raise ConfigError(
                f"contribution.kind: exact evaluates 2^n coalitions a round; "
                f"{n} clients a round is more than {EXACT_SHAPLEY_MAX}: use gtg or tmc"
            )
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
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def asynchronous_algorithms() -> list[str]:
    """Algorithms that asynchrony.kind fedasync and fedbuff apply to: those whose server step
    is a function of the average of the uploaded models (``averages_client_models``)."""
    return [
        name
        for name in ALGORITHMS.names()
        if (cls := ALGORITHMS.get(name)).averages_client_models
        and cls.communicates
        and not cls.pooled
    ]


def check_client_counts(config: RunConfig, num_clients: int) -> None:
    """``eval.new_clients`` and ``train.clients_per_round`` against the number of clients: when
    the config is parsed if it states ``data.num_clients`` (the registered datasets, once their
    defaults are filled in), else when the engine is handed data of its own (Python API)."""
    new, per_round = config.eval.new_clients, config.train.clients_per_round
    if new >= num_clients:
        raise ConfigError(
            f"eval.new_clients: {new} leaves no client to train (there are {num_clients})"
        )
    if per_round is not None and per_round > num_clients - new:
        raise ConfigError(
            f"train.clients_per_round: {per_round} is more than the {num_clients - new} "
            f"training clients (data.num_clients={num_clients}, eval.new_clients={new})"
        )


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
            raise ConfigError(f"kind: {raw['kind']!r} is not a horizontal run's config")
        raw = {k: v for k, v in raw.items() if k != "kind"}
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RunConfig)) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return raw or {}


_SWITCHES: dict[tuple[str, ...], str] = {
    ("algorithm",): "name",
    ("data", "partition"): "kind",
}
"""Sections whose keys belong to one choice (the algorithm, the partition kind): a ``--set``
naming another choice than the file's starts a fresh section."""

_ALTERNATIVES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("train", "local_epochs"): ("train", "local_steps"),
    ("train", "local_steps"): ("train", "local_epochs"),
}
"""Keys that exclude each other: a ``--set`` of one replaces the file's other."""


def _parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    path, text = item.split("=", 1)
    keys = tuple(k for k in path.strip().split(".") if k)
    if not keys:
        raise ConfigError(f"--set {item!r}: empty key")
    return keys, yaml.safe_load(text)


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


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set key.path=value`` overrides (values parsed as YAML scalars/lists).

    ``--set algorithm.name=X`` (or ``data.partition.kind=X``) naming another choice than the
    file's starts a fresh section (the old choice's keys would not apply to X); it is applied
    first, so the other ``--set`` keys of that section land in the new one. Setting one of
    ``train.local_epochs`` / ``train.local_steps`` removes the file's other (both set by
    ``--set`` stays an error)."""
    raw = yaml.safe_load(yaml.safe_dump(raw))  # deep copy of plain data
    parsed = [_parse_override(item) for item in overrides]
    for keys, value in parsed:
        if keys[:-1] in _SWITCHES and keys[-1] == _SWITCHES[keys[:-1]]:
            section = _find_section(raw, keys[:-1])
            if section is None or section.get(keys[-1]) != value:
                _section(raw, keys[:-2])[keys[-2]] = {keys[-1]: value}
    set_paths = {keys for keys, _ in parsed}
    for keys, value in parsed:
        other = _ALTERNATIVES.get(keys)
        if other is not None and value is not None and other not in set_paths:
            section = _find_section(raw, other[:-1])
            if section is not None:
                section.pop(other[-1], None)
        _section(raw, keys[:-1])[keys[-1]] = value
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
