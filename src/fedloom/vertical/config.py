"""The YAML contract of vertical and transfer runs (issue #16):

```yaml
seed: 0
data:
  name: breast_cancer                  # or diabetes
  partition: {kind: vertical, parties: [[0, 10], [10, 30]]}   # column ranges; party 0: labels
  test_fraction: 0.3
algorithm: {name: secureboost, n_trees: 10, max_depth: 3, eta: 0.3, max_bin: 32,
            reg_lambda: 1.0, gamma: 0.0, min_child_weight: 1.0, base_score: null}
secure_aggregation: {kind: paillier, key_bits: 1024}   # or none: the plaintext path
```

Algorithms: ``vertical_linear``, ``vertical_logistic`` (key ``protocol: three_party |
two_party``), ``secureboost``, ``ftl`` (key ``protocol: ahe | secret_sharing``; its row layout
under ``data.partition``: ``rows: [[a0, a1], [b0, b1]]`` and ``labelled_rows: [c0, c1]``).
``secure_aggregation.kind``: ``none`` runs the plaintext path of any algorithm, ``paillier``
the encrypted one, ``secret_sharing`` FTL's secret-sharing protocol.

This module imports nothing heavy (no ``phe``, no ``xgboost``): the API and the command line
use it to recognise a vertical config before anything else is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from fedloom.config import load_yaml
from fedloom.core.settings import Seed, StrictModel
from fedloom.core.validation import check_int64, format_validation_error
from fedloom.core.yaml_text import dump_yaml_text
from fedloom.errors import ConfigError, unknown_name_message
from fedloom.run_config.monitor import TrackingConfig
from fedloom.run_config.rules import Check, Rule, check_rules, equals, used
from fedloom.run_config.train import CheckpointConfig


class VerticalPartition(StrictModel):
    kind: Literal["vertical"] = "vertical"
    parties: list[list[int]] = Field(min_length=2)
    """Column ranges [start, end) per party; party 0 (the guest) holds the labels."""
    rows: list[list[int]] | None = None
    """ftl only: [[a0, a1], [b0, b1]]: source A's and target B's rows (after the seeded
    permutation); they must overlap (default [[0, 400], [200, 569]], the worked example of
    docs/vertical.md)."""
    labelled_rows: list[int] | None = None
    """ftl only: [c0, c1] inside the overlap: the overlap rows whose label enters L_1."""


class VerticalDataConfig(StrictModel):
    name: Literal["breast_cancer", "diabetes", "wine", "digits"] = "breast_cancer"
    """breast_cancer (binary), diabetes (regression), wine and digits (multi-class)."""
    root: str | None = None
    """Unused: the built-in vertical datasets ship with scikit-learn."""
    partition: VerticalPartition
    test_fraction: float = Field(default=0.3, gt=0.0, lt=1.0)
    standardize_target: bool = True
    """Regression: train on the standardised target (RMSE is reported in its own units)."""
    missing_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """secureboost only: blank this share of the feature entries (NaN, missing completely at
    random, train and test rows, a seeded stream) to exercise sparsity-aware split finding."""
    scale_on: Literal["train", "all"] = "train"
    """ftl only: fit the scaler on the training rows (default) or on all rows (the worked
    example of docs/vertical.md)."""


class _Algorithm(StrictModel):
    name: str


class VerticalLinearConfig(_Algorithm):
    """Secure vertical linear regression (Yang et al., ACM TIST 2019, arXiv:1902.04885, Table 1)."""

    name: Literal["vertical_linear"] = "vertical_linear"
    protocol: Literal["three_party", "two_party"] = "three_party"
    lr: float = Field(default=0.1, gt=0.0)
    reg_lambda: float = Field(default=0.01, ge=0.0)
    iterations: int = Field(default=100, ge=1)
    batch_size: int | None = Field(default=None, ge=1)
    """Rows per iteration (null: all, full-batch gradient descent)."""
    fit_intercept: bool = True


class VerticalLogisticConfig(VerticalLinearConfig):
    """Secure vertical logistic regression with Hardy et al.'s Taylor loss (arXiv:1711.10677)."""

    name: Literal["vertical_logistic"] = "vertical_logistic"  # type: ignore[assignment]
    lr: float = Field(default=0.5, gt=0.0)
    iterations: int = Field(default=200, ge=1)


