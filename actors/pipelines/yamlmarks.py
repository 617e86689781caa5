"""Safe YAML loading that keeps each value's line number; aliases are refused.

See docs/pipelines.md ("The file").
"""

from __future__ import annotations

from typing import Any

import yaml

_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
Path_ = tuple[str | int, ...]


class YamlRefusalError(ValueError):
    """The text is not plain YAML data; `line` is 1-based, `key` dotted."""

    def __init__(self, line: int, key: str, message: str) -> None:
        super().__init__(message)
        self.line, self.key, self.message = line, key, message


def dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path) or "(top)"


def load(text: str) -> tuple[Any, dict[Path_, int]]:
    """The data of `text` and the 1-based line of every path in it."""
    try:
        node = yaml.compose(text, Loader=_SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise YamlRefusalError(line, "(yaml)", f"not valid YAML: {exc.problem}") from exc
    except yaml.YAMLError as exc:
        raise YamlRefusalError(1, "(yaml)", f"not valid YAML: {exc}") from exc
    lines: dict[Path_, int] = {}
    if node is None:
        return None, lines
    loader = yaml.SafeLoader("")
    try:
        return _build(node, (), lines, set(), loader), lines
    finally:
        loader.dispose()


def _build(node: yaml.Node, path: Path_, lines: dict[Path_, int], seen: set[int],
           loader: yaml.SafeLoader) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if id(node) in seen:  # the same node twice: an alias
        raise YamlRefusalError(lines[path], dotted(path), "aliases are not allowed (no recursion)")
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                raise YamlRefusalError(key_node.start_mark.line + 1, dotted(path),
                                  "keys must be plain strings (no merges, no complex keys)")
            key = str(key_node.value)
            if key in out:
                raise YamlRefusalError(key_node.start_mark.line + 1, dotted((*path, key)),
                                  "duplicate key")
            lines[(*path, key)] = key_node.start_mark.line + 1
            out[key] = _build(value_node, (*path, key), lines, seen, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(v, (*path, i), lines, seen, loader) for i, v in enumerate(node.value)]
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise YamlRefusalError(lines[path], dotted(path), f"bad value: {exc}") from exc


def locate(data: Any, lines: dict[Path_, int], loc: tuple[Any, ...]) -> tuple[int, str]:
    """The line and dotted key of a pydantic error's `loc` in `data`: components
    that are not a step into the data (union tags) are skipped; a missing key
    is named, on the line of its parent."""
    path: Path_ = ()
    node = data
    missing: list[str] = []
    for part in loc:
        if missing:
            missing.append(str(part))
        elif _holds(node, part):
            node, path = node[part], (*path, part)
        elif isinstance(node, dict) and isinstance(part, str) and part == loc[-1]:
            missing.append(part)
    return lines.get(path, 1), ".".join([*(str(p) for p in path), *missing]) or "(top)"


def _holds(node: Any, part: Any) -> bool:
    """Whether `part` is a key or an index of `node`."""
    if isinstance(node, dict):
        return isinstance(part, str) and part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
