"""Stateful sequences served (``[models.sequence_batching]``), with tritonclient over HTTP
and over gRPC streams: eight clients interleave sixteen sequences (as many as the models'
places: two instances of eight slots or candidates; past them, Triton's sequences wait
for a place that only END or an idle release frees) on an ONNX accumulator whose
state servekit carries (``accumulate``: each answer is its sequence's running sum), and
on the example model that keeps its own state by CORRID (``examples/sequences``); the
served signature hides the controls and the state, ``/config`` shows Triton's
``sequence_batching``, and Triton's errors name the sequence. On native servekit's
sequence batcher schedules; on the triton runtime tritonserver's does, with the servekit
backend keeping the implicit state and the controls; on ray servekit's sequence batcher
runs in the one ingress replica every request of a sequence reaches; on pytriton (which
has no sequence batcher) it runs in servekit's front, beside PyTriton's other models."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest

from conftest import each_client, needs_runtime, sample, scrape, started
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig
from servekit.batching.sequence import Controls, SequencePolicy, StateSpec

pytest.importorskip("tritonclient", reason="needs the triton extra")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "sequences"
STATE = (StateSpec("STATE_IN", "STATE_OUT"),)


def models(strategy: str, idle_us: int = 1_000_000) -> tuple[ModelConfig, ...]:
    return (
        ModelConfig(
            "accumulate", batching=BatchingPolicy(max_batch_size=8), instances=2,
            sequence_batching=SequencePolicy(
                strategy, max_sequence_idle_us=idle_us, max_candidate_sequences=8, states=STATE
            ),
        ),
        ModelConfig(
            "running_mean:RunningMean", "running_mean", path=str(EXAMPLE), instances=2,
            sequence_batching=SequencePolicy(
                strategy, max_sequence_idle_us=idle_us, max_candidate_sequences=8,
                controls=Controls(start="START", ready="READY", corrid="CORRID"),
            ),
        ),
        ModelConfig("add_sub", batching=BatchingPolicy(max_batch_size=8)),
    )  # fmt: skip


RUNTIMES = [(r, s) for r in ("native", "triton") for s in ("direct", "oldest")] + [
    ("pytriton", "direct"),
    ("ray", "oldest"),
]
"""PyTriton's front and Ray run servekit's own sequence batcher, both strategies of which
native runs here."""


@pytest.fixture(scope="module", params=RUNTIMES, ids=[f"{r}-{s}" for r, s in RUNTIMES])
def served(request):
    """The models on servekit's sequence batcher (native; ray, in its ingress replica),
    and on tritonserver's with the servekit backend keeping the implicit state (triton)."""
    runtime_name, strategy = request.param
    needs_runtime(runtime_name)
    # On ray a sequence's requests come one at a time over HTTP through Ray's proxy: on a
    # starved host the next can come over a second later, and Triton's default idle
    # release (1 s) would end the sequence. Its sequences get 10 s.
    idle_us = 10_000_000 if runtime_name == "ray" else 1_000_000
    config = ServeConfig(
        models(strategy, idle_us), ServerConfig(exit_timeout_s=2), runtime=runtime_name
    ).on_loopback()
    with started(config):
        yield config.server


@pytest.fixture
def runtime(request) -> str:
    """The runtime ``served`` runs in this test."""
    return request.node.callspec.params["served"][0]


def _tensor(module, name: str, value: float, width: int):
    tensor = module.InferInput(name, [1, width], "FP32")
    tensor.set_data_from_numpy(np.full((1, width), value, np.float32))
    return tensor


