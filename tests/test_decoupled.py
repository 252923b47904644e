"""A decoupled model (``examples/streaming``: one text in, each of its words out, one
response each) served on native, triton, pytriton (in servekit's front: PyTriton cannot
stop a model for a client that left) and ray (in its ingress replica, over HTTP): over a gRPC stream its responses come in order, flagged
``triton_final_response`` false, then an empty final one where the client asks
(``enable_empty_final_response``); over HTTP they come as Server-Sent Events; a unary
call is refused as Triton refuses it; a model that fails midway sends what it made, then
its error; and a client that leaves stops the model at its next step (measured: the
words it makes after)."""

from __future__ import annotations

import http.client
import json
import queue
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_runtime, scrape, started, wait_until
from servekit import ModelConfig, ServeConfig, ServerConfig

pytest.importorskip("tritonclient", reason="needs the triton extra")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "streaming"


@pytest.fixture(scope="module", params=["native", "triton", "pytriton", "ray"])
def served(request):
    """The models on native, on triton (the servekit backend in tritonserver's decoupled
    mode, behind servekit's front), on pytriton (in the front) and on ray (in its ingress
    replica; HTTP only)."""
    needs_runtime(request.param)
    config = ServeConfig(
        (
            ModelConfig("words:Words", "words", path=str(EXAMPLE)),
            ModelConfig("words:Words", "slow", path=str(EXAMPLE), args={"delay_s": 0.05}),
        ),
        ServerConfig(exit_timeout_s=2),
        runtime=request.param,
    ).on_loopback()
    with started(config):
        yield config.server, request.param


def grpc_only(runtime: str) -> None:
    if runtime == "ray":
        pytest.skip("the ray runtime serves HTTP only (Ray Serve's proxy)")


def count(served, what: str, name: str) -> int:
    """A decoupled model's count on ``/metrics`` (``servekit_decoupled_<what>_total``;
    on triton, tritonserver's metrics port, where the backend counts)."""
    server, runtime = served
    key = (f"servekit_decoupled_{what}", frozenset({("model", name)}))  # parsed without _total
    samples = scrape(server.metrics_url if runtime == "triton" else f"{server.http_url}/metrics")
    assert key in samples, f"no {key[0]} for {name}"
    return int(samples[key])


def made(served, name: str) -> int:
    """Words the model ``name`` has made so far."""
    return count(served, "responses", name)


def text(module, words: str):
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[words.encode()]], dtype=object))
    return tensor


def stream(server, model: str, words: str, **kw) -> list:
    """Every (result, error) the stream brings for one request, until its final flag."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer(model, [text(grpcclient, words)], request_id="r1",
                             enable_empty_final_response=True, **kw)  # fmt: skip
        out = []
        while True:
            result, error = got.get(timeout=30)
            out.append((result, error))
            if error is not None:
                return out
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        c.stop_stream()
        c.close()


def test_a_grpc_stream_brings_each_response_in_order_then_the_final_flag(served):
    server, runtime = served
    grpc_only(runtime)
    out = stream(server, "words", "one two three four")
    assert all(error is None for _, error in out)
    *words, final = [r for r, _ in out]
    assert [w.as_numpy("WORD")[0, 0] for w in words] == [b"one", b"two", b"three", b"four"]
    assert [int(w.as_numpy("INDEX")[0, 0]) for w in words] == [0, 1, 2, 3]
    assert all(w.get_response().id == "r1" for w in words)
    assert not any(w.get_response().parameters["triton_final_response"].bool_param for w in words)
    assert final.get_response().parameters["triton_final_response"].bool_param
    assert not final.get_response().outputs  # the empty final response


def test_a_model_failing_midway_sends_what_it_made_then_its_error(served):
    server, runtime = served
    grpc_only(runtime)
    out = stream(server, "words", "one two fail three")
    assert [r.as_numpy("WORD")[0, 0] for r, e in out if e is None] == [b"one", b"two"]
    error = out[-1][1]
    assert error is not None and "ValueError" in str(error) and "word 2" in str(error)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_unary_call_to_a_decoupled_model_is_refused_naming_it(served, module):
    server, runtime = served
    if module is grpcclient:
        grpc_only(runtime)
    port = server.http_port if module is httpclient else server.grpc_port
    c = module.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(InferenceServerException, match="'words' is decoupled"):
            c.infer("words", [text(module, "one two")])
    finally:
        c.close()


def events(server, model: str, words: str, *, keep: int | None = None) -> list[tuple[str, dict]]:
    """Server-Sent Events for one request: (event, data) each; ``keep``: hang up after so
    many."""
    body = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1],
                                   "data": [words]}]})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", f"/v2/models/{model}/infer", body,
                 {"Content-Type": "application/json", "Accept": "text/event-stream"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("content-type") == "text/event-stream"
    out: list[tuple[str, dict]] = []
    kind, data = "message", ""
    while keep is None or len(out) < keep:
        line = response.readline().decode()
        if not line:
            break
        line = line.rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            out.append((kind, json.loads(data)))
            kind, data = "message", ""
    conn.close()
    return out


def test_http_streams_the_responses_as_server_sent_events(served):
    server, _ = served
    out = events(server, "words", "alpha beta gamma")
    assert [k for k, _ in out] == ["message"] * 3 + ["end"]
    words = [d["outputs"][0]["data"][0] for _, d in out[:3]]
    assert words == ["alpha", "beta", "gamma"]
    failed = events(server, "words", "alpha fail")
    assert [k for k, _ in failed] == ["message", "error"]
    assert "ValueError" in failed[1][1]["error"]


def test_a_client_that_leaves_stops_the_model_at_its_next_step(served):
    """A 200-word request on the slow model (50 ms a word): the client takes three words
    and leaves, over gRPC (stop_stream cancelling) and over HTTP (hangs up). The model
    makes at most a word or two more, read from its own count on ``/metrics``."""
    server, runtime = served
    long = " ".join(f"w{i}" for i in range(200))
    abandoned = count(served, "abandoned", "slow")

    if runtime != "ray":
        got: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        before = made(served, "slow")
        c.async_stream_infer("slow", [text(grpcclient, long)], request_id="long")
        for _ in range(3):
            assert got.get(timeout=30)[1] is None
        c.stop_stream(cancel_requests=True)
        c.close()
        wait_until(lambda: made(served, "slow") - before <= 5, "the model was stopped", 5)
        at_stop = made(served, "slow")
        time.sleep(0.5)  # ten words' time
        assert made(served, "slow") - at_stop <= 1, "the model went on for a client that left"
        abandoned += 1

    before = made(served, "slow")
    assert len(events(server, "slow", long, keep=3)) == 3
    time.sleep(1.0)  # twenty words' time
    assert made(served, "slow") - before <= 3 + 2, "the model went on after the hang-up"
    assert count(served, "abandoned", "slow") == abandoned + 1


@pytest.mark.parametrize("runtime", ["native", "pytriton"])
def test_a_decoupled_model_asking_for_the_response_cache_is_refused_by_name(runtime):
    """Its answers are a stream, not one response: the server does not start, naming it."""
    from servekit.config import CacheConfig

    needs_runtime(runtime)
    config = ServeConfig(
        (ModelConfig("words:Words", "words", path=str(EXAMPLE), response_cache=True),),
        ServerConfig(exit_timeout_s=2, cache=CacheConfig(local_size_mb=1)),
        runtime=runtime,
    ).on_loopback()
    refused = r"models\.words: response_cache on a decoupled model"
    with pytest.raises(ValueError, match=refused), started(config):
        pass
