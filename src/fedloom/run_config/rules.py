"""Cross-section rules of a run config, declared as data and checked in one place.

A :class:`Rule` reads: when every condition of ``when`` holds, every condition of ``requires``
must hold and none of ``excludes`` may; otherwise the config is refused with the rule's
message. Conditions are a key's value (:class:`Setting`, made with :func:`equals` and
:func:`used`), traits of the configured algorithm's class (:class:`Algorithm`), any of several
conditions (:class:`AnyOf`), or another predicate on the parsed config (:class:`Check`).

Each run family has one table of rules beside its top config, whose one validator hands it to
:func:`check_rules`: ``RULES`` beside ``RunConfig`` (``fedloom/config.py``), ``RL_RULES``
(``rl/config.py``), ``VERTICAL_RULES`` (``vertical/config.py``). Each section checks its own
keys itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fedloom.algorithms import ALGORITHMS
from fedloom.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """The key at the dotted ``path`` has one of ``values``, or, when ``values`` is empty, any
    value other than those in ``off`` (the values that leave the feature unused)."""

    path: str
    values: tuple[Any, ...] = ()
    off: tuple[Any, ...] = ("none",)

    def read(self, config: BaseModel) -> Any:
        node: Any = config
        for part in self.path.split("."):
            node = getattr(node, part)
        return node

    def holds(self, config: BaseModel) -> bool:
        value = self.read(config)
        return value in self.values if self.values else value not in self.off

    def describe(self, config: BaseModel) -> str:
        return f"{self.path}: {self.read(config)}"


def equals(path: str, *values: Any) -> Setting:
    """The key at ``path`` is one of ``values``."""
    return Setting(path, values=values)


def used(path: str, *off: Any) -> Setting:
    """The key at ``path`` is set to anything but ``off`` (default: ``"none"``)."""
    return Setting(path, off=off or ("none",))


_ALGORITHM_NAME = Setting("algorithm.name")


@dataclass(frozen=True)
class Algorithm:
    """The configured algorithm's class has every trait of ``has`` and none of ``lacks``
    (traits of its :class:`fedloom.algorithms.capabilities.Capabilities`)."""

    has: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()

    def fits(self, name: str) -> bool:
        cls = ALGORITHMS.get(name)
        caps = cls.capabilities
        return all(getattr(caps, t) for t in self.has) and not any(
            getattr(caps, t) for t in self.lacks
        )

    def holds(self, config: BaseModel) -> bool:
        return self.fits(_ALGORITHM_NAME.read(config))

    def supported(self) -> list[str]:
        """The registered algorithms that have these traits."""
        return [name for name in ALGORITHMS.names() if self.fits(name)]

    def describe(self, config: BaseModel) -> str:
        return _ALGORITHM_NAME.describe(config)


@dataclass(frozen=True)
class Check:
    """Any other predicate on the parsed config; ``text`` names it in a clash list."""

    predicate: Callable[[Any], bool]
    text: str = ""

    def holds(self, config: BaseModel) -> bool:
        return bool(self.predicate(config))

    def describe(self, config: BaseModel) -> str:
        return self.text


@dataclass(frozen=True)
class AnyOf:
    """At least one of ``conditions`` holds."""

    conditions: tuple[Setting | Algorithm | Check, ...]

    def holds(self, config: BaseModel) -> bool:
        return any(c.holds(config) for c in self.conditions)

    def describe(self, config: BaseModel) -> str:
        return ", ".join(c.describe(config) for c in self.conditions if c.holds(config))


Condition = Setting | Algorithm | Check | AnyOf
Message = str | Callable[[Any], str]


def _tuple(value: Condition | Sequence[Condition]) -> tuple[Condition, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,)


@dataclass(frozen=True, init=False)
class Rule:
    """When all of ``when`` hold: all of ``requires`` must hold, none of ``excludes`` may.

    ``message`` is a template formatted with the config's sections (``{privacy.kind}``,
    ``{algorithm.name}``), ``{clash}`` (the excluded settings that are present, as
    ``key: value``), ``{supported}`` (the algorithms with the traits a required
    :class:`Algorithm` asks for) and ``{n}`` (the clients a round, when known); or a function
    of the config returning the message."""

    when: tuple[Condition, ...]
    message: Message
    requires: tuple[Condition, ...]
    excludes: tuple[Condition, ...]

    def __init__(
        self,
        when: Condition | Sequence[Condition],
        message: Message,
        requires: Condition | Sequence[Condition] = (),
        excludes: Condition | Sequence[Condition] = (),
    ) -> None:
        object.__setattr__(self, "when", _tuple(when))
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "requires", _tuple(requires))
        object.__setattr__(self, "excludes", _tuple(excludes))

    def violation(self, config: BaseModel) -> str | None:
        """The error message when ``config`` breaks this rule, else None."""
        if not all(c.holds(config) for c in self.when):
            return None
        missing = [c for c in self.requires if not c.holds(config)]
        clash = [c for c in self.excludes if c.holds(config)]
        if not missing and not clash:
            return None
        if callable(self.message):
            return self.message(config)
        algorithms = [c for c in self.requires if isinstance(c, Algorithm)]
        fields = {name: getattr(config, name) for name in type(config).model_fields}
        nominal = getattr(config, "clients_per_round_nominal", None)
        return self.message.format(
            **fields,
            clash=", ".join(c.describe(config) for c in clash),
            supported=", ".join(algorithms[0].supported()) if algorithms else "",
            n=nominal() if nominal is not None else None,
        )


def check_rules(config: BaseModel, rules: Sequence[Rule]) -> None:
    """Raise ConfigError with the message of the first rule ``config`` breaks (in table
    order: a rule may rely on the rules before it having held)."""
    for rule in rules:
        message = rule.violation(config)
        if message is not None:
            raise ConfigError(message)