def test_eight_clients_interleaving_sequences_over_http_each_get_their_running_sums(
    served, runtime
):
    def client(k: int) -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
        try:
            ids = [1000 * k + j for j in range(1, 3)]  # two sequences per client
            totals = dict.fromkeys(ids, 0.0)
            for step in range(5):
                for sid in ids:
                    value = float(sid % 7 + step)
                    totals[sid] += value
                    flags = dict(sequence_id=sid, sequence_start=step == 0, sequence_end=step == 4)
                    result = c.infer("accumulate", [_tensor(httpclient, "INPUT", value, 4)],
                                     **flags)  # fmt: skip
                    assert np.all(result.as_numpy("OUTPUT") == totals[sid]), (sid, step)
                    result = c.infer("running_mean", [_tensor(httpclient, "VALUE", value, 1)],
                                     **flags)  # fmt: skip
                    mean = totals[sid] / (step + 1)
                    assert np.allclose(result.as_numpy("MEAN"), mean), (sid, step)
        finally:
            c.close()

    each_client(client)
    # Idle again once they stop: nothing left queued for the model.
    metrics = served.metrics_url if runtime == "triton" else f"{served.http_url}/metrics"
    samples = scrape(metrics)
    labels = {"model": "accumulate", "version": "1"}
    key = ("nv_inference_pending_request_count", frozenset(labels.items()))
    assert key in samples, "no pending gauge"
    assert sample(samples, key[0], **labels) == 0


def test_sequences_over_grpc_streams_and_a_model_that_keeps_its_own_state(served, runtime):
    """Each of eight clients streams two interleaved sequences to each model, every request
    sent before any answer is read: the answers, matched by id, are the running sums and
    running means a sequential run gives."""
    if runtime == "ray":
        pytest.skip("the ray runtime serves HTTP only (Ray Serve's proxy)")

    def client(k: int) -> None:
        answers: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
        try:
            c.start_stream(callback=lambda result, error: answers.put((result, error)))
            expected = {}
            for sid in (2 * k + 1, 2 * k + 2):
                seen = []
                for step in range(4):
                    value = float(sid + step)
                    seen.append(value)
                    flags = dict(sequence_id=sid, sequence_start=step == 0, sequence_end=step == 3)
                    rid = f"{sid}-{step}"
                    c.async_stream_infer("accumulate", [_tensor(grpcclient, "INPUT", value, 4)],
                                         request_id=f"a{rid}", **flags)  # fmt: skip
                    c.async_stream_infer("running_mean", [_tensor(grpcclient, "VALUE", value, 1)],
                                         request_id=f"m{rid}", **flags)  # fmt: skip
                    expected[f"a{rid}"] = ("OUTPUT", sum(seen))
                    expected[f"m{rid}"] = ("MEAN", sum(seen) / len(seen))
            for _ in expected:
                result, error = answers.get(timeout=60)
                assert error is None, str(error)
                rid = result.get_response().id
                output, want = expected[rid]
                assert np.allclose(result.as_numpy(output), want), (rid, result.as_numpy(output))
            c.stop_stream()
        finally:
            c.close()

    each_client(client)


