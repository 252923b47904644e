"""Rollout on served runtimes: several versions of add_sub under one name, the split's
shares, named versions, the version in every answer (HTTP and gRPC), the traffic API,
and the canary judged by the server under load: a slow version rolled back, an identical
one promoted step by step, one with other answers caught by its shadow. No request fails
in any of these."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import (
    Load,
    Served,
    metered_bytes,
    on,
    on_ray,
    parse_metrics,
    sample,
    scrape,
    serve_on_runtime,
    wait_until,
)  # fmt: skip
from servekit import BatchingPolicy, ModelConfig, ServeConfig
from servekit.config import StoreConfig
from servekit.rollout import CanaryPolicy, ModelVersion, TrafficPolicy
from servekit.serving import create_runtime
from servekit.zoo.tiny import build_add_sub

pytest.importorskip("httptools", reason="needs the http extra")


A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.ones((1, 16), np.float32)
BODY = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": A.ravel().tolist()},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": B.ravel().tolist()},
        ]
    }
)


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    """add_sub as v1, an identical copy, a much slower one with the same answers, and one
    whose OUTPUT0 is off by one."""
    folder = tmp_path_factory.mktemp("versions")
    files = {}
    for name, kwargs in {
        "v1": {},
        "same": {},
        "slow": {"heavy": 200},
        "off": {"offset": 1.0},
    }.items():
        files[name] = folder / f"{name}.onnx"
        onnx.save(build_add_sub(**kwargs), files[name])
    return files


@pytest.fixture(params=["native", "ray", "pytriton", "triton"])
def serving(request):
    """Serve a model on each runtime in turn: ``serving(model, **server)``."""
    return serve_on_runtime(request, request.param)


@pytest.fixture(params=["native", "ray", "pytriton", "triton", "native+store", "ray+store"])
def anywhere(request):
    """``serving``, and the runtimes with a [store] serving the model among the 29 others
    of ``thirty`` (``stored``)."""
    runtime, _, store = request.param.partition("+")
    if not store:
        return serve_on_runtime(request, runtime)
    return stored(request, runtime)


def model_with(files, v2: str, traffic: TrafficPolicy, canary: CanaryPolicy | None = None):
    return ModelConfig(
        str(files["v1"]), "m", batching=BatchingPolicy(max_batch_size=8),
        versions=(ModelVersion(2, str(files[v2])),), traffic=traffic, canary=canary,
    )  # fmt: skip


class Http:
    def __init__(self, served: Served) -> None:
        self.conn = http.client.HTTPConnection(served.host, served.http_port, timeout=30)

    def call(self, method: str, path: str, body: str | None = None, **headers: str):
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        return r.status, json.loads(r.read() or b"null")

    def infer(self, path: str = "/v2/models/m/infer", **headers: str) -> str:
        status, answer = self.call("POST", path, BODY, **headers)
        assert status == 200, answer
        return answer["model_version"]

    def close(self) -> None:
        self.conn.close()


def session(runtime: Served):
    @contextlib.contextmanager
    def open_one(k: int):
        client = Http(runtime)
        try:
            yield client.infer
        finally:
            client.close()

    return open_one


def test_the_split_sticky_named_versions_and_the_traffic_api(versions, serving):
    traffic = TrafficPolicy({1: 70, 2: 30}, sticky="x-session")
    with serving(model_with(versions, "same", traffic)) as runtime:
        client = Http(runtime)
        try:
            n = 600
            got = [client.infer() for _ in range(n)]
            share = got.count("2") / n
            assert set(got) == {"1", "2"}
            assert abs(share - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / n), share
            sticky = {client.infer(**{"X-Session": "alice"}) for _ in range(20)}
            assert len(sticky) == 1
            assert client.infer("/v2/models/m/versions/2/infer") == "2"
            status, answer = client.call("POST", "/v2/models/m/versions/3/infer", BODY)
            assert status == 404 and "has no version '3'; it has [1, 2]" in answer["error"]
            status, state = client.call("GET", "/v2/models/m/traffic")
            assert status == 200 and state["split"] == {"1": 70, "2": 30}
            status, meta = client.call("GET", "/v2/models/m")
            assert status == 200 and meta["versions"] == ["1", "2"], meta
            status, index = client.call("POST", "/v2/repository/index", "{}")
            listed = sorted((e["name"], e["version"]) for e in index if e["name"].startswith("m"))
            assert status == 200 and listed == [("m", "1"), ("m", "2")], index  # m.v2 is m's 2
            assert state["counts"]["2"]["requests"] >= got.count("2") + 1
            status, state = client.call(
                "POST", "/v2/models/m/traffic", json.dumps({"split": {"2": 100}})
            )
            assert status == 200 and state["split"] == {"2": 100}
            assert {client.infer() for _ in range(50)} == {"2"}
            status, state = client.call("POST", "/v2/models/m/traffic", json.dumps({"shadow": 1}))
            assert status == 200 and state["shadow"] == 1 and state["split"] == {"2": 100}
            runs = state["counts"]["1"]["shadow_runs"]
            assert {client.infer() for _ in range(20)} == {"2"}  # the shadow never answers

            def shadow_runs() -> int:
                return client.call("GET", "/v2/models/m/traffic")[1]["counts"]["1"]["shadow_runs"]

            wait_until(lambda: shadow_runs() >= runs + 20, "20 shadow runs of version 1", 10)
            bad = {"split": {"1": 100}, "shadow": 9}
            status, answer = client.call("POST", "/v2/models/m/traffic", json.dumps(bad))
            assert status == 400 and "unknown version(s) [9]" in answer["error"], answer
            status, state = client.call("POST", "/v2/models/m/traffic", '{"shadow": null}')
            assert status == 200 and state["shadow"] is None and state["split"] == {"2": 100}
            for bad, message in [
                ({"split": {"1": 60, "2": 60}}, "shares must sum to 100, got 120"),
                ({"split": {"1": 50, "9": 50}}, "unknown version(s) [9]"),
                ({"weights": {"1": 100}}, 'expected {"split"'),
                ({"shadow": "two"}, "shadow must be a version number or null, got 'two'"),
            ]:
                status, answer = client.call("POST", "/v2/models/m/traffic", json.dumps(bad))
                assert status == 400 and message in answer["error"], answer
            status, answer = client.call("GET", "/v2/models/m_image/traffic")
            assert status == 404
            client.conn.request("GET", "/metrics")
            metrics = parse_metrics(client.conn.getresponse().read().decode())
            status, state = client.call("GET", "/v2/models/m/traffic")
            for version in ("1", "2"):
                labels = frozenset({("model", "m"), ("version", version)})
                assert (
                    metrics[("servekit_version_requests", labels)]
                    == (state["counts"][version]["requests"])
                )
                assert metrics[("servekit_traffic_share_percent", labels)] == state["split"].get(
                    version, 0
                )
            if runtime.triton_metrics is not None:  # Triton counts each version's requests
                metrics = scrape(runtime.triton_metrics)
            for version in ("1", "2"):
                assert (
                    sample(
                        metrics, "nv_inference_request_success", **runtime.version_labels(version)
                    )
                    > 0
                )
        finally:
            client.close()
        if runtime.grpc_port is None:
            return
        import tritonclient.grpc as grpcclient

        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{runtime.grpc_port}")
        try:
            inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(A)
            inputs[1].set_data_from_numpy(B)
            assert list(grpc.get_model_metadata("m").versions) == ["1", "2"]
            answer = grpc.infer("m", inputs).get_response()
            assert answer.model_version == "2"  # the split set above: all to 2
            assert grpc.infer("m", inputs, model_version="1").get_response().model_version == "1"
        finally:
            grpc.close()


def test_changing_the_split_needs_the_control_token_when_one_is_set(versions, serving):
    traffic = TrafficPolicy({1: 100, 2: 0})
    with serving(model_with(versions, "same", traffic), control_token="secret") as runtime:
        client = Http(runtime)
        try:
            body = json.dumps({"split": {"2": 100}})
            status, answer = client.call("POST", "/v2/models/m/traffic", body)
            assert status == 401 and "servekit-control-token" in answer["error"]
            status, _ = client.call("GET", "/v2/models/m/traffic")  # reading stays open
            assert status == 200
            status, state = client.call(
                "POST", "/v2/models/m/traffic", body, **{"servekit-control-token": "secret"}
            )
            assert status == 200 and state["split"] == {"2": 100}
        finally:
            client.close()


def canary_run(
    serving, versions, v2: str, traffic: TrafficPolicy, canary: CanaryPolicy, until: str,
    settled: Callable[[list], bool] = lambda results: True,
):  # fmt: skip
    """Serve under load until the canary reaches ``until``, then for 100 more answers and
    until ``settled(results)``; (load, the answers' count at ``until``, last state)."""
    with serving(model_with(versions, v2, traffic, canary)) as runtime:
        client = Http(runtime)
        state: dict = {}

        def reached() -> bool:
            nonlocal state
            state = client.call("GET", "/v2/models/m/traffic")[1]
            return state["canary"]["state"] == until

        try:
            with Load(session(runtime), threads=4) as load:
                try:
                    wait_until(reached, f"the canary {until}", 120)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; the last traffic state: {state}") from None
                after = len(load.results)
                load.wait_answers(100)
                wait_until(lambda: settled(load.results), "the answers settled", 60)
            return load.results, after, state
        finally:
            client.close()


def test_a_slow_canary_is_rolled_back_and_no_answer_comes_from_it_after(versions, anywhere):
    # Each of the 4 client threads has at most one request out at the switch: at most 4
    # answers from version 2 come back after it, however late (a slow one may finish
    # behind many fast answers from version 1, the more so on a busy machine), and none
    # once those are in: the load settles on version 1 alone.
    results, after, state = canary_run(
        anywhere, versions, "slow", TrafficPolicy({1: 80, 2: 20}),
        CanaryPolicy(min_requests=60, max_p99_ratio=1.5), "rolled back",
        settled=lambda results: set(results[-50:]) == {"1"},
    )  # fmt: skip
    assert not [r for r in results if isinstance(r, Exception)]
    assert state["split"] == {"1": 100, "2": 0}
    assert "2" in results[:after]
    assert results[after:].count("2") <= 4
    event = state["events"][-1]
    assert event["event"] == "rollback" and "the baseline's" in event["why"]


def test_an_identical_canary_is_promoted_step_by_step(versions, anywhere):
    results, _, state = canary_run(
        anywhere, versions, "same", TrafficPolicy({1: 90, 2: 10}),
        CanaryPolicy(min_requests=40, max_p99_ratio=20.0, step=(10, 50, 100)), "promoted",
    )  # fmt: skip
    assert not [r for r in results if isinstance(r, Exception)]
    assert state["split"] == {"1": 0, "2": 100}
    assert [e["event"] for e in state["events"]] == ["step", "promoted"]


@pytest.fixture(scope="module")
def thirty(tmp_path_factory) -> tuple[Path, float]:
    """A store's root of 29 add_sub models with 2 MB of weights (``f<i>.onnx``), and a
    budget in MB that holds ten of them (as the meter charges them)."""
    root = tmp_path_factory.mktemp("thirty")
    onnx.save(build_add_sub(weights_mb=2), root / "f0.onnx")
    for i in range(1, 29):
        (root / f"f{i}.onnx").write_bytes((root / "f0.onnx").read_bytes())
    return root, 10.5 * metered_bytes(root / "f0.onnx") / 2**20


def stored(request, kind: str):
    """``serving``'s contract, the model served among the 29 others of a [store] whose
    budget holds ten, while two clients send to random others all along (evicting and
    loading); any of their requests that fails fails the test."""
    root, budget_mb = request.getfixturevalue("thirty")
    # Loads queue behind the churn's evictions: on a busy two-core machine one can take
    # past the default 5 s wait, which is not what these tests are about.
    store = StoreConfig(root=str(root), memory_budget_mb=budget_mb, load="on_demand", wait_s=30)

    @contextlib.contextmanager
    def serve_stored(model: ModelConfig, **server) -> Iterator[Served]:
        if kind == "ray":
            url = request.getfixturevalue("ray_url")
            served = on_ray(url, model, store=store, **server)
        else:
            served = on(kind, store)(model, **server)
        with served as runtime:
            stop, failures, answered = threading.Event(), [], [0]
            fill = http.client.HTTPConnection(runtime.host, runtime.http_port, timeout=60)
            for i in range(10):  # the budget is full before the canary's versions load
                fill.request("POST", f"/v2/models/f{i}/infer", BODY)
                r = fill.getresponse()
                assert r.status == 200, r.read()
                r.read()
            fill.close()

            def churn(k: int) -> None:
                rng = np.random.default_rng(k)
                conn = http.client.HTTPConnection(runtime.host, runtime.http_port, timeout=30)
                try:
                    while not stop.is_set():
                        conn.request("POST", f"/v2/models/f{rng.integers(29)}/infer", BODY)
                        r = conn.getresponse()
                        body = r.read()
                        if r.status != 200:
                            failures.append(f"{r.status} {body[:200]!r}")
                        answered[0] += 1
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                finally:
                    conn.close()

            threads = [threading.Thread(target=churn, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            try:
                yield runtime
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert not failures, failures[:5]
            assert answered[0] > 0
            scraped = http.client.HTTPConnection(runtime.host, runtime.http_port, timeout=60)
            scraped.request("GET", "/metrics")
            metrics = parse_metrics(scraped.getresponse().read().decode())
            scraped.close()
            evictions = sum(v for (n, _), v in metrics.items() if n == "servekit_store_evictions")
            assert evictions > 0  # the canary's versions came and went among the others

    return serve_stored


def test_a_version_with_other_answers_is_caught_by_its_shadow_and_never_answers(versions, serving):
    results, _, state = canary_run(
        serving, versions, "off", TrafficPolicy({1: 100, 2: 0}, shadow=2),
        CanaryPolicy(min_requests=40, max_p99_ratio=100.0, max_mismatch_rate=0.0), "rolled back",
    )  # fmt: skip
    assert set(results) == {"1"}  # the shadow never answers
    assert state["counts"]["2"]["mismatches"] >= 1 and state["shadow"] is None
    assert "shadow answers differ" in state["events"][-1]["why"]


@pytest.mark.parametrize("runtime", ["native", "pytriton", "triton"])
def test_a_version_with_another_signature_is_refused_naming_the_difference(
    tmp_path, versions, runtime
):
    if runtime != "native":
        pytest.importorskip("pytriton", reason="needs the triton extra")
    other = tmp_path / "wide.onnx"
    onnx.save(build_add_sub(width=8), other)
    model = ModelConfig(str(versions["v1"]), "m", versions=(ModelVersion(2, str(other)),))
    served = create_runtime(ServeConfig((model,), runtime=runtime).on_loopback())
    try:
        with pytest.raises(
            ValueError,
            match=r"m version 2: the new version's inputs differ: .*got \['INPUT0 FP32 \[8\]'",
        ):
            served.start()
    finally:
        served.stop()


def test_triton_s_repository_holds_every_version_and_the_ensemble_stays_on_version_1(
    tiny_cnn_path, versions
):
    from servekit.triton.repo import model_repository

    cnn = ModelConfig(str(tiny_cnn_path), "c", versions=(ModelVersion(3, str(tiny_cnn_path)),))
    adder = model_with(versions, "off", TrafficPolicy({1: 90, 2: 10}))
    by_name = {m.name: m for m in model_repository(ServeConfig((cnn, adder), runtime="triton"))}
    assert by_name["c"].versions == (1, 3) and list(
        by_name["c"].config.version_policy.specific.versions
    ) == [1, 3]
    assert by_name["m"].version_weights == {2: versions["off"]}
    (step,) = [s for s in by_name["c_image"].config.ensemble_scheduling.step if s.model_name == "c"]
    assert step.model_version == 1  # the image model takes no split, as on every runtime
    plain = model_repository(ServeConfig((ModelConfig(str(tiny_cnn_path), "c"),), runtime="triton"))
    (step,) = [s for s in plain[-1].config.ensemble_scheduling.step if s.model_name == "c"]
    assert step.model_version == -1  # the latest: a new version folder updates the ensemble
