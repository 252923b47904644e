"""Where spans go: OTLP/HTTP batches that an unreachable endpoint never floods a log with
or slows a stop for (``tracing`` sends through ``span_processor``)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["EXPORT_TIMEOUT_S", "STOP_FLUSH_MS", "quiet_exporter", "span_processor"]

log = logging.getLogger("servekit.tracing")

STOP_FLUSH_MS = 1000
"""How long a stop waits for buffered spans: an unreachable endpoint costs a stop no more."""
EXPORT_TIMEOUT_S = 1.0
"""One batch's export, its retries included (the SDK's default retries for 10 s)."""

_SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.sdk.trace.export",
)


def span_processor(endpoint: str) -> Any:
    """The span processor for ``endpoint``: batches sent a second after their spans end
    (the SDK's default waits five), through ``quiet_exporter``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = quiet_exporter(OTLPSpanExporter(endpoint, timeout=EXPORT_TIMEOUT_S), endpoint)
    return BatchSpanProcessor(
        exporter, schedule_delay_millis=1000, export_timeout_millis=STOP_FLUSH_MS
    )


def quiet_exporter(inner: Any, endpoint: str) -> Any:
    """``inner`` (an OTLP exporter), saying an unreachable endpoint once: one warning naming
    it, then nothing until it answers again (said with the count of batches lost). The
    SDK's own lines for each retry and each lost batch are silenced."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    for name in _SDK_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)

    class QuietExporter(SpanExporter):  # type: ignore[misc]  # the SDK imports lazily
        failed = 0
        """Batches lost since the endpoint last answered."""

        def export(self, spans: Any) -> Any:
            try:
                result = inner.export(spans)
            except Exception:  # the SDK's exporter raises on some transport errors
                result = SpanExportResult.FAILURE
            if result == SpanExportResult.SUCCESS:
                if self.failed:
                    log.warning(
                        "trace endpoint %s answers again (%d span batch(es) lost meanwhile)",
                        endpoint, self.failed,
                    )  # fmt: skip
                    self.failed = 0
            else:
                if not self.failed:
                    log.warning(
                        "trace endpoint %s does not answer: spans are dropped until it does",
                        endpoint,
                    )
                self.failed += 1
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(inner.force_flush(timeout_millis))

    return QuietExporter()