def test_the_signature_hides_the_controls_and_state_and_the_config_shows_them(served, runtime):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
    try:
        meta = c.get_model_metadata("accumulate")
        assert [t["name"] for t in meta["inputs"]] == ["INPUT"]
        assert [t["name"] for t in meta["outputs"]] == ["OUTPUT"]
        config = c.get_model_config("accumulate")
        assert "dynamic_batching" not in config
        if runtime == "triton":  # tritonserver's own config: the backend keeps the state
            names = {ci["name"] for ci in config["sequence_batching"]["control_input"]}
            assert {"SERVEKIT_SEQUENCE_START", "SERVEKIT_SEQUENCE_READY"} <= names
            assert not config["sequence_batching"].get("state")
            return
        state = config["sequence_batching"]["state"][0]
        assert (state["input_name"], state["output_name"]) == ("STATE_IN", "STATE_OUT")
        kinds = {  # protobuf's JSON leaves out an enum's first value (START)
            ci["name"]: ci["control"][0].get("kind", "CONTROL_SEQUENCE_START")
            for ci in c.get_model_config("running_mean")["sequence_batching"]["control_input"]
        }
        assert kinds == {"START": "CONTROL_SEQUENCE_START", "READY": "CONTROL_SEQUENCE_READY",
                         "CORRID": "CONTROL_SEQUENCE_CORRID"}  # fmt: skip
    finally:
        c.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritons_sequence_errors_name_the_sequence_and_the_server_goes_on(served, runtime, module):
    if runtime == "ray" and module is grpcclient:
        pytest.skip("the ray runtime serves HTTP only (Ray Serve's proxy)")
    port = served.http_port if module is httpclient else served.grpc_port
    c = module.InferenceServerClient(f"127.0.0.1:{port}")
    x = _tensor(module, "INPUT", 1.0, 4)
    try:
        with pytest.raises(InferenceServerException, match="77.*START flag"):
            c.infer("accumulate", [x], sequence_id=77)  # no START
        with pytest.raises(
            InferenceServerException, match="must carry sequence_id|non-empty correlation ID"
        ):  # servekit's words, tritonserver's
            c.infer("accumulate", [x])
        c.infer("accumulate", [x], sequence_id=78, sequence_start=True, sequence_end=True)
        with pytest.raises(InferenceServerException, match="78.*START flag"):
            c.infer("accumulate", [x], sequence_id=78)  # after its END
        pair = [_tensor(module, "INPUT0", 1.0, 16), _tensor(module, "INPUT1", 1.0, 16)]
        with pytest.raises(InferenceServerException, match="add_sub.*no sequence batcher"):
            c.infer("add_sub", pair, sequence_id=5, sequence_start=True)
        ok = c.infer("accumulate", [x], sequence_id=79, sequence_start=True, sequence_end=True)
        assert np.all(ok.as_numpy("OUTPUT") == 1.0)
    finally:
        c.close()


def test_pytriton_without_its_front_and_several_ray_ingress_replicas_refuse_sequences():
    from servekit import RayOptions

    config = ServeConfig(models("direct")[:1], runtime="pytriton")
    config.check()
    config = config.replace(server=ServerConfig(front=False))
    with pytest.raises(ValueError, match=r"sequence_batching\] with server\.front = false"):
        config.check()
    config = ServeConfig(models("direct")[:1], runtime="ray", ray=RayOptions(ingress_replicas=2))
    with pytest.raises(ValueError, match=r"sequence_batching\] with \[ray\] ingress_replicas = 2"):
        config.check()
    config.replace(ray=RayOptions()).check()


@pytest.mark.parametrize(
    "protocol, streaming", [("http", False), ("grpc", False), ("grpc", True)],
    ids=["http", "grpc", "grpc-stream"],
)  # fmt: skip
def test_the_load_generator_runs_sequences_unary_and_streamed(served, runtime, protocol, streaming):
    """``servekit bench --sequence-length 4 [--streaming]``'s targets: eight workers, each
    running sequences of four (a request without its START would be refused, so any
    slip in the flags shows as errors)."""
    import asyncio

    if runtime == "ray" and protocol == "grpc":
        pytest.skip("the ray runtime serves HTTP only (Ray Serve's proxy)")

    from servekit.bench import MeasureConfig, closed_loop, open_target

    url = served.http_url if protocol == "http" else served.grpc_url

    async def run():
        target = open_target(
            url, "accumulate", {"INPUT": np.ones((1, 4), np.float32)},
            streaming=streaming, sequence_length=4,
        )  # fmt: skip
        try:
            return await closed_loop(target, 8, MeasureConfig(0.5, 0.2, 3))
        finally:
            await target.close()

    point = asyncio.run(run())
    assert point.stats.errors == 0, point.error_messages
    assert point.stats.requests >= 40


@pytest.fixture(scope="module", params=["direct", "oldest"])
def tritons_own(request, tmp_path_factory):
    """tritonserver's own sequence batcher on the same model, as Triton's users write it
    (a Python-backend accumulator keyed by CORRID: ``bench/peers/triton_accumulate.py``)."""
    pytest.importorskip("pytriton", reason="needs the triton extra (its tritonserver)")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peers"))
    from triton_accumulate import serve

    folder = tmp_path_factory.mktemp(f"triton-{request.param}")
    with serve(folder, request.param, max_batch=8, instances=2) as triton:
        yield triton.options.server