class SecureBoostConfig(_Algorithm):
    """SecureBoost with XGBoost's parameter names (Cheng et al. 2021, arXiv:1901.08755)."""

    name: Literal["secureboost"] = "secureboost"
    n_trees: int = Field(default=10, ge=1)
    max_depth: int = Field(default=3, ge=1)
    eta: float = Field(default=0.3, gt=0.0)
    max_bin: int = Field(default=32, ge=2)
    reg_lambda: float = Field(default=1.0, ge=0.0)
    gamma: float = Field(default=0.0, ge=0.0)
    min_child_weight: float = Field(default=1.0, ge=0.0)
    base_score: float | list[float] | None = None
    """null: the mean label (XGBoost >= 2.0's estimate; multi-class: the centred log class
    frequencies, XGBoost 3.x's); a number, or one per class; give it for bit-equal runs."""
    objective: Literal["binary:logistic", "reg:squarederror", "multi:softprob"] | None = None
    """null: from the dataset's task (binary, regression, multi-class)."""
    num_class: int | None = Field(default=None, ge=2)
    """multi:softprob: the number of classes (null: the largest training label + 1)."""
    packing: bool = True
    """Encrypted path: SecureBoost+'s GH packing and cipher compression."""


class FTLConfig(_Algorithm):
    """Federated transfer learning (Liu et al., IEEE Intelligent Systems 2020, arXiv:1812.03337)."""

    name: Literal["ftl"] = "ftl"
    protocol: Literal["ahe", "secret_sharing"] = "ahe"
    hidden: int = Field(default=8, ge=1)
    gamma: float = Field(default=1.0, ge=0.0)
    reg_lambda: float = Field(default=1e-3, ge=0.0)
    lr: float = Field(default=0.5, gt=0.0)
    iterations: int = Field(default=500, ge=1)
    leaky_fast: bool = False
    """AHE only: decrypt representation-level gradients (leaks labels; explicit opt-in)."""


ALGORITHM_CONFIGS: dict[str, type[_Algorithm]] = {
    "vertical_linear": VerticalLinearConfig,
    "vertical_logistic": VerticalLogisticConfig,
    "secureboost": SecureBoostConfig,
    "ftl": FTLConfig,
}
VERTICAL_ALGORITHMS = tuple(ALGORITHM_CONFIGS)


class VerticalSecureConfig(StrictModel):
    kind: Literal["none", "paillier", "secret_sharing"] = "none"
    key_bits: int = Field(default=2048, ge=512)
    """Paillier modulus bits (1024 for tests only, 2048 about 112-bit security)."""
    frac_bits: int = Field(default=32, ge=8, le=64)
    """Fixed-point fractional bits f of the linear models' and FTL's Paillier encoding."""

    @field_validator("key_bits")
    @classmethod
    def _multiple_of_256(cls, v: int) -> int:
        if v % 256:
            raise ValueError("key_bits must be a multiple of 256 (1024 tests, 2048 default)")
        return v


class VerticalEvalConfig(StrictModel):
    every: int = Field(default=1, ge=1)
    """Evaluate on the test rows every this many iterations (trees); always at the end."""


