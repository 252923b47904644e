"""The one check every configuration table read from TOML or a dict goes through: unknown
keys are named, with the known ones, before any value is looked at; then each value whose
field is a plain kind (a flag, a number, a string, a list of them) must be of that kind,
so ``front = "no"`` is refused rather than taken as true."""

from __future__ import annotations

import functools
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["check_keys"]

_ITEMS = {int: "integers", str: "strings"}
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_keys(section: str, data: Any, allowed: set[str], typed: type | None = None) -> None:
    """Raise ``ValueError`` naming the section, any unknown keys and the known ones; with
    ``typed`` (the dataclass the table becomes), a value of another kind than its field's,
    naming the key, the kind and the value."""
    if not isinstance(data, Mapping):
        raise ValueError(f"[{section}]: expected a table, got {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in [{section}]; expected some of {sorted(allowed)}"
        )
    if typed is None:
        return
    kinds = _fields(typed)
    for key, value in data.items():
        wanted = kinds.get(key)
        if wanted and not any(_is(value, kind) for kind in wanted):
            said = " or ".join(_said(kind) for kind in wanted)
            raise ValueError(f"[{section}] {key}: expected {said}, got {value!r}")


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, ...]]:
    """Field -> the plain kinds it takes; fields of any other type (tables, enums,
    literals) are left to the class's own checks."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        options = typing.get_args(hint) if _is_union(hint) else (hint,)
        kinds = tuple(_plain(option) for option in options)
        if all(kind is not None for kind in kinds):
            out[name] = kinds
    return out


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _plain(hint: Any) -> Any:
    """``hint`` as a kind ``_is`` knows (bool, int, float, str, None, (tuple, item)), or None."""
    if hint in (bool, int, float, str) or hint is type(None):
        return hint
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return (tuple, args[0]) if args[0] in _ITEMS else None
    return None


def _is(value: Any, kind: Any) -> bool:
    if isinstance(kind, tuple):
        return isinstance(value, list | tuple) and all(_is(v, kind[1]) for v in value)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False  # a flag is no number
    if kind is float:
        return isinstance(value, int | float) and value == value  # TOML's nan is no setting
    if kind is str:
        return isinstance(value, str | os.PathLike)
    return isinstance(value, kind)


def _said(kind: Any) -> str:
    if isinstance(kind, tuple):
        return f"a list of {_ITEMS[kind[1]]}"
    return "null" if kind is type(None) else _NAMES[kind]
