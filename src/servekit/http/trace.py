"""Triton's trace extension over HTTP: ``GET/POST /v2[/models/<m>]/trace/setting``, the
settings of ``servekit.tracing`` (the server's, or a model's own), changed behind the
control token."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ..errors import InvalidInput
from ..protocol.kserve import parse_json
from ..tracing import Tracing
from .messages import Answer, HttpRequest

__all__ = ["TRACE_SETTING", "trace_setting"]

TRACE_SETTING = re.compile(r"^/v2(?:/models/(?P<name>[^/]+))?/trace/setting$")


async def trace_setting(
    tracing: Tracing,
    request: HttpRequest,
    m: re.Match[str],
    body: Callable[[], bytes],
    check_control: Callable[[HttpRequest], None],
    known: Callable[[str], Any],
) -> Answer:
    """The settings as Triton answers them; a POST changes the named ones first (a null
    value clears a model's own setting), a bad one is a 400 naming it."""
    model = m["name"] or ""
    if model:
        await known(model)  # ModelNotFound names it
    if request.method == "POST":
        check_control(request)
        changes = parse_json(body(), "trace setting request")
        if not isinstance(changes, dict):
            raise InvalidInput(f"trace setting request: expected a JSON object, got {changes!r}")
        try:
            setting = tracing.update(model, changes)
        except ValueError as exc:
            raise InvalidInput(f"trace setting: {exc}") from None
    elif request.method == "GET":
        setting = tracing.setting(model)
    else:
        return 405, json.dumps({"error": f"{request.method} not allowed"}).encode(), {}
    return 200, json.dumps(setting.to_triton()).encode(), {"content-type": "application/json"}
