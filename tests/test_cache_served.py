"""The response cache served (``response_cache = true``, ``[server.cache]``): eight clients
over HTTP and gRPC (tritonclient) get the model's answers, a repeated request is answered
without running the model, the counts add up, a reload is never answered from before it,
on native, Ray and (in servekit's front) the Triton runtimes."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest

from conftest import each_client, sample, scrape
from servekit import ModelConfig, ServeConfig, ServerConfig
from servekit.config import CacheConfig
from servekit.serving import create_runtime
from servekit.zoo.tiny import build_add_sub

tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")


def serve_native(source, cache: CacheConfig | None = None):
    config = ServeConfig(
        (ModelConfig(str(source), "add_sub", response_cache=True),),
        ServerConfig(exit_timeout_s=2, cache=cache or CacheConfig(local_size_mb=8)),
        runtime="native",
    ).on_loopback()
    return config, create_runtime(config)


def infer(client, module, x: np.ndarray) -> dict[str, np.ndarray]:
    inputs = [module.InferInput(n, list(x.shape), "FP32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(x)
    result = client.infer("add_sub", inputs)
    return {n: result.as_numpy(n) for n in ("OUTPUT0", "OUTPUT1")}


def test_eight_clients_over_http_and_grpc_are_answered_from_the_cache_and_counts_add_up(
    add_sub_path,
):
    config, server = serve_native(add_sub_path)
    s = config.server
    server.start()
    try:

        def client(k: int) -> None:
            x = np.full((1, 16), k, np.float32)
            with tritonclient_http.InferenceServerClient(f"127.0.0.1:{s.http_port}") as h:
                for _ in range(3):
                    out = infer(h, tritonclient_http, x)
                    assert np.array_equal(out["OUTPUT0"], 2 * x)
            g = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
            for _ in range(2):  # the same request over gRPC: the answer kept from HTTP
                out = infer(g, tritonclient_grpc, x)
                assert np.array_equal(out["OUTPUT1"], 0 * x)
            g.close()

        each_client(client, clients=8)
        m = scrape(f"http://127.0.0.1:{s.metrics_port}/metrics")
        hits = sample(m, "nv_cache_num_hits_per_model", model="add_sub")
        misses = sample(m, "nv_cache_num_misses_per_model", model="add_sub")
        assert (hits, misses) == (8 * 4, 8)  # each client's first request ran the model
        # The model ran once per distinct request: the cache answered the rest.
        assert sample(m, "nv_inference_request_success", model="add_sub", version="1") == 8
        assert sample(m, "nv_cache_hit_duration_per_model", model="add_sub") > 0
        assert sample(m, "nv_inference_pending_request_count", model="add_sub", version="1") == 0
    finally:
        server.stop()


def test_a_reload_is_never_answered_from_before_it(tmp_path):
    path = tmp_path / "add_sub.onnx"
    onnx.save(build_add_sub(), path)
    config, server = serve_native(path)
    server.start()
    x = np.ones((1, 16), np.float32)
    url = f"127.0.0.1:{config.server.http_port}"
    try:
        with tritonclient_http.InferenceServerClient(url) as h:
            assert infer(h, tritonclient_http, x)["OUTPUT0"][0, 0] == 2.0
            onnx.save(build_add_sub(offset=10.0), path)  # a new file, other answers
            server.reload()
            assert infer(h, tritonclient_http, x)["OUTPUT0"][0, 0] == 12.0
            assert infer(h, tritonclient_http, x)["OUTPUT0"][0, 0] == 12.0  # kept anew
        m = scrape(f"http://127.0.0.1:{config.server.metrics_port}/metrics")
        assert sample(m, "nv_cache_num_misses_per_model", model="add_sub") == 2
        assert sample(m, "nv_cache_num_hits_per_model", model="add_sub") == 1
    finally:
        server.stop()


def test_a_bad_request_is_refused_every_time_and_never_kept(add_sub_path):
    config, server = serve_native(add_sub_path)
    server.start()
    try:
        with tritonclient_http.InferenceServerClient(f"127.0.0.1:{config.server.http_port}") as h:
            for _ in range(2):
                bad = [
                    tritonclient_http.InferInput(n, [1, 8], "FP32") for n in ("INPUT0", "INPUT1")
                ]
                for i in bad:
                    i.set_data_from_numpy(np.zeros((1, 8), np.float32))
                with pytest.raises(Exception, match="INPUT0"):
                    h.infer("add_sub", bad)
            good = np.ones((1, 16), np.float32)
            assert np.array_equal(infer(h, tritonclient_http, good)["OUTPUT0"], 2 * good)
    finally:
        server.stop()


@pytest.mark.parametrize("runtime", ["pytriton", "triton"])
def test_the_triton_runtimes_keep_tritonservers_answers_in_the_front(runtime, tmp_path):
    """On the Triton runtimes servekit's front keeps tritonserver's answer to a request's
    exact bytes: eight clients, each a request three times over HTTP and twice over gRPC,
    make tritonserver run the model twice per client (one miss per protocol: the front
    never decodes an answer to share it); a changed model file, reloaded, is never answered
    from before it; with ``front = false`` the cache is refused by name."""
    pytest.importorskip("pytriton", reason="needs the triton extra (its tritonserver)")
    path = tmp_path / "add_sub.onnx"
    onnx.save(build_add_sub(), path)
    config = ServeConfig(
        (ModelConfig(str(path), "add_sub", response_cache=True),),
        ServerConfig(exit_timeout_s=2, cache=CacheConfig(local_size_mb=8)),
        runtime=runtime,
    ).on_loopback()
    s = config.server
    server = create_runtime(config)
    server.start()
    try:

        def client(k: int) -> None:
            x = np.full((1, 16), k, np.float32)
            with tritonclient_http.InferenceServerClient(f"127.0.0.1:{s.http_port}") as h:
                for _ in range(3):
                    assert np.array_equal(infer(h, tritonclient_http, x)["OUTPUT0"], 2 * x)
            g = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
            for _ in range(2):
                assert np.array_equal(infer(g, tritonclient_grpc, x)["OUTPUT1"], 0 * x)
            g.close()

        each_client(client, clients=8)
        front = scrape(f"{s.http_url}/metrics")
        assert sample(front, "nv_cache_num_hits_per_model", model="add_sub") == 8 * 3
        assert sample(front, "nv_cache_num_misses_per_model", model="add_sub") == 8 * 2
        triton = scrape(s.metrics_url)  # tritonserver ran the model for the misses only
        assert sample(triton, "nv_inference_request_success", model="add_sub", version="1") == 16
        # The metrics port holds the cache's families too, beside tritonserver's.
        assert sample(triton, "nv_cache_num_hits_per_model", model="add_sub") == 8 * 3
        pending = ("nv_inference_pending_request_count",
                   frozenset({("model", "add_sub"), ("version", "1")}))  # fmt: skip
        assert triton.get(pending) == 0  # idle again once the clients stop
        if runtime == "pytriton":  # the triton runtime reloads only in poll or explicit mode
            x = np.ones((1, 16), np.float32)
            with tritonclient_http.InferenceServerClient(f"127.0.0.1:{s.http_port}") as h:
                assert infer(h, tritonclient_http, x)["OUTPUT0"][0, 0] == 2.0
                onnx.save(build_add_sub(offset=10.0), path)  # a new file, other answers
                server.reload()
                assert infer(h, tritonclient_http, x)["OUTPUT0"][0, 0] == 12.0
    finally:
        server.stop()
    with pytest.raises(ValueError, match=r"response_cache with server.front = false"):
        config.replace(server=ServerConfig(front=False, cache=s.cache)).check()


def test_a_cached_model_needs_a_cache_and_no_split_or_sequence():
    bad = {
        "no cache": ({"response_cache": True}, {}, r"response_cache needs \[server.cache\]"),
        "split": (
            {"response_cache": True, "versions": [{"version": 2, "source": "add_sub"}]},
            {"cache": {"local": {"size_mb": 1}}},
            "the version answering is chosen per request",
        ),
    }
    for model, server, message in bad.values():
        data = {"runtime": "native", "server": server,
                "models": [{"source": "add_sub", "name": "m", **model}]}  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ServeConfig.from_dict(data).check()
    with pytest.raises(ValueError, match="local or redis, not both"):
        CacheConfig(local_size_mb=1, redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match=r"url must be redis://"):
        CacheConfig.from_dict({"redis": {"url": "http://x"}})
    with pytest.raises(ValueError, match=r"size_mb must be a number > 0, got 'big'"):
        CacheConfig.from_dict({"local": {"size_mb": "big"}})
    with pytest.raises(ValueError, match=r"\[server.cache.local\]: expected a table, got 64"):
        CacheConfig.from_dict({"local": 64})


def test_two_servers_share_answers_through_redis_and_a_dead_redis_costs_no_request(
    add_sub_path, redis_server
):
    url, stop_redis, _ = redis_server
    cache = CacheConfig(redis_url=url)
    (ca, a), (cb, b) = serve_native(add_sub_path, cache), serve_native(add_sub_path, cache)
    a.start()
    b.start()
    try:
        x = np.full((1, 16), 3, np.float32)
        with tritonclient_http.InferenceServerClient(f"127.0.0.1:{ca.server.http_port}") as h:
            assert np.array_equal(infer(h, tritonclient_http, x)["OUTPUT0"], 2 * x)
        with tritonclient_http.InferenceServerClient(f"127.0.0.1:{cb.server.http_port}") as h:
            assert np.array_equal(infer(h, tritonclient_http, x)["OUTPUT0"], 2 * x)
        mb = scrape(f"http://127.0.0.1:{cb.server.metrics_port}/metrics")
        assert sample(mb, "nv_cache_num_hits_per_model", model="add_sub") == 1
        assert sample(mb, "nv_inference_request_success", model="add_sub", version="1") == 0

        stopped = threading.Event()

        def client(k: int) -> None:
            y = np.full((1, 16), 10 + k, np.float32)
            with tritonclient_http.InferenceServerClient(f"127.0.0.1:{ca.server.http_port}") as h:
                for i in range(40):
                    if k == 0 and i == 10:
                        stop_redis()  # Redis dies under load
                        stopped.set()
                    assert np.array_equal(infer(h, tritonclient_http, y)["OUTPUT1"], 0 * y)

        each_client(client, clients=8)
        assert stopped.is_set()
    finally:
        a.stop()
        b.stop()


def test_the_ray_ingress_answers_from_its_cache(request, add_sub_path):
    from conftest import on_ray

    url = request.getfixturevalue("ray_url")
    model = ModelConfig(str(add_sub_path), "add_sub", response_cache=True)
    with on_ray(url, model, cache=CacheConfig(local_size_mb=8)) as served:
        base = f"http://{served.host}:{served.http_port}"

        def client(k: int) -> None:
            x = np.full((1, 16), k, np.float32)
            with tritonclient_http.InferenceServerClient(base.removeprefix("http://")) as h:
                for _ in range(5):
                    assert np.array_equal(infer(h, tritonclient_http, x)["OUTPUT0"], 2 * x)

        each_client(client, clients=8)
        m = scrape(f"{base}/metrics")  # the one ingress replica's
        hits = sample(m, "nv_cache_num_hits_per_model", model="add_sub")
        misses = sample(m, "nv_cache_num_misses_per_model", model="add_sub")
        assert (hits, misses) == (32, 8)
        assert sample(m, "nv_inference_request_success", model="add_sub", version="1") == 8
        assert sample(m, "nv_inference_pending_request_count", model="add_sub", version="1") == 0
