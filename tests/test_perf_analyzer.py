"""NVIDIA's C++ client as a real client: perf_analyzer (the binary in tritonclient 2.41.0's
wheel, ``perfanalyzer.fetch``) against the native, pytriton and triton runtimes, over HTTP
and gRPC, with and without system shared memory, with batches, a request rate, streaming
and a sequence model (``accumulate``, its state carried by the server). Each run ends
without an error, and the inferences the server's statistics count equal those
perf_analyzer sent: its answers (its C++ client prints each one) times the batch. Before
servekit answered an output placed in a region as tritonserver does (name, datatype and
shape alone), native's HTTP answers carried that output's region in ``parameters``, and
the C++ client refused every one: ``attempt to access non-existing object member
'binary_data_size'``."""

from __future__ import annotations

import pytest

from conftest import needs_runtime, sample, scrape, wait_until
from perfanalyzer import Case, PerfAnalyzer, errors, fetch, inference_count, run
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.batching.sequence import SequencePolicy, StateSpec
from servekit.bench.compare import ServerProcess

SHM = ("--shared-memory", "system")
STREAM = ("--streaming",)
CASES = (
    Case("http-batch", "http", "add_sub", ("--concurrency-range", "2"), batch=4),
    Case("http-shm-batch", "http", "add_sub", ("--concurrency-range", "2", *SHM), batch=4),
    Case("grpc-batch", "grpc", "add_sub", ("--concurrency-range", "2"), batch=4),
    Case("grpc-shm-batch", "grpc", "add_sub", ("--concurrency-range", "2", *SHM), batch=4),
    Case("http-shm-rate", "http", "add_sub", ("--request-rate-range", "300", *SHM), batch=2),
    Case("grpc-rate", "grpc", "add_sub", ("--request-rate-range", "300"), batch=2),
    Case("grpc-shm-stream", "grpc", "add_sub", (*STREAM, *SHM), batch=2),
    Case("http-shm-sequence", "http", "accumulate", SHM),
    Case("grpc-shm-stream-sequence", "grpc", "accumulate", (*STREAM, *SHM)),
)


@pytest.fixture(scope="module")
def perf_analyzer(request) -> PerfAnalyzer:
    """Fetched once into pytest's cache (``.pytest_cache/d/perf_analyzer``)."""
    return fetch(request.config.cache.mkdir("perf_analyzer"))


@pytest.fixture(scope="module", params=["native", "pytriton", "triton"])
def server(request, model_cache, add_sub_path, perf_analyzer):
    needs_runtime(request.param)
    sequences = SequencePolicy(
        "oldest", max_sequence_idle_us=5_000_000, max_candidate_sequences=8,
        states=(StateSpec("STATE_IN", "STATE_OUT"),),
    )  # fmt: skip
    config = ServeConfig(
        (
            ModelConfig(
                str(add_sub_path), "add_sub",
                batching=BatchingPolicy(max_batch_size=8, max_queue_delay_us=500),
            ),
            ModelConfig(
                str(zoo.build("accumulate", model_cache)), "accumulate",
                batching=BatchingPolicy(max_batch_size=8), sequence_batching=sequences,
            ),
        ),
        ServerConfig(exit_timeout_s=2),
        runtime=request.param,
    ).on_loopback()  # fmt: skip
    with ServerProcess(config) as served:
        served.wait_ready(["add_sub", "accumulate"])
        yield served


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_perf_analyzer_runs_without_an_error_and_the_server_counts_what_it_sent(
    server, perf_analyzer, case
):
    urls = {"http": server.config.server.http_url, "grpc": server.config.server.grpc_url}
    http = urls["http"]
    before = inference_count(http, case.model)
    done = run(perf_analyzer, case, urls[case.protocol].split("//")[-1])
    assert done.returncode == 0 and not errors(done), done.output
    sent = done.responses * case.batch
    assert sent > 0, done.output
    labels = {"model": case.model, "version": "1"}
    metrics = server.config.server.metrics_url
    wait_until(
        lambda: (
            sample(scrape(metrics), "nv_inference_pending_request_count", **labels) == 0
            and inference_count(http, case.model) - before >= sent
        ),
        f"the server's count of {case.model}'s inferences reaching {sent}",
        timeout_s=20,
    )
    assert inference_count(http, case.model) - before == sent, done.output
