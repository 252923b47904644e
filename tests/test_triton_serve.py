"""A real PyTriton server on loopback, reached with tritonclient over HTTP and gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra: pip install 'servekit[triton]'")

from conftest import served_models
from servekit import (
    BatchingPolicy,
    InvalidInput,
    ModelNotFound,
    OnnxRuntimeRunner,
    image_classifier,
)
from servekit.client import AsyncClient, Client
from servekit.config import ServerConfig
from servekit.pytriton import TritonServer
from servekit.stages import synthetic_image

POLICY = BatchingPolicy(max_batch_size=8, max_queue_delay_us=5000)


@pytest.fixture(scope="module")
def server(resnet50_path):
    config = ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    srv = TritonServer(
        served_models(resnet50_path, name="resnet50", policy=POLICY, threads=2), config
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def local(resnet50_path):
    runner = OnnxRuntimeRunner(resnet50_path)
    return runner, image_classifier(runner)


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    url = server.server.http_url if request.param == "http" else server.server.grpc_url
    with Client(url) as c:
        yield c


def images(n: int, start: int = 0) -> list[bytes]:
    return [synthetic_image(start + i, size=(200 + 17 * i, 240)) for i in range(n)]


def tensor(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 224, 224)).astype(np.float32)


def test_both_models_are_served(server):
    with Client(server.server.http_url) as c:
        assert c.is_ready() and c.is_ready("resnet50") and c.is_ready("resnet50_image")


def test_tensor_model_equals_the_in_process_runner(client, local):
    x = tensor(3, seed=1)
    got = client.infer("resnet50", {"input": x})["logits"]
    np.testing.assert_allclose(got, local[0].infer({"input": x})["logits"], rtol=1e-4, atol=1e-4)


def test_json_requests_equal_binary_ones(server):
    x = tensor(1, seed=2)
    with Client(server.server.http_url) as c:
        binary = c.infer("resnet50", {"input": x})["logits"]
        as_json = c.infer("resnet50", {"input": x}, binary=False)["logits"]
    np.testing.assert_allclose(as_json, binary, rtol=1e-5, atol=1e-5)


def test_image_model_equals_the_in_process_pipeline(client, local):
    blobs = images(3)
    remote = client.classify(blobs)
    expected = local[1].classify(blobs)
    for r, e in zip(remote, expected, strict=True):
        assert [p.class_id for p in r] == [p.class_id for p in e]
        assert [p.label for p in r] == [p.label for p in e]
        np.testing.assert_allclose([p.score for p in r], [p.score for p in e], rtol=1e-4, atol=1e-5)


def test_concurrent_requests_each_get_their_own_answer(server, local):
    blobs = images(12, start=20)
    expected = [p[0].class_id for p in local[1].classify(blobs)]
    got: dict[int, int] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        url = server.server.http_url if i % 2 else server.server.grpc_url
        try:
            with Client(url) as c:
                got[i] = c.classify([blobs[i]])[0][0].class_id
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(blobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [got[i] for i in range(len(blobs))] == expected


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_inputs_give_the_same_result(server, local, protocol):
    x = tensor(2, seed=3)
    url = server.server.http_url if protocol == "http" else server.server.grpc_url
    with Client(url, shared_memory=True, access_token=server.access_token) as c:
        got = c.infer("resnet50", {"input": x})["logits"]
        again = c.infer("resnet50", {"input": x[:1]})["logits"]
    np.testing.assert_allclose(got, local[0].infer({"input": x})["logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(again, got[:1], rtol=1e-4, atol=1e-4)


def test_shared_memory_needs_the_servers_token(server):
    from servekit import Unauthenticated

    with (
        Client(server.server.http_url, shared_memory=True) as c,
        pytest.raises(Unauthenticated, match="triton-access-token"),
    ):
        c.infer("resnet50", {"input": tensor(1)})


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_async_client(server, local, protocol):
    url = server.server.http_url if protocol == "http" else server.server.grpc_url
    blobs = images(2, start=40)

    async def main():
        async with AsyncClient(url) as c:
            return await asyncio.gather(*[c.classify([b]) for b in blobs])

    got = [r[0][0].class_id for r in asyncio.run(main())]
    assert got == [p[0].class_id for p in local[1].classify(blobs)]


@pytest.mark.parametrize(
    ("model", "inputs", "message"),
    [
        ("resnet50", {"input": np.zeros((1, 3, 224, 224))}, r"'input'.*FP64.*FP32"),
        (
            "resnet50",
            {"input": np.zeros((1, 3, 224, 225), np.float32)},
            r"'input'.*\[-1,3,224,224\].*\[1,3,224,225\]",
        ),
        ("resnet50", {"input": np.zeros((9, 3, 224, 224), np.float32)}, r"batch-size must be <= 8"),
        (
            "resnet50_image",
            {"image": np.array([[b"not a jpeg"]], dtype=object)},
            r"input 'image' row 0: cannot decode image",
        ),
    ],
    ids=["dtype", "shape", "oversized-batch", "undecodable-image"],
)
def test_bad_inputs_get_invalid_argument_naming_the_problem_and_the_server_keeps_serving(
    client, model, inputs, message
):
    with pytest.raises(InvalidInput, match=message):
        client.infer(model, inputs)
    assert client.classify(images(1))[0][0].class_id >= 0


def test_unknown_models_are_reported_by_name(client):
    with pytest.raises((ModelNotFound, InvalidInput), match="resnet51"):
        client.infer("resnet51", {"input": tensor(1)})


def test_one_bad_image_among_concurrent_good_ones_fails_alone(server, local):
    blobs = images(6, start=60)
    expected = [p[0].class_id for p in local[1].classify(blobs)]
    results: dict[int, object] = {}

    def one(i: int, blob: bytes) -> None:
        with Client(server.server.grpc_url) as c:
            try:
                results[i] = c.classify([blob])[0][0].class_id
            except InvalidInput as exc:
                results[i] = exc

    work = [*enumerate(blobs), (99, b"\x89PNG broken")]
    threads = [threading.Thread(target=one, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(6)] == expected
    assert isinstance(results[99], InvalidInput) and "cannot decode image" in str(results[99])


def metric(text: str, name: str, model: str) -> float:
    m = re.search(rf'^{name}{{model="{model}",version="1"}} ([0-9.e+]+)$', text, re.M)
    assert m, f"{name} for {model} not in metrics"
    return float(m.group(1))


def test_batching_is_visible_in_triton_metrics(server):
    def scrape() -> str:
        with urllib.request.urlopen(server.server.metrics_url, timeout=10) as r:
            return r.read().decode()

    before = scrape()
    x = tensor(1, seed=5)

    def one(_: int) -> None:
        with Client(server.server.grpc_url) as c:
            c.infer("resnet50", {"input": x})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Triton counts a request just after answering it: poll (bounded) until all 16 show.
    deadline = time.monotonic() + 10
    while True:
        after = scrape()
        requests = metric(after, "nv_inference_request_success", "resnet50") - metric(
            before, "nv_inference_request_success", "resnet50"
        )
        if requests >= 16 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    executions = metric(after, "nv_inference_exec_count", "resnet50") - metric(
        before, "nv_inference_exec_count", "resnet50"
    )
    assert requests == 16
    assert executions < requests


def test_infer_command_sends_images_to_the_server(server, tmp_path):
    from typer.testing import CliRunner

    from servekit.cli import app

    path = tmp_path / "a.jpg"
    path.write_bytes(images(1)[0])
    result = CliRunner().invoke(
        app,
        [
            "infer",
            str(path),
            "--url",
            server.server.grpc_url,
            "--model",
            "resnet50",
            "--json",
            "--top-k",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(next(iter(__import__("json").loads(result.output).values()))) == 2


def _argv0(proc_dir) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def test_a_server_stops_cleanly_and_frees_its_ports(add_sub_path):
    config = ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    models = served_models(add_sub_path, policy=BatchingPolicy(max_batch_size=4))
    with TritonServer(models, config) as srv:
        with Client(config.http_url) as c:
            a = np.ones((2, 16), np.float32)
            assert (c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"] == 2).all()
        assert srv.is_alive()
        workdir = str(srv._workdir)
    assert not srv.is_alive()
    from pathlib import Path

    left = [
        p for p in Path("/proc").iterdir() if p.name.isdigit() and _argv0(p).startswith(workdir)
    ]
    assert not left, "tritonserver or its stubs outlived the server"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{config.http_url}/v2/health/ready", timeout=2)


def test_bench_command_measures_the_served_model(server, tmp_path):
    import json

    from typer.testing import CliRunner

    from servekit.cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "bench", "--url", server.server.grpc_url, "--model", "resnet50_image", "--concurrency", "1,2",
            "--window", "0.5", "--warmup", "0.2", "--max-windows", "3", "--stability", "0.5", "--out", str(out),
            "--server-pid", str(os.getpid()),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.with_suffix(".json").read_text())
    points = next(iter(data["series"].values()))
    assert [p["level"] for p in points] == [1, 2]
    assert all(p["errors"] == 0 and p["requests"] > 0 for p in points)
    # The server here is this process's tree (tritonserver and its stubs included).
    assert all(p["server_cpu_us"] > 0 and p["client_cpu_us"] > 0 for p in points)
    assert out.with_suffix(".png").stat().st_size > 1000 and out.with_suffix(".csv").exists()
    json_run = CliRunner().invoke(
        app,
        [
            "bench", "--url", server.server.http_url, "--model", "resnet50", "--concurrency", "1",
            "--window", "0.5", "--warmup", "0.2", "--max-windows", "3", "--stability", "0.5", "--json",
        ],
    )  # fmt: skip
    assert json_run.exit_code == 0, json_run.output
    # One progress line per level, and the table once, at the end.
    assert json_run.output.count("resnet50 at http") == 1, json_run.output
    assert json_run.output.count("concurrency 1:") == 1, json_run.output


def test_bench_command_reports_an_unknown_model(server):
    from typer.testing import CliRunner

    from servekit.cli import app

    result = CliRunner().invoke(
        app, ["bench", "--url", server.server.http_url, "--model", "nope", "--concurrency", "1"]
    )
    assert result.exit_code == 2
    assert "nope" in result.output


def test_load_generator_sends_through_shared_memory(server):
    from servekit.bench import MeasureConfig, closed_loop, open_target

    async def main():
        target = open_target(
            server.server.grpc_url,
            "resnet50",
            {"input": tensor(1)},
            shared_memory=True,
            access_token=server.access_token,
        )
        try:
            return await closed_loop(
                target, 2, MeasureConfig(window_s=0.5, warmup_s=0.1, max_windows=3, stability=1.0)
            )
        finally:
            await target.close()

    point = asyncio.run(main())
    assert point.stats.requests > 0 and point.stats.errors == 0


def test_the_locust_user_sends_kserve_requests(server, tmp_path):
    import csv
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if (
        importlib.util.find_spec("locust") is None
    ):  # never import it here: it monkey-patches threading
        pytest.skip("locust is in the dev extra")
    locustfile = Path(__file__).resolve().parents[1] / "bench" / "locustfile.py"
    prefix = tmp_path / "locust"
    subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "-u", "2", "-r", "2", "-t", "4s",
         "--host", server.server.http_url, "--csv", str(prefix), "--only-summary"],
        env={**os.environ, "SERVEKIT_MODEL": "resnet50_image"}, check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    with open(f"{prefix}_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["resnet50_image"]["Request Count"]) > 0
    assert int(rows["resnet50_image"]["Failure Count"]) == 0


def test_metrics_count_known_traffic_exactly(server):
    """Triton's own counters and latency summaries for a PyTriton model after known
    traffic: sequential requests are one execution each; the bad image's error response,
    which Triton counts as a success, is counted in servekit_request_failure."""
    from conftest import sample, scrape

    labels = {"model": "resnet50_image", "version": "1"}
    names = ("nv_inference_request_success", "nv_inference_request_failure")
    names += ("nv_inference_exec_count", "nv_inference_request_summary_us_count")

    def counts() -> dict[str, float]:
        got = scrape(server.server.metrics_url)
        out = {n: sample(got, n, **labels) for n in names}
        out["servekit"] = sample(got, "servekit_request_failure", **labels, code="INVALID_ARG")
        return out

    # Earlier tests' last requests (the Locust run's, say) may still be counted: start
    # once the counters have stood still for a second.
    before, deadline = counts(), time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = counts()
        if now == before:
            break
        before = now
    with Client(server.server.http_url) as c:
        for i in range(3):
            c.classify(images(1, 40 + i))
        with pytest.raises(InvalidInput):
            c.classify([b"not an image"])
    want = {names[0]: 4, names[1]: 0, names[2]: 4, "servekit": 1}
    deadline = time.monotonic() + 10
    while True:  # Triton counts a request just after answering it
        after = counts()
        delta = {n: after[n] - before[n] for n in after}
        if all(delta[n] >= want[n] for n in want) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {n: delta[n] for n in want} == want
    assert delta["nv_inference_request_summary_us_count"] == 4  # summary_latencies is on


def test_triton_exports_every_family_servekit_exports(server):
    """One dashboard for every runtime: servekit's own exposition uses Triton's names. What
    tritonserver cannot export (the autoscaling signal, readiness) servekit's front does
    (tests/test_prometheus.py); this server runs without the front."""
    import re as _re

    from conftest import scrape
    from servekit.metrics import COUNTERS, DEMAND, GAUGES, READY, SUMMARIES

    with Client(server.server.http_url) as c:
        c.classify(images(1, 70))
    names = {
        _re.sub(r"_(count|sum)$", "", n) if "summary" in n else n
        for n, _ in scrape(server.server.metrics_url)
    }
    assert {*COUNTERS, *GAUGES, *SUMMARIES} - {DEMAND, READY} <= names
