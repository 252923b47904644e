"""``servekit traces``: spans watched locally. A real ``servekit traces`` process receives
what each runtime sends (servekit's protobuf, tritonserver's OTLP/JSON) and prints each
trace as a tree; the tree and the JSON decoding on their own."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import free_port, needs_runtime, started, wait_until
from servekit import ModelConfig, RayOptions, ServeConfig, ServerConfig
from servekit.client import Client
from servekit.config import TracingConfig

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the tracing extra")
from servekit.traces import Span, TraceBook, decode_export, tree  # noqa: E402


def test_a_trace_prints_as_a_tree_each_span_under_its_parent_in_start_order():
    ms = 1_000_000
    spans = [
        Span("t1", "b", "a", "queue", 1 * ms, 2 * ms),
        Span("t1", "a", "", "infer", 0, 10 * ms, {"model": "m"}, service="servekit"),
        Span("t1", "c", "a", "batch", 2 * ms, 9 * ms, {"rows": 4}),
        Span("t1", "d", "c", "step preprocess", 3 * ms, 5 * ms, error=True),
        Span("t1", "e", "gone", "orphan", 4 * ms, 6 * ms),
    ]
    assert tree(spans).splitlines() == [
        "trace t1 (5 spans, 10.00 ms)",
        "  infer [servekit] 10.00 ms (+0.00)  model=m",
        "    queue 1.00 ms (+1.00)",
        "    batch 7.00 ms (+2.00)  rows=4",
        "      step preprocess 2.00 ms (+3.00) ERROR",
        "  orphan 2.00 ms (+4.00)",
    ]


def test_a_trace_is_complete_once_its_spans_stop_coming():
    now = [0.0]
    book = TraceBook(quiet_s=1.0, clock=lambda: now[0])
    book.add([Span("t1", "a", "", "infer", 0, 1)])
    now[0] = 0.9
    book.add([Span("t1", "b", "a", "child", 0, 1), Span("t2", "c", "", "other", 0, 1)])
    now[0] = 1.5
    assert book.complete() == []
    now[0] = 2.0
    assert [[s.id for s in t] for t in book.complete()] == [["a", "b"], ["c"]]


def test_otlp_json_with_hex_ids_as_tritonserver_sends_it_is_decoded():
    body = (
        b'{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":'
        b'{"stringValue":"triton-inference-server"}}]},"scopeSpans":[{"spans":[{"traceId":'
        b'"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b7169203331","parentSpanId":'
        b'"00f067aa0ba902b7","name":"InferRequest","startTimeUnixNano":"1000",'
        b'"endTimeUnixNano":"3000","attributes":[{"key":"triton.model_name","value":'
        b'{"stringValue":"add_sub"}}]}]}]}]}'
    )
    (span,) = decode_export(body, "application/json")
    assert span == Span(
        "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "00f067aa0ba902b7",
        "InferRequest", 1000, 3000, {"triton.model_name": "add_sub"}, False,
        "triton-inference-server",
    )  # fmt: skip
    with pytest.raises(ValueError, match="not an OTLP traces export"):
        decode_export(b"\xff garbage", "application/x-protobuf")


@pytest.mark.parametrize("runtime", ["native", "pytriton", "triton", "ray"])
def test_servekit_traces_prints_a_trace_from_each_runtime(runtime, tmp_path, add_sub_path):
    needs_runtime(runtime)
    port = free_port()
    out = tmp_path / "traces.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servekit", "traces", "--port", str(port), "--quiet-s", "1"],
            stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: "receiving traces" in out.read_text(), "servekit traces up", 30)
        tracing = TracingConfig(endpoint=f"http://127.0.0.1:{port}/v1/traces", rate=1.0)
        config = ServeConfig(
            (ModelConfig(str(add_sub_path), "add_sub"),), ServerConfig(tracing=tracing),
            runtime=runtime,
        ).on_loopback()  # fmt: skip
        if runtime == "ray":
            config = config.replace(ray=RayOptions(model_cpus=0.5))
        with started(config):
            with Client(config.server.http_url) as c:
                x = np.ones((1, 16), np.float32)
                assert c.infer("add_sub", {"INPUT0": x, "INPUT1": x})["OUTPUT0"][0, 0] == 2.0
            wait_until(lambda: "\n  infer" in out.read_text(), "a trace printed", 30)
            time.sleep(1.5)  # tritonserver's spans of it, on its own schedule
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    text = out.read_text()
    assert "trace " in text and "  infer [servekit]" in text, text[-2000:]
    if runtime in ("pytriton", "triton"):  # tritonserver's own spans, sent as OTLP/JSON
        assert "InferRequest" in text, text[-2000:]
