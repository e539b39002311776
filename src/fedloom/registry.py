"""Name -> object registries with 'did you mean' errors (algorithms, models, datasets,
partitions)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fedloom.errors import ConfigError, unknown_name_message

T = TypeVar("T")


class Registry(Generic[T]):
    """A small named registry; ``get`` raises a ConfigError naming the closest valid name."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def add(self, name: str, obj: T, replace_same: bool = False) -> None:
        """Register ``obj``; with ``replace_same`` a class of the same module and qualified
        name replaces the old one (a module imported again), anything else twice is an error."""
        old = self._items.get(name)
        if replace_same and old is not None and _same_definition(old, obj):
            self._items[name] = obj
            return
        self.register(name)(obj)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            msg = unknown_name_message(self.kind, name, self._items)
            raise ConfigError(f"{self.config_key}: {msg}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _same_definition(a: object, b: object) -> bool:
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )
