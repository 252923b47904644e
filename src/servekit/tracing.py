"""OpenTelemetry traces of requests, sampled as Triton's trace settings say.

One ``Tracing`` per server, configured by ``[server.tracing]`` (``endpoint``: the OTLP/HTTP
traces URL, ``rate``: the sampled fraction, ``level``: ``off`` or ``timestamps``) and
changed at runtime through Triton's trace extension (``trace_level``, ``trace_rate``: one
request in N, ``trace_count``: how many more to trace, -1 for no limit), globally or per
model. Off, a request costs one check of the level.

A traced request's span continues the caller's trace where the request carries a W3C
``traceparent`` (an HTTP header, gRPC metadata). While it is being served the span is
``CURRENT`` (a context variable), so the core adds its own children without knowing the
front: the Batcher its queue wait and the batch the request ran in (``batched``).
Spans go out through the OpenTelemetry SDK's batching processor and its OTLP/HTTP
exporter (``servekit[tracing]``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .spans import STOP_FLUSH_MS, span_processor

__all__ = [
    "BATCH",
    "CURRENT",
    "ENDPOINT_ENV",
    "LEVELS",
    "PASSED",
    "SIBLINGS",
    "TRACEPARENT",
    "BatchTrace",
    "EnvTracer",
    "TraceSettings",
    "Tracing",
    "batched",
    "child",
    "finish",
    "hop",
    "outgoing",
    "recording",
    "step_spans",
    "traced",
    "triton_trace_config",
]

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
LEVELS = ("OFF", "TIMESTAMPS")

CURRENT: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "servekit_span", default=None
)
"""The span of the request being served in this context and its tracer (None: not traced)."""


@dataclass
class BatchTrace:
    """What the batch running in this context records for its traced requests: their
    spans' ``traceparent``s (a hop the batch makes carries them: Ray's model replica)
    and each pipeline step's run (``step``, ``start_s``, ``end_s`` by ``time.monotonic``)."""

    parents: list[str]
    steps: list[tuple[str, float, float]] = field(default_factory=list)


BATCH: contextvars.ContextVar[BatchTrace | None] = contextvars.ContextVar(
    "servekit_batch", default=None
)
"""The batch running in this context, where any of its requests is traced (None: none is)."""


@contextmanager
def recording(parents: list[str]) -> Iterator[BatchTrace]:
    """While it lasts, the batch run in this context records into the ``BatchTrace`` it
    yields (``BATCH``): its pipeline steps, for spans made once it has run."""
    trace = BatchTrace(parents)
    token = BATCH.set(trace)
    try:
        yield trace
    finally:
        BATCH.reset(token)


SIBLINGS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "servekit_siblings", default=()
)
"""Spans of other traced requests served by the same call as ``CURRENT``'s (a Ray model
replica's call carries a batch of them): each gets the same queue and batch children."""

PASSED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "servekit_traceparent", default=None
)
"""The caller's ``traceparent`` of a request this server does not trace: passed on as it
is, so the next server's own spans (tritonserver's) still join the caller's trace."""


@dataclass
class TraceSettings:
    """Triton's trace settings for the server or one model."""

    level: str = "OFF"
    rate: int = 1000
    """One request in ``rate`` is traced (Triton's ``trace_rate``); 0 traces none."""
    count: int = -1
    """Traces still to take (Triton's ``trace_count``); -1 for no limit."""

    def to_triton(self) -> dict[str, Any]:
        """As Triton's trace extension answers (every value a string or a list of them)."""
        return {
            "trace_level": [self.level],
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
            "log_frequency": "0",
            "trace_mode": "opentelemetry",
        }


def rate_of(fraction: float) -> int:
    """``[server.tracing] rate`` (a fraction) as Triton's one-in-N (0: none)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"[server.tracing] rate must be in [0, 1], got {fraction}")
    return 0 if fraction == 0 else max(1, round(1 / fraction))


class Tracing:
    """Sampling, settings and export for one server (thread-safe)."""

    def __init__(self, endpoint: str, rate: float = 0.001, level: str = "timestamps") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        self.endpoint = endpoint
        self._provider = TracerProvider(resource=Resource({"service.name": "servekit"}))
        self._provider.add_span_processor(span_processor(endpoint))
        self.tracer = self._provider.get_tracer("servekit")
        self._lock = threading.Lock()
        self.settings: dict[str, TraceSettings] = {"": TraceSettings(level.upper(), rate_of(rate))}
        """The server's settings ("") and each model's own, where it has any."""
        self._seen: dict[str, int] = {}
        self._check_level(level.upper())
        self.on_change: Callable[[dict[str, Any]], None] | None = None
        """Told every change made here (``update``) as ``shared()`` reads it, under the
        lock: it must not block (the Ray ingress shares it with its other replicas)."""

    @staticmethod
    def _check_level(level: str) -> None:
        if level not in LEVELS:
            raise ValueError(
                f"trace level must be one of {[x.lower() for x in LEVELS]}, got {level!r}"
            )

    # ------------------------------------------------------------ settings
    def setting(self, model: str = "") -> TraceSettings:
        with self._lock:
            return self.settings.get(model) or self.settings[""]

    def update(self, model: str, changes: Mapping[str, Any]) -> TraceSettings:
        """Triton's ``POST .../trace/setting``: each named setting changed (a null value
        clears a model's own, which then follows the server's again); ``ValueError``
        names a bad one, and nothing changes."""
        with self._lock:
            base = self.settings.get(model) or self.settings[""]
            new = TraceSettings(base.level, base.rate, base.count)
            for key, value in changes.items():
                if value is None:
                    if model:
                        default = self.settings[""]
                        setattr(new, _FIELDS[key], getattr(default, _FIELDS[key]))
                    continue
                if key == "trace_level":
                    levels = value if isinstance(value, list) else [value]
                    level = "OFF" if not levels else str(levels[0]).upper()
                    self._check_level(level)
                    new.level = level
                elif key in ("trace_rate", "trace_count"):
                    try:
                        number = int(value)
                    except (TypeError, ValueError):
                        raise ValueError(f"{key} must be an integer, got {value!r}") from None
                    if number < (0 if key == "trace_rate" else -1):
                        raise ValueError(f"{key} out of range: {number}")
                    setattr(new, _FIELDS[key], number)
                elif key not in ("log_frequency", "trace_file", "trace_mode", "trace_config"):
                    raise ValueError(f"unknown trace setting {key!r}")
            self.settings[model] = new
            if self.on_change is not None:
                self.on_change(self._shared())
            return new

    def shared(self) -> dict[str, Any]:
        """Every setting (the server's under "", each model's own), as ``adopt`` takes them."""
        with self._lock:
            return self._shared()

    def _shared(self) -> dict[str, Any]:
        return {m: dataclasses.asdict(s) for m, s in self.settings.items()}

    def adopt(
        self, shared: Mapping[str, Any], why: str, *, unless: Callable[[], bool] | None = None
    ) -> bool:
        """Another copy's settings (``shared()`` there), in place of these; not (False) when
        ``unless()`` holds under the lock every update here takes, as ``Traffic.adopt``."""
        settings = {str(m): TraceSettings(**s) for m, s in shared.items()}
        for s in settings.values():
            self._check_level(s.level)
        if "" not in settings:
            raise ValueError("shared trace settings without the server's own")
        with self._lock:
            if unless is not None and unless():
                return False
            self.settings = settings
        log.info("trace settings: %s", why)
        return True

    # ------------------------------------------------------------ spans
    def sample(self, model: str) -> bool:
        """Whether this request of ``model`` is traced (one in ``rate``, while ``count`` lasts)."""
        with self._lock:
            s = self.settings.get(model) or self.settings[""]
            if s.level == "OFF" or s.rate == 0 or s.count == 0:
                return False
            seen = self._seen.get(model, 0) + 1
            self._seen[model] = seen
            if (seen - 1) % s.rate:
                return False
            if s.count > 0:
                s.count -= 1
            return True

    def start(self, model: str, name: str, carrier: Mapping[str, str], **attributes: Any) -> Any:
        """A span for one request of ``model``, started (None where it is not sampled),
        continuing the trace ``carrier``'s ``traceparent`` names; ``finish`` ends it."""
        if not self.sample(model):
            return None
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier)
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes={"model": model, **attributes}
        )

    @contextmanager
    def request(
        self, model: str, name: str, carrier: Mapping[str, str], **attributes: Any
    ) -> Iterator[Any]:
        """``start`` for the request served in this context: its span is ``CURRENT`` (or,
        not sampled, its caller's ``traceparent`` is ``PASSED``) until it is answered; an
        exception is recorded on the span and raised on."""
        span = self.start(model, name, carrier, **attributes)
        if span is None:
            passed = PASSED.set(carrier.get(TRACEPARENT))
            try:
                yield None
            finally:
                PASSED.reset(passed)
            return
        token = CURRENT.set((span, self.tracer))
        try:
            yield span
        except BaseException as exc:
            finish(span, exc)
            raise
        else:
            finish(span)
        finally:
            CURRENT.reset(token)

    def continued(self, name: str, parent: str, **attributes: Any) -> Any:
        """A span continuing ``parent`` (a ``traceparent`` a hop brought from a request
        sampled upstream: no sampling here), started; ``finish`` ends it."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({TRACEPARENT: parent})
        return self.tracer.start_span(
            name, context=context, kind=SpanKind.SERVER, attributes=attributes
        )

    def shutdown(self) -> None:
        """Send what is still buffered (a second at most), then stop the exporter."""
        self._provider.force_flush(STOP_FLUSH_MS)
        self._provider.shutdown()


_FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count"}

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""OpenTelemetry's own variable for the OTLP traces URL: where a process servekit does not
configure (the servekit backend in tritonserver's stub) sends its spans."""


