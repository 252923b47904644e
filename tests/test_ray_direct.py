"""``[ray] direct``: each ingress replica serves HTTP on the configured port itself, with
no Ray HTTP proxy, and one handle call carries each batch to the model deployment. The
same protocol, answers and errors as through Ray's proxy; draining refuses new requests.

And the ingress keeps a model replica's device busy with full batches (``[models]
overlap``, on by default on Ray; ``batching.ahead``): a batch leaves for the replica
while the one before it still runs, full or just before the device frees, so the
replica already holds it when the device frees and the device's own record shows batch
after batch of the model's max size; with ``overlap = false`` each replica gets its
next batch only once it has answered the last, and the device waits a round trip every
time. What the device waits between batches with overlap is the replica's own hand-over
(a thread hop), which on a host whose cores are taken is as long as the round trip
itself (8 ms against 12 in one CI run): so the test reads where each batch was when the
device freed, from the replica's own queue times, not the length of the gaps."""

from __future__ import annotations

import json
import os
import statistics
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("tritonclient.http")

import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import each_client, sample, scrape  # noqa: E402
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.config import RayOptions, StoreConfig  # noqa: E402
from servekit.ray.runtime import RayRuntime  # noqa: E402
from servekit.runners.simulated import TIMELINE_ENV  # noqa: E402
from servekit.zoo.tiny import build_simulated  # noqa: E402

# The simulated devices' timeline file reaches Ray's workers through the environment Ray
# starts in: a Ray of the module's own.
pytestmark = pytest.mark.own_ray

ROWS = 8
"""The simulated devices' max batch size."""


@pytest.fixture(scope="module")
def direct(add_sub_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("devices")
    devices = []
    for name, overlap in (("ahead_on", None), ("ahead_off", False)):
        # 150 ms a batch plus 1 ms a row: longer than the ingress takes to gather and send a
        # batch even on a host whose cores are taken (a round trip there: over 100 ms).
        path = folder / f"{name}.onnx"
        onnx.save(build_simulated(f"ray-{name}", 150_000, 1_000), path)
        batching = BatchingPolicy(max_batch_size=ROWS)
        devices.append(ModelConfig(str(path), name, batching=batching, overlap=overlap))
    config = ServeConfig(
        (
            ModelConfig(
                str(add_sub_path), "adder", threads=1,
                batching=BatchingPolicy(max_batch_size=8, max_queue_delay_us=2000),
            ),
            *devices,
        ),
        ServerConfig(exit_timeout_s=2, keep_alive_s=30),
        runtime="ray",
        ray=RayOptions(model_cpus=0.25, direct=True),
    ).on_loopback()  # fmt: skip
    timeline = folder / "timeline.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TIMELINE_ENV, str(timeline))  # Ray's workers inherit it
        with RayRuntime(config, num_cpus=2) as runtime:
            client = httpclient.InferenceServerClient(
                config.server.http_url.removeprefix("http://")
            )
            try:
                for _ in range(600):  # the replica listens once its constructor has run
                    try:
                        if client.is_model_ready("adder"):
                            break
                    except Exception:
                        pass
                    threading.Event().wait(0.2)
                else:
                    raise TimeoutError("the direct ingress did not answer in 120 s")
            finally:
                client.close()
            yield runtime


def tensors(a: np.ndarray, b: np.ndarray, binary: bool) -> list:
    out = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = httpclient.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value, binary_data=binary)
        out.append(tensor)
    return out


def test_ray_serves_no_http_proxy_of_its_own(direct):
    assert not serve.status().proxies
    deployments = sorted(serve.status().applications["servekit"].deployments)
    assert deployments == ["Ingress", "adder", "ahead_off", "ahead_on"]


