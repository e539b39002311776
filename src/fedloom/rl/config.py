"""The YAML contract of federated reinforcement-learning runs (issue #18, docs/rl.md):

```yaml
seed: 0
data: {name: cartpole, num_clients: 4, envs_per_client: 16,
       cartpole: {lengths: [0.25, 0.5, 1.0, 1.5], unseen_lengths: [2.0, 3.0]}}
model: {name: mlp_policy, hidden: [32]}
algorithm: {name: pavg}   # pavg | pavg_embedding | pavg_ppo | pavg_ppo_embedding | local_ppo
                          # | qavg | local | local_dqn | vertical_dqn
train: {rounds: 20, local_steps: 5, lr: 0.01}   # local_steps: E local updates per round
eval: {every: 1, episodes: 20}
aggregator: {kind: mean}  # or any robust rule of docs/security.md
```

A round is E = ``train.local_steps`` local updates (REINFORCE iterations, PPO iterations of
``num_steps`` environment steps and ``update_epochs`` x ``num_minibatches`` Adam steps, or DQN
iterations of one environment step and ``grad_steps`` TD steps) followed by the server's
aggregation. This
module imports nothing heavy: the API uses it to recognise an RL config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from fedloom.compression.config import CompressionConfig
from fedloom.config import load_yaml
from fedloom.core.settings import Seed, StrictModel
from fedloom.core.validation import check_int64, format_validation_error
from fedloom.core.yaml_text import dump_yaml_text
from fedloom.errors import ConfigError, unknown_name_message
from fedloom.privacy.config import PrivacyConfig
from fedloom.robust.config import AggregatorConfig
from fedloom.robust.rules import byzantine_error
from fedloom.run_config.monitor import TrackingConfig
from fedloom.run_config.rules import Check, Rule, check_rules, equals, used
from fedloom.run_config.train import CheckpointConfig

RL_ENVS = ("cartpole", "acrobot")
RL_ALGORITHMS = (
    "pavg",
    "pavg_embedding",
    "pavg_ppo",
    "pavg_ppo_embedding",
    "local_ppo",
    "qavg",
    "local",
    "local_dqn",
    "vertical_dqn",
)
AVERAGING = ("pavg", "pavg_embedding", "pavg_ppo", "pavg_ppo_embedding", "qavg")
"""The algorithms with a server: the agents' networks are aggregated every E local updates."""
PPO = ("pavg_ppo", "pavg_ppo_embedding", "local_ppo")


class CartPoleOptions(StrictModel):
    """Per-agent CartPole physics (Gymnasium's attribute names; ``length`` is half the pole)."""

    lengths: list[Annotated[float, Field(gt=0.0)]] = Field(
        default=[0.25, 0.5, 1.0, 1.5], min_length=1
    )
    """Training half-lengths; agent k gets ``lengths[k % len(lengths)]``."""
    unseen_lengths: list[Annotated[float, Field(gt=0.0)]] = Field(default=[2.0, 3.0])
    """Evaluated only (never trained on): generalisation to new environments."""
    masspole: float = Field(default=0.1, gt=0.0)
    masscart: float = Field(default=1.0, gt=0.0)
    gravity: float = Field(default=9.8, gt=0.0)


class AcrobotOptions(StrictModel):
    """Per-agent Acrobot physics through Gymnasium's vector API (``LINK_MASS_2``)."""

    link_masses: list[Annotated[float, Field(gt=0.0)]] = Field(
        default=[0.5, 1.0, 1.5, 2.0], min_length=1
    )
    unseen_link_masses: list[Annotated[float, Field(gt=0.0)]] = Field(default=[3.0])


