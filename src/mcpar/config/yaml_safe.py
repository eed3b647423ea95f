"""Bounded YAML reading for configs: what a hostile or broken file cannot do to the machine.

A config is a few dozen keys. The bounds below are far above any real one and keep an alias bomb,
a thousand nested brackets or a multi-gigabyte file from eating memory: it is refused in well
under a second with a line that names the file (and line) and what to fix. ``mcpar.config``
reads every config file and every ``--set`` value through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mcpar.errors import UserError, problem


def clip_text(text: str, limit: int = 80) -> str:
    """`text` on one line and at most `limit` characters, for a problem line."""
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."

# A config is a few dozen keys; these bounds are far above any real one and keep a hostile or
# broken file (an alias bomb, a thousand nested brackets, a multi-gigabyte file) from eating the
# machine's memory: it is refused in well under a second with a line that says what to fix.
MAX_CONFIG_BYTES = 1 << 20  # 1 MiB
MAX_YAML_ALIASES = 100  # alias uses (*name) in one document
MAX_YAML_DEPTH = 32  # nested mappings/sequences, aliases expanded
MAX_YAML_NODES = 10_000  # values once every alias is expanded


class YAMLBoundExceeded(Exception):
    """A document over one of the bounds above; ``line`` is 1-based, or None when unknown."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message = message
        self.line = line


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts alias uses and nesting while it composes the node graph,
    then checks the graph's size with every alias expanded (and that no alias refers to a node
    that contains it), before any Python object is built."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise YAMLBoundExceeded(
                    f"more than {MAX_YAML_ALIASES} alias uses (*name); write the values out "
                    "instead of repeating anchors", self.peek_event().start_mark.line + 1)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise YAMLBoundExceeded(
                f"nested more than {MAX_YAML_DEPTH} levels deep; a config is a few levels of "
                "sections", self.peek_event().start_mark.line + 1)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_expanded(root: yaml.Node) -> None:
    """Refuse a node graph that, with aliases expanded, nests past MAX_YAML_DEPTH, holds more
    than MAX_YAML_NODES values, or contains itself. Shared nodes are measured once."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height)
    open_nodes: set[int] = set()

    def measure(node: yaml.Node, level: int) -> tuple[int, int]:
        key = id(node)
        if key in open_nodes:
            raise YAMLBoundExceeded("an alias refers to a node that contains it (the value "
                                     "would be infinite)", node.start_mark.line + 1)
        if key not in measured:
            if level > MAX_YAML_DEPTH:
                raise YAMLBoundExceeded(
                    f"nested more than {MAX_YAML_DEPTH} levels deep once aliases are expanded",
                    node.start_mark.line + 1)
            open_nodes.add(key)
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            size, height = 1, 1
            for child in children:
                child_size, child_height = measure(child, level + 1)
                size += child_size
                height = max(height, child_height + 1)
                if size > MAX_YAML_NODES:
                    raise YAMLBoundExceeded(
                        f"more than {MAX_YAML_NODES:,} values once aliases are expanded (an "
                        "alias bomb?); a config is a few dozen keys", node.start_mark.line + 1)
            open_nodes.discard(key)
            measured[key] = (size, height)
        size, height = measured[key]
        if level + height - 1 > MAX_YAML_DEPTH:
            raise YAMLBoundExceeded(
                f"nested more than {MAX_YAML_DEPTH} levels deep once aliases are expanded",
                node.start_mark.line + 1)
        return size, height

    measure(root, 1)


def _precheck_events(text: str) -> None:
    """Count values, nesting and alias uses over libyaml's event stream, stopping at the first
    excess (libyaml composes in C, out of _BoundedLoader's reach). Syntax errors are left to
    the loader that follows, which names them."""
    depth = aliases = events = 0
    try:
        for event in yaml.parse(text, Loader=yaml.CSafeLoader):
            events += 1
            if events > 2 * MAX_YAML_NODES:  # a start and an end event per collection
                raise YAMLBoundExceeded(
                    f"more than {MAX_YAML_NODES:,} values; a config is a few dozen keys",
                    event.start_mark.line + 1)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise YAMLBoundExceeded(
                        f"nested more than {MAX_YAML_DEPTH} levels deep; a config is a few "
                        "levels of sections", event.start_mark.line + 1)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_YAML_ALIASES:
                    raise YAMLBoundExceeded(
                        f"more than {MAX_YAML_ALIASES} alias uses (*name); write the values out "
                        "instead of repeating anchors", event.start_mark.line + 1)
    except yaml.YAMLError as err:
        if "nesting depth" in str(err):  # libyaml's own limit (1000 levels)
            raise YAMLBoundExceeded(
                f"nested more than {MAX_YAML_DEPTH} levels deep; a config is a few levels of "
                "sections", _yaml_line(err)) from None


def bounded_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` within the bounds above; raises YAMLBoundExceeded,
    yaml.YAMLError, or ValueError (an integer of more digits than Python converts)."""
    if getattr(yaml, "__with_libyaml__", False):
        # libyaml (C) scans a 1 MiB file in milliseconds where the Python scanner takes seconds;
        # its events are checked first, its node graph after, both before anything is built.
        _precheck_events(text)
        loader: Any = yaml.CSafeLoader(text)
    else:
        loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_message(err: yaml.YAMLError) -> str:
    """What PyYAML says is wrong, on one line, without its marks (the line is named apart)."""
    if isinstance(err, yaml.MarkedYAMLError):
        text = ": ".join(p for p in (err.context, err.problem) if p) or "syntax error"
        mark = err.problem_mark or err.context_mark
        if mark is not None:
            text += f" (column {mark.column + 1})"
    else:
        text = str(err)
    return clip_text(" ".join(text.split()), 200)


def _yaml_line(err: yaml.YAMLError) -> int | None:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return mark.line + 1 if mark is not None else None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a raw mapping, with user errors for missing or bad files.

    The file must be UTF-8 and at most MAX_CONFIG_BYTES, and its YAML within the bounds on
    aliases, nesting and expanded size above; each refusal names the file (and the line when
    known) and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(problem(str(path), "config file not found; give the path to a YAML file"))
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise UserError(problem(str(path), f"cannot read the config file: {err.strerror}")) \
            from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UserError(problem(str(path), f"larger than {MAX_CONFIG_BYTES >> 20} MiB; a config "
                                "is a few dozen keys: is this the right file?"))
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UserError(problem(f"{path}:{line}", f"not UTF-8 text (byte {data[err.start]:#04x} "
                                f"at offset {err.start}); save the file as UTF-8")) from None
    try:
        raw = bounded_yaml(text)
    except YAMLBoundExceeded as err:
        where = f"{path}:{err.line}" if err.line else str(path)
        raise UserError(problem(where, f"refused: {err.message}")) from None
    except yaml.YAMLError as err:
        line = _yaml_line(err)
        where = f"{path}:{line}" if line else str(path)
        message = _yaml_message(err)
        raise UserError(problem(where, f"not valid YAML: {message}")) from None
    except ValueError:  # an integer of more digits than Python converts
        raise UserError(problem(str(path), "holds an integer too long to read (thousands of "
                                "digits); no config value is that large")) from None
    if raw is not None and not isinstance(raw, dict):
        raise UserError(problem(str(path), "the top level must be a mapping of sections"))
    return raw or {}
