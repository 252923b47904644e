"""Triton's shared-memory extension over HTTP: ``GET /v2/{system,cuda}sharedmemory
[/region/<r>]/status``, ``POST .../region/<r>/register`` and ``POST .../[region/<r>/]
unregister``. Behind the control token. Served from the server's ``SharedMemory`` (native;
CUDA regions where it sees a GPU), passed on to tritonserver with the front's own control
headers (the Triton runtimes' front, which maps a system region too where it serves models
itself), or refused naming where it is served (Ray)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..errors import InvalidInput
from ..protocol.kserve import parse_json
from ..protocol.models import PassThroughRegistry
from ..protocol.shm import (
    NO_SHARED_MEMORY,
    SharedMemory,
    check_registration,
    cuda_refusal,
)
from .messages import Answer, HttpRequest, not_allowed

__all__ = ["SHARED_MEMORY", "shared_memory_answer"]

SHARED_MEMORY = re.compile(
    r"^/v2/(?P<kind>system|cuda)sharedmemory(?:/region/(?P<name>[^/]+))?"
    r"/(?P<action>status|register|unregister)$"
)
_JSON = {"content-type": "application/json"}
_METHODS = {"status": "GET", "register": "POST", "unregister": "POST"}


async def shared_memory_answer(
    match: re.Match[str],
    request: HttpRequest,
    body: Callable[[], bytes],
    regions: SharedMemory | None,
    behind: PassThroughRegistry | None,
    check_control: Callable[[HttpRequest], None],
) -> Answer:
    """The answer to one shared-memory request (``match``: of ``SHARED_MEMORY``)."""
    action, kind = match["action"], match["kind"]
    if request.method != _METHODS[action]:
        return not_allowed(request, _METHODS[action])
    name = match["name"]
    data = body() if request.method == "POST" else None
    if behind is not None:  # tritonserver maps the region
        check_control(request)
        mirror = regions if kind == "system" else None  # the front's own models read it
        mirrored = None
        if action == "register" and kind == "system":  # the client's error, not Triton's 500
            registration = _registration(data, name)
            check_registration(*registration)
            if mirror is not None:
                mirror.register(*registration)
                mirrored = registration[0]
        try:
            answer = await behind.restricted(request.method, request.wire_path, data)
        except BaseException:
            if mirror is not None and mirrored is not None:
                mirror.unregister(mirrored)
            raise
        if mirror is not None and mirrored is not None and answer[0] != 200:
            mirror.unregister(mirrored)  # tritonserver refused it
        elif mirror is not None and action == "unregister" and answer[0] == 200:
            mirror.unregister(name)
        return answer
    refusal = cuda_refusal(regions) if kind == "cuda" else None
    if regions is None and refusal is None:
        refusal = f"shared memory {NO_SHARED_MEMORY}"
    if regions is None or refusal is not None:
        if action == "status" and match["name"] is None:
            return _json(200, [])  # none registered
        if action == "unregister":  # none registered, so none left: as Triton answers
            check_control(request)
            return 200, b"", _JSON
        return _json(403, {"error": f"{request.method} {request.path}: {refusal}"})
    check_control(request)
    if action == "status":
        return _json(200, regions.status(name, kind))
    if action == "unregister":
        regions.unregister(name, kind)
        return 200, b"", _JSON
    if kind == "cuda":
        regions.register_cuda(*_cuda_registration(data, name))
    else:
        regions.register(*_registration(data, name))
    return 200, b"", _JSON


def _registration(body: bytes | None, name: str | None) -> tuple[str, Any, Any, Any]:
    """(name, key, offset, byte_size) of a registration's body; what is missing named."""
    if name is None:
        raise InvalidInput("a registration names its region: /region/<name>/register")
    data = parse_json(body or b"", "shared-memory registration")
    if not isinstance(data, dict) or "key" not in data or "byte_size" not in data:
        raise InvalidInput(
            'shared-memory registration: expected {"key": "/name", "offset": <int>, '
            f'"byte_size": <int>}}, got {str(data)[:200]}'
        )
    return name, data["key"], data.get("offset", 0), data["byte_size"]


def _cuda_registration(body: bytes | None, name: str | None) -> tuple[str, Any, Any, Any]:
    """(name, raw_handle, device_id, byte_size) of a CUDA registration's body, the handle
    decoded from base64; what is missing named."""
    if name is None:
        raise InvalidInput("a registration names its region: /region/<name>/register")
    data = parse_json(body or b"", "CUDA shared-memory registration")
    handle = data.get("raw_handle") if isinstance(data, dict) else None
    b64 = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(b64, str) or "device_id" not in data or "byte_size" not in data:
        raise InvalidInput(
            'CUDA shared-memory registration: expected {"raw_handle": {"b64": <base64>}, '
            f'"device_id": <int>, "byte_size": <int>}}, got {str(data)[:200]}'
        )
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error:
        raise InvalidInput(
            f"CUDA shared-memory region {name!r}: raw_handle's b64 is not base64: {b64[:100]!r}"
        ) from None
    return name, raw, data["device_id"], data["byte_size"]


def _json(status: int, data: object) -> tuple[int, bytes, Mapping[str, str]]:
    return status, orjson.dumps(data), _JSON