class RLDataConfig(StrictModel):
    name: Literal["cartpole", "acrobot"] = "cartpole"
    root: str | None = None
    """Unused: the environments are simulated."""
    num_clients: int = Field(default=4, ge=1)
    """Agents (vertical_dqn: one environment stream, the parties are set by the algorithm)."""
    envs_per_client: int = Field(default=16, ge=1)
    cartpole: CartPoleOptions = CartPoleOptions()
    acrobot: AcrobotOptions = AcrobotOptions()

    @property
    def variants(self) -> tuple[list[float], list[float]]:
        """(training, unseen) values of the varied physics parameter."""
        if self.name == "cartpole":
            return list(self.cartpole.lengths), list(self.cartpole.unseen_lengths)
        return list(self.acrobot.link_masses), list(self.acrobot.unseen_link_masses)

    @property
    def variant_key(self) -> str:
        return "length" if self.name == "cartpole" else "link_mass_2"


class RLModelConfig(StrictModel):
    name: Literal["mlp_policy"] = "mlp_policy"
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default=[32], min_length=1)
    activation: Literal["tanh", "relu"] | None = None
    """null: tanh for policies (4-32-2 tanh on CartPole, docs/rl.md), relu for Q-networks."""


class _Algorithm(StrictModel):
    gamma: float = Field(default=0.99, gt=0.0, le=1.0)


class PAvgConfig(_Algorithm):
    """PAvg: REINFORCE locally, policies averaged every E updates (Jin et al. 2022)."""

    name: Literal["pavg"] = "pavg"
    mu: float = Field(default=0.0, ge=0.0)
    """FedProx's proximal coefficient on the local updates (0: plain averaging)."""


class PAvgEmbeddingConfig(PAvgConfig):
    """PAvg with a learned per-environment embedding concatenated to the state (Jin et al.
    2022, personalization); unseen environments get the agents' mean embedding."""

    name: Literal["pavg_embedding"] = "pavg_embedding"  # type: ignore[assignment]
    embedding_dim: int = Field(default=2, ge=1)


class LocalConfig(_Algorithm):
    """Independent REINFORCE agents: the local baseline (no communication)."""

    name: Literal["local"] = "local"


class PPOKeys(_Algorithm):
    """PPO's keys (Schulman et al. 2017; GAE, Schulman et al. 2016), defaulting to CleanRL's
    ``ppo.py`` for CartPole (its ``num_envs`` 4 is ``data.envs_per_client``)."""

    num_steps: int = Field(default=128, ge=1)
    """Steps of every environment per PPO iteration (the rollout length)."""
    gae_lambda: float = Field(default=0.95, ge=0.0, le=1.0)
    num_minibatches: int = Field(default=4, ge=1)
    """Minibatches per epoch; must divide num_steps x data.envs_per_client."""
    update_epochs: int = Field(default=4, ge=1)
    clip_coef: float = Field(default=0.2, gt=0.0)
    clip_vloss: bool = True
    """Clip the value update around the rollout's values (CleanRL's clipped value loss)."""
    norm_adv: bool = True
    """Standardise the advantages within each minibatch."""
    ent_coef: float = Field(default=0.01, ge=0.0)
    vf_coef: float = Field(default=0.5, ge=0.0)
    max_grad_norm: float = Field(default=0.5, gt=0.0)
    """Each agent's gradient is clipped to this global norm."""
    anneal_lr: bool = True
    """Anneal Adam's step size linearly to 0 over the run's iterations."""
    adam_eps: float = Field(default=1e-5, gt=0.0)


class PAvgPPOConfig(PPOKeys):
    """PAvg with PPO agents: actor and critic averaged every E PPO iterations."""

    name: Literal["pavg_ppo"] = "pavg_ppo"
    mu: float = Field(default=0.0, ge=0.0)
    """FedProx's proximal coefficient on the local updates (0: plain averaging)."""


class PAvgPPOEmbeddingConfig(PAvgPPOConfig):
    """PPO agents with a learned per-environment embedding concatenated to the state of actor
    and critic (Jin et al. 2022); the embedding is never averaged."""

    name: Literal["pavg_ppo_embedding"] = "pavg_ppo_embedding"  # type: ignore[assignment]
    embedding_dim: int = Field(default=2, ge=1)


class LocalPPOConfig(PPOKeys):
    """Independent PPO agents: the local baseline (no communication)."""

    name: Literal["local_ppo"] = "local_ppo"


