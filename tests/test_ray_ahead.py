"""Ray's ingress keeps a model replica's device busy with full batches (``[models]
overlap``, on by default there; ``batching.ahead``): a batch leaves for the replica while
the one before it still runs, full or just before the device frees, so the device's own
record shows it taking batch after batch of the model's max size with no Ray round trip
between them. With ``overlap = false`` each replica gets its next batch only once it has
answered the last, and the device waits a round trip every time."""

from __future__ import annotations

import json
import statistics

import numpy as np
import onnx
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra")
pytest.importorskip("ray.serve")
pytest.importorskip("tritonclient.http")

import tritonclient.http as httpclient  # noqa: E402

from conftest import each_client  # noqa: E402
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.config import RayOptions  # noqa: E402
from servekit.ray.runtime import RayRuntime  # noqa: E402
from servekit.runners.simulated import TIMELINE_ENV  # noqa: E402
from servekit.zoo.tiny import build_simulated  # noqa: E402

ROWS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ahead")
    timeline = folder / "timeline.jsonl"
    models = []
    for name, overlap in (("ahead_on", None), ("ahead_off", False)):
        # 150 ms a batch plus 1 ms a row: slower than Ray's proxy hands requests to the
        # ingress (milliseconds of CPU each), so the clients, not the proxy, fill batches.
        path = folder / f"{name}.onnx"
        onnx.save(build_simulated(f"ray-{name}", 150_000, 1_000), path)
        batching = BatchingPolicy(max_batch_size=ROWS)
        models.append(ModelConfig(str(path), name, batching=batching, overlap=overlap))
    config = ServeConfig(
        tuple(models), ServerConfig(exit_timeout_s=2), runtime="ray",
        ray=RayOptions(model_cpus=0.25),
    ).on_loopback()  # fmt: skip
    mp = pytest.MonkeyPatch()
    mp.setenv(TIMELINE_ENV, str(timeline))  # Ray's worker processes inherit it
    try:
        with RayRuntime(config, num_cpus=2) as runtime:
            yield config.server.http_url.removeprefix("http://"), timeline
            del runtime
    finally:
        mp.undo()


def load(url: str, model: str, clients: int = 2 * ROWS, each: int = 8) -> None:
    def work(k: int) -> None:
        client = httpclient.InferenceServerClient(url)
        try:
            for i in range(each):
                x = np.full((1, 16), 100 * k + i, np.float32)
                tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
                tensor.set_data_from_numpy(x)
                answer = client.infer(model, [tensor]).as_numpy("OUTPUT0")
                assert answer.shape == (1, 16), answer.shape
        finally:
            client.close()

    each_client(work, clients=clients, timeout_s=240)


def batches(timeline, device: str) -> list[dict]:
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    return sorted((b for b in lines if b["device"] == device), key=lambda b: b["start"])


def test_with_overlap_the_device_runs_full_batches_back_to_back_and_without_it_waits(served):
    url, timeline = served
    for model in ("ahead_on", "ahead_off"):
        load(url, model)
    on, off = batches(timeline, "ray-ahead_on"), batches(timeline, "ray-ahead_off")
    # The first batches teach the ingress the round trip; judge the rest.
    steady_on, steady_off = on[len(on) // 4 :], off[len(off) // 4 :]
    full_on = sum(b["rows"] == ROWS for b in steady_on) / len(steady_on)
    assert full_on >= 0.75, f"with overlap, {full_on:.0%} of batches were full: {steady_on}"

    def gaps(record: list[dict]) -> list[float]:
        return [b["start"] - a["end"] for a, b in zip(record, record[1:], strict=False)]

    idle_on, idle_off = statistics.median(gaps(steady_on)), statistics.median(gaps(steady_off))
    assert idle_on < idle_off / 2, (
        f"the device idled a median {idle_on * 1e3:.1f} ms between batches with overlap, "
        f"{idle_off * 1e3:.1f} ms without"
    )