def _stream_sequences(port: int, k: int) -> dict[str, np.ndarray]:
    """Client ``k``'s two interleaved sequences of five, streamed, every request sent before
    any answer is read: OUTPUT by request id."""
    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        for step in range(5):
            for sid in (100 + 2 * k, 101 + 2 * k):
                c.async_stream_infer(
                    "accumulate", [_tensor(grpcclient, "INPUT", float(sid * step % 13), 4)],
                    request_id=f"{sid}-{step}", sequence_id=sid,
                    sequence_start=step == 0, sequence_end=step == 4,
                )  # fmt: skip
        out = {}
        for _ in range(10):
            result, error = answers.get(timeout=60)
            assert error is None, str(error)
            out[result.get_response().id] = result.as_numpy("OUTPUT")
        c.stop_stream()
        return out
    finally:
        c.close()


def _http_sequences(port: int, k: int) -> dict[str, np.ndarray]:
    """The same sequences as ``_stream_sequences``, over HTTP, one request at a time."""
    c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        out = {}
        for step in range(5):
            for sid in (100 + 2 * k, 101 + 2 * k):
                result = c.infer(
                    "accumulate", [_tensor(httpclient, "INPUT", float(sid * step % 13), 4)],
                    sequence_id=sid, sequence_start=step == 0, sequence_end=step == 4,
                )  # fmt: skip
                out[f"{sid}-{step}"] = result.as_numpy("OUTPUT")
        return out
    finally:
        c.close()


def test_tritonservers_own_sequence_batcher_gives_the_same_answers(served, runtime, tritons_own):
    """The same interleaved sequences from eight clients at once, streamed to servekit
    (over HTTP to ray, which has no gRPC) and to tritonserver's own sequence batcher:
    identical outputs, request by request, and both the running sums."""
    from concurrent.futures import ThreadPoolExecutor

    ask, port = (
        (_http_sequences, served.http_port)
        if runtime == "ray"
        else (_stream_sequences, served.grpc_port)
    )
    with ThreadPoolExecutor(16) as pool:
        ours = pool.map(ask, [port] * 8, range(8))
        theirs = pool.map(_stream_sequences, [tritons_own.grpc_port] * 8, range(8))
        ours, theirs = list(ours), list(theirs)
    for k, (mine, triton) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.keys() == triton.keys()
        for rid in mine:
            assert np.array_equal(mine[rid], triton[rid]), (k, rid, mine[rid], triton[rid])
            sid, step = map(int, rid.split("-"))
            want = sum(float(sid * s % 13) for s in range(step + 1))
            assert np.all(mine[rid] == want), (rid, mine[rid], want)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_sequence_models_statistics_and_config_come_from_where_it_is_served(
    served, runtime, module
):
    """On pytriton the front serves the sequence model itself: its statistics and config
    are servekit's, not tritonserver's (which has no such model), on both protocols."""
    if runtime == "ray" and module is grpcclient:
        pytest.skip("the ray runtime serves HTTP only (Ray Serve's proxy)")
    port = served.http_port if module is httpclient else served.grpc_port
    c = module.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        x = _tensor(module, "INPUT", 1.0, 4)
        c.infer("accumulate", [x], sequence_id=90, sequence_start=True, sequence_end=True)
        as_json = {"as_json": True} if module is grpcclient else {}
        stats = c.get_inference_statistics("accumulate", **as_json)
        (entry,) = stats["model_stats"]
        assert entry["name"] == "accumulate"
        assert int(entry["inference_stats"]["success"]["count"]) >= 1
        config = c.get_model_config("accumulate", **as_json)
        config = config.get("config", config)  # gRPC wraps it
        assert config["name"] == "accumulate" and "sequence_batching" in config
    finally:
        c.close()