class _DQN(_Algorithm):
    buffer: int = Field(default=50_000, ge=1)
    batch_size: int = Field(default=128, ge=1)
    grad_steps: int = Field(default=2, ge=1)
    """TD steps per iteration (one environment step of every environment)."""
    target_every: int = Field(default=50, ge=1)
    """Iterations between target-network copies."""
    learning_starts: int = Field(default=1_000, ge=1)
    """Transitions per agent in the buffer before TD steps begin."""
    epsilon_start: float = Field(default=1.0, ge=0.0, le=1.0)
    epsilon_end: float = Field(default=0.05, ge=0.0, le=1.0)
    explore_fraction: float = Field(default=0.3, gt=0.0, le=1.0)


class _HorizontalDQN(_DQN):
    double: bool = False
    """Double DQN (van Hasselt et al. 2016): the online network picks the next action, the
    target network values it."""


class QAvgConfig(_HorizontalDQN):
    """QAvg: DQN locally, Q-networks averaged every E iterations (Jin et al. 2022)."""

    name: Literal["qavg"] = "qavg"
    mu: float = Field(default=0.0, ge=0.0)
    global_target: bool = True
    """A target copy made during a round is replaced by that round's global Q-network (no
    extra traffic); false: each agent keeps its local pre-averaging copy."""


class LocalDQNConfig(_HorizontalDQN):
    name: Literal["local_dqn"] = "local_dqn"


class VerticalDQNConfig(_DQN):
    """Vertical federated DQN (Zhuo et al. 2019) and the baselines of docs/rl.md (``mode``)."""

    name: Literal["vertical_dqn"] = "vertical_dqn"
    mode: Literal["vertical", "party_a", "centralized"] = "vertical"
    """vertical: A and B by message passing; party_a: the Q-party alone on its features;
    centralized: one DQN on the full state."""
    party_a: list[Annotated[int, Field(ge=0)]] = Field(default=[0, 1], min_length=1)
    """State features of the Q-party A (CartPole: cart position and velocity)."""
    party_b: list[Annotated[int, Field(ge=0)]] = Field(default=[2, 3], min_length=1)
    """State features of collaborator B (pole angle and angular velocity)."""
    bottom: int = Field(default=32, ge=1)
    """Width of each party's bottom network."""
    noise_std: float = Field(default=0.0, ge=0.0)
    """sigma of the Gaussian noise on B's activations."""

    @model_validator(mode="after")
    def _disjoint(self) -> VerticalDQNConfig:
        if set(self.party_a) & set(self.party_b):
            raise ValueError("algorithm.party_a and algorithm.party_b must not share features")
        return self


Algorithm = Annotated[
    PAvgConfig
    | PAvgEmbeddingConfig
    | LocalConfig
    | PAvgPPOConfig
    | PAvgPPOEmbeddingConfig
    | LocalPPOConfig
    | QAvgConfig
    | LocalDQNConfig
    | VerticalDQNConfig,
    Field(discriminator="name"),
]

RL_ALGORITHM_CONFIGS: dict[str, type[_Algorithm]] = {
    c.model_fields["name"].default: c
    for c in (
        PAvgConfig,
        PAvgEmbeddingConfig,
        LocalConfig,
        PAvgPPOConfig,
        PAvgPPOEmbeddingConfig,
        LocalPPOConfig,
        QAvgConfig,
        LocalDQNConfig,
        VerticalDQNConfig,
    )
}
"""Each RL algorithm's config class by name (``fedloom algorithms``)."""

DEFAULT_LR = {"reinforce": 0.01, "ppo": 2.5e-4, "dqn": 5e-4}


class RLTrainConfig(StrictModel):
    rounds: int = Field(default=20, ge=1)
    local_steps: int = Field(default=5, ge=1)
    """E: local updates between two aggregations."""
    lr: float | None = Field(default=None, gt=0.0)
    """Adam's step size (null: 0.01 for REINFORCE, 2.5e-4 for PPO, 5e-4 for DQN)."""
    clients_per_round: int | None = Field(default=None, ge=1)
    """Agents whose update the server aggregates each round, sampled without replacement
    from a seeded stream as horizontal runs do (engine/sampling.py); null: every agent."""