class EnvTracer:
    """Spans of a process configured by ``ENDPOINT_ENV`` alone (the servekit backend):
    its requests are sampled upstream (tritonserver hands over the trace context of a
    request it traces), so every span asked for here is recorded."""

    def __init__(self, service: str, endpoint: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        self._provider = TracerProvider(resource=Resource({"service.name": service}))
        self._provider.add_span_processor(span_processor(endpoint))
        self.tracer = self._provider.get_tracer("servekit")

    @classmethod
    def from_env(cls, service: str) -> EnvTracer | None:
        """One where ``ENDPOINT_ENV`` is set and the SDK is installed, else None."""
        import os

        endpoint = os.environ.get(ENDPOINT_ENV)
        if not endpoint:
            return None
        try:
            return cls(service, endpoint)
        except ImportError:
            return None

    def span(
        self,
        name: str,
        carrier: Mapping[str, str],
        start_s: float,
        end_s: float,
        error: BaseException | None = None,
        **attributes: Any,
    ) -> Any:
        """A finished span from ``start_s`` to ``end_s`` (``time.monotonic``), a child of
        the span ``carrier``'s ``traceparent`` names; returned for children of its own."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract(carrier)
        span = self.tracer.start_span(
            name, context=context, start_time=_epoch_ns(start_s), attributes=attributes
        )
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end(end_time=_epoch_ns(end_s))
        return span

    def shutdown(self) -> None:
        """Send what is still buffered (a second at most), then stop the exporter."""
        self._provider.force_flush(STOP_FLUSH_MS)
        self._provider.shutdown()


def finish(span: Any, error: BaseException | None = None) -> None:
    """End ``span``, with ``error`` recorded on it (its status then ERROR)."""
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


@contextmanager
def hop(span: Any, tracer: Any, passed: str | None) -> Iterator[None]:
    """While it lasts, a hop made from here (``outgoing``) carries ``span``'s traceparent,
    or ``passed`` where there is no span: for callbacks that build a hop's request at once,
    outside any context of the request's own (the Triton front's fast path)."""
    token = CURRENT.set((span, tracer)) if span is not None else None
    passed_token = PASSED.set(passed)
    try:
        yield
    finally:
        PASSED.reset(passed_token)
        if token is not None:
            CURRENT.reset(token)


def traceparent(span: Any) -> str:
    """The W3C ``traceparent`` of ``span``: what a hop passes on, so the next server's spans
    are its children."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def traced() -> str | None:
    """The ``traceparent`` of the request traced in this context (None: it is not traced)."""
    current = CURRENT.get()
    return traceparent(current[0]) if current is not None else None


def outgoing() -> str | None:
    """The ``traceparent`` a hop from the request served here sends on: its span's where
    it is traced, else the caller's own (None: neither)."""
    current = CURRENT.get()
    return traceparent(current[0]) if current is not None else PASSED.get()


def triton_trace_config(endpoint: str, rate: float, level: str) -> list[str]:
    """tritonserver's ``--trace-config`` values for the same settings: OpenTelemetry mode,
    exporting to ``endpoint`` (its own spans join a trace through the ``traceparent``
    the front passes on)."""
    return [
        "mode=opentelemetry",
        f"opentelemetry,url={endpoint}",
        "opentelemetry,resource=service.name=tritonserver",
        f"level={level.upper()}",
        f"rate={rate_of(rate)}",
        "count=-1",
    ]


def _epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic`` reading as nanoseconds since the epoch (what spans take)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def child(
    name: str, start_s: float, end_s: float | None, parent: Any = None, **attributes: Any
) -> Any:
    """A child of the current request's span (``CURRENT``; or of ``parent``), from
    ``start_s`` to ``end_s`` (``time.monotonic``; None: left open, the caller ends it);
    nothing where the request is not traced."""
    current = CURRENT.get()
    if current is None:
        return None
    from opentelemetry import trace

    span, tracer = current
    context = trace.set_span_in_context(parent if parent is not None else span)
    start = _epoch_ns(start_s)
    s = tracer.start_span(name, context=context, start_time=start, attributes=attributes)
    if end_s is not None:
        s.end(end_time=_epoch_ns(end_s))
    return s


def batched(
    arrival_s: float,
    started_s: float,
    batch_rows: int,
    instance: int,
    steps: list[tuple[str, float, float]] | None = None,
) -> None:
    """The request served in this context waited from ``arrival_s`` to ``started_s`` and ran
    in a batch of ``batch_rows`` rows on ``instance`` until now: two children of its span
    (``queue``, ``batch``), where it is traced; a pipeline's ``steps`` as the batch's."""
    current = CURRENT.get()
    if current is None:
        return
    now = time.monotonic()
    for span in (current[0], *SIBLINGS.get()):
        child("queue", arrival_s, started_s, parent=span)
        batch = child("batch", started_s, None, span, batch_rows=batch_rows, instance=instance)
        step_spans(batch, current[1], steps or [])
        batch.end(end_time=_epoch_ns(now))


def step_spans(parent: Any, tracer: Any, steps: list[tuple[str, float, float]]) -> None:
    """A pipeline's ``steps`` (``BatchTrace.steps``) as finished children of ``parent``."""
    from opentelemetry import trace

    context = trace.set_span_in_context(parent)
    for index, (name, start_s, end_s) in enumerate(steps):
        s = tracer.start_span(
            f"step {name}", context=context, start_time=_epoch_ns(start_s),
            attributes={"step": index},
        )  # fmt: skip
        s.end(end_time=_epoch_ns(end_s))
