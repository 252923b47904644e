"""The Triton front's fast path (``Forwarding``, a mixin of ``KServeApp``): an infer
request for a model behind tritonserver is checked as the model would check it, then its
bytes go on unchanged; a request header that passed is remembered, so a client that
repeats it is not decoded again."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from .. import tracing
from ..batching.sequence import SequenceFlags
from ..errors import INFERENCE_TOKEN_HEADER, InvalidInput, RunnerError, ServekitError
from ..metrics import Metrics
from ..protocol.kserve import (
    HEADER_LENGTH,
    DecodedRequest,
    explicit_binary,
)
from ..protocol.models import FrontModel, PassThrough, PassThroughRegistry
from ..protocol.parameters import scheduling, sequence_flags, unsequenced
from ..protocol.shm import DECLARED, Regions, check_output_room
from ..spec import ModelSpec
from ..tracing import Tracing
from .messages import Reply

__all__ = ["MODEL", "Forwarding", "whole_body"]

MODEL = re.compile(
    r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
    r"(?P<rest>/ready|/infer|/config|/stats|/traffic)?$"
)
"""A model's paths: ``/v2/models/<name>[/versions/<v>][/ready|/infer|...]``."""

_HEADER_LENGTH = HEADER_LENGTH.encode()
_TOKEN = INFERENCE_TOKEN_HEADER.encode()
_CHECKED_MAX = 256
"""Binary requests' headers that passed the check, remembered per app (``_pass_through``)."""
_CHECKED_HEADER_BYTES = 4096


class Checked(NamedTuple):
    """A request that passed the front's check, as it goes on (``Forwarding._pass_through``)."""

    body: bytes
    length: int | None
    """Its JSON header's length (``Inference-Header-Content-Length``), if binary."""
    timeout_us: int | None
    sequence: SequenceFlags | None


class Forwarding:
    """Checks and forwards requests for models that pass through (``PassThrough``)."""

    metrics: Metrics
    tracing: Tracing | None
    _behind: PassThroughRegistry | None
    _checked: dict[
        tuple[str, bytes, int],
        tuple[ModelSpec, bytes | None, int | None, SequenceFlags | None],
    ]

    if TYPE_CHECKING:  # the app's own; declared for the type checker only

        def _check_token(self, given: bytes) -> None: ...

        def _error(self, exc: ServekitError) -> tuple[int, bytes, dict[str, str]]: ...

        def _decode(
            self, name: str, body: bytes, raw: str | None, regions: Regions | None = None
        ) -> DecodedRequest: ...

    def forward_now(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        reply: Reply,
    ) -> bool | Callable[[], None]:
        """The fast path (``messages.FastPath``): an unversioned infer of a model known to pass
        through is checked exactly as on the full path, then its bytes go on from
        callbacks. Anything else (versions, encodings, raw binary, a model not looked
        up yet) returns False and takes the full path; a request taken returns True, or
        what to call if its client leaves before the answer (``front.window``)."""
        behind = self._behind
        if behind is None or method != "POST" or not path.endswith("/infer"):
            return False
        m = MODEL.match(path)
        if m is None or m["version"] is not None or m["rest"] != "/infer":
            return False
        model = behind.peek(m["name"])
        if model is None or getattr(model, "decoupled", False):
            return False
        raw, token = None, b""
        for key, value in headers:
            if key == _HEADER_LENGTH:
                raw = value.decode("latin-1")
            elif key == _TOKEN:
                token = value
            elif key == b"content-encoding" and value.lower() not in (b"", b"identity"):
                return False
        if whole_body(raw):
            return False
        tracer, span, passed = self.tracing, None, None
        if tracer is not None:  # a span started now, ended with the answer: no task here
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
            span = tracer.start(m["name"], "infer", carrier, protocol="http")
            passed = carrier.get(tracing.TRACEPARENT)
        try:
            self._check_token(token)
            checked = self._pass_through(m["name"], model, body, raw)
        except ServekitError as exc:
            if span is not None:
                tracing.finish(span, exc)
            reply(*self._error(exc))
            return True

        def done(answer: tuple[int, bytes, dict[str, str]] | ServekitError) -> None:
            if span is not None:
                failed = isinstance(answer, ServekitError) or answer[0] >= 400
                why = answer if isinstance(answer, ServekitError) else RunnerError(f"{answer[0]}")
                tracing.finish(span, why if failed else None)
            reply(*(self._error(answer) if isinstance(answer, ServekitError) else answer))

        c = checked
        with tracing.hop(span, tracer.tracer if tracer else None, passed):
            leave = model.send(c.body, c.length, "", done, c.timeout_us, c.sequence)
        return leave or True

    def _pass_through(
        self, name: str, model: FrontModel | PassThrough, body: bytes, raw: str | None
    ) -> Checked:
        """Checked as the model would check it; the bytes to send on (``explicit_binary``),
        the request's ``timeout`` parameter (microseconds) and its sequence, if any.

        A request with its tensors in binary is judged by its JSON header and its length
        alone (numbers' raw bytes are any bytes): a header that passed is remembered, so
        a client that repeats it is not decoded again. BYTES tensors are always decoded."""
        spec = model.spec  # type: ignore[union-attr]
        key = None
        if raw and raw.isascii() and raw.isdigit() and 0 < int(raw) <= len(body):
            length = int(raw)
            if length <= _CHECKED_HEADER_BYTES:
                key = (name, body[:length], len(body))
                hit = self._checked.get(key)
                if hit is not None and hit[0] is spec:
                    header, timeout_us, sequence = hit[1], hit[2], hit[3]
                    if header is None:
                        return Checked(body, length, timeout_us, sequence)
                    return Checked(header + body[length:], len(header), timeout_us, sequence)
        request = self._decode(name, body, raw, DECLARED)  # tritonserver reads the regions
        try:
            timeout_us = scheduling(request.parameters).get("timeout_us")
            sequence = sequence_flags(request.parameters)
            if sequence is not None and not getattr(model, "sequenced", False):
                raise unsequenced(name, sequence)
            rows = spec.validate_inputs(request.inputs)
            check_output_room(spec, rows, request.shm_outputs)
        except InvalidInput:
            self.metrics.failed(name)  # refused here: tritonserver never sees it
            raise
        checked, checked_length = explicit_binary(body, int(raw) if raw else None, request)
        if key is not None and all(a.dtype.kind != "O" for a in request.inputs.values()):
            if len(self._checked) >= _CHECKED_MAX:
                self._checked.clear()
            header = None if checked is body else checked[:checked_length]
            self._checked[key] = (spec, header, timeout_us, sequence)
        return Checked(checked, checked_length, timeout_us, sequence)


def whole_body(raw: str | None) -> bool:
    """``Inference-Header-Content-Length: 0``: the body is the model's one input, raw."""
    return raw is not None and raw.isascii() and raw.isdigit() and int(raw) == 0