class RLEvalConfig(StrictModel):
    every: int = Field(default=1, ge=1)
    """Rounds between greedy evaluations (the last round is always evaluated)."""
    episodes: int = Field(default=20, ge=1)
    """Greedy episodes per environment."""


class RLRunConfig(StrictModel):
    kind: Literal["rl"] = "rl"
    """The run family (docs/rl.md, "The kind key"); optional here, inferred once by
    ``fedloom.api.run_kind`` when absent."""
    seed: Seed = 0
    data: RLDataConfig = RLDataConfig()
    model: RLModelConfig = RLModelConfig()
    algorithm: Algorithm = PAvgConfig()
    train: RLTrainConfig = RLTrainConfig()
    eval: RLEvalConfig = RLEvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    aggregator: AggregatorConfig = AggregatorConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    """client_dp: DP-FedAvg on the policy update (docs/rl.md, Mechanisms)."""
    compression: CompressionConfig = CompressionConfig()
    """Upload compression of the agents' policy updates (docs/rl.md, Mechanisms)."""

    @model_validator(mode="after")
    def _cross_section_rules(self) -> RLRunConfig:
        """The rules between sections (``RL_RULES``), here and nowhere else."""
        check_rules(self, RL_RULES)
        return self

    @property
    def averages(self) -> bool:
        return self.algorithm.name in AVERAGING

    @property
    def learner(self) -> str:
        if self.algorithm.name in PPO:
            return "ppo"
        return "reinforce" if self.algorithm.name in ("pavg", "pavg_embedding", "local") else "dqn"

    @property
    def byzantine_f(self) -> int:
        """The Byzantine agents a robust rule tolerates: aggregator.f, else 1."""
        return self.aggregator.f if self.aggregator.f is not None else 1

    @property
    def per_round(self) -> int:
        """The agents a round: train.clients_per_round, else every agent."""
        return self.train.clients_per_round or self.data.num_clients

    @property
    def lr(self) -> float:
        return self.train.lr if self.train.lr is not None else DEFAULT_LR[self.learner]

    @property
    def activation(self) -> str:
        if self.model.activation is not None:
            return self.model.activation
        return "relu" if self.learner == "dqn" else "tanh"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return dump_yaml_text(self.to_dict(), sort_keys=False)


def _ppo_batch(config: RLRunConfig) -> int:
    """PPO's rollout: algorithm.num_steps x data.envs_per_client transitions."""
    assert isinstance(config.algorithm, PPOKeys)
    return config.algorithm.num_steps * config.data.envs_per_client


def _byzantine_error(config: RLRunConfig) -> str | None:
    return byzantine_error(config.aggregator.kind, config.per_round, config.byzantine_f)


_CLIENT_DP = equals("privacy.kind", "client_dp")
_ROBUST = used("aggregator.kind", "mean")
_COMPRESSION = used("compression.kind")
_VERTICAL_DQN = equals("algorithm.name", "vertical_dqn")

