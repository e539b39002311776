"""The YAML that configs, ``--set`` values, search spaces and sweep specs are read as
(docs/inputs.md, "Strict values"): PyYAML's safe subset, with two changes.

- A key written twice in one mapping is an error naming the key's path and both lines (PyYAML
  keeps the last silently). Keys merged in by ``<<: *anchor`` may still be overridden.
- An integer too long for Python to read (over 4300 digits) is a YAMLError, not a ValueError.
- A number in exponent notation without a dot or an exponent sign (``1e-3``, ``2E5``) is a
  float, as in YAML 1.2's core schema (YAML 1.1, which PyYAML follows, reads it as a string;
  config values are typed strictly, so it would be refused).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_MERGE = "tag:yaml.org,2002:merge"
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of the YAML text holds a key twice; the message names its path and lines."""


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys and reads ``1e-3`` as a float."""

    def construct_yaml_int(self, node: ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # sys.get_int_max_str_digits(): larger than any config's int
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} digits is too large", node.start_mark
            ) from None

    def construct_document(self, node: Node) -> Any:
        self._check_keys(node)
        return super().construct_document(node)

    def _check_keys(self, root: Node) -> None:
        """DuplicateKeyError for the first mapping that holds a key twice. Each node is
        visited once (aliases point to nodes already seen), so an alias cycle or bomb costs
        no more than its text."""
        seen: set[int] = set()
        stack: list[tuple[Node, str]] = [(root, "")]
        while stack:
            node, path = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, SequenceNode):
                stack.extend((item, path) for item in reversed(node.value))
            elif isinstance(node, MappingNode):
                stack.extend(reversed(self._children(node, path)))

    def _children(self, node: MappingNode, path: str) -> list[tuple[Node, str]]:
        lines: dict[Any, int] = {}
        children = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, ScalarNode):
                children.append((value_node, path))
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise DuplicateKeyError(
                    f"duplicate key '{path}{key}' (lines {lines[key]} and {line}): keep one"
                )
            lines[key] = line
            children.append((value_node, f"{path}{key}."))
        return children


class ConfigDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes a string ``ConfigLoader`` would read as a float
    (``"1e5"``), so that what fedloom writes (config.yaml, the ``--set`` items of a trial or a
    sweep cell) reads back as it was."""


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)
for _cls in (ConfigLoader, ConfigDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def load_yaml_text(text: str) -> Any:
    """``text`` parsed as config YAML (``ConfigLoader``); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: no Python objects


def dump_yaml_text(value: Any, **options: Any) -> str:
    """``value`` (plain data) as YAML that ``load_yaml_text`` reads back equal
    (``ConfigDumper``); ``options`` as ``yaml.safe_dump``'s."""
    return yaml.dump(value, Dumper=ConfigDumper, **options)