def test_eight_clients_get_their_own_answers_a_bad_request_fails_alone_and_batches_cross(
    direct,
):
    url = direct.config.server.http_url

    def work(k: int) -> None:
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        rng = np.random.default_rng(k)
        try:
            for i in range(25):
                if i == 7:
                    with pytest.raises(InferenceServerException, match="INPUT0") as caught:
                        client.infer("adder", tensors(np.ones((1, 3), np.float32),
                                                      np.ones((1, 16), np.float32), k % 2 == 0))  # fmt: skip
                    assert caught.value.status() == "400", caught.value
                    continue
                a = rng.standard_normal((1, 16)).astype(np.float32)
                b = rng.standard_normal((1, 16)).astype(np.float32)
                result = client.infer("adder", tensors(a, b, k % 2 == 0))
                np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
                np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
        finally:
            client.close()

    each_client(work)
    samples = scrape(f"{url}/metrics")
    labels = {"model": "adder", "version": "1"}
    answered = sample(samples, "nv_inference_request_success", **labels)
    batches = sample(samples, "nv_inference_exec_count", **labels)
    assert answered >= 8 * 24
    # The ingress batched them before the Ray call: fewer calls than requests.
    assert 0 < batches < answered / 2, (batches, answered)
    # Nothing is left held back or queued once the clients stop.
    assert sample(samples, "nv_inference_pending_request_count", **labels) == 0


def test_direct_honours_the_http_servers_knobs_and_refuses_a_store(tmp_path):
    ServeConfig(
        runtime="ray", server=ServerConfig(keep_alive_s=30), ray=RayOptions(direct=True)
    ).check()
    with pytest.raises(ValueError, match="keep_alive_s = 30"):
        ServeConfig(runtime="ray", server=ServerConfig(keep_alive_s=30)).check()
    with pytest.raises(ValueError, match=r"\[ray\] direct with a \[store\]"):
        ServeConfig(
            (), runtime="ray", ray=RayOptions(direct=True), store=StoreConfig(root=str(tmp_path))
        ).check()


def test_with_overlap_the_device_runs_full_batches_back_to_back_and_without_it_waits(direct):
    url = direct.config.server.http_url.removeprefix("http://")

    def work(model: str, k: int) -> None:
        client = httpclient.InferenceServerClient(url)
        try:
            for i in range(8):
                tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
                tensor.set_data_from_numpy(np.full((1, 16), 100 * k + i, np.float32))
                answer = client.infer(model, [tensor]).as_numpy("OUTPUT0")
                assert answer.shape == (1, 16), answer.shape
        finally:
            client.close()

    for model in ("ahead_on", "ahead_off"):
        each_client(lambda k, m=model: work(m, k), clients=2 * ROWS, timeout_s=240)
    timeline = Path(os.environ[TIMELINE_ENV]).read_text()
    lines = [json.loads(line) for line in timeline.splitlines()]

    def batches(device: str) -> list[dict]:
        record = sorted((b for b in lines if b["device"] == device), key=lambda b: b["start"])
        return record[len(record) // 4 :]  # the first batches teach the ingress the round trip

    def gaps(record: list[dict]) -> list[float]:
        return [b["start"] - a["end"] for a, b in zip(record, record[1:], strict=False)]

    samples = scrape(f"{direct.config.server.http_url}/metrics")
    for model in ("ahead_on", "ahead_off"):
        labels = {"model": model, "version": "1"}
        assert sample(samples, "nv_inference_request_success", **labels) == 2 * ROWS * 8
        assert sample(samples, "nv_inference_pending_request_count", **labels) == 0
    on, off = batches("ray-ahead_on"), batches("ray-ahead_off")
    full = sum(b["rows"] == ROWS for b in on) / len(on)
    assert full >= 0.75, f"with overlap, {full:.0%} of batches were full: {on}"
    # With overlap a batch reaches the replica while the device runs the one before and
    # waits there for it (up to a batch's 158 ms: a mean of 130 ms here alone, 22-36 under
    # two busy loops, where the ingress takes longer to send); without, it comes once the
    # device is idle and waits only for the replica's hand-over (0.0 ms in all four runs).
    waited = {}
    for model in ("ahead_on", "ahead_off"):
        where = serve.get_deployment_handle(model, "servekit").where.remote().result(timeout_s=30)
        assert where["requests"] >= 2 * 8, where  # one request per batch, 8 rows at most
        waited[model] = where["queue_us"] / where["requests"] / 1e3
    assert waited["ahead_on"] > 5, waited
    assert waited["ahead_off"] < waited["ahead_on"] / 4, waited
    idle_on, idle_off = statistics.median(gaps(on)), statistics.median(gaps(off))
    print(f"device idle between batches, median: {idle_on * 1e3:.1f} ms with overlap, "
          f"{idle_off * 1e3:.1f} ms without; waited in the replica {waited} ms")  # fmt: skip