RL_RULES: tuple[Rule, ...] = (
    # the server-side mechanisms act on the averaged policy: only averaging algorithms have one
    Rule(
        when=Check(lambda c: not c.averages),
        excludes=(_ROBUST, used("privacy.kind"), _COMPRESSION),
        message="{clash}: {algorithm.name} does not aggregate (use " + ", ".join(AVERAGING) + ")",
    ),
    # client-level DP and compression compose as in horizontal runs (fedloom/config.py)
    Rule(
        when=(),
        excludes=equals("privacy.kind", "distributed_dp"),
        message="privacy.kind distributed_dp needs secure aggregation, which RL runs do not "
        "have; use client_dp",
    ),
    Rule(
        when=(),
        excludes=equals("privacy.kind", "sample_dp"),
        message="privacy.kind sample_dp: the agents' local steps are not DP-SGD steps; use "
        "client_dp, DP on each agent's policy update",
    ),
    Rule(
        when=_CLIENT_DP,
        requires=equals("privacy.sampling", "fixed"),
        message="privacy.sampling: RL rounds aggregate exactly train.clients_per_round agents; "
        "set sampling: fixed",
    ),
    Rule(
        when=_CLIENT_DP,
        excludes=(_ROBUST, _COMPRESSION),
        message="privacy.kind client_dp does not combine with {clash}: a robust rule needs each "
        "update in the clear, compression changes the clipped updates",
    ),
    Rule(
        when=(),
        excludes=used("compression.download"),
        message="compression.download: the agents' broadcast is not compressed in RL runs",
    ),
    Rule(
        when=(),
        excludes=equals("aggregator.kind", "feature_aware"),
        message="aggregator.kind feature_aware averages the input columns of clients with "
        "missing features (docs/security.md); RL agents observe every feature: use mean or a "
        "robust rule",
    ),
    # the algorithm's own needs
    Rule(
        when=_VERTICAL_DQN,
        requires=equals("data.name", "cartpole"),
        message="algorithm vertical_dqn: data.name must be cartpole",
    ),
    Rule(
        when=_VERTICAL_DQN,
        requires=Check(lambda c: max(c.algorithm.party_a + c.algorithm.party_b) < 4),
        message="algorithm.party_a/party_b: CartPole has features 0..3",
    ),
    Rule(
        when=equals("data.name", "acrobot"),
        requires=Check(lambda c: c.learner == "reinforce"),
        message="data.name acrobot (Gymnasium's vector API): algorithm {algorithm.name} needs "
        "the batched CartPole; use pavg, pavg_embedding or local",
    ),
    Rule(
        when=used("train.clients_per_round", None),
        requires=Check(lambda c: c.averages and c.per_round <= c.data.num_clients),
        message="train.clients_per_round {train.clients_per_round}: needs an averaging "
        "algorithm (" + ", ".join(AVERAGING) + ") and at most data.num_clients "
        "({data.num_clients})",
    ),
    Rule(
        when=equals("algorithm.name", *PPO),
        requires=Check(lambda c: _ppo_batch(c) % c.algorithm.num_minibatches == 0),
        message=lambda c: (
            f"algorithm.num_minibatches {c.algorithm.num_minibatches} must "
            f"divide the rollout of algorithm.num_steps x data.envs_per_client = {_ppo_batch(c)} "
            "transitions"
        ),
    ),
    # Krum and Bulyan need enough agents a round (the same number take part every round)
    Rule(
        when=equals("aggregator.kind", "krum", "multi_krum", "bulyan"),
        requires=Check(lambda c: _byzantine_error(c) is None),
        message=lambda c: str(_byzantine_error(c)),
    ),
)
"""Every rule between the sections of an RL run, in the order they are checked
(run_config/rules.py says how a rule reads)."""


def is_rl_config(raw: Any) -> bool:
    """Whether a raw config (mapping or parsed) asks for an RL run: ``kind: rl``, or, without a
    ``kind`` key, an RL environment or an RL algorithm (docs/rl.md, "The kind key")."""
    if isinstance(raw, RLRunConfig):
        return True
    if not isinstance(raw, dict):
        return False
    if raw.get("kind") is not None:
        return raw["kind"] == "rl"
    data, algo = raw.get("data"), raw.get("algorithm")
    name = data.get("name") if isinstance(data, dict) else None
    algo_name = algo.get("name") if isinstance(algo, dict) else algo
    return name in RL_ENVS or (algo_name in RL_ALGORITHMS and algo_name != "local")


def parse_rl_config(raw: Any) -> RLRunConfig:
    """Validate a raw mapping (or a YAML path); ConfigError naming the key on failure."""
    if isinstance(raw, RLRunConfig):
        return raw
    if isinstance(raw, str | Path):
        raw = load_yaml(raw)
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    check_int64(raw)
    algo = raw.get("algorithm")
    name = algo.get("name") if isinstance(algo, dict) else algo
    if name is not None and name not in RL_ALGORITHMS:
        raise ConfigError(unknown_name_message("algorithm.name (RL)", str(name), RL_ALGORITHMS))
    try:
        return RLRunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RLRunConfig)) from None
