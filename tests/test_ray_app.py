"""The Ray Serve app on a real local Ray, reached over KServe v2 HTTP with tritonclient."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("tritonclient.http")

from conftest import ray_serve, wait_until
from servekit import InvalidInput, ModelNotFound, OnnxRuntimeRunner, image_classifier
from servekit.client import Client
from servekit.ray import build_app
from servekit.stages import synthetic_image


@pytest.fixture(scope="module")
def ray_url(resnet50_path):
    with ray_serve() as url:
        app = build_app(
            {
                "model": str(resnet50_path),
                "name": "resnet50",
                # The ingress's batcher holds a latency budget itself (no fixed delay).
                "batching": {"max_batch_size": 8, "latency_budget_ms": 500},
                "ray": {"model_cpus": 0.5, "stage_cpus": 0.25},
            }
        )
        serve.run(app, name="servekit", route_prefix="/")
        with Client(url) as c:
            c.wait_ready("resnet50_image", timeout_s=120)
        yield url


@pytest.fixture(scope="module")
def local(resnet50_path):
    runner = OnnxRuntimeRunner(resnet50_path)
    return runner, image_classifier(runner)


def test_ray_app_answers_like_the_in_process_pipeline(ray_url, local):
    images = [synthetic_image(i) for i in range(3)]
    with Client(ray_url) as c:
        assert c.classify(images, model="resnet50_image") == local[1].classify(images)
        x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
        np.testing.assert_allclose(
            c.infer("resnet50", {"input": x})["logits"],
            local[0].infer({"input": x})["logits"],
            rtol=1e-4,
            atol=1e-4,
        )


def test_concurrent_requests_batch_and_each_get_their_own_answer_or_error(ray_url, local):
    images = [synthetic_image(20 + i) for i in range(8)]
    images[3] = b"not an image"  # batched with the others, fails alone
    good = [i for i in range(8) if i != 3]
    expected = [p[0].class_id for p in local[1].classify([images[i] for i in good])]
    got: dict[int, object] = {}
    barrier = threading.Barrier(8)

    def one(i: int) -> None:
        with Client(ray_url) as c:
            barrier.wait()
            try:
                got[i] = c.classify([images[i]], model="resnet50_image")[0][0].class_id
            except InvalidInput as exc:
                got[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in good] == expected
    assert isinstance(got[3], InvalidInput) and "cannot decode image" in str(got[3])


def test_bad_inputs_get_a_400_naming_the_problem(ray_url):
    with Client(ray_url) as c:
        with pytest.raises(InvalidInput, match="expected dtype FP32, got FP64"):
            c.infer("resnet50", {"input": np.zeros((1, 3, 224, 224))})
        with pytest.raises(InvalidInput, match="cannot decode image"):
            c.classify([b"junk"], model="resnet50_image")
        with pytest.raises(ModelNotFound, match="nope"):
            c.infer("nope", {"input": np.zeros((1, 3, 224, 224), np.float32)})
        assert len(c.classify([synthetic_image(1)], model="resnet50_image")[0]) == 5


def test_a_model_replica_killed_under_load_is_replaced_and_later_requests_succeed(ray_url):
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "#resnet50#" in a["name"]
    ]
    assert names, "no replica of the resnet50 deployment found"
    stop, answered = threading.Event(), []

    def load() -> None:
        with Client(ray_url) as c:
            while not stop.is_set():
                try:
                    answered.append(len(c.classify([synthetic_image(4)], "resnet50_image")[0]))
                except Exception as exc:  # requests in flight on the killed replica may fail
                    answered.append(exc)

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: len(answered) >= 3, "three answers before the kill")
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        seen = len(answered)
        wait_until(lambda: len(answered) >= seen + 6, "answers (or errors) after the kill", 60)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert answered.count(5) >= 3
    with Client(ray_url) as c:
        wait_until(
            lambda: len(c.classify([synthetic_image(2)], model="resnet50_image")[0]) == 5,
            "an answer from the recovered app", 90,
        )  # fmt: skip
        for _ in range(3):  # and it keeps serving
            assert len(c.classify([synthetic_image(3)], model="resnet50_image")[0]) == 5


def test_the_ingress_exports_triton_named_metrics_for_known_traffic(ray_url):
    from conftest import sample, scrape

    labels = {"model": "resnet50_image", "version": "1"}
    names = ("nv_inference_request_success", "nv_inference_request_failure")
    names += ("nv_inference_exec_count", "nv_inference_count")

    def counts() -> dict[str, float]:
        got = scrape(f"{ray_url}/metrics")
        return {n: sample(got, n, **labels) for n in names}

    before = counts()
    with Client(ray_url) as c:
        for i in range(3):  # one at a time: one ingress batch each
            c.classify([synthetic_image(50 + i)], model="resnet50_image")
        with pytest.raises(InvalidInput):
            c.classify([b"junk"], model="resnet50_image")
    after = counts()
    assert {n: after[n] - before[n] for n in names} == {
        "nv_inference_request_success": 3,
        "nv_inference_request_failure": 1,
        "nv_inference_exec_count": 4,
        "nv_inference_count": 4,
    }
    got = scrape(f"{ray_url}/metrics")
    p50 = sample(got, "nv_inference_request_summary_us", **labels, quantile="0.5")
    assert 1_000 < p50 < 10_000_000  # a ResNet-50 request: milliseconds, not micro or minutes


def test_the_ingress_batcher_holds_its_latency_budget_and_exports_what_it_chose(ray_url):
    from conftest import parse_metrics

    with Client(ray_url) as c:
        for i in range(4):
            c.classify([synthetic_image(70 + i)], model="resnet50_image")
    with urllib.request.urlopen(f"{ray_url}/metrics", timeout=30) as r:
        got = parse_metrics(r.read().decode())
    budgets = {dict(labels)["model"]: v for (n, labels), v in got.items()
               if n == "servekit_latency_budget_seconds"}  # fmt: skip
    assert budgets.get("resnet50") == 0.5
    attained = [v for (n, _), v in got.items() if n == "servekit_latency_budget_attainment"]
    targets = [v for (n, _), v in got.items() if n == "servekit_batch_target_rows"]
    assert attained and all(0 <= v <= 1 for v in attained)
    assert targets and all(1 <= v <= 8 for v in targets)
