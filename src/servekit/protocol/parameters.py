"""Triton's request parameters that schedule a request, decoded the same for HTTP and
gRPC: ``priority`` and ``timeout`` (the dynamic batcher's), ``sequence_id``,
``sequence_start`` and ``sequence_end`` (the sequence batcher's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..batching.sequence import SequenceFlags
from ..errors import InvalidInput

__all__ = ["flag", "scheduling", "sequence_flags", "unsequenced"]


def flag(parameters: Mapping[str, Any], key: str, whose: str = "") -> bool:
    """A boolean parameter, false where absent; only JSON's true and false are flags (``"no"``
    or ``1`` is refused). ``whose`` names the object that carries it in the error."""
    value = parameters.get(key, False)
    if type(value) is not bool:
        where = f"{whose}: " if whose else ""
        raise InvalidInput(f"{where}parameter {key!r}: expected true or false, got {value!r}")
    return value


def scheduling(parameters: Mapping[str, Any]) -> dict[str, int]:
    """Triton's request parameters ``priority`` and ``timeout`` (microseconds), checked,
    as ``Batcher.infer`` keywords (HTTP and gRPC alike)."""
    out = {}
    for key, arg in (("priority", "priority"), ("timeout", "timeout_us")):
        if key in parameters:
            value = parameters[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInput(
                    f"parameter {key!r}: expected a non-negative integer, got {value!r}"
                )
            out[arg] = value
    return out


def sequence_flags(parameters: Mapping[str, Any]) -> SequenceFlags | None:
    """Triton's sequence parameters ``sequence_id`` (an integer or a string),
    ``sequence_start`` and ``sequence_end`` (booleans), checked; None when the request
    names no sequence (HTTP and gRPC alike)."""
    if not any(k in parameters for k in ("sequence_id", "sequence_start", "sequence_end")):
        return None
    sid = parameters.get("sequence_id", 0)
    if (
        isinstance(sid, bool)
        or not isinstance(sid, int | str)
        or (isinstance(sid, int) and sid < 0)
    ):
        raise InvalidInput(
            f"parameter 'sequence_id': expected a non-negative integer or a string, got {sid!r}"
        )
    return SequenceFlags(sid, flag(parameters, "sequence_start"), flag(parameters, "sequence_end"))


def unsequenced(name: str, flags: SequenceFlags) -> InvalidInput:
    """The error for a ``sequence_id`` sent to a model with no sequence batcher."""
    return InvalidInput(
        f"model {name!r} has no sequence batcher: sequence_id {flags.id!r} is for a model "
        "served with sequence_batching"
    )
