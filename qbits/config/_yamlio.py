"""YAML files: safe loading only, bounded, exact round trips.

Files are read with a :class:`yaml.SafeLoader` (so a file can never build a
Python object) that also refuses duplicate keys, which plain YAML would
silently resolve to the last one. A file holds either one config (keys
``fwd``/``dlhs``/``drhs``), a per-layer :class:`~qbits.QuantConfig` (keys
``rules``/``default``) or just a preset name.

A config is a few kilobytes, so a file that asks for much more is refused
before it can exhaust time or memory, with an error naming the file and the
limit: at most :data:`MAX_BYTES` bytes of UTF-8 text (a UTF-8 byte-order mark
is allowed; UTF-16 and binary files are refused), mappings and lists nested at
most :data:`MAX_DEPTH` deep, at most :data:`MAX_ITEMS` entries in one list or
mapping, and at most :data:`MAX_VALUES` values in the whole document once
anchors and aliases (``&name``/``*name``) are expanded; aliases are allowed
within that budget, so a nested "billion laughs" file is refused at once.
An integer is at most :data:`MAX_INT_CHARS` characters long (Python refuses
to read one of more than 4300 digits, and no config value comes near).
Only regular files are read: a FIFO, a device or a directory is refused
before it is opened for reading, so reading never waits for a writer.

Numbers in exponent notation without a dot or a signed exponent (``1e-3``,
``2.5e3``), which YAML 1.1 reads as strings, are read as floats, as YAML 1.2
and JSON read them.

Sweep files (``qbits sweep``) are read the same way,
with :func:`read_yaml`. :func:`dump` writes a config.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from qbits._errors import ConfigError
from qbits._files import read_regular_file
from qbits.config import presets
from qbits.config._schema import to_dict

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_INT_CHARS",
    "MAX_ITEMS",
    "MAX_VALUES",
    "dump",
    "parse_yaml",
    "preset_yaml",
    "read_yaml",
    "write_presets",
]

#: Largest file (bytes; characters for YAML text) qbits reads as YAML.
MAX_BYTES = 1 << 20
#: Deepest nesting of mappings and lists (the top-level value is depth 1).
MAX_DEPTH = 32
#: Most entries in one list or mapping.
MAX_ITEMS = 10_000
#: Most values (scalars, lists, mappings) in a document, aliases expanded.
MAX_VALUES = 100_000
#: Longest integer, in characters (sign and ``_`` included).
MAX_INT_CHARS = 100

_LIMIT = "a limit of qbits' YAML reader"


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and bounds the document.

    While the document is composed it counts the nesting depth (before
    descending, so a deeply nested file never reaches Python's recursion
    limit), the entries of each collection, and the size and height of every
    node with its aliases expanded (an alias is counted as often as it is
    used, computed once per node).
    """

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> values, height

    def compose_node(self, parent: Any, index: Any) -> Any:
        if parent is not None and len(parent.value) >= MAX_ITEMS:
            raise ConfigError(
                "",
                len(parent.value) + 1,
                f"at most {MAX_ITEMS} entries in one list or mapping",
                why=f"{_at(self.peek_event().start_mark)}: {_LIMIT}",
            )
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigError(
                    "",
                    self._depth,
                    f"mappings and lists nested at most {MAX_DEPTH} deep",
                    why=f"{_at(self.peek_event().start_mark)}: {_LIMIT}",
                )
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._measure(node)
        return node

    def _measure(self, node: Any) -> None:
        """Records the expanded size and height of a just composed node."""
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        known = [self._sizes.get(id(c), (1, 1)) for c in children]
        values = 1 + sum(v for v, _ in known)
        height = 1 + max((h for _, h in known), default=0)
        self._sizes[id(node)] = (values, height)
        if values > MAX_VALUES:
            raise ConfigError(
                "",
                values,
                f"at most {MAX_VALUES} values in the document, aliases (*name) "
                "expanded",
                why=f"{_at(node.start_mark)}: {_LIMIT}",
            )
        if height > MAX_DEPTH:
            raise ConfigError(
                "",
                height,
                f"mappings and lists nested at most {MAX_DEPTH} deep, aliases "
                "(*name) expanded",
                why=f"{_at(node.start_mark)}: {_LIMIT}",
            )


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:  # a list or mapping as a key
            kind = "a list" if isinstance(key, list) else "a mapping"
            raise ConfigError(
                "",
                kind,
                "a string, number, bool or null as a key",
                why=f"{_at(key_node.start_mark)}: an unhashable key",
            ) from None
        if duplicate:
            line = key_node.start_mark.line + 1
            raise ConfigError(
                "",
                key,
                "each key once per mapping",
                why=f"duplicate key at line {line}",
            )
        seen[key] = True
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    text = node.value
    if len(text) > MAX_INT_CHARS:
        raise ConfigError(
            "",
            f"an integer of {len(text)} characters ({text[:12]}...)",
            f"an integer of at most {MAX_INT_CHARS} characters",
            why=f"{_at(node.start_mark)}: {_LIMIT}; no config value comes near",
        )
    return loader.construct_yaml_int(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings :class:`_StrictLoader` reads as floats."""


# YAML 1.1 wants a dot and a signed exponent (1.0e-3); 1e-3 was a string.
_EXPONENT = re.compile(
    r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+\Z"
)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789.")
)
_Dumper.add_implicit_resolver(
    "tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789.")
)


def _too_big(size: int) -> ConfigError:
    return ConfigError(
        "",
        size,
        f"at most {MAX_BYTES} bytes of YAML",
        why=f"{_LIMIT}; a config is a few kilobytes",
    )


def _decode(data: bytes) -> str:
    """UTF-8 bytes (an optional byte-order mark) as text; ConfigError otherwise."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(
            "",
            data[:4],
            "UTF-8 text",
            why="a UTF-16 byte-order mark: save the file as UTF-8",
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise ConfigError(
            "",
            data[e.start : e.start + 4],
            "UTF-8 text",
            why=f"line {line}, column {column}: not UTF-8; a binary file or "
            "another encoding?",
        ) from None


def parse_yaml(text: str | bytes, source: str | None = None) -> Any:
    r"""Parses YAML into plain data, safely and within the limits above.

    The reader behind :func:`qbits.load_config` and sweep files: only plain YAML
    (mappings, lists, strings, numbers, booleans, null; no tags that build
    Python objects), each key once per mapping, and the size limits of this
    module.

    Args:
      text: The YAML text (bytes must be UTF-8).
      source: The file name, for error messages.

    Returns:
      The document as dicts, lists and scalars (``None`` for an empty one).

    Raises:
      ConfigError: For text that breaks a rule or does not parse; one line
        naming ``source``, the place and the rule.

    Example:
      >>> qbits.config._yamlio.parse_yaml("seeds: [0, 1]")
      {'seeds': [0, 1]}
      >>> qbits.config._yamlio.parse_yaml("a: &x [1, 2]\nb: *x")
      {'a': [1, 2], 'b': [1, 2]}
    """
    try:
        if isinstance(text, bytes):
            if len(text) > MAX_BYTES:
                raise _too_big(len(text))
            text = _decode(text)
        if not isinstance(text, str):
            raise ConfigError("", text, "YAML text (a str)")
        if len(text) > MAX_BYTES:
            raise _too_big(len(text))
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except ConfigError as e:
        raise e.within(source=source) from None
    except yaml.constructor.ConstructorError as e:
        tag = re.search(r"tag '([^']*)'", e.problem or "")
        line = getattr(e.problem_mark, "line", -1) + 1
        raise ConfigError(
            "",
            tag.group(1) if tag else e.problem,
            "plain YAML: mappings, lists, strings, numbers, booleans and null",
            why=f"line {line}: a tag that would build a Python object",
            source=source,
        ) from None
    except yaml.reader.ReaderError as e:
        raise ConfigError(
            "",
            chr(e.character) if isinstance(e.character, int) else e.character,
            "YAML text: printable characters only",
            why=f"character {e.position}: {e.reason}; a binary file?",
            source=source,
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = _at(mark) + ": " if mark else ""
        raise ConfigError(
            "",
            text if len(text) < 40 else text[:37] + "...",
            "valid YAML",
            why=where + str(getattr(e, "problem", e)).splitlines()[0],
            source=source,
        ) from None


def read_yaml(path: str | os.PathLike) -> Any:
    r"""Reads a YAML file into plain data (see :func:`parse_yaml`).

    Only the first :data:`MAX_BYTES` bytes are ever read: a larger file is
    refused without reading the rest. Only a regular file is read: a FIFO
    (which would wait for a writer forever), a device or a directory is
    refused.

    Args:
      path: The file.

    Returns:
      The document as dicts, lists and scalars.

    Raises:
      ConfigError: For a file that cannot be read or breaks a rule; the
        message starts with the file name.

    Example:
      >>> import pathlib, tempfile
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "x.yaml"
      >>> _ = f.write_text("a: 1\na: 2\n")
      >>> try:
      ...     qbits.config._yamlio.read_yaml(f)
      ... except qbits.ConfigError as e:
      ...     print(str(e).removeprefix(f"{f}: "))
      expected each key once per mapping, got 'a' (duplicate key at line 2).
    """
    source = os.fspath(path)
    try:
        data, kind = read_regular_file(path, MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            "", source, "a readable file", why=e.strerror or str(e)
        ) from None
    except ValueError as e:  # e.g. a NUL byte in the path
        raise ConfigError("", source, "a readable file", why=str(e)) from None
    if kind is not None:
        raise ConfigError(
            "",
            source,
            "a regular file",
            why=f"it is {kind}; a config is read from a file",
            source=source,
        )
    return parse_yaml(data, source)


def dump(config: Any, path: str | os.PathLike | None = None, comment: str = "") -> str:
    """A config as YAML text; written to the file ``path`` too when given.

    The one way to write a config: :func:`qbits.load_config` reads the text
    or the file back into an equal config.

    Args:
      config: A :class:`~qbits.DotGeneralConfig`, :class:`~qbits.QuantConfig`,
        any piece of one, or another config (``qbits.kvcache.CacheConfig``,
        ``qbits.lora.LoraConfig``).
      path: The file to write (``None``: only return the text).
      comment: Text put first, each line as a ``#`` comment.

    Returns:
      The YAML text.

    Example:
      >>> print(qbits.config.dump(qbits.presets.get("int4_weight_only")))
      fwd:
        rhs:
          numerics:
            type: int
            bits: 4
            dtype: int4
          granularity:
            type: tiled
            tile_size: 128
      <BLANKLINE>
      >>> import tempfile
      >>> path = tempfile.mkdtemp() + "/w4a8.yaml"
      >>> _ = qbits.config.dump(qbits.presets.get("w4a8"), path)
      >>> qbits.load_config(path, qbits.DotGeneralConfig) == qbits.presets.get("w4a8")
      True
    """
    header = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
    body = yaml.dump(
        to_dict(config), Dumper=_Dumper, sort_keys=False, default_flow_style=False
    )
    text = header + (body if body.strip() != "{}" else "{}\n")
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def preset_yaml(name: str) -> str:
    """The text of ``configs/<name>.yaml``: the preset, its description on top.

    Example:
      >>> print(qbits.config._yamlio.preset_yaml("none"))
      # none: No quantization: exactly ``lax.dot_general``.
      #
      # The float baseline of every ablation, and the config to give layers that
      # must stay float (or use ``null`` in a rule).
      {}
      <BLANKLINE>
    """
    return dump(presets.get(name), comment=f"{name}: {presets.describe(name)}")


def write_presets(directory: str | os.PathLike) -> list[str]:
    """Writes every preset to ``directory/<name>.yaml``; returns the paths.

    The files in the repository's ``configs/`` are written by this function
    (a test checks they are current).
    """
    paths = []
    for name in presets.names():
        path = os.path.join(directory, f"{name}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(preset_yaml(name))
        paths.append(path)
    return paths
