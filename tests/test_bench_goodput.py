"""``servekit bench --timeout-ms --retries`` end to end against native serving ``sim_t4``
(issue 71): clients that give up close their connections (cancel their gRPC calls), the
server counts them abandoned, and the report holds goodput beside throughput.

``sim_t4`` at max batch 32 takes 8 ms + 1.6 ms a row of simulated device time (no CPU):
64 clients keep two full batches waiting, each about 60 ms, so with a 100 ms deadline
the second batch's clients give up (their deadline spent, nothing is left to retry in)
and only part of what the clients asked for is answered in time.
"""

from __future__ import annotations

import json

import pytest

from conftest import on, sample, scrape
from servekit import BatchingPolicy, ModelConfig, zoo

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

FAST = ["--window", "1", "--warmup", "0.5", "--max-windows", "3", "--stability", "5"]


@pytest.fixture(scope="module")
def served(model_cache):
    path = zoo.build("sim_t4", model_cache)
    model = ModelConfig(str(path), "m", batching=BatchingPolicy(max_batch_size=32))
    with on("native")(model) as s:
        yield s


def abandoned(served) -> float:
    """``servekit_requests_abandoned_total`` of model m, wherever it was left."""
    s = scrape(f"http://127.0.0.1:{served.http_port}/metrics")
    return sum(
        sample(s, "servekit_requests_abandoned", model="m", version="1", where=where)
        for where in ("queued", "running")
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bench_with_a_deadline_reports_goodput_below_what_was_asked(served, protocol, tmp_path):
    from typer.testing import CliRunner

    from servekit.cli import app

    port = served.http_port if protocol == "http" else served.grpc_port
    before = abandoned(served)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            f"{protocol}://127.0.0.1:{port}",
            "--model",
            "m",
            "--concurrency",
            "64",
            "--timeout-ms",
            "100",
            "--retries",
            "1",
            "--input-data",
            "zero",
            *FAST,
            "--out",
            str(out),
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    assert "goodput" in result.output
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["timeout_ms"] == 100 and data["meta"]["retries"] == 1
    [point] = next(iter(data["series"].values()))
    assert point["timed_out"] > 0, point
    assert 0 < point["goodput"] <= point["throughput"], point
    assert point["goodput"] < point["sent_per_s"] and point["goodput_share"] < 1, point
    # The clients that gave up left the server: it dropped or discarded their requests.
    assert abandoned(served) > before


def test_streaming_cannot_give_up_on_one_request(served):
    from typer.testing import CliRunner

    from servekit.cli import app

    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            f"grpc://127.0.0.1:{served.grpc_port}",
            "--model",
            "m",
            "--concurrency",
            "1",
            "--streaming",
            "--timeout-ms",
            "100",
            *FAST,
        ],  # fmt: skip
    )
    assert result.exit_code == 2
    assert "not with --streaming" in " ".join(result.output.split())
