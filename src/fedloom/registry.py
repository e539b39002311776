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

    def add(self, name: str, obj: T) -> None:
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
