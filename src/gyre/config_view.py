"""`gyre config`: the resolved config as TOML-like lines, each value with where it came from, and with `--explain`
each field's description.

Sources: `default` (the demo preset, gyre.config), `file` (the `--config` file) or `--set`. A description is the
field's pydantic description (its attribute docstring: gyre.config and gyre-sched read them with
`use_attribute_docstrings`); the few embedded models of other packages that do not turn that on (gyre-eval's
sandbox, gyre-cell's Mooncake and stop gate, gyre-train's loss dataclass) have theirs read from the same docstrings
here. Torch-free: `gyre config` must answer fast (tests/test_cli_door.py).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import textwrap
from typing import Any

from pydantic import BaseModel

from gyre.config import RunConfig

__all__ = ["FieldRow", "field_rows", "render", "source_of"]

_WIDTH = 44
"""Column of the `# source` comment (longer lines push it right)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FieldRow:
    """One field of the resolved config: a section (`value` is None) or a value."""

    path: tuple[str, ...]
    description: str
    """One line (the docstring's whitespace collapsed); empty when the field has none."""
    section: bool
    value: Any = None
    """JSON data (as written to RUN/config.json)."""


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of `cls` and its bases (the string right below `name: type = ...`)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for node, after in itertools.pairwise(body):
            doc = after.value if isinstance(after, ast.Expr) else None
            named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            if named and isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                out[node.target.id] = doc.value
    return out


def _fields(obj: Any) -> list[tuple[str, Any, str]]:
    """(name, value, description) of a model's or dataclass's fields, in declaration order."""
    cls = type(obj)
    if isinstance(obj, BaseModel):
        named = [(n, info.description) for n, info in cls.model_fields.items()]
    else:
        named = [(f.name, None) for f in dataclasses.fields(obj)]
    docs = _docstrings(cls)
    return [
        (name, getattr(obj, name), " ".join((desc or docs.get(name, "")).split())) for name, desc in named
    ]


def _is_section(value: Any) -> bool:
    return isinstance(value, BaseModel) or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def field_rows(cfg: RunConfig) -> list[FieldRow]:
    """Every field of `cfg`: the run's own values first, then each section (depth first), as in a TOML file."""
    data = cfg.model_dump(mode="json")
    rows: list[FieldRow] = []

    def walk(obj: Any, data: dict, path: tuple[str, ...]) -> None:
        fields = _fields(obj)
        for name, value, desc in fields:
            if not _is_section(value):
                rows.append(FieldRow((*path, name), desc, False, data[name]))
        for name, value, desc in fields:
            if _is_section(value):
                rows.append(FieldRow((*path, name), desc, True))
                walk(value, data[name], (*path, name))

    walk(cfg, data, ())
    return rows


def source_of(path: tuple[str, ...], sources: dict[str, str]) -> str:
    """Where the value at `path` came from: the layer (`--set` before `file`) that set it, a section above it, or
    a key below it (a table value such as `launcher.proxy_resources`); else `default`."""
    dotted = ".".join(path)
    for layer in ("--set", "file"):
        for key, where in sources.items():
            if where == layer and (
                key == dotted or dotted.startswith(key + ".") or key.startswith(dotted + ".")
            ):
                return layer
    return "default"


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, 118, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def render(cfg: RunConfig, sources: dict[str, str], explain: bool = False) -> str:
    """The config as `key = value  # source` lines under `[section]` headers; `explain`: each field's description
    as a comment line above it."""
    out = [
        "# the resolved config; after each value where it came from: default (the demo preset), file, --set"
    ]
    for row in field_rows(cfg):
        if row.section:
            out.append("")
            if explain and row.description:
                out += _comment(row.description)
            out.append(f"[{'.'.join(row.path)}]")
            continue
        if explain and row.description:
            out += _comment(row.description)
        line = f"{row.path[-1]} = {json.dumps(row.value)}"
        out.append(f"{line.ljust(_WIDTH)}  # {source_of(row.path, sources)}")
    return "\n".join(out)
