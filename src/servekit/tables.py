"""The one check every configuration table read from TOML or a dict goes through: unknown
keys are named, with the known ones, before any value is looked at."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_keys"]


def check_keys(section: str, data: Any, allowed: set[str]) -> None:
    """Raise ``ValueError`` naming the section, any unknown keys and the known ones."""
    if not isinstance(data, Mapping):
        raise ValueError(f"[{section}]: expected a table, got {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in [{section}]; expected some of {sorted(allowed)}"
        )