class VerticalRunConfig(StrictModel):
    kind: Literal["vertical"] = "vertical"
    """The run family (docs/vertical.md, "The kind key"); optional here, inferred once by
    ``fedloom.config.run_kind`` when absent."""
    seed: Seed = 0
    data: VerticalDataConfig
    algorithm: Any
    secure_aggregation: VerticalSecureConfig = Field(default_factory=VerticalSecureConfig)
    eval: VerticalEvalConfig = Field(default_factory=VerticalEvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Every ``every`` iterations (trees) and after the last; ftl has no saved state yet."""

    @field_validator("algorithm", mode="before")
    @classmethod
    def _parse_algorithm(cls, value: Any) -> _Algorithm:
        if isinstance(value, _Algorithm):
            return value
        return parse_algorithm(value)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> VerticalRunConfig:
        """The rules between sections (``VERTICAL_RULES``), here and nowhere else."""
        check_rules(self, VERTICAL_RULES)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return dump_yaml_text(self.to_dict(), sort_keys=False)


_FTL = equals("algorithm.name", "ftl")
_LINEAR = equals("algorithm.name", "vertical_linear", "vertical_logistic")
_TWO_PARTIES = Check(lambda c: len(c.data.partition.parties) == 2)

VERTICAL_RULES: tuple[Rule, ...] = (
    # the secure computation: FTL's secret sharing, or Paillier (docs/vertical.md)
    Rule(
        when=equals("secure_aggregation.kind", "secret_sharing"),
        requires=Check(
            lambda c: (
                isinstance(c.algorithm, FTLConfig) and c.algorithm.protocol == "secret_sharing"
            )
        ),
        message="secure_aggregation.kind secret_sharing is FTL's protocol: use algorithm "
        "{{name: ftl, protocol: secret_sharing}}, or kind paillier / none",
    ),
    Rule(
        when=(_FTL, equals("algorithm.protocol", "secret_sharing")),
        excludes=equals("secure_aggregation.kind", "paillier"),
        message="ftl with protocol secret_sharing uses no Paillier key: set "
        "secure_aggregation.kind to secret_sharing (or none for the plaintext path)",
    ),
    Rule(
        when=(_FTL, equals("algorithm.protocol", "ahe")),
        excludes=equals("secure_aggregation.kind", "secret_sharing"),
        message="ftl protocol ahe needs secure_aggregation.kind paillier or none",
    ),
    # FTL's parties and rows
    Rule(
        when=_FTL,
        requires=_TWO_PARTIES,
        message="ftl takes exactly two parties (source A, target B)",
    ),
    Rule(
        when=_FTL,
        requires=equals("data.name", "breast_cancer"),
        message="ftl needs binary labels: data.name breast_cancer",
    ),
    Rule(
        when=used("algorithm.name", "ftl"),
        excludes=(used("data.partition.rows", None), used("data.partition.labelled_rows", None)),
        message="data.partition.rows and labelled_rows apply to ftl only",
    ),
    Rule(
        when=used("algorithm.name", "ftl"),
        excludes=used("data.scale_on", "train"),
        message="data.scale_on applies to ftl only",
    ),
    # the linear models' parties and targets
    Rule(
        when=(_LINEAR, equals("algorithm.protocol", "two_party")),
        requires=_TWO_PARTIES,
        message="{algorithm.name} protocol two_party takes exactly two parties (guest, host); "
        "more hosts need protocol three_party (a coordinator holds the key)",
    ),
    Rule(
        when=_LINEAR,
        excludes=equals("data.name", "wine", "digits"),
        message="{algorithm.name} needs a binary or regression target, not {data.name}'s "
        "classes: use algorithm secureboost",
    ),
    Rule(
        when=equals("algorithm.name", "vertical_logistic"),
        requires=equals("data.name", "breast_cancer"),
        message="vertical_logistic needs binary labels: data.name breast_cancer",
    ),
    # SecureBoost's keys
    Rule(
        when=used("data.missing_fraction", 0.0),
        requires=equals("algorithm.name", "secureboost"),
        message="data.missing_fraction applies to secureboost only",
    ),
    Rule(
        when=(equals("algorithm.name", "secureboost"), used("algorithm.num_class", None)),
        requires=equals("algorithm.objective", None, "multi:softprob"),
        message="algorithm.num_class applies to objective multi:softprob only",
    ),
)
"""Every rule between the sections of a vertical run, in the order they are checked
(run_config/rules.py says how a rule reads)."""


def parse_algorithm(value: Any) -> _Algorithm:
    """The ``algorithm`` section, validated by the named algorithm's config class."""
    if not isinstance(value, dict) or "name" not in value:
        raise ConfigError("algorithm: expected a mapping with a 'name'")
    name = value["name"]
    if name not in ALGORITHM_CONFIGS:
        raise ConfigError(
            "algorithm.name: " + unknown_name_message("vertical algorithm", name, ALGORITHM_CONFIGS)
        )
    model = ALGORITHM_CONFIGS[name]
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model, prefix="algorithm.")) from None


def is_vertical_config(raw: Any) -> bool:
    """Whether a raw config (mapping) asks for a vertical run: a vertical algorithm, or a
    vertical partition."""
    if isinstance(raw, VerticalRunConfig):
        return True
    if not isinstance(raw, dict):
        return False
    if raw.get("kind") is not None:  # explicit (docs/vertical.md, "The kind key")
        return raw["kind"] == "vertical"
    algo = raw.get("algorithm")
    name = algo.get("name") if isinstance(algo, dict) else algo
    data = raw.get("data")
    partition = data.get("partition") if isinstance(data, dict) else None
    kind = partition.get("kind") if isinstance(partition, dict) else None
    return name in VERTICAL_ALGORITHMS or kind == "vertical"


def parse_vertical_config(raw: Any) -> VerticalRunConfig:
    """Validate a raw mapping (or a YAML path); ConfigError naming the key on failure."""
    if isinstance(raw, VerticalRunConfig):
        return raw
    if isinstance(raw, str | Path):
        raw = load_yaml(Path(raw))
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    check_int64(raw)
    raw = {**raw, "algorithm": parse_algorithm(raw.get("algorithm"))}
    try:
        return VerticalRunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, VerticalRunConfig)) from None
